"""Every timing process starts with the OpenMP wait setting it is deployed with (nothing added: libgomp's default
or the user's own), a caller's extra environment beside it, and the setting is part of every recorded environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from torchnitro.bench.environment import _PREFIXES, THREAD_SETTING, describe_environment, timing_environment, timing_process_env
from torchnitro.bench.isolated import ChildTimer, save_inputs

_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def env_probe(path: str) -> Callable[..., Any]:
    """A ChildTimer loader (run in the child): writes the child's OpenMP wait variables to ``path``."""
    Path(path).write_text(json.dumps({k: os.environ.get(k) for k in _VARS}))
    return lambda x: x


@pytest.fixture
def no_omp_env(monkeypatch):
    for k in _VARS:
        monkeypatch.delenv(k, raising=False)


def _child_env(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    save_inputs([(torch.ones(2),)], tmp_path / "in.pt")
    out = tmp_path / "env.json"
    with ChildTimer("test_isolated_env:env_probe", {"path": str(out)}, tmp_path / "in.pt", threads=1,
                    env=env) as timer:
        timer.wait_ready()
        return json.loads(out.read_text()), timer.env


def test_timing_processes_add_no_thread_setting_of_their_own():
    # a bounded spin count (10000) made mlp eager 7.6 ms against the default's 3.3 ms: timing processes run the
    # wait setting a deployed process has (results/timing_fairness.md, "OpenMP wait settings")
    assert THREAD_SETTING == {}
    assert timing_process_env({}) == {} and timing_process_env({"PATH": "/bin"}) == {}
    assert timing_process_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_every_timing_process_starts_with_libgomps_default_wait(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path)
    assert got == {k: None for k in _VARS}
    assert recorded == {}
    assert not any(k in os.environ for k in _VARS)  # this process is left as it was


def test_extra_env_is_all_a_timing_process_adds(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path, {"MALLOC_TRIM_THRESHOLD_": "536870912"})
    assert got == {k: None for k in _VARS}
    assert recorded == {"MALLOC_TRIM_THRESHOLD_": "536870912"}


def test_a_callers_own_wait_setting_reaches_the_child(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert got == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert recorded == {"OMP_WAIT_POLICY": "ACTIVE"}
    got, recorded = _child_env(tmp_path, {"GOMP_SPINCOUNT": "300000"})
    assert got == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"} and recorded == {"GOMP_SPINCOUNT": "300000"}


def test_the_users_own_wait_setting_is_inherited(tmp_path, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    got, recorded = _child_env(tmp_path)
    assert got == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None} and recorded == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    got, recorded = _child_env(tmp_path)
    assert got == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "7"} and recorded == {}


def test_recorded_environment_says_the_timing_processes_run_the_default_or_the_users_wait(monkeypatch, no_omp_env):
    for k in [k for k in os.environ if k.startswith(_PREFIXES)]:  # another test may leave OMP_NUM_THREADS etc. set
        monkeypatch.delenv(k)
    env = timing_environment()
    assert env["timing_processes"] == "inherited"
    assert describe_environment(env).endswith("timing processes run libgomp's default OpenMP wait (nothing added)")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    assert describe_environment().endswith("GOMP_SPINCOUNT=50, timing processes inherit this OpenMP wait setting")
