"""TorchRec's training step on `benchmarks/lookup.py`'s id batches, as a peer process.

Runs in `.venv-torchrec` (`make bench-torchrec`): it imports torch, torchrec
and fbgemm_gpu only, nothing of sparseflow. The model is TorchRec's
`EmbeddingBagCollection` (sum pooling, one feature per table) sharded by
`DistributedModelParallel` on one CPU rank (table-wise, fused kernel), with
the optimizer fused into the backward pass (`apply_optimizer_in_backward`): FBGEMM's table-batched
embedding op does the lookup, and its backward applies the update to the
touched rows. A step is forward, `0.5 * sum(activations^2)`, backward (with
the fused update): what a TorchRec user runs.

Optimizers (the argument of `setup`), as FBGEMM defines them, with `g` a
touched row's gradient (the sum over its ids in the batch):
  * sgd: `EXACT_SGD`, `w -= lr * g`;
  * adagrad: `EXACT_ADAGRAD`, one accumulator per element,
    `a += g^2; w -= lr * g / (sqrt(a) + eps)`;
  * rowwise_adagrad: `EXACT_ROWWISE_ADAGRAD`, one accumulator per row,
    `a += mean(g^2 over the row); w -= lr * g / (sqrt(a) + eps)`.
Accumulators start at the shape's `initial_accumulator` (FBGEMM starts them
at 0; they are set after construction, as our side starts them).

The ids come from an `.npz` file the driver writes: `values_<b>_<t>` (int ids)
and `offsets_<b>_<t>` (row splits, `batch + 1` of them) for batch `b` and
table `t`.

Commands (the line protocol of `_line_protocol.py`; anything the libraries
print goes to stderr):
  * `setup <optimizer>`: builds the model (dropping the previous one), runs
    one step on batch 0 and checks it against a float64 numpy step from the
    same initial rows: every touched row (and its accumulator) within 1e-4 of
    the row's largest reference value, every other row bitwise unchanged. A
    failed check answers `ok: false` with `CheckFailed: ...` and leaves no
    model, so `time` has nothing to time. Then runs `--warmup` steps.
  * `time <steps>`: runs `steps` steps over the batches in turn; answers
    `step_ms`, one time per step.
  * `quit`.

    .venv-torchrec/bin/python benchmarks/lookup_torchrec_peer.py BATCHES.npz \\
        --shape '{"tables": 8, "vocabulary": 1000000, "dim": 16, "batch": 4096}'
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import torch
import torch.distributed as dist
import torchrec
from _line_protocol import reply_stream, serve
from _lookup_shape import OPTIMIZERS, LookupShape
from _step_times import step_times
from torchrec import optim as trec_optim
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

# A hot row's gradient is a float32 sum of thousands of ids' terms, in the
# order FBGEMM's threads happen to add them; its Adagrad accumulator (the
# square of that sum) came out 1.1e-5 off float64 in one of about ten runs.
# A misconfigured optimizer is off by far more.
RELATIVE_TOLERANCE = 1e-4


class CheckFailed(RuntimeError):
    """TorchRec's step disagrees with the numpy reference."""


def load_batches(path: str, tables: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per batch, per table, `(values int64[ids], offsets int64[batch + 1])`."""
    with np.load(path) as data:
        count = sum(1 for name in data.files if name.startswith("values_") and name.endswith("_0"))
        return [
            [
                (
                    data[f"values_{b}_{t}"].astype(np.int64),
                    data[f"offsets_{b}_{t}"].astype(np.int64),
                )
                for t in range(tables)
            ]
            for b in range(count)
        ]


def keyed_jagged(batch: list[tuple[np.ndarray, np.ndarray]]) -> torchrec.KeyedJaggedTensor:
    return torchrec.KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(len(batch))],
        values=torch.from_numpy(np.concatenate([values for values, _ in batch])),
        lengths=torch.from_numpy(np.concatenate([np.diff(offsets) for _, offsets in batch])),
    )


def _optimizer(name: str, shape: LookupShape) -> tuple[type, dict]:
    if name == "sgd":
        return torch.optim.SGD, {"lr": shape.learning_rate}
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": shape.learning_rate, "eps": shape.epsilon}
    if name == "rowwise_adagrad":
        return trec_optim.RowWiseAdagrad, {"lr": shape.learning_rate, "eps": shape.epsilon}
    raise ValueError(f"unknown optimizer {name!r}; one of {OPTIMIZERS}")


def build_model(name: str, shape: LookupShape) -> DistributedModelParallel:
    """The collection with `name`'s optimizer fused into the backward: every
    table whole on the one rank with the fused kernel (the planner would make
    small tables data-parallel, with a dense kernel)."""
    collection = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=shape.dim,
                num_embeddings=shape.vocabulary,
                feature_names=[f"f{t}"],
                pooling=torchrec.PoolingType.SUM,
            )
            for t in range(shape.tables)
        ],
        device=torch.device("meta"),
    )
    optimizer_class, kwargs = _optimizer(name, shape)
    apply_optimizer_in_backward(optimizer_class, collection.parameters(), kwargs)
    fused_table_wise = table_wise(rank=0, compute_kernel=EmbeddingComputeKernel.FUSED.value)
    plan = construct_module_sharding_plan(
        collection,
        {f"t{t}": fused_table_wise for t in range(shape.tables)},
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    model = DistributedModelParallel(
        collection, device=torch.device("cpu"), plan=ShardingPlan({"": plan})
    )
    for accumulator in accumulators(model):
        accumulator.fill_(shape.initial_accumulator)
    return model


def tables(model: DistributedModelParallel) -> list[torch.Tensor]:
    """The live weights of every table, `float32[vocabulary, dim]` (world 1: the whole table)."""
    state = model.state_dict()
    names = sorted((k for k in state if k.endswith(".weight")), key=_table_index)
    return [state[k].local_shards()[0].tensor for k in names]


def accumulators(model: DistributedModelParallel) -> list[torch.Tensor]:
    """The live optimizer slot of every table (none for SGD)."""
    state = model.fused_optimizer.state_dict()["state"]
    return [
        slot.local_shards()[0].tensor
        for key in sorted(state, key=_table_index)
        for slot in state[key].values()
    ]


def _table_index(key: str) -> int:
    return int(key.split(".t")[1].split(".")[0])


def step(model: DistributedModelParallel, batch: torchrec.KeyedJaggedTensor) -> None:
    pooled = model(batch).values()
    (0.5 * (pooled * pooled).sum()).backward()


def reference_rows(
    name: str,
    rows: np.ndarray,
    accumulator: np.ndarray | None,
    values: np.ndarray,
    offsets: np.ndarray,
    shape: LookupShape,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One float64 step of one table on its touched rows.

    Args:
      rows: float64[vocabulary, dim], the table before the step.
      accumulator: float64[vocabulary, dim] (adagrad), [vocabulary]
        (rowwise_adagrad) or None (sgd).

    Returns:
      `(touched ids, rows after, accumulator after)` of the touched ids.
    """
    touched, inverse = np.unique(values, return_inverse=True)
    sample = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    activations = np.zeros((offsets.size - 1, shape.dim))
    np.add.at(activations, sample, rows[values])
    gradient = np.zeros((touched.size, shape.dim))
    np.add.at(gradient, inverse, activations[sample])  # d loss / d activation = activation
    if name == "sgd":
        return touched, rows[touched] - shape.learning_rate * gradient, None
    squares = gradient * gradient if name == "adagrad" else np.mean(gradient * gradient, axis=1)
    slot = accumulator[touched] + squares
    scale = np.sqrt(slot) + shape.epsilon
    if name == "rowwise_adagrad":
        scale = scale[:, None]
    return touched, rows[touched] - shape.learning_rate * gradient / scale, slot


def _row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row (or per value of a 1-D array), the largest error relative to the
    row's largest reference value: an element that nearly cancels carries the
    row's float32 rounding, not its own."""
    if want.ndim == 1:
        got, want = got[:, None], want[:, None]
    scale = np.maximum(np.abs(want).max(axis=1), np.finfo(np.float32).tiny)
    return np.abs(got - want).max(axis=1) / scale


def _close(what: str, got: np.ndarray, want: np.ndarray) -> float:
    """The largest row error; raises `CheckFailed` past `RELATIVE_TOLERANCE`."""
    errors = _row_errors(got, want)
    worst = int(np.argmax(errors))
    if errors[worst] > RELATIVE_TOLERANCE:
        raise CheckFailed(
            f"{what}: {int(np.sum(errors > RELATIVE_TOLERANCE))} touched rows off by more "
            f"than {RELATIVE_TOLERANCE} relative; worst, touched row {worst}: got "
            f"{got[worst]}, numpy float64 gives {want[worst]}"
        )
    return float(errors[worst])


def check_one_step(
    name: str, model: DistributedModelParallel, batch: list, shape: LookupShape
) -> dict:
    """Runs one step on `batch` and compares it with `reference_rows`, table by table."""
    before = [t.detach().clone() for t in tables(model)]
    slots_before = [s.detach().clone() for s in accumulators(model)]
    if any(not torch.all(s == shape.initial_accumulator) for s in slots_before):
        raise CheckFailed(f"accumulators do not start at {shape.initial_accumulator}")
    step(model, keyed_jagged(batch))
    after, slots_after = tables(model), accumulators(model)
    checked, worst = 0, 0.0
    for t, (values, offsets) in enumerate(batch):
        slot = slots_before[t].double().numpy() if slots_before else None
        touched, want, want_slot = reference_rows(
            name, before[t].double().numpy(), slot, values, offsets, shape
        )
        worst = max(worst, _close(f"table t{t} rows", after[t].numpy()[touched], want))
        if want_slot is not None:
            got_slot = slots_after[t].numpy()[touched]
            worst = max(worst, _close(f"table t{t} accumulators", got_slot, want_slot))
        untouched = np.ones(shape.vocabulary, bool)
        untouched[touched] = False
        if not torch.equal(after[t][untouched], before[t][untouched]):
            raise CheckFailed(f"table t{t}: rows outside the batch changed")
        checked += touched.size
    return {"touched_rows_checked": checked, "max_relative_error": worst}


class Peer:
    """The model of the current optimizer and the batches, driven by commands."""

    def __init__(self, batches: list, shape: LookupShape, warmup: int) -> None:
        self.batches = batches
        self.inputs = [keyed_jagged(b) for b in batches]
        self.shape = shape
        self.warmup = warmup
        self.model: DistributedModelParallel | None = None
        self.next_batch = 0

    def setup(self, name: str) -> dict:
        self.model = None
        gc.collect()
        model = build_model(name, self.shape)
        check = check_one_step(name, model, self.batches[0], self.shape)
        self.model, self.next_batch = model, 1
        self._run(self.warmup)
        return {"optimizer": name, "check": check}

    def time(self, steps: str) -> dict:
        if self.model is None:
            raise RuntimeError("no model: `setup <optimizer>` first (or it failed its check)")
        return {"step_ms": self._run(int(steps))}

    def _run(self, steps: int) -> list[float]:
        times = step_times(
            lambda batch: step(self.model, batch), self.inputs, self.next_batch, steps
        )
        self.next_batch += steps
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", help=".npz of values_<b>_<t> and offsets_<b>_<t>")
    parser.add_argument("--shape", required=True, help="a LookupShape as JSON")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    replies = reply_stream()
    shape = LookupShape.from_json(args.shape)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    peer = Peer(load_batches(args.batches, shape.tables), shape, args.warmup)
    greeting = {
        "torchrec": torchrec.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    serve(replies, {"setup": peer.setup, "time": peer.time}, greeting=greeting)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
