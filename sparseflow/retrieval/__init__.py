"""Retrieval: training records of interactions, a trained two-tower's vectors, recall@K.

The two-tower model itself is `sparseflow.towers.TwoTower`; docs/retrieval.md
walks through a run. `write_interactions` writes interactions as records
(with each item's `log q` for the log-Q correction), `held_out_last`
splits off each user's last interactions, `recent_items` gives each
interaction its user's items before it (a user feature), `TrainedTwoTower` runs the
trained towers on ids (every item's vector, the held-out users' vectors),
and `recall_at_k` scores the ranking. Importing this package imports flax.

>>> import numpy as np
>>> from sparseflow import retrieval
>>> users = np.array([[1.0, 0.0], [0.0, 1.0]])
>>> items = np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]])
>>> retrieval.recall_at_k(users, items, np.array([2, 2]), k=1, exclude=[[0], []])
0.5
"""

from sparseflow.retrieval._interactions import (
    held_out_last,
    item_log_q,
    recent_items,
    write_interactions,
)
from sparseflow.retrieval._recall import recall_at_k
from sparseflow.retrieval._vectors import TrainedTwoTower

__all__ = [
    "TrainedTwoTower",
    "held_out_last",
    "item_log_q",
    "recall_at_k",
    "recent_items",
    "write_interactions",
]
