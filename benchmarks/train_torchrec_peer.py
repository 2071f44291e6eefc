"""TorchRec's DLRM training on Criteo-format batches, the peer of `benchmarks/train_vs_torchrec.py`.

Runs in `.venv-torchrec` (`make bench-torchrec`): it imports torch, torchrec
and fbgemm_gpu only, nothing of sparseflow. One process is one training run;
the driver starts a fresh one per round.

The model is `torchrec.models.dlrm.DLRM` over an `EmbeddingBagCollection`
of one table per categorical feature (`--vocabulary` rows x 16, sum
pooling), `dense_arch_layer_sizes` [64, 16] and `over_arch_layer_sizes`
[64, 32, 1], sharded by `DistributedModelParallel` on one CPU rank (gloo,
world size 1; every table whole on the rank with the fused kernel, the dense
part under DDP as DMP wraps it). The tables' optimizer is FBGEMM's row-wise
Adagrad fused into the backward (`apply_optimizer_in_backward` with
`torchrec.optim.RowWiseAdagrad`: lr 0.05, eps 1e-8, accumulators set to 0.1
after construction, as our config starts them); the tables start from a
truncated normal of stddev 0.05, as our config's initializer. The dense
part's optimizer is Adam (lr 0.001); the loss is the mean BCE with logits.
`torch.set_num_threads(2)`; the initial parameters are seeded.

The batches come from an `.npz` file the driver writes from our imported
records with our parser (the same ids, dense log1p counts and labels):
`keys` (the feature names), and per batch `b`: `values_<b>` (int64 ids,
feature after feature), `lengths_<b>` (int32, `features x batch`, feature
after feature), `dense_<b>` (float32 `[batch, 13]`) and `labels_<b>`
(float32 `[batch]`). They are turned into `KeyedJaggedTensor`s and dense
tensors before anything is timed (the peer's cheapest input) and cycled
through.

Commands (the line protocol of `_line_protocol.py`; anything the libraries
print goes to stderr):
  * `train <steps>`: trains `steps` steps (zero_grad, forward, loss,
    backward with the fused table update, the dense optimizer's step);
    answers `step_ms` (one per step), `losses`, and seconds from this
    process's start (before torch is imported) to the end of the first step
    (`time_to_first_step_s`) and of the last (`run_s`).
  * `quit`.

    .venv-torchrec/bin/python benchmarks/train_torchrec_peer.py BATCHES.npz
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch is imported

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchrec  # noqa: E402
from _line_protocol import reply_stream, serve  # noqa: E402
from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.sharding_plan import (  # noqa: E402
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.optim import RowWiseAdagrad  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

DIM = 16
DENSE_ARCH = [64, DIM]
OVER_ARCH = [64, 32, 1]
TABLE_LEARNING_RATE = 0.05
TABLE_EPSILON = 1e-8
INITIAL_ACCUMULATOR = 0.1
INITIAL_STDDEV = 0.05
DENSE_LEARNING_RATE = 0.001
THREADS = 2
SEED = 0
EBC_PATH = "sparse_arch.embedding_bag_collection"


class Batch:
    """One batch as the model takes it."""

    def __init__(self, keys: list[str], data, b: int) -> None:
        self.sparse = torchrec.KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(data[f"values_{b}"].astype(np.int64)),
            lengths=torch.from_numpy(data[f"lengths_{b}"].astype(np.int32)),
        )
        self.dense = torch.from_numpy(data[f"dense_{b}"])
        self.labels = torch.from_numpy(data[f"labels_{b}"])


def load_batches(path: str) -> tuple[list[str], list[Batch]]:
    with np.load(path) as data:
        keys = [str(k) for k in data["keys"]]
        count = sum(1 for name in data.files if name.startswith("values_"))
        return keys, [Batch(keys, data, b) for b in range(count)]


def build_model(
    keys: list[str], vocabulary: int, dense_features: int
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    collection = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=f"t_{key}",
                embedding_dim=DIM,
                num_embeddings=vocabulary,
                feature_names=[key],
                pooling=torchrec.PoolingType.SUM,
            )
            for key in keys
        ],
        device=torch.device("meta"),
    )
    dlrm = DLRM(
        embedding_bag_collection=collection,
        dense_in_features=dense_features,
        dense_arch_layer_sizes=DENSE_ARCH,
        over_arch_layer_sizes=OVER_ARCH,
    )
    apply_optimizer_in_backward(
        RowWiseAdagrad,
        dlrm.sparse_arch.parameters(),
        {"lr": TABLE_LEARNING_RATE, "eps": TABLE_EPSILON},
    )
    fused_table_wise = table_wise(rank=0, compute_kernel=EmbeddingComputeKernel.FUSED.value)
    plan = construct_module_sharding_plan(
        collection,
        {f"t_{key}": fused_table_wise for key in keys},
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    model = DistributedModelParallel(
        dlrm, device=torch.device("cpu"), plan=ShardingPlan({EBC_PATH: plan})
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=DENSE_LEARNING_RATE),
    )
    initialized = _initialize_tables(model)
    if initialized != len(keys):
        raise RuntimeError(f"set the initial rows of {initialized} tables of {len(keys)}")
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def _initialize_tables(model: DistributedModelParallel) -> int:
    """Our config's start: rows from a truncated normal, accumulators at 0.1 (world 1:
    every shard is the whole table, a view of FBGEMM's live weights). Returns the
    number of tables whose rows were set."""
    state = model.state_dict()
    tables = [v for k, v in state.items() if k.startswith(EBC_PATH) and k.endswith(".weight")]
    with torch.no_grad():
        for table in tables:
            rows = table.local_shards()[0].tensor
            torch.nn.init.trunc_normal_(
                rows, std=INITIAL_STDDEV, a=-2 * INITIAL_STDDEV, b=2 * INITIAL_STDDEV
            )
        for slots in model.fused_optimizer.state_dict()["state"].values():
            for slot in slots.values():
                slot.local_shards()[0].tensor.fill_(INITIAL_ACCUMULATOR)
    return len(tables)


def accumulator_shapes(model: DistributedModelParallel) -> list[list[int]]:
    """The shapes of the first table's optimizer slots (row-wise: one value per row)."""
    slots = next(iter(model.fused_optimizer.state_dict()["state"].values()))
    return [list(slot.local_shards()[0].tensor.shape) for slot in slots.values()]


class Peer:
    def __init__(self, model, optimizer, batches: list[Batch]) -> None:
        self.model, self.optimizer, self.batches = model, optimizer, batches

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad()
        logits = self.model(batch.dense, batch.sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def train(self, steps: str) -> dict:
        times, losses, first = [], [], None
        for index in range(int(steps)):
            began = time.perf_counter()
            losses.append(self.step(self.batches[index % len(self.batches)]))
            ended = time.perf_counter()
            times.append((ended - began) * 1e3)
            first = ended if first is None else first
        return {
            "step_ms": times,
            "losses": losses,
            "time_to_first_step_s": first - STARTED,
            "run_s": time.perf_counter() - STARTED,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", help=".npz of keys and values_/lengths_/dense_/labels_<b>")
    parser.add_argument("--vocabulary", type=int, default=100_000)
    args = parser.parse_args()
    replies = reply_stream()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)  # the initial parameters
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    keys, batches = load_batches(args.batches)
    model, optimizer = build_model(keys, args.vocabulary, batches[0].dense.shape[1])
    greeting = {
        "torchrec": torchrec.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batches": len(batches),
        "accumulator_shapes": accumulator_shapes(model),
        "setup_s": time.perf_counter() - STARTED,
    }
    serve(replies, {"train": Peer(model, optimizer, batches).train}, greeting=greeting)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
