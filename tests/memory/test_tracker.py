from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchnitro.errors import InputError
from torchnitro.memory import track


def _linear_step(in_f: int = 64, out_f: int = 32, batch: int = 8):
    lin = nn.Linear(in_f, out_f)
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    x = torch.randn(batch, in_f)
    return lin, opt, x


def test_single_linear_exact_bytes():
    lin, opt, x = _linear_step()
    param_bytes = (64 * 32 + 32) * 4
    with track(lin, opt) as t:
        loss = lin(x).sum()
        loss.backward()
        opt.step()
    r = t.report()
    assert r.baseline_bytes == param_bytes
    assert r.peak.by_category["parameters"] == param_bytes
    assert r.per_phase["backward"].by_category["gradients"] == param_bytes
    # Adam: exp_avg + exp_avg_sq per parameter, plus one fp32 step counter per tensor
    assert r.per_phase["optimizer"].by_category["optimizer_state"] == 2 * param_bytes + 2 * 4
    assert r.per_phase["forward"].by_category["inputs"] == x.numel() * 4  # x: seen as an op input
    assert r.final_bytes == param_bytes * 4 + 8 + 4 + x.numel() * 4  # params, grads, state, loss, x


def test_forward_activation_vs_temporary():
    lin, opt, x = _linear_step(batch=16)
    with track(lin) as t:
        y = lin(x)  # (16, 32) kept by the caller
        z = (y * 2).sum()  # y*2 is a temporary freed inside forward
        del z
    r = t.report()
    assert r.per_phase["forward"].by_category["activations"] == 16 * 32 * 4  # y alive at the end
    # peak: when the sum (4 B) is made, y*2 is still alive; both are freed before the block ends
    assert r.per_phase["forward"].by_category["temporaries"] == 16 * 32 * 4 + 4
    assert y.shape == (16, 32)


def test_views_count_once_and_frees_are_seen():
    with track() as t:
        a = torch.zeros(1000)
        v = a.view(10, 100)
        v2 = a[10:20]
        del a, v, v2
        b = torch.zeros(500)
    assert t.report().peak.bytes == 4000
    assert t.live_bytes == 2000
    del b


def test_steady_state_state_counted_from_start():
    lin, opt, x = _linear_step()
    lin(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track(lin, opt) as t:
        pass
    pb = (64 * 32 + 32) * 4
    assert t.report().baseline_bytes == pb + 2 * pb + 8


def test_explicit_phase_and_timeline(tmp_path):
    with track(timeline=True) as t:
        with t.phase("load"):
            a = torch.ones(256)
        b = torch.ones(128)
    r = t.report()
    assert r.per_phase["load"].bytes == 1024
    assert r.per_phase["forward"].bytes == 1024 + 512
    p = t.save_timeline(tmp_path / "trace.json")
    data = json.loads(p.read_text())
    assert [e["args"] for e in data["traceEvents"]][-1] == {"forward": 1536}
    j = json.loads(t.save_timeline(tmp_path / "t.json", format="json").read_text())
    assert j[0]["live_bytes"] == 1024
    del a, b


def test_bad_input():
    with pytest.raises(InputError, match="nn.Module"):
        track(model="not a model")  # type: ignore[arg-type]
    with track() as t:
        pass
    with pytest.raises(InputError, match="timeline=True"):
        t.save_timeline("x.json")
    with pytest.raises(InputError, match="round_to"):
        track(round_to=0)


def test_round_to_mimics_block_rounding():
    with track(round_to=512) as t:
        a = torch.ones(3)  # 12 bytes -> one 512-byte block
    assert t.peak_bytes == 512
    del a


@pytest.mark.gpu
def test_cuda_matches_max_memory_allocated():
    from torchnitro.nn.models import TransformerConfig, TransformerLM

    m = TransformerLM(TransformerConfig(vocab_size=2000, dim=128, n_layers=2, max_seq_len=256)).cuda()
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randint(0, 2000, (4, 128), device="cuda")

    def step():
        loss = nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with track(m, opt, round_to=512) as t:
        step()
    torch.cuda.synchronize()
    cuda_peak = torch.cuda.max_memory_allocated()
    tracked = t.report().peak.bytes + (base - t.report().baseline_bytes)
    assert abs(tracked - cuda_peak) / cuda_peak < 0.10


def test_peak_lists_owning_modules_and_nodes():
    m = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(64, 32)
    with track(m) as t:
        m(x).sum().backward()
    r = t.report()
    fwd = r.per_phase["forward"].by_owner
    assert fwd["0"] == 64 * 256 * 4 and fwd["1"] == 64 * 256 * 4  # Linear output, GELU output
    assert any(k.endswith("Backward0") for k in r.per_phase["backward"].by_owner)

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with track(m) as t2:
        with pytest.raises(RuntimeError):
            Boom()(x)
        m(x)
    assert t2._module_stack == []  # the failing module did not leave a stale entry
