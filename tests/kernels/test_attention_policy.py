from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnitro.errors import ConfigError, ShapeError
from torchnitro.kernels import attention_policy as P
from torchnitro.kernels import reference
from torchnitro.kernels.flash_attention import FlashAttentionFunction


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TORCHNITRO_ATTENTION", raising=False)
    P.reset_attention_routes()
    yield
    P.reset_attention_routes()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launches of our flash kernel (interpreted on CPU), wherever they come from."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    calls = []
    real = FlashAttentionFunction.apply

    def spy(*args):
        calls.append(args[3:5])  # (causal, window)
        return real(*args)

    monkeypatch.setattr(FlashAttentionFunction, "apply", spy)
    return calls


def _qkv(B=2, H=4, Hkv=4, Tq=11, Tk=11, D=8, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = (torch.randn(B, Hkv, Tk, D, generator=g) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_plain_calls_are_sdpa_on_cpu(causal, hkv, kernel_calls):
    q, k, v = _qkv(Hkv=hkv)
    route = P.route_attention(q, k, v, causal)
    assert route.backend == "sdpa" and "never timed off CUDA" in route.reason and route.ours_ms is None
    out = P.attention(q, k, v, causal)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != 4))
    assert kernel_calls == []


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_goes_to_our_kernel(causal, kernel_calls):
    q, k, v = _qkv(Hkv=2, Tq=13, Tk=13, grad=True)
    route = P.route_attention(q, k, v, causal, window=4)
    assert route.backend == "flash" and "sliding window" in route.reason
    out = P.attention(q, k, v, causal, window=4, site="test")
    assert kernel_calls == [(causal, 4)]
    torch.testing.assert_close(out, reference.flash_attention(q, k, v, causal, 4), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


def test_window_that_masks_nothing_is_plain_attention(kernel_calls):
    q, k, v = _qkv(Tq=9, Tk=9)
    assert P.route_attention(q, k, v, True, window=9).backend == "sdpa"
    torch.testing.assert_close(P.attention(q, k, v, True, window=50), F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    assert kernel_calls == []


def test_forced_backends_and_bad_values(kernel_calls, monkeypatch):
    q, k, v = _qkv(Hkv=2)
    assert P.route_attention(q, k, v, True, backend="flash").backend == "flash"
    P.attention(q, k, v, True, backend="flash")
    assert kernel_calls == [(True, None)]
    sd = P.attention(q, k, v, True, window=3, backend="sdpa")  # SDPA with the window as a mask
    torch.testing.assert_close(sd, reference.flash_attention(q, k, v, True, 3))
    assert len(kernel_calls) == 1
    monkeypatch.setenv("TORCHNITRO_ATTENTION", "flash")
    assert P.route_attention(q, k, v).backend == "flash"
    assert P.route_attention(q, k, v, backend="sdpa").backend == "sdpa"  # the argument wins over the variable
    monkeypatch.setenv("TORCHNITRO_ATTENTION", "fastest")
    with pytest.raises(ConfigError, match=r"TORCHNITRO_ATTENTION='fastest'; expected one of"):
        P.route_attention(q, k, v)
    with pytest.raises(ConfigError, match=r"backend='cudnn'"):
        P.route_attention(q, k, v, backend="cudnn")
    with pytest.raises(ShapeError, match="expected k and v of shape"):
        P.attention(q, k[:, :, :, :4], v)


def test_grouped_kv_without_enable_gqa_goes_to_our_kernel(kernel_calls, monkeypatch):
    monkeypatch.setattr(P, "SDPA_HAS_GQA", False)
    q, k, v = _qkv(Hkv=2)
    assert P.route_attention(q, k, v, True).backend == "flash"
    assert P.route_attention(*_qkv(Hkv=4), True).backend == "sdpa"
    forced = P.sdpa(q, k, v, causal=True)  # forced SDPA on such a torch repeats K/V
    torch.testing.assert_close(forced, reference.flash_attention(q, k, v, True))


@pytest.fixture
def fake_timing(monkeypatch):
    """Pretend measurements can run here; ``times`` holds (ours_ms, sdpa_ms) or an exception to raise."""
    monkeypatch.setattr(P, "_unmeasurable", lambda q: None)
    monkeypatch.setattr(P, "triton_importable", lambda: True)
    state = {"times": (1.0, 2.0), "calls": 0}

    def medians(a, b, time_ms, rounds=P.ROUNDS):
        state["calls"] += 1
        if isinstance(state["times"], Exception):
            if state["calls"] == 1:
                raise state["times"]
            return 1.0, 1.0
        return state["times"]

    monkeypatch.setattr(P, "interleaved_medians", medians)
    return state


def test_measured_route_picks_ours_only_when_clearly_faster(fake_timing):
    q, k, v = _qkv()
    r = P.route_attention(q, k, v, True, site="s")
    assert (r.backend, r.ours_ms, r.sdpa_ms, r.phase) == ("flash", 1.0, 2.0, "fwd") and "2.00x" in r.reason
    assert fake_timing["calls"] == 1
    P.route_attention(q, k, v, True, site="s")
    assert fake_timing["calls"] == 1  # cached per bucket
    fake_timing["times"] = (0.97, 1.0)  # 3% faster is within the margin: keep SDPA
    r = P.route_attention(*_qkv(Tq=40, Tk=40), True)
    assert r.backend == "sdpa" and "needs >=" in r.reason and fake_timing["calls"] == 2
    r = P.route_attention(*_qkv(grad=True), True)  # training is its own bucket, timed forward + backward
    assert r.phase == "fwd+bwd" and fake_timing["calls"] == 3


def test_measurement_failure_keeps_sdpa(fake_timing):
    fake_timing["times"] = RuntimeError("out of shared memory")
    r = P.route_attention(*_qkv(), False)
    assert r.backend == "sdpa" and "our kernel failed" in r.reason and "out of shared memory" in r.reason


@pytest.mark.parametrize("grad", [False, True])
def test_real_measurement_path_runs_both_backends(grad, kernel_calls, monkeypatch):
    """The CUDA-only measurement code, run on CPU with a wall-clock stand-in for the CUDA-event timer."""
    import time

    def wall_ms(fn, reps):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps

    monkeypatch.setattr(P, "_unmeasurable", lambda q: None)
    monkeypatch.setattr(P, "cuda_ms", wall_ms)
    q, k, v = _qkv(B=1, H=2, Hkv=1, Tq=16, Tk=16, grad=grad)
    out = P.attention(q, k, v, True, site="measured")
    r = P.attention_routes()[0]
    assert r["phase"] == ("fwd+bwd" if grad else "fwd") and r["ours_ms"] > 0 and r["sdpa_ms"] > 0, r
    assert (r["backend"] == "flash") == (r["ours_ms"] <= (1 - P.MARGIN) * r["sdpa_ms"])
    assert len(kernel_calls) >= 2  # our kernel ran during the measurement
    assert all(t.grad is None for t in (q, k, v))  # timing did not touch the caller's tensors
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               atol=1e-5, rtol=1e-5)


def test_interleaved_medians_alternate_and_take_the_median():
    order = []
    a, b = (lambda: "a"), (lambda: "b")
    times = {"a": iter([9.0, 1.0, 1.0, 3.0, 1.2, 5.0, 1.1]), "b": iter([9.0, 2.0, 2.0, 2.2, 9.0, 2.1, 2.3])}

    def time_ms(fn, reps):
        name = fn()
        order.append(name)
        return next(times[name])

    ta, tb = P.interleaved_medians(a, b, time_ms, rounds=5)
    assert order[:4] == ["a", "b", "a", "b"]  # warm-up each, then one sizing call each
    assert order[4:] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert (ta, tb) == (1.2, 2.2)


def test_timed_training_call_leaves_callers_tensors_alone():
    q, k, v = _qkv(grad=True)
    fn = P._timed_call(lambda a, b, c: P.sdpa(a, b, c, causal=True), q, k, v, train=True)
    grads = fn()
    assert len(grads) == 3 and all(t.grad is None for t in (q, k, v))


def test_report_lists_each_site_with_its_reason(kernel_calls):
    q, k, v = _qkv()
    P.attention(q, k, v, True, site="layer.a")
    P.attention(q, k, v, True, window=3, site="layer.b")
    P.attention(q, k, v, True, site="layer.a")  # same site and bucket: one row
    rows = P.attention_routes()
    assert [(r["site"], r["backend"]) for r in rows] == [("layer.a", "sdpa"), ("layer.b", "flash")]
    assert "Tq<=16" in rows[0]["bucket"] and "causal" in rows[0]["bucket"]
    text = P.attention_report()
    assert "layer.a" in text and "sliding window" in text
    assert set(P.chosen_configs().values()) == {f"{r['backend']}: {r['reason']}" for r in rows}
    assert "TORCHNITRO_ATTENTION=auto" in P.policy_summary()


def test_patched_reference_lm_uses_sdpa_and_keeps_outputs(kernel_calls):
    from torchnitro.kernels import patch_
    from torchnitro.nn.models import TransformerConfig, TransformerLM

    model = TransformerLM(TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)).eval()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = model(tokens)
        summary = patch_(model)
        after = model(tokens)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert kernel_calls == []  # plain causal GQA attention: torch's SDPA, as before the patch
    assert "attention policy" in (summary.attention or "")
    assert [r["backend"] for r in P.attention_routes() if r["site"] == "patch:nn.models attention"] == ["sdpa"]


def test_patch_without_attention_leaves_it_alone(monkeypatch):
    from torchnitro.kernels import patch_
    from torchnitro.nn.models import TransformerConfig, TransformerLM

    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    model = TransformerLM(TransformerConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2))
    summary = patch_(model, attention=False)
    assert summary.attention is None and "_CausalSelfAttention -> FusedRefAttention" not in summary.replaced
    assert type(model.blocks[0].attn).__name__ == "_CausalSelfAttention"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_measured_route_on_gpu(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = P.attention(q, k, v, causal, site="gpu test")
    route = P.attention_routes()[0]
    assert route["phase"] == "fwd+bwd" and route["ours_ms"] > 0 and route["sdpa_ms"] > 0, route
    assert (route["backend"] == "flash") == (route["ours_ms"] <= (1 - P.MARGIN) * route["sdpa_ms"]), route
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    win = P.attention(q, k, v, causal, window=128)
    torch.testing.assert_close(win, reference.flash_attention(q, k, v, causal, 128), atol=2e-2, rtol=2e-2)
    assert P.route_attention(q, k, v, causal, window=128).backend == "flash"
