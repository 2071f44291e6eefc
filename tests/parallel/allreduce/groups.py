"""Running one round on every node of an in-process group at once."""

import threading

JOIN_TIMEOUT_S = 60


def all_reduce_together(nodes, sync_key, values):
    """Every node's `all_reduce(sync_key, value)` from its own thread; results or errors."""
    out = [None] * len(nodes)

    def run(rank):
        try:
            out[rank] = nodes[rank].all_reduce(sync_key, values[rank])
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a node hung"
    return out
