from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.autotune.analyze import Analysis, analyze, machine_roofline
from torchnitro.bench import TimingConfig
from torchnitro.errors import InputError


class ManualAttention(nn.Module):
    """matmul + softmax attention, odd dims, dropout: every finding at once."""

    def __init__(self, dim: int = 36):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, 64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        y = self.proj(torch.matmul(att, v))
        return self.drop(F.relu(self.ff(y)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)

    def forward(self, x):
        return self.bn2(self.conv2(F.relu(self.bn(self.conv(x)))))


def _kinds(a: Analysis) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in a.findings:
        out.setdefault(f.kind, []).append(f.message)
    return out


def test_flops_and_params_of_a_linear():
    m = nn.Linear(64, 128).eval()
    a = analyze(m, torch.randn(8, 64), measure_machine=False)
    assert a.parameters == 64 * 128 + 128
    assert a.parameter_bytes == a.parameters * 4
    assert a.flops == 2 * 8 * 64 * 128
    assert a.roofline_s is None and a.eager_s is None
    assert "alignment" not in _kinds(a)


def test_findings_manual_attention_dropout_training_alignment():
    m = ManualAttention().train()
    a = analyze(m, torch.randn(2, 10, 36), measure_machine=False)
    k = _kinds(a)
    assert "scaled_dot_product_attention" in k["attention"][0]
    assert any("not multiples of 8" in msg for msg in k["alignment"])  # 36 and 108
    assert any("Linear+activation" in msg for msg in k["fusion"])
    assert "training" in k and "dropout" in k
    clean = analyze(m.eval(), torch.randn(2, 10, 36), measure_machine=False)
    assert "training" not in _kinds(clean) and "dropout" not in _kinds(clean)


def test_sdpa_model_has_no_attention_finding_and_conv_bn_chains():
    from torchnitro.nn.zoo import get_builtin

    enc = get_builtin("encoder")
    a = analyze(enc.build(), enc.inputs(2, 16, 0), measure_machine=False)
    assert "attention" not in _kinds(a)
    c = analyze(ConvBN().eval(), torch.randn(1, 3, 8, 8), measure_machine=False)
    fusion = [f for f in c.findings if f.kind == "fusion"][0]
    assert fusion.message.startswith("2 Conv+BatchNorm pair(s) (1 followed by ReLU)")


def test_roofline_with_measured_machine():
    mr = machine_roofline("cpu")
    assert mr.peak_flops["float32"] > 1e8 and mr.bandwidth > 1e8
    assert machine_roofline("cpu") is mr  # cached per process
    m = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).eval()
    quick = TimingConfig().quick()
    a = analyze(m, torch.randn(64, 256), timing=quick)
    assert a.eager_s and a.eager_s > 0
    assert a.roofline_s == pytest.approx(max(a.compute_s, a.memory_s))
    assert a.compute_s == pytest.approx(a.flops / mr.peak_flops["float32"])
    assert a.gap == pytest.approx(a.eager_s / a.roofline_s)
    d = a.to_dict()
    assert d["bound"] in ("compute", "memory") and math.isfinite(d["gap"])
    md = a.to_markdown()
    assert "roofline" in md and "GFLOP" in md
    from rich.console import Console

    Console(file=open("/dev/null", "w")).print(a.rich())


def test_bad_inputs():
    with pytest.raises(InputError, match="expected a torch.nn.Module"):
        analyze(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="raised RuntimeError"):
        analyze(nn.Linear(4, 4), torch.randn(2, 5), measure_machine=False)
