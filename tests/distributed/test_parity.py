"""DDP, FSDP2, HSDP, TP and FSDP+TP on real gloo ranks against one process on the whole batch,
and exact evaluation through the sharded loader on the same meshes.

One group of ranks per world size runs every scenario in turn (the session fixture ``ranks`` of
conftest.py), so the suite pays for process start-up twice, not once per strategy. fp32: loss and
every gradient within 1e-6 (norm-relative, per tensor); the fp16-compressed DDP hook within fp16's
precision. Pipelines run in the same groups; test_pipeline.py checks them.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import FOUR, TWO, tiny_lm, tokens, two_steps
from torchnitro.distributed.parity import compare, full_tensors

TOL = {"ddp_fp16": 2e-3, "fsdp_bf16": 3e-2}


@pytest.fixture(scope="module")
def reference():
    return two_steps(tiny_lm(), tokens(), grads=lambda m: full_tensors(m, grads=True))


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_loss_and_grads_match_single_process(name, ranks, reference):
    got = torch.load(ranks / f"{name}.pt", weights_only=True)
    want_losses, want_grads = reference
    tol = TOL.get(name, 1e-6)
    rep = compare(got["grads"], want_grads)
    assert rep.ok, f"{name}: parameters missing on one side: {rep.missing}"
    assert rep.rel_err <= tol, f"{name}: gradient of {rep.worst} off by {rep.rel_err:.2e} (relative), tolerance {tol}"
    for step, (a, b) in enumerate(zip(got["losses"], want_losses)):
        assert abs(a - b) <= tol * abs(b), f"{name}: loss at step {step} {a} != {b}"


@pytest.mark.parametrize("name", ["ddp", "tp", "hsdp", "fsdp_tp"])
def test_exact_evaluation_counts_every_sample_once(name, ranks):
    """13 samples over 2 or 4 data-parallel ranks (and tp copies that must not be counted twice)."""
    mean, count = torch.load(ranks / f"{name}.pt", weights_only=True)["eval"]
    assert count == 13
    assert mean == sum(i * i for i in range(13)) / 13


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "hsdp", "fsdp_tp"])
def test_global_grad_norm_over_mixed_dtensor_meshes(name, ranks, reference):
    """clip_grad_norm_ sums plain (replicated) and DTensor (TP, FSDP, both) gradients into the true norm."""
    want = torch.sqrt(sum(g.double().pow(2).sum() for g in reference[1].values())).item()
    got = torch.load(ranks / f"{name}.pt", weights_only=True)["grad_norm"]
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "hsdp", "fsdp_tp"])
def test_planned_state_bytes_per_rank_equal_measured(name, ranks):
    """Parameter, gradient and AdamW state bytes of every rank, predicted vs the storages the ranks hold."""
    from tests.distributed.common import MODEL
    from torchnitro.distributed import ParallelConfig
    from torchnitro.distributed.planner import rank_state_bytes
    from torchnitro.nn.models import TransformerConfig

    cfg = ParallelConfig(**{**TWO, **FOUR}[name])
    measured = torch.load(ranks / f"{name}.pt", weights_only=True)["memory"]
    for rank, got in enumerate(measured):
        shard_index = (rank // cfg.tp) % cfg.dp_shard  # mesh dims (dp_replicate, dp_shard, tp), tp innermost
        want = rank_state_bytes(TransformerConfig(**MODEL), cfg, dp_shard_index=shard_index)
        assert (got["parameters"], got["gradients"], got["optimizer_state"]) == \
            (want.parameters, want.gradients, want.optimizer_state), f"{name} rank {rank}"
