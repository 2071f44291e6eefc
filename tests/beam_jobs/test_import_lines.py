"""Line parsing and Example encoding of the import (beam_jobs/_lines.py, _example_encoder.py)."""

import numpy as np
import pytest
import tensorflow as tf

import beam_jobs
from beam_jobs._example_encoder import ExampleEncoder
from beam_jobs._lines import BadLine, LineParser

KINDS = beam_jobs.ColumnKind


def _protobuf(keys, kinds, values) -> bytes:
    """The reference: TensorFlow's Example message, serialized deterministically."""
    example = tf.train.Example()
    for key, kind, value in zip(keys, kinds, values):
        if value is None:
            continue
        feature = example.features.feature[key]
        if kind is KINDS.INT:
            feature.int64_list.value.append(int(value))
        elif kind is KINDS.FLOAT:
            feature.float_list.value.append(value)
        else:
            feature.bytes_list.value.append(value if isinstance(value, bytes) else value.encode())
    return example.SerializeToString(deterministic=True)


def test_the_encoder_writes_protobufs_deterministic_bytes():
    keys = ["z", "label", "a_long_key_" * 20, "é", "b", "f"]
    kinds = [KINDS.INT, KINDS.INT, KINDS.STRING, KINDS.HEX, KINDS.FLOAT, KINDS.STRING]
    encoder = ExampleEncoder(keys, kinds)
    rng = np.random.default_rng(0)
    rows = [
        [None] * 6,
        [0, 1, "", "ab", 0.0, b"\x00\xff"],
        [-1, -(2**63), "x" * 200, None, -2.5e-30, "ünï"],
        [2**63 - 1, 127, None, "0" * 128, 3.4e38, None],
        [128, 300, "y" * 16384, "f", None, "z" * 127],
    ]
    for _ in range(200):
        rows.append(
            [
                int(rng.integers(-(2**63), 2**63 - 1)) if rng.random() < 0.8 else None,
                int(rng.integers(0, 2)),
                "s" * int(rng.integers(0, 300)) if rng.random() < 0.8 else None,
                f"{int(rng.integers(0, 2**32)):x}" if rng.random() < 0.8 else None,
                float(np.float32(rng.normal() * 1e6)) if rng.random() < 0.8 else None,
                None,
            ]
        )
    for row in rows:
        assert encoder.encode(row) == _protobuf(keys, kinds, row), row


@pytest.mark.parametrize(
    "field, kind, value",
    [
        ("-7", KINDS.INT, -7),
        ("+7", KINDS.INT, 7),
        ("9223372036854775807", KINDS.INT, 2**63 - 1),
        ("1e3", KINDS.FLOAT, 1000.0),
        ("-.5", KINDS.FLOAT, -0.5),
        ("aB09", KINDS.HEX, "aB09"),
        (" x ", KINDS.STRING, " x "),
    ],
)
def test_fields_that_their_kind_accepts(field, kind, value):
    parser = LineParser(beam_jobs.ColumnSpec((beam_jobs.Column("c", kind),)), "\t")
    assert parser.values(parser.fields(field.encode() + b"\n")) == [value]


@pytest.mark.parametrize(
    "field, kind, reason",
    [
        ("1_000", KINDS.INT, "'1_000' is not an integer"),
        (" 1", KINDS.INT, "' 1' is not an integer"),
        ("١٢", KINDS.INT, "'١٢' is not an integer"),  # Arabic-Indic digits
        ("9223372036854775808", KINDS.INT, "'9223372036854775808' is outside int64"),
        ("nan", KINDS.FLOAT, "'nan' is not a number"),
        ("1e999", KINDS.FLOAT, "'1e999' is not finite"),
        ("1e39", KINDS.FLOAT, "'1e39' is outside float32"),
        ("0x1f", KINDS.HEX, "'0x1f' is not hexadecimal"),
        ("z" * 60, KINDS.INT, "'" + "z" * 40 + "...' is not an integer"),
    ],
)
def test_fields_that_their_kind_rejects_are_named(field, kind, reason):
    parser = LineParser(beam_jobs.ColumnSpec((beam_jobs.Column("c", kind),)), "\t")
    with pytest.raises(BadLine, match=f"column 'c': {reason}"):
        parser.values(parser.fields(field.encode()))


def test_a_line_that_is_not_utf8_is_named():
    parser = LineParser(beam_jobs.ColumnSpec((beam_jobs.Column("c", KINDS.STRING),)), "\t")
    with pytest.raises(BadLine, match="not UTF-8: invalid start byte at byte 1"):
        parser.fields(b"a\xff\n")
