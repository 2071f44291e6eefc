"""The config's `synthetic` section: the data `make-data` and the demo write.

Only those two read it; a config for real records has none. It describes
each feature's ids (valency, Zipf exponent) and the example counts:

  synthetic:
    examples: 50_000        # training examples
    eval_examples: 5_000    # held-out examples
    shards: 2               # files per format
    features:
      user_id: {valency: [1, 1]}
      clicked_items: {valency: [1, 20], zipf: 1.2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import embedding
import pipelines
from sparseflow.config._checker import Node, build, check_kind, get, integer, mapping

_DEFAULT_ZIPF_EXPONENT = 1.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """The synthetic dataset of a run.

    Attributes:
      dataset: the features' and dense values' description.
      examples: training examples.
      eval_examples: held-out examples.
      shards: files per split and format.
    """

    dataset: pipelines.SyntheticDataset
    examples: int
    eval_examples: int
    shards: int = 1


def _valency(node: Node) -> tuple[int, int]:
    values = check_kind(node, "list")
    if len(values) != 2:
        raise node.error(f"expected [min, max], got {values!r}")
    low, high = (check_kind(node.child(i), "int") for i in range(2))
    if low < 1:
        raise node.error(f"min valency must be >= 1 (every sample has an id), got {low}")
    if low > high:
        raise node.error(f"min valency {low} is greater than max valency {high}")
    return low, high


def _feature(node: Node, spec: embedding.FeatureSpec, weighted: bool) -> pipelines.SyntheticFeature:
    mapping(node, ("valency",), ("zipf",))
    min_valency, max_valency = _valency(node.child("valency"))
    zipf = get(node, "zipf", "number", _DEFAULT_ZIPF_EXPONENT)
    if not zipf > 1:
        raise node.child("zipf").error(f"the Zipf exponent must be > 1, got {zipf}")
    return build(
        node,
        pipelines.SyntheticFeature,
        dict(
            name=spec.name,
            vocabulary_size=spec.table_spec.vocabulary_size,
            min_valency=min_valency,
            max_valency=max_valency,
            zipf_exponent=zipf,
            weighted=weighted,
        ),
    )


def read_synthetic(
    node: Node,
    features: Mapping[str, embedding.FeatureSpec],
    layout: pipelines.FeatureLayout,
) -> SyntheticConfig:
    """The `synthetic` section at `node`, for `features` written in the fixed `layout`."""
    mapping(node, ("examples", "eval_examples", "features"), ("shards",))
    entries = node.child("features")
    mapping(entries, tuple(features))
    dataset = build(
        entries,
        pipelines.SyntheticDataset,
        dict(
            features=tuple(
                _feature(entries.child(name), spec, name in layout.weighted)
                for name, spec in features.items()
            ),
            num_dense_features=layout.num_dense_features,
        ),
    )
    return SyntheticConfig(
        dataset=dataset,
        examples=integer(node, "examples"),
        eval_examples=integer(node, "eval_examples", minimum=0),
        shards=integer(node, "shards", 1),
    )
