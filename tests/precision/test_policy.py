from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from torchnitro.errors import InputError
from torchnitro.hardware import hardware_info
from torchnitro.precision import TrainStep, choose_policy


def _hw(**kw):
    return dataclasses.replace(hardware_info(), **kw)


def test_auto_policy_by_hardware():
    assert choose_policy("auto", "cpu", _hw(cpu_flags=("avx512_bf16", "avx512f"))).name == "bf16"
    assert choose_policy("auto", "cpu", _hw(cpu_flags=("amx_bf16",))).name == "bf16"
    p = choose_policy("auto", "cpu", _hw(cpu_flags=("avx2",)))
    assert p.name == "fp32" and not p.grad_scaler and "avx512_bf16" in p.reason
    assert choose_policy("auto", "cuda", _hw(gpu_capability=(9, 0))).name == "bf16"
    old = choose_policy("auto", "cuda", _hw(gpu_capability=(7, 5)))
    assert old.name == "fp16" and old.grad_scaler and "7.5" in old.reason
    assert choose_policy("fp16", "cpu").grad_scaler


def test_bad_policy():
    with pytest.raises(InputError, match="auto"):
        choose_policy("int4")
    with pytest.raises(InputError, match="nn.Module"):
        TrainStep("m", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_train_step_learns_and_reports(policy):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    seen = []  # the dtype each Linear's matmul produced: a policy that ignores its dtype shows fp32 here
    for lin in (m[0], m[2]):
        lin.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    step = TrainStep(m, torch.optim.AdamW(m.parameters(), 1e-2), policy, max_grad_norm=1.0)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    losses = [step(x, target=y) for _ in range(15)]
    assert losses[-1] < losses[0]
    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[policy]
    assert seen == [want] * 30, set(seen)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # master weights stay fp32
    r = step.report()
    assert r["policy"] == policy and r["steps"] == 15 and r["grad_scaler"] == (policy == "fp16")
    assert step.last_grad_norm is not None


def test_fp16_scaler_skips_overflow_step():
    m = nn.Linear(4, 1)
    step = TrainStep(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp16", loss_fn=lambda o, t: (o * t).sum())
    w = m.weight.detach().clone()
    step(torch.ones(2, 4), target=torch.tensor(float("inf")))
    assert step.skipped == 1 and step.report()["loss_scale"] < 2.0 ** 16
    torch.testing.assert_close(m.weight.detach(), w)  # the overflowed step was not applied
