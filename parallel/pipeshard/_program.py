"""Slicing the differentiated program into per-stage, per-microbatch pieces.

The input is the jaxpr of `value_and_grad` of the layer-marked loss at
microbatch shapes. Its forward layers sit between forward START/END
markers, its backward layers between backward ones (see `_markers`). Given
the stage of every layer, every equation gets one of four places:

* a piece: the forward (F) or backward (B) of a stage, run once per
  microbatch on the stage's devices: the equations from the stage's first
  marker to its last, in its direction;
* post: linear equations outside every layer whose inputs are already
  summed over microbatches, run once per step (the sum of a parameter's
  gradients from the several stages that use it: tied weights);
* floating: equations that read no per-microbatch value (constants), copied
  into every piece that reads them;
* otherwise, it joins the next piece in program order (the last one if none
  follows), which keeps every piece's inputs produced before it runs.

Values crossing pieces are sent between stages per microbatch; values read
by post equations or returned are summed over microbatches (or, for the
gradients of per-example inputs, kept per microbatch and concatenated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr, JaxprEqn, Var
from jax.extend.core import primitives as prims

from parallel.pipeshard._jaxprs import vars_of
from parallel.pipeshard._markers import is_marker
from parallel.pipeshard._schedules import TaskKind


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """One stage's forward or backward, as equations of the whole program.

    Attributes:
      stage: the stage whose devices run it.
      kind: forward or backward.
      eqns: its equations, in program order (floating ones copied in).
      split_inputs: program inputs sliced per microbatch (the batch).
      step_inputs: program inputs and constants fixed over the step.
      transfer_inputs: values from earlier pieces of the same microbatch.
      transfer_outputs: values later pieces of the same microbatch read.
      sum_outputs: values summed over the microbatches of the step.
      concat_outputs: values kept per microbatch and concatenated.
    """

    stage: int
    kind: TaskKind
    eqns: tuple[JaxprEqn, ...]
    split_inputs: tuple[Var, ...]
    step_inputs: tuple[Var, ...]
    transfer_inputs: tuple[Var, ...]
    transfer_outputs: tuple[Var, ...]
    sum_outputs: tuple[Var, ...]
    concat_outputs: tuple[Var, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicrobatchProgram:
    """The differentiated program cut into pieces.

    Attributes:
      jaxpr: the differentiated program (`[loss, *grads]` at microbatch
        shapes); its invars are the loss's flat inputs.
      pieces: in per-microbatch dependency order, F of stages 0..p-1 then B
        of stages p-1..0; a stage without backward work has no B piece.
      post_eqns: linear equations run once on the microbatch sums.
      floating_eqns: equations reading no per-microbatch value.
      concat_outvars: per output of `jaxpr`, True when it is concatenated
        over microbatches rather than summed.
    """

    jaxpr: ClosedJaxpr
    pieces: tuple[Piece, ...]
    post_eqns: tuple[JaxprEqn, ...]
    floating_eqns: tuple[JaxprEqn, ...]
    concat_outvars: tuple[bool, ...]

    def piece(self, stage: int, kind: TaskKind) -> Piece | None:
        for candidate in self.pieces:
            if candidate.stage == stage and candidate.kind is kind:
                return candidate
        return None


def slice_program(
    jaxpr: ClosedJaxpr,
    *,
    split_invars: Sequence[bool],
    stage_of_layer: Sequence[int],
    concat_outvars: Sequence[bool],
) -> MicrobatchProgram:
    """Cuts `jaxpr` into pieces for the given layer-to-stage map."""
    eqns = jaxpr.jaxpr.eqns
    ranges = _stage_ranges(eqns, stage_of_layer)
    owner = _owners(len(eqns), ranges)
    split = {v for v, s in zip(jaxpr.jaxpr.invars, split_invars) if s}
    floating = _floating(eqns, owner, split)
    concat_vars = {v for v, c in zip(jaxpr.jaxpr.outvars, concat_outvars) if c}
    post = _post_eqns(eqns, owner, floating, jaxpr.jaxpr.outvars, concat_vars)
    for i in range(len(eqns)):
        if owner[i] is None and i not in floating and i not in post:
            owner[i] = next(
                (r for r, (_, _, lo, _) in enumerate(ranges) if lo > i), len(ranges) - 1
            )
    members = [[i for i in range(len(eqns)) if owner[i] == r] for r in range(len(ranges))]
    pieces = _build_pieces(jaxpr, ranges, members, floating, split, post, concat_vars)
    return MicrobatchProgram(
        jaxpr=jaxpr,
        pieces=pieces,
        post_eqns=tuple(eqns[i] for i in sorted(post)),
        floating_eqns=tuple(eqns[i] for i in sorted(floating)),
        concat_outvars=tuple(concat_outvars),
    )


def _stage_ranges(eqns, stage_of_layer) -> list[tuple[int, TaskKind, int, int]]:
    """(stage, kind, first, last) equation index of every piece, in order."""
    bounds: dict[tuple[int, TaskKind], list[int]] = {}
    for i, eqn in enumerate(eqns):
        if is_marker(eqn):
            stage = stage_of_layer[eqn.params["layer"]]
            kind = TaskKind.BACKWARD if eqn.params["backward"] else TaskKind.FORWARD
            bounds.setdefault((stage, kind), []).append(i)
    num_stages = max(stage_of_layer) + 1
    order = [(s, TaskKind.FORWARD) for s in range(num_stages)]
    order += [(s, TaskKind.BACKWARD) for s in reversed(range(num_stages))]
    ranges = [(s, k, min(bounds[s, k]), max(bounds[s, k])) for s, k in order if (s, k) in bounds]
    for before, after in zip(ranges, ranges[1:]):
        if before[3] >= after[2]:
            raise RuntimeError(
                f"Pipeline pieces interleave in the differentiated program: {before[:2]} ends "
                f"at equation {before[3]} after {after[:2]} starts at {after[2]}."
            )
    return ranges


def _owners(num_eqns: int, ranges) -> list[int | None]:
    owner: list[int | None] = [None] * num_eqns
    for r, (_, _, lo, hi) in enumerate(ranges):
        owner[lo : hi + 1] = [r] * (hi - lo + 1)
    return owner


def _floating(eqns, owner, split: set[Var]) -> set[int]:
    """Equations outside the pieces that read no per-microbatch value."""
    floating, floating_vars = set(), set()
    defined_by_eqn = {v for e in eqns for v in vars_of(e.outvars)}
    for i, eqn in enumerate(eqns):
        if owner[i] is not None:
            continue
        reads = vars_of(eqn.invars)
        if all(v in floating_vars or (v not in defined_by_eqn and v not in split) for v in reads):
            floating.add(i)
            floating_vars.update(vars_of(eqn.outvars))
    return floating


def _post_eqns(eqns, owner, floating, outvars, concat_vars: set[Var]) -> set[int]:
    """Free sums whose results only reach post equations or summed outputs.

    Moving `add_any(a, b)` after the microbatch loop is exact because it is
    linear: the sum over microbatches of `a_k + b_k` is `sum a_k + sum b_k`.
    """
    producer = {v: i for i, e in enumerate(eqns) for v in vars_of(e.outvars)}
    consumers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in vars_of(eqn.invars):
            consumers.setdefault(v, []).append(i)
    post: set[int] = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if owner[i] is not None or i in floating or eqn.primitive is not prims.add_jaxvals_p:
            continue
        reads = vars_of(eqn.invars)
        inputs_summable = len(reads) == len(eqn.invars) and all(
            v in producer and producer[v] not in floating for v in reads
        )
        outputs_summed = all(
            v not in concat_vars and all(c in post for c in consumers.get(v, ()))
            for v in vars_of(eqn.outvars)
        )
        if inputs_summable and outputs_summed:
            post.add(i)
    return post


def _build_pieces(jaxpr, ranges, members, floating, split, post, concat_vars):
    eqns = jaxpr.jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in vars_of(e.outvars)}
    piece_of = {}
    for r, indices in enumerate(members):
        for i in indices:
            piece_of.update((v, r) for v in vars_of(eqns[i].outvars))
    readers: dict[Var, set] = {}
    for r, indices in enumerate(members):
        for i in indices:
            for v in vars_of(eqns[i].invars):
                if piece_of.get(v) != r:
                    readers.setdefault(v, set()).add(r)
    post_reads = {v for i in post for v in vars_of(eqns[i].invars)}
    returned = set(vars_of(jaxpr.jaxpr.outvars))
    pieces = []
    for r, (stage, kind, _, _) in enumerate(ranges):
        indices = sorted(set(members[r]) | _floating_closure(members[r], eqns, producer, floating))
        local = {v for i in indices for v in vars_of(eqns[i].outvars)}
        reads = dict.fromkeys(v for i in indices for v in vars_of(eqns[i].invars) if v not in local)
        for v in reads:
            if v in producer and piece_of.get(v, r) >= r:
                raise RuntimeError(f"Piece {stage}{kind.value} reads {v} before it is produced.")
        own = [v for i in members[r] for v in vars_of(eqns[i].outvars)]
        summed = [v for v in own if v in post_reads or (v in returned and v not in concat_vars)]
        pieces.append(
            Piece(
                stage=stage,
                kind=kind,
                eqns=tuple(eqns[i] for i in indices),
                split_inputs=tuple(v for v in reads if v in split),
                step_inputs=tuple(v for v in reads if v not in producer and v not in split),
                transfer_inputs=tuple(v for v in reads if v in producer),
                transfer_outputs=tuple(v for v in own if readers.get(v, set()) - {r}),
                sum_outputs=tuple(summed),
                concat_outputs=tuple(v for v in own if v in concat_vars),
            )
        )
    return tuple(pieces)


def _floating_closure(indices, eqns, producer, floating) -> set[int]:
    """Floating equations the given equations need, transitively."""
    needed, stack = set(), [v for i in indices for v in vars_of(eqns[i].invars)]
    while stack:
        v = stack.pop()
        i = producer.get(v)
        if i is not None and i in floating and i not in needed:
            needed.add(i)
            stack.extend(vars_of(eqns[i].invars))
    return needed


def split_weight_gradients(program: MicrobatchProgram) -> MicrobatchProgram:
    """`program` with every backward piece split into B (inputs) and W (weights).

    B keeps the equations its stage's input gradients need (the values sent
    to the stage before, and per-example gradients of the batch); W gets
    the rest, the weight gradients summed over microbatches. Values of B
    that W reads pass from B to W like any transfer. Nothing waits for W, so
    a schedule may defer it (zero bubble).
    """
    pieces = []
    for piece in program.pieces:
        pieces += _split_backward(piece) if piece.kind is TaskKind.BACKWARD else [piece]
    return dataclasses.replace(program, pieces=tuple(pieces))


def _split_backward(piece: Piece) -> list[Piece]:
    eqns = [single for eqn in piece.eqns for single in _per_operand(eqn)]
    needed = set(piece.transfer_outputs) | set(piece.concat_outputs)
    in_input_part = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        if needed.intersection(vars_of(eqns[i].outvars)):
            in_input_part[i] = True
            needed.update(vars_of(eqns[i].invars))
    input_eqns = [e for e, inside in zip(eqns, in_input_part) if inside]
    weight_eqns = [e for e, inside in zip(eqns, in_input_part) if not inside]
    if not weight_eqns:
        return [piece]
    input_made = {v for e in input_eqns for v in vars_of(e.outvars)}
    weight_reads = {v for e in weight_eqns for v in vars_of(e.invars)}
    handed_on = tuple(
        dict.fromkeys(v for e in input_eqns for v in vars_of(e.outvars) if v in weight_reads)
    )

    def part(kind, eqns, extra_inputs, extra_outputs, made):
        reads = {v for e in eqns for v in vars_of(e.invars)}
        return Piece(
            stage=piece.stage,
            kind=kind,
            eqns=tuple(eqns),
            split_inputs=tuple(v for v in piece.split_inputs if v in reads),
            step_inputs=tuple(v for v in piece.step_inputs if v in reads),
            transfer_inputs=tuple(v for v in piece.transfer_inputs if v in reads) + extra_inputs,
            transfer_outputs=tuple(v for v in piece.transfer_outputs if v in made) + extra_outputs,
            sum_outputs=tuple(v for v in piece.sum_outputs if v in made),
            concat_outputs=tuple(v for v in piece.concat_outputs if v in made),
        )

    weight_made = {v for e in weight_eqns for v in vars_of(e.outvars)}
    return [
        part(TaskKind.BACKWARD, input_eqns, (), handed_on, input_made),
        part(TaskKind.WEIGHT, weight_eqns, handed_on, (), weight_made),
    ]


def _per_operand(eqn: JaxprEqn) -> list[JaxprEqn]:
    """A layer marker as one marker per operand (it is the identity on each).

    A backward marker passes a layer's input and weight gradients together;
    apart, the input gradients no longer depend on the weight gradients.
    """
    if not is_marker(eqn) or len(eqn.invars) <= 1:
        return [eqn]
    return [eqn.replace(invars=[i], outvars=[o]) for i, o in zip(eqn.invars, eqn.outvars)]
