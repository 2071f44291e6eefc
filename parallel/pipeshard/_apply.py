"""The once-per-step part: gradient sums, finalization and the update.

After the microbatch loop, three kinds of operation remain, in order:
the post equations of the differentiated program (sums of a tied
parameter's gradients), the finalization of each output (mean over
microbatches, or concatenation of per-example gradients), and the train
step's own equations after the gradient (the optimizer update). Each
operation is placed on the stage holding most of the bytes it reads, so
a parameter's update runs where its gradient was accumulated; operations
reading nothing placed (an optimizer's step count) are copied to every
place that needs them. Operations on one stage that need nothing from
another stage produced in this phase run as one program; a dependency
across stages starts a new level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DropVar, JaxprEqn, Literal, Var

from parallel.pipeshard._jaxprs import eval_eqn, nbytes, vars_of
from parallel.pipeshard._options import LossReduction
from parallel.pipeshard._program import MicrobatchProgram


@dataclasses.dataclass(frozen=True)
class PerMicrobatch:
    """Key of the list of a value's per-microbatch results."""

    var: Var


Key = Var | PerMicrobatch


@dataclasses.dataclass(frozen=True, eq=False)
class ApplyOp:
    """One operation of the apply phase: `outputs = run(inputs)`."""

    inputs: tuple[Any, ...]
    outputs: tuple[Var, ...]
    run: Callable[[list], list]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApplyPiece:
    """Operations run as one program on one stage at one level."""

    stage: int
    level: int
    ops: tuple[ApplyOp, ...]
    inputs: tuple[Key, ...]
    outputs: tuple[Var, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepGraph:
    """The outer train step around its gradient equation.

    Attributes:
      jaxpr: the train step at full batch shapes.
      grad_index: position of the `pipeshard_value_and_grad` equation.
      grad_sources: per input of that equation (the loss program's
        inputs), the train step's atom it reads.
    """

    jaxpr: ClosedJaxpr
    grad_index: int
    grad_sources: tuple[Any, ...]

    @property
    def grad_eqn(self) -> JaxprEqn:
        return self.jaxpr.jaxpr.eqns[self.grad_index]


def build_apply_pieces(
    program: MicrobatchProgram,
    step: StepGraph,
    *,
    num_microbatches: int,
    reduction: LossReduction,
    input_homes: Mapping[Var, int],
) -> tuple[ApplyPiece, ...]:
    """Places the apply phase on stages and groups it into programs.

    Args:
      program: the sliced differentiated program.
      step: the train step.
      num_microbatches: m.
      reduction: how the loss reduces over examples.
      input_homes: the stage of train-step inputs with a natural place (a
        parameter: the first stage reading it).

    Returns:
      The pieces, in execution order (by level, then stage).
    """
    ops = _ops(program, step, num_microbatches, reduction)
    homes = _input_homes(program, input_homes)
    placement = _place(ops, homes, num_microbatches)
    return _group(ops, placement, step.jaxpr.jaxpr.outvars)


def _ops(program, step, m, reduction) -> list[ApplyOp]:
    produced_per_microbatch = {v for p in program.pieces for v in p.sum_outputs}
    produced_per_microbatch |= {v for e in program.post_eqns for v in vars_of(e.outvars)}
    concatenated = {v for p in program.pieces for v in p.concat_outputs}
    ops = [_eqn_op(e) for e in program.post_eqns]
    ops += [_eqn_op(e) for e in program.floating_eqns]
    scale = 1.0 / m if reduction is LossReduction.MEAN else 1.0
    for j_out, concat, o_out in zip(
        program.jaxpr.jaxpr.outvars, program.concat_outvars, step.grad_eqn.outvars
    ):
        if isinstance(o_out, DropVar):
            continue
        if concat and j_out in concatenated:
            ops.append(ApplyOp((PerMicrobatch(j_out),), (o_out,), _concat_op(scale)))
        elif concat:
            ops.append(ApplyOp((j_out,), (o_out,), _tile_op(m, scale)))
        elif j_out in produced_per_microbatch:
            ops.append(ApplyOp((j_out,), (o_out,), _scale_op(scale)))
        else:  # The same value in every microbatch: its sum is m times it.
            ops.append(ApplyOp((j_out,), (o_out,), _scale_op(scale * m)))
    ops += [_eqn_op(e) for i, e in enumerate(step.jaxpr.jaxpr.eqns) if i != step.grad_index]
    return ops


def _eqn_op(eqn: JaxprEqn) -> ApplyOp:
    return ApplyOp(tuple(eqn.invars), tuple(eqn.outvars), lambda values: eval_eqn(eqn, values))


def _scale_op(factor: float) -> Callable[[list], list]:
    return lambda values: [values[0] if factor == 1.0 else values[0] * factor]


def _concat_op(factor: float) -> Callable[[list], list]:
    return lambda values: _scale_op(factor)([jnp.concatenate(values[0], axis=0)])


def _tile_op(m: int, factor: float) -> Callable[[list], list]:
    return lambda values: _scale_op(factor)([jnp.concatenate([values[0]] * m, axis=0)])


def _input_homes(program: MicrobatchProgram, input_homes: Mapping[Var, int]) -> dict[Key, int]:
    homes: dict[Key, int] = dict(input_homes)
    for piece in program.pieces:
        homes.update((v, piece.stage) for v in piece.sum_outputs)
        homes.update((PerMicrobatch(v), piece.stage) for v in piece.concat_outputs)
    return homes


def _key_bytes(key: Key, m: int) -> int:
    if isinstance(key, PerMicrobatch):
        return m * nbytes(key.var.aval)
    return nbytes(key.aval)


def _place(ops, homes: dict[Key, int], m: int) -> list[tuple[int, int] | None]:
    """(stage, level) of every op, None for ops copied where needed."""
    level_of: dict[Key, tuple[int, int]] = {}  # var -> (stage, level) of its producer
    placement = []
    for op in ops:
        weights: dict[int, int] = {}
        for key in op.inputs:
            if isinstance(key, Literal):
                continue
            stage = level_of[key][0] if key in level_of else homes.get(key)
            if stage is not None:
                weights[stage] = weights.get(stage, 0) + _key_bytes(key, m)
        if not weights:
            placement.append(None)
            continue
        stage = min(weights, key=lambda s: (-weights[s], s))
        level = max(
            (
                level_of[k][1] + (level_of[k][0] != stage)
                for k in op.inputs
                if not isinstance(k, Literal) and k in level_of
            ),
            default=0,
        )
        placement.append((stage, level))
        level_of.update((v, (stage, level)) for v in vars_of(op.outputs))
    return placement


def _group(ops, placement, outvars: Sequence[Any]) -> tuple[ApplyPiece, ...]:
    producer = {v: i for i, op in enumerate(ops) for v in vars_of(op.outputs)}
    returned = set(vars_of(outvars))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, where in enumerate(placement):
        if where is not None:
            groups.setdefault((where[1], where[0]), []).append(i)
    floating_returned = [v for v in returned if v in producer and placement[producer[v]] is None]
    if floating_returned:
        groups.setdefault((0, 0), [])
    readers: dict[Var, set] = {}
    for key, members in groups.items():
        for i in members:
            for v in vars_of(ops[i].inputs):
                readers.setdefault(v, set()).add(key)
    pieces = []
    for (level, stage), members in sorted(groups.items()):
        wanted = floating_returned if (level, stage) == (0, 0) else []
        roots = [k for i in members for k in ops[i].inputs] + wanted
        indices = sorted(set(members) | _copied_closure(roots, ops, producer, placement))
        local = {v for i in indices for v in vars_of(ops[i].outputs)}
        inputs = dict.fromkeys(
            k
            for i in indices
            for k in ops[i].inputs
            if not isinstance(k, Literal) and k not in local
        )
        own = [v for i in members for v in vars_of(ops[i].outputs)] + wanted
        outputs = [v for v in own if v in returned or readers.get(v, set()) - {(level, stage)}]
        pieces.append(
            ApplyPiece(
                stage=stage,
                level=level,
                ops=tuple(ops[i] for i in indices),
                inputs=tuple(inputs),
                outputs=tuple(dict.fromkeys(outputs)),
            )
        )
    return tuple(pieces)


def _copied_closure(roots, ops, producer, placement) -> set[int]:
    needed, stack = set(), [k for k in roots if isinstance(k, Var)]
    while stack:
        i = producer.get(stack.pop())
        if i is not None and placement[i] is None and i not in needed:
            needed.add(i)
            stack.extend(k for k in ops[i].inputs if isinstance(k, Var))
    return needed


def run_ops(ops: Sequence[ApplyOp], inputs: Sequence[Key], outputs: Sequence[Var]):
    """A function evaluating `ops` from values of `inputs` to `outputs`."""

    def run(*values):
        env: dict[Any, Any] = dict(zip(inputs, values))
        for op in ops:
            results = op.run([k.val if isinstance(k, Literal) else env[k] for k in op.inputs])
            env.update((v, r) for v, r in zip(op.outputs, results) if not isinstance(v, DropVar))
        return [env[v] for v in outputs]

    return run
