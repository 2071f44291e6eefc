"""`ProcessGroup`: commands to every child together, and a shutdown that waits for none
before every child has been asked to quit."""

import sys
from pathlib import Path

from _line_protocol import LineProcess, ProcessGroup

CHILD = Path(__file__).with_name("line_group_child.py")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _child(index: int, folder: Path) -> LineProcess:
    argv = [sys.executable, str(CHILD), str(index), str(folder)]
    return LineProcess(f"child {index}", argv, env={"PYTHONPATH": str(BENCHMARKS)}, greet=False)


def test_every_child_answers_in_order_and_all_quit_together(tmp_path):
    children = [_child(i, tmp_path) for i in range(2)]
    with ProcessGroup(children) as group:
        assert [reply["index"] for reply in group.call("name")] == [0, 1]
    # Each child ends only once the other was asked to quit too.
    assert [child._process.returncode for child in children] == [0, 0]
