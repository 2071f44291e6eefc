"""Comparing a layout with jax-tpu-embedding's, whose buffers are defined only
where the row pointers point."""

import numpy as np


def assert_same_layout(ours: dict, theirs: dict, *, devices: int, slots: int) -> None:
    """Equal row pointers, and equal entries wherever they point (the reference
    leaves the rest of a slot's buffer uninitialized)."""
    for stack, pointers in theirs["lhs_row_pointers"].items():
        np.testing.assert_array_equal(ours["lhs_row_pointers"][stack], pointers, err_msg=stack)
        by_slot = pointers.reshape(devices, slots, -1)
        for field in ("lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
            got = ours[field][stack].reshape(devices, slots, -1)
            want = theirs[field][stack].reshape(devices, slots, -1)
            for device in range(devices):
                for slot in range(slots):
                    used = by_slot[device, slot, -1]
                    # Mean and sqrtn gains may round differently (one ulp).
                    np.testing.assert_allclose(
                        got[device, slot, :used],
                        want[device, slot, :used],
                        rtol=1e-6 if field == "lhs_gains" else 0,
                        err_msg=f"{field}[{stack}], device {device}, slot {slot}",
                    )
