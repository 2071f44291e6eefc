"""Test-wide setup that must run before anything imports jax."""

import os

# Eight virtual CPU devices, the shape every multi-device test assumes. XLA
# reads the flag once, when jax initializes its backend, so it is set here.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

try:
    from absl import flags
except ImportError:
    pass
else:
    # Grain reads absl flags; under pytest nothing parses the command line.
    flags.FLAGS.mark_as_parsed()
