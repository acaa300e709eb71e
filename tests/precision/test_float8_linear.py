from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.nn.models import TransformerConfig, TransformerLM
from torchnitro.precision import Float8Config, Float8Linear, scaled_mm_available, sqnr, to_float8_
from torchnitro.precision.fp8 import E4M3, E5M2


def _e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the e4m3 grid at ``scale`` and scaled back, in fp32."""
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("shape", [(4, 32, 128), (5, 7, 48)])
def test_output_and_grads_close_to_fp32(scaling, shape):
    torch.manual_seed(0)
    ref = nn.Linear(shape[-1], 96)
    f8 = Float8Linear.from_linear(nn.Linear(shape[-1], 96), Float8Config(scaling, backend="emulated"))
    f8.load_state_dict(ref.state_dict())
    x = torch.randn(shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):  # second call exercises the delayed history
        ya, yb = ref(xa), f8(xb)
    assert yb.shape == ya.shape
    # e4m3 keeps 3 mantissa bits: ~29 dB here. The upper bound fails a layer that stayed fp32 (> 100 dB)
    # or ran in bf16/fp16 (> 45 dB); the lower bound fails a broken cast.
    assert 18.0 <= sqnr(ya, yb) <= 36.0
    # the exact emulation: per-tensor scales 448/amax, both operands rounded to e4m3, product in fp32
    w = ref.weight.detach()
    expect = _e4m3(x, 448 / x.abs().amax()) @ _e4m3(w, 448 / w.abs().amax()).T + ref.bias.detach()
    torch.testing.assert_close(yb.detach(), expect, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert 18.0 <= sqnr(xa.grad, xb.grad) <= 32.0  # e5m2 gradients: 2 mantissa bits, ~24.5 dB here
    assert 18.0 <= sqnr(ref.weight.grad, f8.weight.grad) <= 32.0
    torch.testing.assert_close(f8.bias.grad, ref.bias.grad, rtol=0, atol=0)


def test_to_float8_swaps_and_shares_parameters():
    m = TransformerLM(TransformerConfig(vocab_size=128, dim=64, n_layers=2))
    before = {n: p for n, p in m.named_parameters()}
    to_float8_(m, "delayed")
    assert isinstance(m.blocks[0].attn.wq, Float8Linear) and isinstance(m.blocks[1].mlp.w2, Float8Linear)
    assert type(m.lm_head) is nn.Linear  # skipped: output head stays high precision
    assert m.lm_head.weight is m.embed.weight  # tie intact
    after = dict(m.named_parameters())
    assert set(after) == set(before) and all(after[n] is before[n] for n in before)
    x = torch.randint(0, 128, (2, 16))
    out = m(x)
    nn.functional.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None for p in m.parameters())


def test_fp8_training_tracks_fp32_loss():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, dim=64, n_layers=2, max_seq_len=32)
    a, b = TransformerLM(cfg), TransformerLM(cfg)
    b.load_state_dict(a.state_dict())
    to_float8_(b, "dynamic")
    oa, ob = torch.optim.AdamW(a.parameters(), 3e-3), torch.optim.AdamW(b.parameters(), 3e-3)
    x = torch.randint(0, 64, (4, 32))
    losses = {"a": [], "b": []}
    for _ in range(8):
        for k, m, o in (("a", a, oa), ("b", b, ob)):
            loss = nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            losses[k].append(loss.item())
    assert losses["b"][-1] < losses["b"][0] * 0.9  # it learns
    assert abs(losses["b"][-1] - losses["a"][-1]) < 0.1 * losses["a"][-1]


def test_bad_input_and_backend_errors():
    with pytest.raises(InputError, match="nn.Module"):
        to_float8_("model")  # type: ignore[arg-type]
    if not scaled_mm_available():
        with pytest.raises(BackendUnavailableError, match="8.9"):
            Float8Linear(32, 32, config=Float8Config(backend="scaled_mm"))
        with pytest.raises(BackendUnavailableError):
            to_float8_(nn.Sequential(nn.Linear(16, 16)), config=Float8Config(backend="torchao"))


@pytest.mark.gpu
def test_scaled_mm_matches_emulated_on_gpu():
    if not scaled_mm_available():
        pytest.skip("GPU without fp8 tensor cores (capability < 8.9)")
    torch.manual_seed(0)
    lin = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    hw = Float8Linear.from_linear(lin, Float8Config(backend="scaled_mm"))
    emu = Float8Linear.from_linear(lin, Float8Config(backend="emulated"))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    y_hw, y_emu = hw(x), emu(x)
    assert sqnr(y_emu.float(), y_hw.float()) >= 30.0
    assert sqnr(lin(x).float(), y_hw.float()) >= 18.0


def test_fused_dynamic_cast_path_matches_the_torch_path(monkeypatch):
    """Float8Linear's Triton cast (interpreted here) gives the same outputs and grads as the torch cast."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    g = torch.randn(2, 16, 48)
    results = []
    for env in ("reference", "triton"):
        monkeypatch.setenv("TORCHNITRO_KERNELS", env)
        monkeypatch.setenv("TRITON_INTERPRET", "1" if env == "triton" else "0")
        torch.manual_seed(1)
        layer = Float8Linear(64, 48, config=Float8Config("dynamic", backend="emulated"))
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        results.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad, layer.scale_x.scale.clone()))
    for a, b in zip(*results):  # same fp8 operands; fp32 matmul summation order may differ by an ulp
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_dynamic_cast_matches_the_scaled_cast(dtype):
    from torchnitro.precision.float8_linear import _dynamic_cast
    from torchnitro.precision.fp8 import amax_to_scale, cast_to_fp8

    for x in (torch.randn(5, 123) * 7, torch.zeros(4, 16)):
        q, scale, inv = _dynamic_cast(x, dtype, margin=1)
        ref_scale = amax_to_scale(x.abs().amax(), dtype, 1)
        assert torch.equal(scale, ref_scale) and torch.equal(inv, ref_scale.reciprocal())
        assert torch.equal(q.float(), cast_to_fp8(x, ref_scale, dtype).float())


def test_dynamic_path_compiles_without_graph_breaks():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
    to_float8_(model, skip=())
    x = torch.randn(2, 8, 32, requires_grad=True)
    model(x).sum().backward()
    ref = (x.grad.clone(), model[0].weight.grad.clone())
    x.grad = None
    model.zero_grad()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: model(t).sum(), backend=counter, fullgraph=True)  # a break raises here
    compiled(x).backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(x.grad, ref[0])
    torch.testing.assert_close(model[0].weight.grad, ref[1])


@pytest.mark.gpu
def test_compiled_scaled_mm_path_has_no_graph_breaks_and_matches_eager():
    if not scaled_mm_available():
        pytest.skip("GPU without fp8 tensor cores (capability < 8.9)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = to_float8_(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().bfloat16(), skip=())
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().sum().backward()
    ref = (x.grad.clone(), model[0].weight.grad.clone())
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(lambda t: model(t).float().sum(), fullgraph=True)  # a graph break raises here
    compiled(x).backward()
    assert sqnr(ref[0].float(), x.grad.float()) >= 25.0
    assert sqnr(ref[1].float(), model[0].weight.grad.float()) >= 25.0
