"""What a `sparseflow` process does with the objects it holds, as the command line runs it."""

from __future__ import annotations

import gc


def freeze_live_objects() -> None:
    """Takes every object alive now out of the garbage collector's scans (`gc.freeze`).

    Python's full collections walk every tracked object. A command imports
    JAX, Grain, NumPy and the rest, some 180,000 objects that live as long
    as the process; a training run's setup (tracing, compiling) then
    triggers full collections that walked them all, and the interpreter's
    exit walks everything left again (measures in docs/benchmarks.md).
    Frozen, they are not collected until `gc.unfreeze` (which the training
    loop's end calls, `_train._setup_objects_frozen`): garbage among them
    stays till then.

    The `sparseflow` script (`sparseflow._script`) calls it twice per
    process, once the chosen command is imported (with the collector paused
    until then) and once it has returned (before the exit, whose collections
    then have nothing to walk: files and logs are closed by their `with`
    blocks and atexit handlers, which still run); never the library's
    functions, which run inside a user's process, whose garbage is not
    theirs to keep.
    """
    gc.freeze()
