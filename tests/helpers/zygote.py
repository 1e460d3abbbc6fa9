"""A process that has imported torch, Lightning and the package once and forks a child for each script it is asked to
run: the server half of :mod:`tests.helpers.warm_launch` (run as ``python -m tests.helpers.zygote``).

A fresh interpreter spends most of a 2-process test importing (Lightning imports torchmetrics, which imports
``transformers`` where it is installed: about 10 s of CPU per process on 2 shared cores, against 1-4 s of training).
A child forked from here starts with those modules loaded and runs the script as ``python script.py`` would, with
the environment, working directory, arguments and output files it was given.

Protocol (one JSON object per line): the client writes ``{"argv": [...], "cwd": ..., "env": {...}, "stdout": path,
"stderr": path}`` to stdin; the server answers ``{"pid": N}`` and, when that child ends, ``{"exit": N, "status":
S}`` (``S`` as ``subprocess`` reports it: the exit code, or minus the signal that ended it). ``{"ready": true}`` is the
first line, once the imports are done. End of stdin ends the server and kills the children it still has.

The server starts with the environment its children will get, less what differs per launch (ranks, ports), so
whatever reads the environment at import time read what a fresh process would have: the client starts one server
per distinct environment (and one per rank, so that ranks keep distinct string-hash seeds as separate interpreters
have). Only the main thread forks: the threads the imports start (OpenBLAS's pool) are idle, as they are when a
DataLoader forks its workers.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import select
import signal
import sys
from typing import Any

PRELOAD = ("torch", "lightning.pytorch", "lightning_comp", "lightning_comp.distributed", "tests.helpers.distributed")


def _search_path_entries(value: str) -> list[str]:
    return [os.path.abspath(p) for p in value.split(os.pathsep) if p]


#: the interpreter's own search path: less its first entry (the folder ``-m`` ran in) and what ``PYTHONPATH`` added
BASE_PATH = [entry for entry in sys.path[1:]
             if os.path.abspath(entry) not in _search_path_entries(os.environ.get("PYTHONPATH", ""))]


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _redirect(fd: int, path: str | None, flags: int) -> None:
    target = os.open(path or os.devnull, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the script's process and run it to the end (never returns)."""
    os.setpgid(0, 0)  # its own group: a kill reaches whatever it starts
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _redirect(0, None, os.O_RDONLY)
    _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter seeds ``random`` from the OS; torch's default seed is fixed either way
    argv: list[str] = request["argv"]
    # the search path ``python script.py`` would have: the script's folder, then the request's PYTHONPATH
    sys.path[:] = ["", *_search_path_entries(request["env"].get("PYTHONPATH", "")), *BASE_PATH]
    code: int | str | None = 0
    try:
        if argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            import runpy

            script = os.path.abspath(argv[1])
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what an uncaught exception does to ``python script.py``: the traceback, exit status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    raise SystemExit(code)  # the interpreter's own exit: atexit handlers, then the streams flushed


def _reap(children: set[int]) -> None:
    """Report every child that has ended (and forget it: its process id may be given to another process)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    _send({"ready": True})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)  # a child that ended is reported within 0.2 s
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            children.add(pid)
            _send({"pid": pid})
    for pid in children:  # the client is gone: nothing it started and that still runs outlives it
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
