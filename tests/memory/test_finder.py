from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchnitro.errors import BudgetError, InputError, OutOfMemoryError
from torchnitro.memory import FinderConfig, find_batch_size, plan
from torchnitro.nn.models import TransformerConfig

from ._steps import lm_step


@pytest.fixture
def no_collect(monkeypatch):
    """``FakeStep`` allocates nothing, so the finder's ``gc.collect()`` after each trial (``finder._free``) frees
    nothing: it only costs time, more the longer the test process has run (a whole suite's objects to walk)."""
    import torchnitro.memory.finder as finder

    monkeypatch.setattr(finder, "_free", lambda: None)


class FakeStep:
    """Raises an injected OOM above ``limit``, like accelerate's and Lightning's finder tests."""

    def __init__(self, limit: int, exc: BaseException | None = None):
        self.limit, self.calls = limit, []
        self.exc = exc

    def __call__(self, b: int) -> None:
        self.calls.append(b)
        if b > self.limit:
            raise self.exc or OutOfMemoryError(f"injected OOM at batch {b}")


def test_power_mode_sequence(no_collect):
    step = FakeStep(limit=40)
    r = find_batch_size(step, FinderConfig(mode="power", max_val=1024, steps_per_trial=1))
    assert [t.batch_size for t in r.trials] == [1, 2, 4, 8, 16, 32, 64]
    assert r.batch_size == 32 and [t.fits for t in r.trials][-1] is False


@pytest.mark.parametrize("limit", [1, 37, 100, 777, 4096])
def test_binsearch_within_margin_and_trial_bound(limit, no_collect):
    step = FakeStep(limit)
    r = find_batch_size(step, FinderConfig(mode="binsearch", margin=0.05, max_val=4096, steps_per_trial=1))
    assert r.batch_size <= limit
    assert limit - r.batch_size <= max(1, 0.05 * r.batch_size)
    assert r.n_trials <= 2 * math.log2(4096)


def test_starts_from_estimate_and_takes_fewer_trials(no_collect):
    step = FakeStep(limit=900)
    r = find_batch_size(step, FinderConfig(init_val=850, margin=0.05, max_val=4096, steps_per_trial=1))
    assert r.trials[0].batch_size == 850 and r.n_trials <= 6
    assert 900 - r.batch_size <= 0.05 * r.batch_size


def test_runtime_error_oom_message_and_custom_detector(no_collect):
    step = FakeStep(10, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert find_batch_size(step, FinderConfig(mode="power", steps_per_trial=1)).batch_size == 8
    step2 = FakeStep(10, ValueError("my allocator said no"))
    r = find_batch_size(step2, FinderConfig(mode="power", steps_per_trial=1), is_oom=lambda e: isinstance(e, ValueError))
    assert r.batch_size == 8


def test_other_errors_propagate_and_state_is_restored():
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0, momentum=0.9)
    before = {k: v.clone() for k, v in lin.state_dict().items()}

    def step(b: int) -> None:
        lin(torch.randn(b, 4)).sum().backward()
        opt.step()
        if b > 4:
            raise KeyError("a bug in the step, not an OOM")

    with pytest.raises(KeyError):
        find_batch_size(step, FinderConfig(mode="power"), model=lin, optimizer=opt)
    for k, v in lin.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert opt.state_dict()["state"] == {} and all(p.grad is None for p in lin.parameters())


def test_budget_on_cpu_uses_tracker_and_planner_start():
    cfg = TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    model, opt, _ = lm_step(cfg, 1, 32)
    x_all = torch.randint(0, cfg.vocab_size, (64, 32))

    def step(b: int) -> None:
        x = x_all[:b]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    budget = plan(cfg, batch=12, seq=32).peak_bytes
    est = lambda b: plan(cfg, batch=b, seq=32).peak_bytes  # noqa: E731
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = find_batch_size(step, FinderConfig(budget_bytes=budget, max_val=64), estimate=est, model=model, optimizer=opt)
    assert r.start == 12
    assert all((t.peak_bytes or 0) <= budget for t in r.trials if t.fits)
    assert all((t.peak_bytes or 0) > budget for t in r.trials if not t.fits)
    assert 11 <= r.batch_size <= 13  # the planner is within a few percent of the tracker
    assert r.n_trials <= 4
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_throughput_mode_returns_a_measured_batch(no_collect):
    step = FakeStep(limit=16)
    r = find_batch_size(step, FinderConfig(mode="throughput", max_val=64, steps_per_trial=1))
    assert r.max_fitting == 16
    assert set(r.throughput) == {1, 2, 4, 8, 16} and r.batch_size in r.throughput
    assert "throughput" in r.table()


def test_bad_input(no_collect):
    big = nn.Linear(1000, 1000)
    with pytest.raises(BudgetError, match="smaller than the model"):
        find_batch_size(FakeStep(4), FinderConfig(budget_bytes=1000), model=big)
    cfg = TransformerConfig(vocab_size=256, dim=64, n_layers=2, max_seq_len=32)
    with pytest.raises(BudgetError, match="batch 1"):
        find_batch_size(FakeStep(4), FinderConfig(budget_bytes=1000), estimate=lambda b: plan(cfg, batch=b, seq=32).peak_bytes)
    with pytest.raises(InputError, match="mode"):
        FinderConfig(mode="linear")
    with pytest.raises(InputError, match="margin"):
        FinderConfig(margin=2)
    with pytest.raises(InputError, match="received dict, expected a memory.FinderConfig"):
        find_batch_size(FakeStep(4), {"mode": "power"})
    with pytest.raises(BudgetError, match="batch size 1 does not fit"):
        find_batch_size(FakeStep(0), FinderConfig(steps_per_trial=1))


@pytest.mark.gpu
def test_budget_on_cuda_counts_only_the_step_not_foreign_allocations():
    cfg = TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    model, opt, _ = lm_step(cfg, 1, 32)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x_all = torch.randint(0, cfg.vocab_size, (64, 32), device="cuda")

    def step(b: int) -> None:
        x = x_all[:b]
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1)  # create the cuBLAS workspace and optimizer state outside the trials
    budget = plan(cfg, batch=12, seq=32).peak_bytes
    alone = find_batch_size(step, FinderConfig(budget_bytes=budget, max_val=64, margin=0.05), model=model, optimizer=opt)
    hog = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # held by someone else in the process
    crowded = find_batch_size(step, FinderConfig(budget_bytes=budget, max_val=64, margin=0.05), model=model, optimizer=opt)
    del hog
    assert all(t.peak_bytes is not None and t.peak_bytes <= budget for t in crowded.trials if t.fits)
    assert any(not t.fits for t in crowded.trials)  # the budget binds below max_val
    assert abs(crowded.batch_size - alone.batch_size) <= max(1, 0.05 * alone.batch_size)
    assert 6 <= alone.batch_size <= 24  # allocator peak near the planner's estimate for batch 12
