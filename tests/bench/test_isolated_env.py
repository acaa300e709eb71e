"""Every timing process starts with the OpenMP wait setting it is deployed with (nothing added: libgomp's default
or the user's own) and under glibc's allocator setting (unless the environment chooses the allocator), a caller's
extra environment beside it, and both settings are part of every recorded environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import platform

import pytest
import torch

from torchnitro.bench.environment import (_PREFIXES, ALLOCATOR_SETTING, GLIBC_DEFAULTS, THREAD_SETTING,
                                          describe_environment, timing_environment, timing_process_env)
from torchnitro.bench.isolated import ChildTimer, save_inputs

_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_MALLOC = tuple(ALLOCATOR_SETTING)
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator setting is glibc's")


def env_probe(path: str) -> Callable[..., Any]:
    """A ChildTimer loader (run in the child): writes the child's OpenMP wait variables to ``path`` (and, under
    "malloc", its MALLOC_* variables)."""
    got: dict[str, Any] = {k: os.environ.get(k) for k in _VARS}
    got["malloc"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    Path(path).write_text(json.dumps(got))
    return lambda x: x


def fresh_buffer(mib: int) -> Callable[..., Any]:
    """A ChildTimer loader: each call allocates, fills and frees ``mib`` MiB (above glibc's largest dynamic mmap
    threshold, 32 MiB, so with glibc's defaults every call maps it anew and faults every page in)."""
    n = mib * (1 << 20) // 4
    return lambda x: torch.ones(n).sum() + x


@pytest.fixture
def no_omp_env(monkeypatch):
    for k in _VARS:
        monkeypatch.delenv(k, raising=False)
    for k in [k for k in os.environ if k.startswith("MALLOC_")] + ["LD_PRELOAD"]:
        monkeypatch.delenv(k, raising=False)


def _child_env(tmp_path: Path, env: dict[str, str | None] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    save_inputs([(torch.ones(2),)], tmp_path / "in.pt")
    out = tmp_path / "env.json"
    with ChildTimer("test_isolated_env:env_probe", {"path": str(out)}, tmp_path / "in.pt", threads=1,
                    env=env) as timer:
        timer.wait_ready()
        got = json.loads(out.read_text())
        malloc = got.pop("malloc")
        return {**got, "malloc": malloc}, timer.env


def _omp(got: dict[str, Any]) -> dict[str, Any]:
    return {k: got[k] for k in _VARS}


def test_timing_processes_add_no_thread_setting_of_their_own():
    # a bounded spin count (10000) made mlp eager 7.6 ms against the default's 3.3 ms: timing processes run the
    # wait setting a deployed process has (results/timing_fairness.md, "OpenMP wait settings")
    assert THREAD_SETTING == {}
    for environ in ({}, {"PATH": "/bin"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        assert not set(timing_process_env(environ)) & set(_VARS)


@glibc
def test_timing_processes_add_glibcs_allocator_setting_unless_the_environment_chooses_the_allocator():
    # with glibc's defaults fresh processes of the same eager differed by 10-20% (results/eager_spread.md)
    assert timing_process_env({}) == ALLOCATOR_SETTING
    assert timing_process_env({"OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"}) == ALLOCATOR_SETTING
    assert timing_process_env({"MALLOC_MMAP_THRESHOLD_": "131072"}) == {}  # the user's own thresholds are inherited
    assert timing_process_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}
    # other allocator variables combine with the setting (dropping it would bring the per-process spread back)
    assert timing_process_env({"MALLOC_ARENA_MAX": "2"}) == ALLOCATOR_SETTING
    assert timing_process_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == ALLOCATOR_SETTING
    assert timing_process_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == {}
    assert timing_process_env(dict(GLIBC_DEFAULTS)) == {}  # a caller that removes them gets glibc's defaults


@glibc
def test_every_timing_process_starts_with_libgomps_default_wait_and_the_allocator_setting(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path)
    assert _omp(got) == {k: None for k in _VARS}
    assert got["malloc"] == ALLOCATOR_SETTING and recorded == ALLOCATOR_SETTING
    assert not any(k in os.environ for k in _VARS + _MALLOC)  # this process is left as it was


def test_extra_env_replaces_the_allocator_setting(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path, {"MALLOC_TRIM_THRESHOLD_": "536870912"})
    assert _omp(got) == {k: None for k in _VARS}
    assert got["malloc"] == {"MALLOC_TRIM_THRESHOLD_": "536870912"}  # not merged with the default setting
    assert recorded == {"MALLOC_TRIM_THRESHOLD_": "536870912"}


def test_glibc_defaults_remove_the_variables_even_when_this_process_has_them(tmp_path, no_omp_env, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "268435456")
    got, recorded = _child_env(tmp_path, dict(GLIBC_DEFAULTS))
    assert got["malloc"] == {}
    assert recorded == GLIBC_DEFAULTS
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "268435456"  # this process is left as it was


@glibc
def test_samples_report_the_page_faults_glibcs_defaults_cost(tmp_path, no_omp_env):
    """64 MiB allocated and freed per call: with glibc's defaults each call maps it anew and faults its 16384 pages
    in; under the allocator setting it stays in the heap (no faults once the heap has grown to hold it).

    The heap may take more than one sample to grow (a CI run saw [8192, 8192, 0]): the last of five samples counts."""
    save_inputs([(torch.ones(1),)], tmp_path / "in.pt")
    with ChildTimer("test_isolated_env:fresh_buffer", {"mib": 64}, tmp_path / "in.pt", threads=1, gate=None) as kept:
        for _ in range(5):
            kept.sample(2, warm=1)
        with kept.again(GLIBC_DEFAULTS) as default:
            for _ in range(3):
                default.sample(2, warm=1)
            assert len(kept.faults) == 5 and len(default.faults) == 3
            assert kept.faults[-1] < 1000, kept.faults
            assert min(default.faults) > 8000, default.faults


def test_a_callers_own_wait_setting_reaches_the_child(tmp_path, no_omp_env):
    got, recorded = _child_env(tmp_path, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert _omp(got) == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert {k: v for k, v in recorded.items() if k in _VARS} == {"OMP_WAIT_POLICY": "ACTIVE"}
    got, recorded = _child_env(tmp_path, {"GOMP_SPINCOUNT": "300000"})
    assert _omp(got) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"}
    assert {k: v for k, v in recorded.items() if k in _VARS} == {"GOMP_SPINCOUNT": "300000"}


def test_the_users_own_wait_setting_is_inherited(tmp_path, no_omp_env, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    got, recorded = _child_env(tmp_path)
    assert _omp(got) == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert not set(recorded) & set(_VARS)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    got, recorded = _child_env(tmp_path)
    assert _omp(got) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "7"} and not set(recorded) & set(_VARS)


def test_the_users_own_allocator_setting_is_inherited(tmp_path, no_omp_env, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    got, recorded = _child_env(tmp_path)
    assert got["malloc"] == {"MALLOC_TRIM_THRESHOLD_": "0"} and recorded == {}
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    got, recorded = _child_env(tmp_path)
    assert got["malloc"] == {"MALLOC_ARENA_MAX": "2", **ALLOCATOR_SETTING} and recorded == ALLOCATOR_SETTING


@glibc
def test_recorded_environment_says_what_the_timing_processes_run(monkeypatch, no_omp_env):
    for k in [k for k in os.environ if k.startswith(_PREFIXES)]:  # another test may leave OMP_NUM_THREADS etc. set
        monkeypatch.delenv(k)
    env = timing_environment()
    assert env["timing_processes"] == "MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912"
    text = describe_environment(env)
    assert "(default thresholds)" in text  # this process's own allocator
    assert "timing processes started with MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912" in text
    assert text.endswith("timing processes run libgomp's default OpenMP wait (nothing added)")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    assert describe_environment().endswith("GOMP_SPINCOUNT=50, timing processes started with MALLOC_MMAP_THRESHOLD_="
                                           "268435456 MALLOC_TRIM_THRESHOLD_=536870912 (glibc's thresholds fixed: no "
                                           "page faults from returned memory, the same in every process), timing "
                                           "processes inherit this OpenMP wait setting")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert "MALLOC_MMAP_THRESHOLD_=131072, timing processes inherit this allocator setting" in describe_environment()


def test_a_process_that_cannot_start_leaves_nothing_open_and_again_raises_recipe_error(tmp_path, no_omp_env,
                                                                                       monkeypatch):
    """Popen failing (memory, process limit): the timer's log is closed and removed and the OSError reaches the
    caller (start_children times that variant here); ``again``, which only the trials call, raises RecipeError,
    which each trial notes instead of stopping the search."""
    import subprocess

    from torchnitro.errors import RecipeError

    save_inputs([(torch.ones(2),)], tmp_path / "in.pt")

    def no_process(*a, **kw):
        raise OSError("Resource temporarily unavailable")

    with ChildTimer("test_isolated_env:env_probe", {"path": str(tmp_path / "env.json")}, tmp_path / "in.pt",
                    threads=1, gate=None) as timer:
        timer.wait_ready()
        monkeypatch.setattr(subprocess, "Popen", no_process)
        with pytest.raises(OSError, match="Resource temporarily"):
            ChildTimer("test_isolated_env:env_probe", {"path": "x"}, tmp_path / "in.pt", threads=1,
                       log=tmp_path / "never.log")
        assert not (tmp_path / "never.log").exists()
        with pytest.raises(RecipeError, match="a fresh timing process could not start"):
            timer.again(dict(GLIBC_DEFAULTS))
        assert [p for p in tmp_path.iterdir() if p.suffix == ".log" and p != timer.log] == []


@glibc
def test_only_a_malloc_replacement_or_glibcs_malloc_tunables_count_as_the_environments_allocator_choice(monkeypatch):
    """LD_PRELOAD of Intel's OpenMP (as CPU tuning guides suggest) leaves glibc's malloc: timing processes still get
    the setting; GLIBC_TUNABLES=glibc.malloc.* is the user's threshold choice in glibc's other spelling: inherited."""
    from torchnitro.bench import environment as env_mod

    assert timing_process_env({"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"}) == ALLOCATOR_SETTING
    assert timing_process_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2:/opt/intel/lib/libiomp5.so"}) == {}
    assert timing_process_env({"LD_PRELOAD": "libtbbmalloc_proxy.so.2"}) == {}
    assert timing_process_env({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == {}
    assert timing_process_env({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}) == ALLOCATOR_SETTING
    why = env_mod.allocator_untunable({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2 /opt/intel/lib/libiomp5.so"})
    assert why is not None and "libjemalloc.so.2" in why and "libiomp5" not in why
    why = env_mod.allocator_untunable({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert why is not None and "glibc.malloc.trim_threshold=1" in why
    # deploying a recorded setting leaves a threshold the user set through GLIBC_TUNABLES as it is
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(env_mod, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    for k in ALLOCATOR_SETTING:
        monkeypatch.setenv(k, "0")  # recorded as absent before: restored as absent
        monkeypatch.delenv(k)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert env_mod.apply_allocator(ALLOCATOR_SETTING, environ=False) == {"MALLOC_TRIM_THRESHOLD_": "536870912"}
    assert calls == [(-1, 536870912)]
    env = timing_environment()
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_threshold=65536"
    assert "(default thresholds)" not in describe_environment(env)
