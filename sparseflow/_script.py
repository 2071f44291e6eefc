"""The `sparseflow` script and `python -m sparseflow`: the command line in a process of its own."""

import gc


def script() -> int:
    """Runs this process's command line (`sparseflow._cli.main`); returns its exit status.

    Unlike a call of `main` inside a user's program, the script owns its
    process: the garbage collector is paused from here, before the command's
    imports (JAX, Grain, NumPy and the rest: some 180,000 objects that live
    as long as the process, whose making set off full collections that
    walked them all), until `main` has them in and takes them out of the
    collector's scans; the objects alive once the command has returned are
    taken out too, before the exit (`sparseflow._process`). This module
    imports nothing else at its top, and importing the package imports no
    more than its face (`sparseflow/__init__.py`).
    """
    gc.disable()
    from sparseflow import _cli, _process  # noqa: PLC0415 - imported with the collector paused

    status = _cli.main(owns_process=True)
    _process.freeze_live_objects()
    return status
