"""The config's `preprocessing` section."""

from __future__ import annotations

import dataclasses

import embedding
import pipelines
from sparseflow.config._checker import Node, enum_choice, get, mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessingConfig:
    """How the host preprocessing treats ids over the limits or out of range.

    Attributes:
      allow_id_dropping: drop (and count) ids over a table's partition limits
        instead of raising.
      invalid_id_policy: raise on ids outside the vocabulary, or drop them.
    """

    allow_id_dropping: bool = False
    invalid_id_policy: embedding.InvalidIdPolicy = embedding.InvalidIdPolicy.RAISE
    enable_minibatching: bool = False
    on_bad_record: pipelines.BadRecordPolicy = pipelines.BadRecordPolicy.RAISE


def read_preprocessing(node: Node) -> PreprocessingConfig:
    mapping(node, (), ("allow_id_dropping", "invalid_ids", "enable_minibatching", "on_bad_record"))
    return PreprocessingConfig(
        allow_id_dropping=get(node, "allow_id_dropping", "bool", False),
        invalid_id_policy=enum_choice(
            node, "invalid_ids", embedding.InvalidIdPolicy.RAISE, "invalid-id policy"
        ),
        enable_minibatching=get(node, "enable_minibatching", "bool", False),
        on_bad_record=enum_choice(
            node, "on_bad_record", pipelines.BadRecordPolicy.RAISE, "bad-record policy"
        ),
    )
