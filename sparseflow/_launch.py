"""Several hosts: `jax.distributed` set-up, and local processes standing in for hosts.

`sparseflow train --num-processes P` on one machine starts P copies of the
same command, each with `--process-id i --coordinator 127.0.0.1:PORT`, each
seeing `devices / P` CPU devices and using gloo for CPU collectives. On real
hosts, run one process per host with `--process-id` and `--coordinator`
given by hand (or by the cluster's launcher).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import portpicker

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(count: int) -> None:
    """Makes the CPU backend show `count` devices.

    Must run before the first JAX computation (the backend reads XLA_FLAGS
    when it starts, not at import). A count the user already set wins.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()


def initialize_distributed(
    coordinator: str, num_processes: int, process_id: int, *, bind_address: str | None = None
) -> None:
    """Joins the `jax.distributed` group (gloo collectives on CPU).

    Args:
      coordinator: `host:port` of process 0's coordinator, as the others reach it.
      num_processes: processes of the group.
      process_id: this process's index.
      bind_address: `host:port` process 0's coordinator listens on; None: the
        coordinator address itself. JAX would listen on every interface,
        which exposes a local launch's coordinator to the network.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=bind_address or coordinator,
    )


def free_port_block(num_processes: int, stride: int) -> int:
    """A base port whose per-process blocks (`base + stride * r`) are free now."""
    for _ in range(100):
        base = portpicker.pick_unused_port()
        if base + stride * num_processes < 65536 and all(
            portpicker.is_port_free(base + stride * r) for r in range(num_processes)
        ):
            return base
    raise RuntimeError("Found no free block of ports for the minibatching agreement.")


def _env_with_devices(count: int | None) -> dict[str, str]:
    """This process's environment; with CPU devices forced to `count` unless it is None."""
    env = dict(os.environ)
    if count is None:
        return env
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_FLAG}={count}"])
    return env


class ProcessFailedError(RuntimeError):
    """A local process ended with a non-zero status or was killed by a signal.

    Attributes:
      exit_status: the status the launcher should exit with (128 + the signal
        number for a process killed by a signal, as a shell reports it).
    """

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def launch_local_processes(
    argv: Sequence[str], num_processes: int, devices_per_process: int | None, timeout_s: float
) -> None:
    """Runs `sparseflow <argv>` as `num_processes` local processes, until all succeed.

    Every process gets `--process-id i --coordinator 127.0.0.1:PORT` and
    `devices_per_process` CPU devices (None: the devices it sees, as
    `mesh.devices: auto` asks). If one fails, the others are stopped (they
    would wait for it forever).

    Raises:
      ProcessFailedError: a process exited with a non-zero status or was
        killed by a signal.
      TimeoutError: the processes did not finish within `timeout_s`.
    """
    coordinator = f"127.0.0.1:{portpicker.pick_unused_port()}"
    command = [sys.executable, "-m", "sparseflow", *argv, "--coordinator", coordinator]
    env = _env_with_devices(devices_per_process)
    processes = [
        subprocess.Popen([*command, "--process-id", str(i)], env=env) for i in range(num_processes)
    ]
    try:
        wait_for_processes(processes, timeout_s)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def wait_for_processes(processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """Waits until every process has exited with status 0.

    Raises:
      ProcessFailedError: as soon as one process ends otherwise; the message
        names every process that has failed so far, and how.
      TimeoutError: the processes did not finish within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            # A signal's number is negative: the worst status is not the largest code.
            message = "; ".join(_describe_failure(i, code) for i, code in failed)
            raise ProcessFailedError(message, _exit_status(failed[0][1]))
        if all(code == 0 for code in codes):
            return
        time.sleep(0.2)
    raise TimeoutError(f"The {len(processes)} processes did not finish within {timeout_s:.0f} s.")


def _describe_failure(index: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process {index} was killed by {name}"
    return f"process {index} exited with status {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code
