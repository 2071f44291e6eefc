"""Local launches: a failed or killed process fails the launch; the coordinator stays local."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import portpicker
import pytest

from sparseflow import _launch, shipped_config

REPO = Path(__file__).resolve().parents[2]
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO)


def test_a_process_killed_by_a_signal_fails_the_launch():
    processes = [
        _python("pass"),
        _python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
    ]
    for process in processes:
        process.wait(timeout=60)
    assert [p.returncode for p in processes] == [0, -signal.SIGKILL]
    with pytest.raises(_launch.ProcessFailedError, match="process 1 was killed by SIGKILL") as e:
        _launch.wait_for_processes(processes, timeout_s=10)
    assert e.value.exit_status == 128 + signal.SIGKILL


def test_a_non_zero_status_fails_the_launch():
    processes = [_python("raise SystemExit(3)"), _python("import time; time.sleep(30)")]
    try:
        with pytest.raises(_launch.ProcessFailedError, match="process 0 exited with status 3"):
            _launch.wait_for_processes(processes, timeout_s=20)
    finally:
        processes[1].kill()
        processes[1].wait()


def _children(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(child) for child in f.read().split()]
    return children


def test_train_fails_when_a_local_process_is_killed(tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparseflow",
            "train",
            "--config",
            str(shipped_config("demo")),
            "--data",
            str(tmp_path),
            "--no-progress",
            "--num-processes",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(children := _children(launcher.pid)) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "no processes started"
            time.sleep(0.05)
        os.kill(children[1], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert "error: process 1 was killed by SIGKILL" in stderr


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as the kernel shows them) listening on `port`."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == _LISTEN and int(hex_port, 16) == port:
                    addresses.append(address)
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_the_coordinator_of_a_local_launch_listens_on_loopback_only():
    port = portpicker.pick_unused_port()
    # Process 0 of 2 starts the coordinator and waits for process 1, which never comes.
    coordinator = _python(
        f"from sparseflow import _launch; _launch.initialize_distributed('127.0.0.1:{port}', 2, 0)"
    )
    try:
        deadline = time.monotonic() + 60
        while not (addresses := _listening_addresses(port)):
            assert coordinator.poll() is None, "the coordinator process ended"
            assert time.monotonic() < deadline, "the coordinator never listened"
            time.sleep(0.1)
    finally:
        coordinator.kill()
        coordinator.wait()
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
    assert set(addresses) <= loopback, addresses
