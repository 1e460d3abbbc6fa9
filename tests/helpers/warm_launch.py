"""Start a test script's process as a child forked from an interpreter that has already imported torch, Lightning
and the package (:mod:`tests.helpers.zygote`), instead of a fresh ``python script.py`` that spends about 10 s of CPU
importing them. The 2-process tests start about a hundred such processes; each now costs its own work.

What the script sees is what a fresh process would give it: its argv, working directory, environment and output
files; ``__name__ == "__main__"``; ``sys.path[0]`` its own folder; its exit status (or the signal that ended it) as
``subprocess`` reports it. A server is started per distinct environment (less what differs per launch: ranks,
ports, the current test's name) and per ``slot`` (the rank), so import-time reads of the environment match and ranks
keep distinct string-hash seeds. What only a fresh process can show (an import-time failure, a launcher Lightning
itself starts) is still tested by the tests that start processes themselves (the examples, ``ddp_spawn``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.helpers.paths import REPO

__all__ = ["DIST_VARS", "WarmProcess", "can_start_warm", "run_warm", "start_warm", "stop_servers"]

#: What says where a process stands in a process group: an earlier in-process DDP run leaves these in ``os.environ``
#: (``tests.helpers.distributed`` re-exports it; defined here, below it, as the server imports that module).
DIST_VARS = frozenset({"LOCAL_RANK", "RANK", "GLOBAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT"})
#: Variables a launch sets for itself, or that a test's earlier seeding leaves in ``os.environ``, all read when a run
#: starts, not when a module is imported: not part of what picks a server (the child gets them all the same).
PER_LAUNCH = DIST_VARS | {"PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"}
READY_TIMEOUT_S = 300.0
MAX_SERVERS = 6  # per test process; the oldest is stopped beyond it (each holds about 0.5 GB)


def can_start_warm(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is this interpreter running a script or ``-c`` code (what a server can fork), on Linux (where
    forking a process that has imported torch is what a DataLoader's workers do; macOS and Windows start fresh)."""
    return (sys.platform.startswith("linux") and len(argv) >= 2 and argv[0] == sys.executable
            and (argv[1] == "-c" and len(argv) >= 3 or not argv[1].startswith("-")))


class _Server:
    """One ``tests.helpers.zygote`` process and what it has said."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - open as long as the server: what it printed itself
        self.process = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote"], cwd=REPO, env=dict(env),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors,
                                        start_new_session=True)
        self._pending = b""
        self.exits: dict[int, int] = {}
        self._ready = False

    def _wait_ready(self) -> None:
        if not self._ready:
            try:
                ready = self._next(lambda m: "ready" in m, READY_TIMEOUT_S)
            except RuntimeError:
                ready = None
            if ready is None:
                self.stop()
                self._errors.seek(0)
                raise RuntimeError(f"the warm-start server did not start (exit {self.process.poll()}):\n"
                                   + self._errors.read().decode(errors="replace")[-3000:])
            self._ready = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def _messages(self, timeout: float) -> list[dict[str, object]]:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], timeout)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm-start server ended (exit {self.process.wait()})")
            self._pending += chunk
        messages = []
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            messages.append(json.loads(line))
        for message in messages:
            if "exit" in message:
                self.exits[int(message["exit"])] = int(message["status"])  # type: ignore[call-overload]
        return messages

    def _next(self, wanted: Callable[[dict[str, object]], bool], timeout: float) -> dict[str, object] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self._messages(min(0.5, max(0.0, deadline - time.monotonic()))):
                if wanted(message):
                    return message
        return None

    def start(self, request: dict[str, object]) -> int:
        self._wait_ready()
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        answer = self._next(lambda m: "pid" in m, 60.0)
        if answer is None:
            raise RuntimeError("the warm-start server did not answer")
        return int(answer["pid"])  # type: ignore[call-overload]

    def poll(self) -> None:
        self._messages(0.0)

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the server kills the children it still has and ends
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_SERVERS: dict[tuple[int, tuple[tuple[str, str], ...]], _Server] = {}


def _server(slot: int, env: Mapping[str, str]) -> _Server:
    key = (slot, tuple(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH)))
    server = _SERVERS.get(key)
    if server is not None and server.alive():
        _SERVERS[key] = _SERVERS.pop(key)  # most recently used last
        return server
    while len(_SERVERS) >= MAX_SERVERS:
        _SERVERS.pop(next(iter(_SERVERS))).stop()
    startup = {k: v for k, v in env.items() if k not in PER_LAUNCH}
    startup["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), startup.get("PYTHONPATH", "")]))
    _SERVERS[key] = server = _Server(startup)
    return server


def stop_servers() -> None:
    """Stop every server this process started (``tests/conftest.py`` does at the end of each process's session; a
    server whose client dies without it ends at the end of its input)."""
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


class WarmProcess:
    """The part of :class:`subprocess.Popen` the launchers use, for a child of a server."""

    def __init__(self, server: _Server, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.poll()
            self.returncode = self._server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, sig)  # the child's own group (it may not have made it yet: then the pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_warm(argv: Sequence[str], cwd: Path, envs: Sequence[Mapping[str, str]],
               outputs: Sequence[tuple[Path, Path]]) -> list[WarmProcess]:
    """Start ``argv`` (``[sys.executable, script, *args]`` or ``[sys.executable, "-c", code, *args]``) once per
    environment in ``envs``, the ``i``-th forked from slot ``i``'s warm server (the servers a launch lacks start side
    by side), its output written to ``outputs[i]`` (stdout, stderr).

    Raises:
        ValueError: ``argv`` is not this interpreter running a script or code (see :func:`can_start_warm`).
        RuntimeError: a server could not be started or stopped answering.
    """
    if not can_start_warm(argv):
        raise ValueError(f"cannot start {list(argv)[:3]} warm: expected [sys.executable, script | -c code, ...]")
    servers = [_server(slot, env) for slot, env in enumerate(envs)]
    return [WarmProcess(server, server.start({"argv": list(argv), "cwd": str(cwd), "env": dict(env),
                                              "stdout": str(out), "stderr": str(err)}))
            for server, env, (out, err) in zip(servers, envs, outputs, strict=True)]


def run_warm(argv: Sequence[str], cwd: Path | None = None, env: Mapping[str, str] | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`` for a script or
    ``-c`` code, forked from a warm server (slot 0) where :func:`can_start_warm` allows it, a fresh process otherwise.

    Raises:
        subprocess.TimeoutExpired: it still ran after ``timeout`` seconds (it is killed first).
    """
    where = Path.cwd() if cwd is None else Path(cwd)
    environment = dict(os.environ if env is None else env)
    if not can_start_warm(argv):
        return subprocess.run(list(argv), cwd=where, env=environment, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        (process,) = start_warm(argv, where, [environment], [(out, err)])
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(list(argv), timeout or 0.0, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(list(argv), code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
