"""Embedding specs, host preprocessing into the sharded layout, lookup and updates.

This package imports none of sparseflow's other packages. `jte_compat` holds
jax-tpu-embedding's names and signatures as aliases (docs/switching.md).
"""

from embedding import _optimizers, checks, fdo, initializers, jte_compat
from embedding._buffers import aligned_empty
from embedding._cpu_kernels import without_cpu_kernels
from embedding._dense_lookup import dense_lookup
from embedding._errors import SparseflowError
from embedding._feature_input import InvalidIdPolicy, RaggedIds
from embedding._interaction import pairwise_dots
from embedding._layout import LimitBreachError
from embedding._lookup import LayoutIndex, sparse_dense_matmul
from embedding._malloc import give_back_freed_memory
from embedding._mesh_geometry import MeshGeometry
from embedding._minibatch import AllReduceInterface
from embedding._optimizers import *  # noqa: F403 - the specs and slots its __all__ lists
from embedding._preprocess import (
    PreprocessedInput,
    SparseDenseMatmulInput,
    SparseDenseMatmulInputStats,
    coo_buffer_size_per_device,
    preprocess_sparse_dense_matmul_input,
    preprocessed_input_shapes,
)
from embedding._relayout import (
    embedding_variables_shapes,
    relayout_embedding_variables,
    restack,
)
from embedding._specs import (
    Combiner,
    FeatureIdTransformation,
    FeatureSpec,
    StackedTableSpec,
    TableSettingInStack,
    TableSpec,
    feature_dims,
)
from embedding._stacking import (
    auto_stack_tables,
    get_stacked_table_specs,
    prepare_feature_specs_for_training,
    stack_tables,
)
from embedding._update import apply_gradients
from embedding._variables import (
    EmbeddingVariables,
    gather_tables,
    init_embedding_variables,
    shard_tables,
    table_key,
)
from embedding.fdo import *  # noqa: F403 - the names its __all__ lists, exported here too

__all__ = [
    *_optimizers.__all__,
    *fdo.__all__,
    "checks",
    "AllReduceInterface",
    "Combiner",
    "EmbeddingVariables",
    "FeatureIdTransformation",
    "FeatureSpec",
    "InvalidIdPolicy",
    "LayoutIndex",
    "LimitBreachError",
    "MeshGeometry",
    "PreprocessedInput",
    "RaggedIds",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "SparseflowError",
    "StackedTableSpec",
    "TableSettingInStack",
    "TableSpec",
    "aligned_empty",
    "apply_gradients",
    "coo_buffer_size_per_device",
    "dense_lookup",
    "embedding_variables_shapes",
    "feature_dims",
    "gather_tables",
    "auto_stack_tables",
    "get_stacked_table_specs",
    "give_back_freed_memory",
    "init_embedding_variables",
    "initializers",
    "jte_compat",
    "pairwise_dots",
    "preprocess_sparse_dense_matmul_input",
    "preprocessed_input_shapes",
    "prepare_feature_specs_for_training",
    "relayout_embedding_variables",
    "restack",
    "shard_tables",
    "sparse_dense_matmul",
    "stack_tables",
    "table_key",
    "without_cpu_kernels",
]
