"""The fork server behind ``torchnitro train``'s fast restarts (``distributed/prewarm.py``), with real processes:
a worker forked from the server sees the client's argv, environment, directory and stdout, its exit code is the
client's, killing the client (kill -9 of a rank) kills it, and without a server the client runs the module
itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchnitro.distributed import prewarm

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.distributed.workers.echo"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One fork server for the module's tests (its start-up imports what it pre-warms); each test forks its own
    workers from it, and the kill test checks that it serves on."""
    sock = str(tmp_path_factory.mktemp("prewarm") / "s")
    proc = subprocess.Popen([sys.executable, "-m", "torchnitro.distributed.prewarm", "serve", sock, MODULE], cwd=ROOT)
    yield sock, proc
    proc.terminate()
    proc.wait(timeout=30)


def _client(env: dict, cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(prewarm.worker_command(MODULE, list(args)), cwd=cwd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_forked_worker_gets_the_clients_state_and_exit_code(server, tmp_path):
    sock, proc = server
    env = {prewarm.ENV_SOCKET: sock, prewarm.ENV_PID: str(proc.pid), "ECHO_VAR": "x1", "ECHO_CODE": "3"}
    c = _client(env, tmp_path, "a", "--b")
    out, _ = c.communicate(timeout=100)
    got = json.loads(out.strip().splitlines()[-1])
    assert c.returncode == 3
    assert got["argv"] == ["a", "--b"] and got["cwd"] == str(tmp_path) and got["var"] == "x1"
    assert got["ppid"] == proc.pid and got["pid"] != c.pid  # forked by the server, not the client itself


@pytest.mark.timeout(120)
def test_killing_the_client_kills_the_forked_worker(server, tmp_path):
    sock, proc = server
    pidfile = tmp_path / "pid"
    env = {prewarm.ENV_SOCKET: sock, prewarm.ENV_PID: str(proc.pid), "ECHO_SLEEP": "100", "ECHO_PIDFILE": str(pidfile)}
    c = _client(env, tmp_path)
    deadline = time.monotonic() + 100
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and c.poll() is None, "the worker never started"
        time.sleep(0.05)
    child = int(pidfile.read_text())
    os.kill(c.pid, signal.SIGKILL)
    c.wait()
    assert _wait_gone(child, 10.0), "the forked worker outlived its killed client"
    assert proc.poll() is None  # the server serves on


@pytest.mark.timeout(60)
def test_without_a_server_the_client_runs_the_module_itself(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {prewarm.ENV_SOCKET: str(tmp_path / "none"), prewarm.ENV_PID: str(gone.pid), "ECHO_CODE": "5"}
    c = _client(env, tmp_path, "z")
    out, _ = c.communicate(timeout=50)
    got = json.loads(out.strip().splitlines()[-1])
    assert c.returncode == 5 and got["argv"] == ["z"] and got["pid"] == c.pid  # exec'd in place
