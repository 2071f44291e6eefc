"""The stage-function protocols and the pytrees of SC/TC step pipelining.

The user's types are type parameters: sparse and dense inputs, embedding
activations and gradients, the aux values the stages hand on, the pipeline
output, the TC train state and the embedding variables. Each pipelined step
(`parallel.step`) runs three stages, each on a different batch:

- the SC backward stage (`ScBwdStageFun`) updates the tables with batch
  i-2's embedding gradients;
- the SC forward stage (`ScFwdStageFun`) looks up batch i in the updated
  tables;
- the TC stage (`TcStageFun`) runs the dense forward and backward pass of
  batch i-1 and returns its embedding gradients.

`PipelineState` carries what one step hands the next: batch i's inputs and
activations (`LastStepInput`) and batch i-1's gradients (`StepBeforeLastStepInput`).
"""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, Protocol, TypeAlias, TypeVar

__all__ = [
    "CurrentStepInput",
    "LastStepInput",
    "PipelineState",
    "ScBwdStageFun",
    "ScFwdStageFun",
    "StepBeforeLastStepInput",
    "TcStageFun",
]

_SparseInput = TypeVar("_SparseInput")
_DenseInput = TypeVar("_DenseInput")
_EmbeddingActivations = TypeVar("_EmbeddingActivations")
_EmbeddingGradients = TypeVar("_EmbeddingGradients")
_ScFwdAux = TypeVar("_ScFwdAux")
_TcAux = TypeVar("_TcAux")
_ScBwdAux = TypeVar("_ScBwdAux")
_PipelineOutput = TypeVar("_PipelineOutput")
_TcTrainState = TypeVar("_TcTrainState")
_EmbeddingVariables = TypeVar("_EmbeddingVariables")


class ScFwdStageFun(Protocol[_SparseInput, _EmbeddingActivations, _EmbeddingVariables, _ScFwdAux]):
    """The SparseCore forward stage: looks a batch up in the embedding tables."""

    def __call__(
        self,
        sparse_inputs: _SparseInput,
        embedding_variables: _EmbeddingVariables,
    ) -> tuple[_EmbeddingActivations, _ScFwdAux]:
        """Looks up one batch.

        Args:
          sparse_inputs: the batch's sparse inputs (e.g. an
            `embedding.PreprocessedInput`).
          embedding_variables: the tables, already updated with the gradients
            of the batch two steps back.

        Returns:
          `(embedding_activations, sc_fwd_aux)`; the pipeline hands both to the
          TC stage of the next step (`sc_fwd_aux` may be `None`).
        """
        ...


class TcStageFun(
    Protocol[
        _EmbeddingActivations,
        _DenseInput,
        _EmbeddingGradients,
        _PipelineOutput,
        _TcTrainState,
        _ScFwdAux,
        _TcAux,
    ]
):
    """The TensorCore stage: the dense forward and backward pass of a batch."""

    def __call__(
        self,
        embedding_activations: _EmbeddingActivations,
        dense_inputs: _DenseInput,
        train_state: _TcTrainState,
        sc_fwd_aux: _ScFwdAux | None = None,
    ) -> tuple[_EmbeddingGradients, _PipelineOutput, _TcTrainState, _TcAux]:
        """Runs the dense model on one batch and updates its parameters.

        Args:
          embedding_activations: what the SC forward stage returned for this
            batch one step earlier.
          dense_inputs: the batch's dense inputs.
          train_state: the dense parameters and optimizer state.
          sc_fwd_aux: the aux the SC forward stage returned for this batch.

        Returns:
          `(embedding_gradients, output, train_state, tc_aux)`: the gradients
          of the loss with respect to `embedding_activations` (same structure),
          the step's output (loss, metrics), the updated train state (same
          structure as the one passed in) and the aux handed to the SC
          backward stage of the next step (may be `None`).
        """
        ...


class ScBwdStageFun(
    Protocol[_SparseInput, _EmbeddingGradients, _EmbeddingVariables, _TcAux, _ScBwdAux]
):
    """The SparseCore backward stage: applies a batch's embedding gradients."""

    def __call__(
        self,
        sparse_inputs: _SparseInput,
        embedding_gradients: _EmbeddingGradients,
        embedding_variables: _EmbeddingVariables,
        tc_aux: _TcAux | None = None,
    ) -> tuple[_EmbeddingVariables, _ScBwdAux]:
        """Updates the tables with one batch's gradients.

        Args:
          sparse_inputs: the batch's sparse inputs, as the SC forward stage got
            them two steps earlier.
          embedding_gradients: what the TC stage returned for the batch.
          embedding_variables: the tables.
          tc_aux: the aux the TC stage returned for the batch.

        Returns:
          `(embedding_variables, sc_bwd_aux)`: the updated tables and an aux
          `parallel.step` returns to the caller (may be `None`).
        """
        ...


class CurrentStepInput(NamedTuple, Generic[_SparseInput, _DenseInput]):
    """The inputs of batch i, fed to the step that runs its SC forward stage.

    Attributes:
      sparse_inputs: used by the SC forward stage now and by the SC backward
        stage two steps later.
      dense_inputs: used by the TC stage of the next step.
    """

    sparse_inputs: _SparseInput
    dense_inputs: _DenseInput


class LastStepInput(
    NamedTuple, Generic[_SparseInput, _DenseInput, _EmbeddingActivations, _ScFwdAux]
):
    """What the previous step (batch i-1) left for the TC stage.

    Attributes:
      sparse_inputs: kept for the SC backward stage of the next step.
      embedding_activations: the SC forward stage's activations.
      dense_inputs: the batch's dense inputs.
      sc_fwd_aux: the SC forward stage's aux.
    """

    sparse_inputs: _SparseInput
    embedding_activations: _EmbeddingActivations
    dense_inputs: _DenseInput
    sc_fwd_aux: _ScFwdAux


class StepBeforeLastStepInput(NamedTuple, Generic[_SparseInput, _EmbeddingGradients, _TcAux]):
    """What the step before the previous one (batch i-2) left for the SC backward stage.

    Attributes:
      sparse_inputs: the batch's sparse inputs.
      embedding_gradients: the TC stage's embedding gradients.
      tc_aux: the TC stage's aux.
    """

    sparse_inputs: _SparseInput
    embedding_gradients: _EmbeddingGradients
    tc_aux: _TcAux


class PipelineState(
    NamedTuple,
    Generic[
        _SparseInput,
        _DenseInput,
        _EmbeddingActivations,
        _EmbeddingGradients,
        _TcAux,
        _ScFwdAux,
        _PipelineOutput,
    ],
):
    """The state one pipelined step hands the next (a pytree of arrays).

    Attributes:
      pipeline_step: `int32[]`, the number of steps run so far (pipeline steps,
        not training steps: batch `pipeline_step - 1`'s TC stage runs next).
      last_step_inputs: batch i-1's inputs, activations and SC forward aux.
      step_before_last_step_inputs: batch i-2's sparse inputs, embedding
        gradients and TC aux.
      placeholder_output: zeros shaped like the TC stage's output, returned by
        steps that do not run the TC stage.
      placeholder_tc_aux: zeros shaped like the TC stage's aux, handed on by
        steps that do not run the TC stage.
    """

    pipeline_step: Any  # shape=(), dtype=int32
    last_step_inputs: LastStepInput[_SparseInput, _DenseInput, _EmbeddingActivations, _ScFwdAux]
    step_before_last_step_inputs: StepBeforeLastStepInput[_SparseInput, _EmbeddingGradients, _TcAux]
    placeholder_output: _PipelineOutput
    placeholder_tc_aux: _TcAux


AnyPipelineState: TypeAlias = PipelineState[PipelineState.__parameters__]
"""`PipelineState` over its own type variables (the module's), to spell them once."""
