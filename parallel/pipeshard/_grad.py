"""`grad` / `value_and_grad`: where the pipelined gradient is taken.

Outside `parallelize` they are `jax.grad` / `jax.value_and_grad`. While
`parallelize` traces a train step they instead stage the loss function,
closure included, as one `pipeshard_value_and_grad` equation holding the
loss's jaxpr: the program before it feeds the pipeline, the program after
it (the optimizer update) is applied per stage.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Jaxpr, Primitive
from jax.interpreters import mlir

from parallel.pipeshard._jaxprs import check_marker_placement, eval_eqns, read_atom

_CAPTURING = contextvars.ContextVar("pipeshard_capturing", default=False)

pipeline_grad_p = Primitive("pipeshard_value_and_grad")
pipeline_grad_p.multiple_results = True


def evaluate_loss(jaxpr: Jaxpr, num_consts: int, *flat_args) -> Any:
    """The loss of a staged loss jaxpr; consts are the last `num_consts` args."""
    split = len(flat_args) - num_consts
    env = dict(zip(jaxpr.constvars, flat_args[split:]))
    env.update(zip(jaxpr.invars, flat_args[:split]))
    eval_eqns(jaxpr.eqns, env)
    return read_atom(env, jaxpr.outvars[0])


def _value_and_grad_impl(*flat_args, jaxpr, num_diff, num_consts, out_avals):
    del out_avals

    def loss(diff):
        return evaluate_loss(jaxpr, num_consts, *diff, *flat_args[num_diff:])

    value, grads = jax.value_and_grad(loss)(list(flat_args[:num_diff]))
    return [value, *grads]


pipeline_grad_p.def_impl(_value_and_grad_impl)
pipeline_grad_p.def_abstract_eval(lambda *_, out_avals, **__: list(out_avals))
mlir.register_lowering(pipeline_grad_p, mlir.lower_fun(_value_and_grad_impl, multiple_results=True))


@contextlib.contextmanager
def capturing_gradients() -> Iterator[None]:
    """While active, the wrappers stage their loss instead of differentiating."""
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    values = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not values or any(isinstance(a, bool) or not isinstance(a, int) for a in values):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}.")
    if len(set(values)) != len(values):
        raise ValueError(f"argnums lists an argument twice: {argnums!r}.")
    return values


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0) -> Callable:
    """`jax.value_and_grad` whose gradient `parallelize` pipelines.

    Use it (once) inside the train step given to `parallelize`, on a loss
    function that contains the pipeline markers:

      def train_step(state, batch):
          loss, grads = pipeshard.value_and_grad(loss_fn)(state.params, batch)
          ...

    The loss must return a float scalar that is the mean (or, with
    `loss_reduction="sum"`, the sum) over the batch of per-example terms.
    `has_aux` is not supported: return metrics from the train step instead.

    Args:
      fun: the loss, `fun(*args) -> float scalar`.
      argnums: which positional arguments to differentiate.

    Returns:
      `f(*args) -> (loss, grads)`; grads has the structure of
      `args[argnums]` (a tuple of them when `argnums` is a tuple).
    """
    positions = _argnums(argnums)

    @functools.wraps(fun)
    def wrapped(*args):
        if not _CAPTURING.get():
            return jax.value_and_grad(fun, argnums)(*args)
        if max(positions) >= len(args):
            raise TypeError(
                f"argnums={argnums!r} but {getattr(fun, '__name__', 'fun')} got {len(args)} "
                "positional arguments."
            )
        return _stage(fun, argnums, positions, args)

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0) -> Callable:
    """`jax.grad` whose gradient `parallelize` pipelines.

    Same contract as `value_and_grad`, returning only the gradients.
    """
    value_and_grad_fun = value_and_grad(fun, argnums)

    @functools.wraps(fun)
    def wrapped(*args):
        return value_and_grad_fun(*args)[1]

    return wrapped


def _stage(fun, argnums, positions: tuple[int, ...], args: tuple) -> tuple[Any, Any]:
    """Binds the loss as one `pipeshard_value_and_grad` equation."""
    diff = args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in positions)
    others = tuple(a for i, a in enumerate(args) if i not in positions)
    flat_diff, diff_tree = jax.tree.flatten(diff)
    flat_others, others_tree = jax.tree.flatten(others)

    def flat_loss(*flat):
        diff_args = jax.tree.unflatten(diff_tree, flat[: len(flat_diff)])
        other_args = iter(jax.tree.unflatten(others_tree, flat[len(flat_diff) :]))
        diff_iter = iter((diff_args,) if isinstance(argnums, int) else diff_args)
        call_args = [
            next(diff_iter) if i in positions else next(other_args) for i in range(len(args))
        ]
        return fun(*call_args)

    closed = jax.make_jaxpr(flat_loss)(*flat_diff, *flat_others)
    _check_scalar_loss(closed.out_avals, fun)
    check_marker_placement(closed.jaxpr)
    inputs = [*flat_diff, *flat_others, *closed.consts]
    params = dict(jaxpr=closed.jaxpr, num_diff=len(flat_diff), num_consts=len(closed.consts))
    # jax's own value_and_grad gives the output types (and rejects what it cannot differentiate).
    impl = functools.partial(_value_and_grad_impl, **params, out_avals=())
    out_avals = tuple(jax.make_jaxpr(impl)(*inputs).out_avals)
    outs = pipeline_grad_p.bind(*inputs, **params, out_avals=out_avals)
    return outs[0], jax.tree.unflatten(diff_tree, outs[1:])


def _check_scalar_loss(out_avals, fun) -> None:
    name = getattr(fun, "__name__", "the loss")
    if len(out_avals) != 1:
        raise TypeError(
            f"{name} must return a single scalar loss, got {len(out_avals)} outputs; "
            "has_aux is not supported by pipeshard.value_and_grad."
        )
    aval = out_avals[0]
    if aval.shape != () or not np.issubdtype(aval.dtype, np.floating):
        raise TypeError(
            f"{name} must return a float scalar loss, got {aval.dtype}{list(aval.shape)}."
        )
