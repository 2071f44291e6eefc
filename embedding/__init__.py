"""Embedding specs, host preprocessing into the sharded layout, lookup and updates.

This package imports none of sparseflow's other packages. `jte_compat` holds
jax-tpu-embedding's names and signatures as aliases (docs/switching.md).
"""

from embedding import checks, initializers, jte_compat
from embedding._buffers import aligned_empty
from embedding._errors import SparseflowError
from embedding._feature_input import InvalidIdPolicy, RaggedIds
from embedding._interaction import pairwise_dots
from embedding._layout import LimitBreachError
from embedding._lookup import LayoutIndex, sparse_dense_matmul
from embedding._mesh_geometry import MeshGeometry
from embedding._minibatch import AllReduceInterface
from embedding._optimizers import (
    AdagradOptimizerSpec,
    AdagradSlots,
    AdamOptimizerSpec,
    AdamSlots,
    FTRLOptimizerSpec,
    FTRLSlots,
    OptimizerSpec,
    RowWiseAdagradOptimizerSpec,
    RowWiseAdagradSlots,
    SGDOptimizerSpec,
    SGDSlots,
)
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
from embedding.fdo import (
    FdoBatchOrder,
    FdoClient,
    FdoGeometry,
    FdoLayout,
    FdoStats,
    FdoStatsError,
    LimitRaises,
    OnMismatch,
    StackFdoStats,
    StackLimits,
    TableIdFrequency,
    apply_fdo,
    batch_fdo_stats,
    exceeds,
    fdo_layout,
    fdo_limits,
    fdo_stats_file_name,
    limit_raises_path,
    load_fdo_stats,
    load_limit_raises,
    max_limits,
    merge_fdo_stats,
    set_stack_limits,
    stack_limits,
    write_fdo_stats,
    write_limit_raises,
)

__all__ = [
    "checks",
    "AdagradOptimizerSpec",
    "AdagradSlots",
    "AdamOptimizerSpec",
    "AdamSlots",
    "AllReduceInterface",
    "Combiner",
    "EmbeddingVariables",
    "FTRLOptimizerSpec",
    "FTRLSlots",
    "FdoBatchOrder",
    "FdoClient",
    "FdoGeometry",
    "FdoLayout",
    "FdoStats",
    "FdoStatsError",
    "FeatureIdTransformation",
    "FeatureSpec",
    "InvalidIdPolicy",
    "LayoutIndex",
    "LimitBreachError",
    "MeshGeometry",
    "LimitRaises",
    "OnMismatch",
    "OptimizerSpec",
    "PreprocessedInput",
    "RaggedIds",
    "RowWiseAdagradOptimizerSpec",
    "RowWiseAdagradSlots",
    "SGDOptimizerSpec",
    "SGDSlots",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "SparseflowError",
    "StackFdoStats",
    "StackLimits",
    "StackedTableSpec",
    "TableIdFrequency",
    "TableSettingInStack",
    "TableSpec",
    "aligned_empty",
    "apply_fdo",
    "apply_gradients",
    "batch_fdo_stats",
    "coo_buffer_size_per_device",
    "embedding_variables_shapes",
    "exceeds",
    "fdo_layout",
    "fdo_limits",
    "fdo_stats_file_name",
    "gather_tables",
    "auto_stack_tables",
    "get_stacked_table_specs",
    "init_embedding_variables",
    "initializers",
    "jte_compat",
    "limit_raises_path",
    "pairwise_dots",
    "load_fdo_stats",
    "load_limit_raises",
    "max_limits",
    "merge_fdo_stats",
    "preprocess_sparse_dense_matmul_input",
    "preprocessed_input_shapes",
    "prepare_feature_specs_for_training",
    "relayout_embedding_variables",
    "restack",
    "set_stack_limits",
    "shard_tables",
    "sparse_dense_matmul",
    "stack_limits",
    "stack_tables",
    "table_key",
    "write_fdo_stats",
    "write_limit_raises",
]
