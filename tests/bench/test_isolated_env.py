"""Every timing process starts with the OpenMP wait setting of ``bench.environment`` (libgomp's spin bounded),
a caller's or user's own setting wins, and the setting is part of every recorded environment."""

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


def test_timing_process_env_is_the_thread_setting_unless_the_user_chose_one():
    assert timing_process_env({}) == THREAD_SETTING and timing_process_env({}) is not THREAD_SETTING  # a copy
    assert timing_process_env({"PATH": "/bin"}) == THREAD_SETTING
    assert timing_process_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert timing_process_env({"GOMP_SPINCOUNT": "infinite"}) == {}


def test_every_timing_process_starts_with_the_thread_setting(tmp_path, no_omp_env):
    assert THREAD_SETTING and set(THREAD_SETTING) <= set(_VARS)  # OpenMP's wait: what stalls a full team
    got, recorded = _child_env(tmp_path)
    assert got == {k: THREAD_SETTING.get(k) for k in _VARS}
    assert recorded == THREAD_SETTING
    assert not any(k in os.environ for k in _VARS)  # this process is left as it was


def test_extra_env_keeps_the_thread_setting_beside_it(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path, {"MALLOC_TRIM_THRESHOLD_": "536870912"})
    assert got == {k: THREAD_SETTING.get(k) for k in _VARS}
    assert recorded == {**THREAD_SETTING, "MALLOC_TRIM_THRESHOLD_": "536870912"}


def test_a_callers_own_wait_setting_replaces_it_instead_of_being_overridden(tmp_path, no_omp_env):
    # a GOMP_SPINCOUNT beside OMP_WAIT_POLICY=ACTIVE would turn the endless spin asked for into a bounded one
    got, recorded = _child_env(tmp_path, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert got == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert recorded == {"OMP_WAIT_POLICY": "ACTIVE"}
    got, recorded = _child_env(tmp_path, {"GOMP_SPINCOUNT": "300000"})  # libgomp's own default, asked for
    assert got == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"} and recorded == {"GOMP_SPINCOUNT": "300000"}


def test_the_users_own_wait_setting_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    got, recorded = _child_env(tmp_path)
    assert got == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None} and recorded == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    got, recorded = _child_env(tmp_path)
    assert got == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "7"} and recorded == {}


def test_recorded_environment_names_the_timing_processes_setting(monkeypatch, no_omp_env):
    for k in [k for k in os.environ if k.startswith(_PREFIXES)]:  # another test may leave OMP_NUM_THREADS etc. set
        monkeypatch.delenv(k)
    setting = " ".join(f"{k}={v}" for k, v in THREAD_SETTING.items())
    env = timing_environment()
    assert env["timing_processes"] == setting
    assert describe_environment(env).endswith(f"timing processes started with {setting}")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    assert describe_environment().endswith("GOMP_SPINCOUNT=50, timing processes inherit this OpenMP wait setting")
