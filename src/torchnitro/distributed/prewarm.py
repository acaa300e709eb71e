"""Pre-warmed workers: a fork server that has imported torch once, so a restarted rank starts in milliseconds.

torchrun starts every worker of every attempt as a fresh process; after a rank is killed, the new
workers spend most of the time to the first resumed step importing torch, torch.distributed and
torch._dynamo (torch.optim's first use imports it): results/distributed_resume.md. Here the launcher
starts one server per node before torchrun (``serve``). It imports the training module and
torch._dynamo, then waits on a Unix socket. torchrun's worker command is this file run as a script
(``run``: standard library only, so it starts in a few tens of milliseconds); it connects, hands
over its argv, environment, working directory and stdin/stdout/stderr, and the server forks a child
that runs ``python -m <module>`` in that state. The worker process torchrun watches stays the
client:

- signals torchrun sends it (SIGTERM when stopping the group) are forwarded to the child;
- the client exits with the child's exit code, or dies of the child's signal;
- when the client dies (``kill -9`` of a rank), the child sees its connection close and exits at
  once, so a dead rank is a dead rank, as with plain torchrun.

Nothing is shared between children but what the server imported before any fork: no process group,
no CUDA context (the server never touches a device), no threads. A child sets its thread count from
``OMP_NUM_THREADS`` (torchrun's), which a fresh process would have read at import. When the server is
not there (not started, died, or still importing after ``WAIT_S``), the client ``exec``s the plain
``python -m <module>`` command instead: slower, never wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

__all__ = ["ENV_SOCKET", "ENV_PID", "WAIT_S", "serve", "run", "worker_command"]

ENV_SOCKET = "TORCHNITRO_PREWARM_SOCKET"  # path of the server's Unix socket, set by the launcher
ENV_PID = "TORCHNITRO_PREWARM_PID"  # the server's pid: a client stops waiting for a server that is gone
WAIT_S = 60.0  # how long a client waits for the server to finish importing before it starts on its own
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_MAX_MSG = 1 << 20


def worker_command(module: str, args: list[str]) -> list[str]:
    """torchrun's worker command for ``python -m module args`` through the server: this file as a script."""
    return [sys.executable, os.path.abspath(__file__), "run", module, *args]


# ---- client (a worker process under torchrun): standard library only -------------------------------------

def _exec_plain(module: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _connect(path: str, server_pid: int) -> socket.socket | None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if server_pid and not _alive(server_pid):
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            time.sleep(0.05)
    return None


def run(module: str, args: list[str]) -> None:
    """Worker side: have the server fork ``python -m module args`` in this process's state; mirror its exit."""
    path, server_pid = os.environ.get(ENV_SOCKET), int(os.environ.get(ENV_PID, "0") or 0)
    conn = _connect(path, server_pid) if path else None
    if conn is None:
        _exec_plain(module, args)
    request = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(conn, [request], [0, 1, 2])
        reply = conn.recv(_MAX_MSG)
    except OSError:
        reply = b""
    if not reply:  # the server went away before forking: start on our own
        conn.close()
        _exec_plain(module, args)
    child = json.loads(reply)["pid"]
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(child, signum) if _alive(child) else None)
    msg = conn.recv(_MAX_MSG)
    if not msg:  # the server died with the child running: wait for the child itself
        while _alive(child):
            time.sleep(0.1)
        sys.exit(1)
    code = json.loads(msg)["code"]
    if code < 0:  # killed by a signal: die of the same one, as the child did
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    sys.exit(code if code >= 0 else 128 - code)


# ---- server (one per node, started by the launcher) --------------------------------------------------------

def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: take the worker's stdio, environment and directory, run the module, exit."""
    import runpy
    import threading
    import traceback
    import warnings

    for sig in _FORWARDED + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's KeyboardInterrupt
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # torchrun runs workers with `python -u`: no output held back
        try:
            stream.reconfigure(line_buffering=True, write_through=True)
        except (AttributeError, ValueError):
            pass
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])

    def watch() -> None:  # the client (the rank torchrun watches) died: so does this rank, at once
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [request["module"], *request["args"]]
    # the server imported the module; running it again as __main__ is what `python -m` does (runpy warns)
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            sys.stderr.write(f"{e.code}\n")  # what the interpreter does for sys.exit('message')
    except BaseException:  # noqa: BLE001 - a worker's crash is its exit code, as in a fresh process
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    os._exit(code)


def serve(path: str, module: str) -> None:
    """Import ``module`` and torch._dynamo, then fork a child per worker request until the parent exits."""
    import importlib
    import select

    importlib.import_module(module)
    import torch._dynamo  # noqa: F401 - torch.optim imports it at its first use: 1.4-1.7 s per fresh worker

    parent = os.getppid()
    tmp = f"{path}.tmp{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, path)  # clients connect only once the imports are done
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], 0.05)
            if ready:
                conn, _ = listener.accept()
                try:
                    data, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 3)
                    request = json.loads(data)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    try:  # never back into this loop (or its finally) in the child
                        listener.close()
                        for c in children.values():
                            c.close()
                        _child(conn, request, fds)
                    finally:
                        os._exit(1)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.send(json.dumps({"pid": pid}).encode())
                except OSError:
                    pass
                children[pid] = conn
            _reap(children)
    finally:
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # its client is gone (killed): nobody to tell
        conn.close()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} run MODULE [ARGS...] | serve SOCKET MODULE; received {sys.argv[1:]}")
