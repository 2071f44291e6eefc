"""The TorchRec peer's environment, for the benchmarks that run TorchRec next to us
(`lookup.py`, `train_vs_torchrec.py`): its Python, checked to exist, and huge pages.

TorchRec needs torch, so it lives in its own environment, `.venv-torchrec`
(`make bench-torchrec`). Our update kernels keep the tables on huge pages;
PyTorch does the same for its CPU allocations of 2 MiB and more under
`THP_MEM_ALLOC_ENABLE=1`, which the peer runs with unless
`--no-peer-huge-pages`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TORCHREC_PYTHON = Path(__file__).resolve().parents[1] / ".venv-torchrec" / "bin" / "python"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--no-peer-huge-pages` and `--torchrec-python`."""
    parser.add_argument(
        "--no-peer-huge-pages",
        dest="peer_huge_pages",
        action="store_false",
        help="run TorchRec without THP_MEM_ALLOC_ENABLE=1 (its tables on 4 KiB pages)",
    )
    parser.add_argument("--torchrec-python", type=Path, default=TORCHREC_PYTHON)


def check_python(args: argparse.Namespace) -> None:
    """Stops the benchmark, saying how to make it, when the environment is missing."""
    if not args.torchrec_python.exists():
        raise SystemExit(
            f"TorchRec's environment is missing ({args.torchrec_python} does not exist). "
            "Create it with `make bench-torchrec` (or pass --torchrec-python), then run "
            "this again; without the peer there are no ratios to print."
        )


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    """Our environment, with the peer's huge pages on or off as `args` say."""
    return dict(os.environ, THP_MEM_ALLOC_ENABLE="1" if args.peer_huge_pages else "0")
