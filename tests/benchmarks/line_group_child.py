"""A child for test_line_protocol.py: answers `name` with its index; on `quit` it
waits for its partner's quit (as a `jax.distributed` group's shutdown does)."""

import sys
import time
from pathlib import Path

from _line_protocol import reply_stream, serve

index, folder = int(sys.argv[1]), Path(sys.argv[2])
serve(reply_stream(), {"name": lambda _: {"index": index}}, greeting={})
(folder / f"quit-{index}").touch()
deadline = time.monotonic() + 10
while not (folder / f"quit-{1 - index}").exists():
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
