"""Parse time per record: a record schema with renamed keys and string ids vs the fixed layout.

Both sides parse samples of the same kind (8 sparse features of 1-20 ids
drawn from [0, 2^32), 13 dense values, a label) with
`pipelines.parse_examples`, in batches of `--batch` records:

  * fixed: today's layout (`<feature>` int64 ids, `dense` float list,
    `label` int64), as `sparseflow make-data` writes it;
  * schema: a `RecordSchema` whose features read renamed keys, half of them
    8-character hex strings hashed into a 1M-row vocabulary (as Criteo's
    categorical columns), the dense values 13 scalar keys (int, with a
    default and `log1p`), the label a float cut at 0.5.

The setups alternate forwards and backwards (`--repeats` passes) so that the
machine's drift spreads over both. The last line printed is one JSON object
with the median microseconds per record of each and `ratio_schema_vs_fixed`
(schema time / fixed time; the target is at most 1.3).

    python benchmarks/parse_schema.py [--records 32768] [--batch 1024] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import tensorflow as tf
from _alternating import add_repeats_argument, alternating

import pipelines

FEATURES = 8
DENSE = 13
VOCABULARY = 1_000_000


def _fixed_records(rng: np.random.Generator, count: int) -> list[bytes]:
    records = []
    for _ in range(count):
        feature = {
            f"feature_{f}": tf.train.Feature(
                int64_list=tf.train.Int64List(
                    value=rng.integers(0, 2**32, rng.integers(1, 21)).tolist()
                )
            )
            for f in range(FEATURES)
        }
        feature["dense"] = tf.train.Feature(
            float_list=tf.train.FloatList(value=rng.random(DENSE).tolist())
        )
        feature["label"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[rng.integers(2)]))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        records.append(example.SerializeToString())
    return records


def _schema_records(rng: np.random.Generator, count: int) -> list[bytes]:
    records = []
    for _ in range(count):
        feature = {}
        for f in range(FEATURES):
            ids = rng.integers(0, 2**32, rng.integers(1, 21))
            if f % 2:
                value = tf.train.Feature(int64_list=tf.train.Int64List(value=ids.tolist()))
            else:
                value = tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[b"%08x" % i for i in ids])
                )
            feature[f"C{f + 1}"] = value
        for d in range(DENSE):
            feature[f"I{d + 1}"] = tf.train.Feature(
                int64_list=tf.train.Int64List(value=[int(rng.integers(0, 1000))])
            )
        feature["click"] = tf.train.Feature(float_list=tf.train.FloatList(value=[rng.random()]))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        records.append(example.SerializeToString())
    return records


def layouts() -> dict[str, pipelines.FeatureLayout]:
    names = tuple(f"feature_{f}" for f in range(FEATURES))
    schema = pipelines.RecordSchema(
        sparse=tuple(
            pipelines.SparseColumn(
                name=name,
                key=f"C{f + 1}",
                ids="int64" if f % 2 else "bytes",
                hash_buckets=None if f % 2 else VOCABULARY,
            )
            for f, name in enumerate(names)
        ),
        dense=tuple(
            pipelines.DenseColumn(key=f"I{d + 1}", type="int", default=0, transform="log1p")
            for d in range(DENSE)
        ),
        label=pipelines.LabelColumn(key="click", type="float", threshold=0.5),
    )
    return {
        "fixed": pipelines.FeatureLayout(sparse=names, num_dense_features=DENSE),
        "schema": pipelines.FeatureLayout.from_schema(schema),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1024)
    add_repeats_argument(parser)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    records = {
        "fixed": _fixed_records(rng, args.records),
        "schema": _schema_records(rng, args.records),
    }
    layout = layouts()
    for name in layout:  # compile and warm up
        pipelines.parse_examples(records[name][: args.batch], layout[name])
    seconds: dict[str, list[float]] = {name: [] for name in layout}
    for _, name in alternating(list(layout), args.repeats):
        batches = [
            records[name][start : start + args.batch]
            for start in range(0, args.records, args.batch)
        ]
        start = time.perf_counter()
        for batch in batches:
            pipelines.parse_examples(batch, layout[name])
        seconds[name].append((time.perf_counter() - start) / args.records)
    us = {name: 1e6 * statistics.median(values) for name, values in seconds.items()}
    for name, value in us.items():
        print(f"{name}: {value:.2f} us/record")
    print(
        json.dumps(
            {
                "records": args.records,
                "batch": args.batch,
                "repeats": args.repeats,
                "fixed_us_per_record": round(us["fixed"], 3),
                "schema_us_per_record": round(us["schema"], 3),
                "ratio_schema_vs_fixed": round(us["schema"] / us["fixed"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
