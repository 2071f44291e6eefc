"""The lookup benchmark's TorchRec peer: its protocol, its numpy check, and the
driver's figures. Tests that run the peer need `.venv-torchrec`
(`make bench-torchrec`) and are skipped without it."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _line_protocol import LineProcess
from _lookup_shape import OPTIMIZERS, LookupShape
from lookup import ratio_figures

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
TORCHREC_PYTHON = REPO / ".venv-torchrec" / "bin" / "python"
SHAPE = LookupShape(tables=2, vocabulary=300, dim=4, batch=16, max_valency=5)

needs_torchrec = pytest.mark.skipif(
    not TORCHREC_PYTHON.exists(), reason="no .venv-torchrec (make bench-torchrec)"
)


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for b in range(2):
        for t in range(SHAPE.tables):
            lengths = rng.integers(1, SHAPE.max_valency + 1, SHAPE.batch)
            arrays[f"values_{b}_{t}"] = (rng.zipf(1.1, lengths.sum()) - 1) % SHAPE.vocabulary
            arrays[f"offsets_{b}_{t}"] = np.concatenate([[0], np.cumsum(lengths)])
    path = tmp_path_factory.mktemp("peer") / "batches.npz"
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def peer(batches):
    argv = [str(TORCHREC_PYTHON), str(BENCHMARKS / "lookup_torchrec_peer.py"), str(batches)]
    with LineProcess("torchrec", argv + ["--shape", SHAPE.to_json(), "--warmup", "1"]) as process:
        yield process


@needs_torchrec
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_peer_step_matches_numpy_then_times(peer, optimizer):
    setup = peer.call(f"setup {optimizer}")
    assert setup["check"]["touched_rows_checked"] > 0
    assert setup["check"]["max_relative_error"] <= 1e-4
    assert len(peer.call("time 3")["step_ms"]) == 3


@needs_torchrec
def test_peer_answers_errors_and_keeps_serving(peer):
    assert "unknown optimizer" in peer.request("setup momentum")["error"]
    assert "setup <optimizer>" in peer.request("time 1")["error"]
    assert "unknown command" in peer.request("run")["error"]


_WRONG_STEP = """
import dataclasses, sys
import torch.distributed as dist
import lookup_torchrec_peer as peer
from _lookup_shape import LookupShape

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
shape = LookupShape.from_json(sys.argv[1])
model = peer.build_model("adagrad", shape)
wrong = dataclasses.replace(shape, learning_rate=2 * shape.learning_rate)
try:
    peer.check_one_step("adagrad", model, peer.load_batches(sys.argv[2], shape.tables)[0], wrong)
except peer.CheckFailed as e:
    print("CheckFailed:", e)
"""


@needs_torchrec
def test_peer_check_rejects_a_step_that_is_not_the_reference(batches):
    result = subprocess.run(
        [str(TORCHREC_PYTHON), "-c", _WRONG_STEP, SHAPE.to_json(), str(batches)],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "CheckFailed: table t0 rows" in result.stdout


def test_rowwise_ratio_is_against_the_faster_of_rowwise_and_sgd_share():
    figures = {
        "torchrec_sgd_ms": 10.0,
        "torchrec_rowwise_adagrad_ms": 20.0,
        "torchrec_rowwise_adagrad_ms_by_round": [30.0, 5.0],
        "ours_rowwise_adagrad_ms": 5.0,
        "ours_rowwise_adagrad_ms_by_round": [5.0, 5.0],
    }
    ratios = ratio_figures("rowwise_adagrad", figures)
    assert ratios["torchrec_rowwise_adagrad_target_ms"] == 6.5
    assert ratios["ratio_vs_torchrec_rowwise_adagrad"] == 1.3
    assert ratios["ratio_vs_torchrec_rowwise_adagrad_by_round"] == [1.3, 1.0]
    assert "ratio_vs_torchrec_rowwise_adagrad_8dev" not in ratios


def test_benchmark_without_torchrec_says_how_to_get_it(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "lookup.py"), "--torchrec-python", str(tmp_path / "no")],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "make bench-torchrec" in result.stderr
    assert result.stdout == ""
