"""Pipeline parallelism: every schedule (GPipe, 1F1B, Interleaved1F1B; with checkpointing; PP x FSDP on 4 ranks)
against the unsplit 4-layer LM on the whole batch, on real gloo ranks (the session fixture ``ranks``).

fp32: both losses, every gradient of step 1 and every parameter after an SGD step within 1e-6
(norm-relative per tensor). A wrong micro-batch scaling is off by a factor of the micro-batch count, and
a missing sum of the tied embedding/head gradient leaves ``embed.weight`` far off; both fail here.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import PIPE_FOUR, PIPE_LAYERS, PIPE_TWO, tiny_lm, tokens, two_steps
from torchnitro.distributed import ParallelConfig, parallelize
from torchnitro.distributed.parity import compare, full_tensors
from torchnitro.distributed.pipeline import _split, stage_layers
from torchnitro.errors import ConfigError


@pytest.fixture(scope="module")
def reference():
    model = tiny_lm(PIPE_LAYERS)
    losses, grads = two_steps(model, tokens(), grads=lambda m: full_tensors(m, grads=True))
    return losses, grads, full_tensors(model)  # parameters after the SGD step


@pytest.mark.parametrize("name", [*PIPE_TWO, *PIPE_FOUR])
def test_schedule_matches_unsplit_model(name, ranks, reference):
    got = torch.load(ranks / f"{name}.pt", weights_only=True)
    want_losses, want_grads, want_params = reference
    for what, a, b in (("gradient", got["grads"], want_grads), ("parameter after SGD", got["params"], want_params)):
        rep = compare(a, b)
        assert rep.ok, f"{name}: {what}s missing on one side: {rep.missing}"
        assert rep.rel_err <= 1e-6, f"{name}: {what} of {rep.worst} off by {rep.rel_err:.2e} (relative)"
    for step, (a, b) in enumerate(zip(got["losses"], want_losses)):
        assert a == pytest.approx(b, rel=1e-6), f"{name}: loss at step {step}"
    assert got["copy_diff"] == 0.0  # the tied weight's copies on the first and last stage stay identical


def test_pipeline_checkpoint_loads_into_unsplit_model(ranks, tmp_path):
    """Stable names: DCP saved by the 2-stage pipeline loads into one unsplit model, bit for bit."""
    from torchnitro.distributed import ModelState, init, load, shutdown

    saved = torch.load(ranks / "pp_1f1b.pt", weights_only=True)["params"]
    torch.manual_seed(5)
    model = tiny_lm(PIPE_LAYERS)
    for p in model.parameters():
        torch.nn.init.normal_(p)  # nothing left of the initial weights
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    init(ParallelConfig())
    try:
        assert load({"train": ModelState(model, opt)}, ranks / "pp_1f1b-ckpt") == 1
    finally:
        shutdown()
    got = full_tensors(model)
    assert set(got) == set(saved)
    assert all(torch.equal(got[k], saved[k]) for k in got)
    assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize("layers, stages, sizes", [(4, 2, [2, 2]), (5, 3, [2, 2, 1]), (3, 3, [1, 1, 1])])
def test_stage_layers(layers, stages, sizes):
    got = stage_layers(layers, stages)
    assert [len(r) for r in got] == sizes and [i for r in got for i in r] == list(range(layers))


@pytest.mark.parametrize("kw", [dict(pp=2), dict(pp=3), dict(pp=2, pp_schedule="interleaved1f1b", stages_per_rank=2)])
def test_stages_chain_to_the_unsplit_model_under_its_names(kw):
    """One process: the stages of every pp rank, run in stage order, give the unsplit logits, and the ranks'
    containers together name every parameter exactly as the unsplit model does (DCP keys)."""
    cfg = ParallelConfig(**kw)
    model = tiny_lm(PIPE_LAYERS)
    x = tokens()[:, :-1]
    want = model(x)
    parts = [_split(model, cfg, r) for r in range(cfg.pp)]
    stages = sorted(((s, st) for r, (_, sts, _) in enumerate(parts) for s, st in zip(range(r, 99, cfg.pp), sts)),
                    key=lambda t: t[0])
    h = x
    for _, st in stages:
        h = st(h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    names = {n: p.shape for c, _, _ in parts for n, p in c.named_parameters()}
    assert names == {n: p.shape for n, p in model.named_parameters()}


def test_pipeline_errors():
    with pytest.raises(ConfigError, match=r"4 layers into pp \* stages_per_rank = 6 stages"):
        _split(tiny_lm(PIPE_LAYERS), ParallelConfig(pp=3, pp_schedule="interleaved1f1b", stages_per_rank=2), 0)
    with pytest.raises(ConfigError, match=r"call torchnitro.distributed.pipeline\(model, cfg, mesh\)"):
        parallelize(tiny_lm(), ParallelConfig(pp=2), mesh=None)
