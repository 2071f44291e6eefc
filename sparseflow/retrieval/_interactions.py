"""Interactions as training records for a retrieval model, and their held-out split."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

import pipelines
from sparseflow.retrieval._ids import row_ids

_log = logging.getLogger(__name__)

LOG_Q_KEY = "log_q"
LABEL_KEY = "label"


def item_log_q(items: ArrayLike) -> np.ndarray:
    """`float64[n]`: `log q(items[i])`, q being an item's share of the n interactions.

    Args:
      items: `int[n]`, the item of every training interaction.
    """
    items = np.asarray(items)
    if items.ndim != 1 or not items.size:
        raise ValueError(f"items must be a non-empty int[n], got shape {list(items.shape)}.")
    _, inverse, counts = np.unique(items, return_inverse=True, return_counts=True)
    return np.log(counts[inverse] / items.size)


def held_out_last(users: ArrayLike, times: ArrayLike, *, per_user: int = 1) -> np.ndarray:
    """`bool[n]`: each user's last `per_user` interactions by time (ties: the later
    in the input), which a leave-last-out evaluation holds out.

    A user with `per_user` interactions or fewer keeps them all for training.

    Args:
      users: `int[n]`, the user of each interaction.
      times: `int[n]` or `float[n]`, when it happened.
      per_user: interactions held out per user, >= 1.
    """
    users, times = np.asarray(users), np.asarray(times)
    if users.ndim != 1 or users.shape != times.shape:
        raise ValueError(
            f"users and times must be [n] arrays of one length, got {list(users.shape)} and "
            f"{list(times.shape)}."
        )
    if isinstance(per_user, bool) or not isinstance(per_user, int) or per_user < 1:
        raise ValueError(f"per_user must be an int >= 1, got {per_user!r}.")
    order = np.lexsort((np.arange(users.size), times, users))
    sorted_users = users[order]
    starts = np.searchsorted(sorted_users, sorted_users, side="left")
    ends = np.searchsorted(sorted_users, sorted_users, side="right")
    # A user's interactions are order[starts:ends]; the last per_user of them go.
    held = (ends - np.arange(users.size) <= per_user) & (ends - starts > per_user)
    mask = np.zeros(users.size, bool)
    mask[order[held]] = True
    return mask


def recent_items(
    users: ArrayLike, items: ArrayLike, times: ArrayLike, *, length: int, known: ArrayLike = None
) -> list[np.ndarray]:
    """For every interaction, its user's items before it: a "recently seen" feature.

    Interaction r gets the items of its user's interactions that came before
    it (by time; ties by input order), the last `length` of them, oldest
    first; only interactions where `known` is True count (e.g. the training
    ones, so that a held-out interaction's history holds no held-out item).

    Args:
      users, items: `int[n]`, the user and item of each interaction.
      times: `int[n]` or `float[n]`.
      length: the most items kept, >= 1.
      known: `bool[n]`, or None for all.

    Returns:
      n `int64` arrays (empty for a user's first interaction).
    """
    users, items, times = np.asarray(users), np.asarray(items), np.asarray(times)
    if not users.shape == items.shape == times.shape or users.ndim != 1:
        raise ValueError(
            f"users, items and times must be [n] arrays of one length, got "
            f"{[list(a.shape) for a in (users, items, times)]}."
        )
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}.")
    known = np.ones(users.size, bool) if known is None else np.asarray(known, bool)
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * users.size
    history: list[int] = []
    previous = None
    for r in np.lexsort((np.arange(users.size), times, users)):
        if users[r] != previous:
            history, previous = [], users[r]
        out[r] = np.array(history[-length:], np.int64)
        if known[r]:
            history.append(int(items[r]))
    return out


def write_interactions(
    out_dir: str | os.PathLike,
    ids: Mapping[str, ArrayLike],
    *,
    item_feature: str,
    num_shards: int = 1,
    record_format: str = "arrayrecord",
) -> list[str]:
    """Writes training interactions as `tf.train.Example` records for a retrieval model.

    Record r holds, under each key of `ids`, its int64 ids (one, or a list,
    e.g. `recent_items`); under `log_q` the float `log q` of its item
    (`item_log_q` over these records: the log-Q correction of
    `towers.TwoTower`); under `label` the int 1. A config reads them with a
    `record` section (`features: {<key>: {}}`, `dense: [log_q]`, `label:
    {key: label}`), as the shipped `two_tower` config does. Shard s holds
    records `[s n / shards, (s + 1) n / shards)` in input order; shuffling is
    the trainer's (`training.shuffle`).

    Args:
      out_dir: the folder for `part-SSSSS-of-NNNNN.<ext>` (created if needed).
      ids: per feature (record key), `int[n]` (one id a record) or n lists of ids.
      item_feature: the key of `ids` holding the item (one id a record),
        whose share gives q.
      num_shards: files written, `1 <= num_shards <= n`.
      record_format: `"arrayrecord"` or `"tfrecord"`.

    Returns:
      The files written, in shard order.

    Raises:
      ValueError: `ids` of different lengths or without `item_feature`, or
        a bad `num_shards` or `record_format`.
    """
    columns = {key: row_ids(values, f"ids[{key!r}]") for key, values in ids.items()}
    if item_feature not in columns:
        raise ValueError(f"item_feature {item_feature!r} is not a key of ids ({sorted(columns)}).")
    rows = {key: column.rows for key, column in columns.items()}
    n = rows[item_feature]
    if set(rows.values()) != {n}:
        raise ValueError(f"ids must hold one entry per interaction, of one length n; got {rows}.")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= n:
        raise ValueError(f"num_shards must be an int in [1, {n}] (records), got {num_shards!r}.")
    items = columns[item_feature]
    if not np.array_equal(items.row_splits, np.arange(n + 1)):
        raise ValueError(f"ids[{item_feature!r}] must hold one item per interaction.")
    extension = pipelines.RecordFormat(record_format).extension
    import tensorflow as tf  # seconds to import: only where records are written

    log_q = item_log_q(items.values)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        path = os.path.join(out_dir, f"part-{shard:05d}-of-{num_shards:05d}{extension}")
        with pipelines.RecordFileWriter(path) as writer:
            for r in range(shard * n // num_shards, (shard + 1) * n // num_shards):
                ids_of_r = {k: c.row(r).tolist() for k, c in columns.items()}
                writer.write(_example(tf, ids_of_r, log_q[r]))
        paths.append(path)
    _log.info("Wrote %d interactions to %d files in %s.", n, num_shards, out_dir)
    return paths


def _example(tf, ids: Mapping[str, list[int]], log_q: float) -> bytes:
    """One interaction's serialized `tf.train.Example` (`tf`: the tensorflow module)."""

    def int64(values: list[int]):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    feature = {key: int64(values) for key, values in ids.items()}
    feature[LOG_Q_KEY] = tf.train.Feature(float_list=tf.train.FloatList(value=[log_q]))
    feature[LABEL_KEY] = int64([1])
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)
