"""Launch plans: after the first call a launcher skips pick_config and the key building, and still computes
the reference; plans are kept only for final configs; the cheap env read and the cached SM count."""

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


def _counting(monkeypatch, mod):
    calls = []
    real = mod.pick_config

    def pick(key, *args, **kwargs):
        calls.append(key)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(mod, "pick_config", pick)
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
    calls = _counting(monkeypatch, mod)
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
    calls = _counting(monkeypatch, rope_mod)
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
