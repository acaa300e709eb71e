"""Launch plans: after the first call a launcher skips pick_config and the key building, and still computes
the reference; plans are kept only for final configs; make_plan (hit and miss by key, what it keeps);
the cheap env read and the cached SM count."""

from __future__ import annotations

import importlib

import pytest
import torch

from torchnitro.kernels import _triton, apply_rope, layer_norm, reference, rms_norm

rms_mod = importlib.import_module("torchnitro.kernels.rms_norm")
ln_mod = importlib.import_module("torchnitro.kernels.layer_norm")
rope_mod = importlib.import_module("torchnitro.kernels.rope")


@pytest.fixture
def fresh():
    _triton.clear_tuned_configs()
    yield
    _triton.clear_tuned_configs()


def _counting(monkeypatch):
    """Tuning keys passed to pick_config (every launcher reaches it through _triton.make_plan)."""
    calls = []
    real = _triton.pick_config

    def pick(key, *args, **kwargs):
        calls.append(key)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(_triton, "pick_config", pick)
    return calls


def _grads(fn, inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("mod,fn,ref,make", [
    (rms_mod, lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
     lambda: [torch.randn(3, 5, 40), torch.randn(40)]),
    (ln_mod, layer_norm, reference.layer_norm, lambda: [torch.randn(6, 40), torch.randn(40), torch.randn(40)]),
])
def test_norm_second_call_uses_the_plan_and_matches_reference(triton_cpu, fresh, monkeypatch, mod, fn, ref, make):
    calls = _counting(monkeypatch)
    inputs = make()
    _grads(fn, inputs)
    first = len(calls)
    assert first == 2  # forward and backward picked once each
    outs, grads = _grads(fn, inputs)
    assert len(calls) == first  # the second call is a plan hit: no pick_config, no tuning key
    ref_outs, ref_grads = _grads(ref, inputs)
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    _grads(fn, [torch.randn(7, 40)] + inputs[1:])  # another row count: its own plan
    assert len(calls) == first + 2


def test_rope_second_call_uses_the_plan_and_matches_reference(triton_cpu, fresh, monkeypatch):
    calls = _counting(monkeypatch)
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    ang = torch.randn(6, 4)
    cos, sin = ang.cos(), ang.sin()
    fn = lambda a, b: apply_rope(a, b, cos, sin)  # noqa: E731
    _grads(fn, [q, k])
    first = len(calls)
    outs, grads = _grads(fn, [q, k])
    assert len(calls) == first
    exp = _grads(lambda a, b: (reference.rope(a, cos, sin), reference.rope(b, cos, sin)), [q, k])
    for a, b in zip(outs + grads, exp[0] + exp[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_forced_config_neither_uses_nor_stores_a_plan(triton_cpu, fresh):
    x, w = torch.randn(4, 40), torch.randn(40)
    for cfg in rms_mod.fwd_candidates(40)[:3]:
        y, _, _ = rms_mod.rms_norm_forward(x, w, 1e-6, config=cfg)
        torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert not _triton._PLANS


def test_plans_are_kept_only_for_final_configs(fresh):
    dev = torch.device("cuda", 0)
    big = _triton.TUNE_MIN_SIZE
    _triton.store_plan("untimed", "p", ("k", 1), dev, big)  # default while timing was impossible
    assert _triton.cached_plan("untimed") is None
    _triton._TUNED[("k", 2)] = {"config": {}, "ms": {}}
    _triton.store_plan("timed", "p", ("k", 2), dev, big)
    _triton.store_plan("small", "p", ("k", 3), dev, big - 1)
    _triton.store_plan("cpu", "p", ("k", 4), torch.device("cpu"), big)
    assert [_triton.cached_plan(k) for k in ("timed", "small", "cpu")] == ["p", "p", "p"]
    _triton.clear_tuned_configs()
    assert _triton.cached_plan("timed") is None


CANDS = ({"ROWS": 1}, {"ROWS": 2}, {"ROWS": 4})


def _build(cfg):
    return ("plan", cfg["ROWS"])


def _never(plan):
    raise AssertionError(f"executed {plan}; expected no timing run")


def test_make_plan_keeps_the_plan_of_the_pick_under_the_exact_key(fresh, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_triton, "tuning_enabled", lambda device: True)
    executed = []

    def fake_time(cands, run):  # runs each candidate once, as the CUDA-event timer does
        for c in cands:
            run(c)
        return {0: 3.0, 1: 1.0, 2: 2.0}

    monkeypatch.setattr(_triton, "_time_candidates", fake_time)
    assert _triton.cached_plan(("op", 8)) is None  # miss before the first call
    plan = _triton.make_plan(("op", 8), None, ("tune", 8), CANDS, "cuda", None, build=_build,
                             execute=executed.append)
    assert plan == ("plan", 2)  # built from the fastest candidate
    assert executed == [("plan", 1), ("plan", 2), ("plan", 4)]  # timing launched execute(build(cfg)) of each
    assert _triton.cached_plan(("op", 8)) is plan  # hit: the very object make_plan built
    assert _triton.cached_plan(("op", 9)) is None  # another exact key misses
    assert _triton.cached_plan(("op", 8), {"ROWS": 1}) is None  # a forced config never hits
    assert _triton.tuned_configs()["('tune', 8)"]["config"] == {"ROWS": 2}
    again = _triton.make_plan(("op", 9), None, ("tune", 8), CANDS, "cuda", None, build=_build, execute=_never)
    assert again == ("plan", 2) and _triton.cached_plan(("op", 9)) is again  # same tuning key: no new timing


def test_make_plan_with_a_forced_config_builds_it_and_keeps_nothing(fresh, monkeypatch):
    calls = _counting(monkeypatch)
    plan = _triton.make_plan(("op", 1), {"ROWS": 4}, ("tune", 1), CANDS, "cpu", 10, build=_build, execute=_never)
    assert plan == ("plan", 4) and calls == [] and not _triton._PLANS


def test_make_plan_keeps_a_default_only_where_it_is_final(fresh, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNEL_TUNE", "0")  # CUDA default only because timing is off: not kept
    big = _triton.TUNE_MIN_SIZE
    cuda = _triton.make_plan(("op", 2), None, ("tune", 2), CANDS, "cuda", big, build=_build, execute=_never)
    assert cuda == ("plan", 1) and _triton.cached_plan(("op", 2)) is None
    cpu = _triton.make_plan(("op", 3), None, ("tune", 3), CANDS, "cpu", big, build=_build, execute=_never)
    assert cpu == ("plan", 1) and _triton.cached_plan(("op", 3)) is cpu  # CPU is never timed: final


def test_plan_cache_starts_over_when_full(fresh, monkeypatch):
    monkeypatch.setattr(_triton, "_MAX_PLANS", 2)
    for i in range(3):
        _triton.make_plan(("op", i), None, ("tune", i), CANDS, "cpu", 1, build=_build, execute=_never)
    assert [_triton.cached_plan(("op", i)) for i in range(3)] == [None, None, ("plan", 1)]


class _Grid:
    """Stands in for a LazyKernel: ``kernel[grid]`` gives (name, grid)."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        return self.name, grid


def test_norm_plans_size_the_grid_from_the_config():
    from torchnitro.kernels import _norm

    assert _norm.norm_fwd_plan(_Grid("fwd"), {"ROWS": 4, "num_warps": 8}, 37, 33) == (
        ("fwd", (10,)), {"BLOCK": 64, "ROWS": 4, "num_warps": 8})
    main, pre = _Grid("bwd"), _Grid("prefetch")
    cpu = torch.device("cpu")  # num_programs: 8 off CUDA
    assert _norm.norm_bwd_plan(main, pre, {"PER_SM": 2, "ROWS": 2, "num_warps": 8}, 37, 33, cpu) == (
        ("bwd", (16,)), {"ROWS": 2, "num_warps": 8, "BLOCK": 64}, 16)
    assert _norm.norm_bwd_plan(main, pre, {"PER_SM": 4, "ROWS": 4, "num_warps": 8}, 37, 33, cpu)[2] == 10  # row steps
    assert _norm.norm_bwd_plan(main, pre, {"PER_SM": 1, "ROWS": 1, "PREFETCH": 1, "num_warps": 16}, 37, 33, cpu) == (
        ("prefetch", (8,)), {"num_warps": 16, "BLOCK": 64}, 8)


def test_getenv_sees_every_change(monkeypatch):
    monkeypatch.delenv("TORCHNITRO_TEST_FLAG", raising=False)
    assert _triton.getenv("TORCHNITRO_TEST_FLAG") is None
    monkeypatch.setenv("TORCHNITRO_TEST_FLAG", "1")
    assert _triton.getenv("TORCHNITRO_TEST_FLAG") == "1"
    monkeypatch.setenv("TORCHNITRO_TEST_FLAG", "0")
    assert _triton.getenv("TORCHNITRO_TEST_FLAG") == "0"
    monkeypatch.delenv("TORCHNITRO_TEST_FLAG")
    assert _triton.getenv("TORCHNITRO_TEST_FLAG") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _triton.interpreting()


def test_sm_count_is_queried_once_per_device(monkeypatch):
    queries = []

    class Props:
        multi_processor_count = 132

    def props(index):
        queries.append(index)
        return Props()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    _triton._sm_count.cache_clear()
    try:
        assert [_triton.num_programs(torch.device("cuda", 0)) for _ in range(3)] == [132] * 3
        assert _triton.num_programs(torch.device("cuda", 1)) == 132
        assert queries == [0, 1]
    finally:
        _triton._sm_count.cache_clear()
