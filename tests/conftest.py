"""Test-wide setup that must run before anything imports jax."""

import atexit
import os
import shutil
import tempfile

# Eight virtual CPU devices, the shape every multi-device test assumes. XLA
# reads the flag once, when jax initializes its backend, so it is set here.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

# The commands' compiled programs go to this session's own cache folder (the
# processes the tests start inherit it): never to the user's, and no test
# depends on what an earlier session left there.
_CACHE = tempfile.mkdtemp(prefix="sparseflow-test-compilation-cache-")
os.environ["SPARSEFLOW_COMPILATION_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

try:
    from absl import flags
except ImportError:
    pass
else:
    # Grain reads absl flags; under pytest nothing parses the command line.
    flags.FLAGS.mark_as_parsed()
