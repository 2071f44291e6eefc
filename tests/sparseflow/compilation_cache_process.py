"""Runs `sparseflow ARGV`, counting JAX's persistent compilation cache events.

Run by test_compilation_cache.py in a fresh process:

    python compilation_cache_process.py ARGV...

Its last stdout line is `{"status": ..., "events": {event: count}}`.
"""

import collections
import json
import sys

from jax import monitoring


def main(argv: list[str]) -> int:
    events = collections.Counter()
    monitoring.register_event_listener(lambda event, **kwargs: events.update([event]))
    from sparseflow import _cli

    status = _cli.main(argv)
    print(json.dumps({"status": status, "events": dict(events)}))
    return status


# Grain's worker processes import this module again: only the parent runs the command.
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
