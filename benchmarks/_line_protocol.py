"""Child processes driven over a line protocol, for benchmarks that compare
setups living in separate processes (another device count, another
environment).

The child reads one command per line on stdin (`name argument`, or `quit`)
and answers each with one JSON object on a line of stdout: `{"ok": true, ...}`
or `{"ok": false, "error": "..."}`. Its first line is a greeting. Standard
library only: the TorchRec peer imports it from its own environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

Command = Callable[[str], dict[str, Any]]


class ChildError(RuntimeError):
    """A child answered `ok: false`, or stopped answering."""


def reply_stream() -> TextIO:
    """The process's stdout, kept for replies; everything else printed to stdout
    from now on (libraries, C code) goes to stderr, so it cannot be taken for
    a reply. Call it first thing in the child."""
    sys.stdout.flush()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return replies


def serve(replies: TextIO, commands: Mapping[str, Command], *, greeting: dict[str, Any]) -> None:
    """Sends `greeting`, then answers commands from stdin until `quit` or end of
    input. A command that raises answers `ok: false` with the exception; the
    loop goes on."""
    _write(replies, {"ok": True, **greeting})
    for line in sys.stdin:
        name, _, argument = line.strip().partition(" ")
        if name == "quit":
            return
        _write(replies, _answer(commands, name, argument))


def _answer(commands: Mapping[str, Command], name: str, argument: str) -> dict[str, Any]:
    if name not in commands:
        return {"ok": False, "error": f"unknown command {name!r}; one of {sorted(commands)}, quit"}
    try:
        return {"ok": True, **commands[name](argument)}
    except Exception as e:  # the driver decides what a failure means
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _write(stream: TextIO, reply: dict[str, Any]) -> None:
    stream.write(json.dumps(reply) + "\n")
    stream.flush()


class LineProcess:
    """A child process speaking the protocol; its stderr goes to ours.

    Use as a context manager: leaving it sends `quit` and waits for the child
    (killing it after `timeout_s`).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60,
        greet: bool = True,
    ) -> None:
        """Starts the child; with `greet`, waits for its greeting (else call
        `read_greeting`: children that meet each other before greeting, as the
        processes of one `jax.distributed` group do, are all started first)."""
        self.name = name
        self.timeout_s = timeout_s
        self._process = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
        )
        self.greeting: dict[str, Any] | None = None
        if greet:
            self.read_greeting()

    def read_greeting(self) -> None:
        self.greeting = self._reply()

    def send(self, command: str) -> None:
        """Sends `command` without waiting for the reply (`receive` reads it)."""
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()

    def receive(self, command: str) -> dict[str, Any]:
        """The reply to `command`, sent before; raises `ChildError` on `ok: false`."""
        reply = self._reply()
        if not reply["ok"]:
            raise ChildError(f"{self.name}: `{command}` failed: {reply['error']}")
        return reply

    def request(self, command: str) -> dict[str, Any]:
        """Sends `command`; returns the reply, `ok: false` ones included."""
        self.send(command)
        return self._reply()

    def call(self, command: str) -> dict[str, Any]:
        """`request`, raising `ChildError` on `ok: false`."""
        self.send(command)
        return self.receive(command)

    def _reply(self) -> dict[str, Any]:
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise ChildError(f"{self.name} exited with status {code} (its stderr is above)")
        return json.loads(line)

    def close(self) -> None:
        self.ask_to_quit()
        try:
            self._process.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def ask_to_quit(self) -> None:
        """Sends `quit` and closes the child's input, without waiting for it to end."""
        if self._process.poll() is None and not self._process.stdin.closed:
            try:
                self._process.stdin.write("quit\n")
                self._process.stdin.close()
            except OSError:
                pass

    def __enter__(self) -> LineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ProcessGroup:
    """Children that take every command together (the processes of one
    `jax.distributed` group: a program with collectives runs on all or none).

    Use as a context manager: leaving it asks every child to quit before it
    waits for any (each waits for the others at the group's shutdown).
    """

    def __init__(self, processes: Sequence[LineProcess]) -> None:
        self.processes = list(processes)
        try:
            for process in self.processes:
                if process.greeting is None:
                    process.read_greeting()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for process in self.processes:
            process.ask_to_quit()
        for process in self.processes:
            process.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def call(self, command: str) -> list[dict[str, Any]]:
        """Sends `command` to every child, then returns their replies in order."""
        for process in self.processes:
            process.send(command)
        return [process.receive(command) for process in self.processes]
