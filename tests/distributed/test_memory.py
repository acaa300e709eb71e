"""The planner's per-rank peak memory against the allocator's measured peak of a real training step
(``distributed.measure``), on small layouts: FSDP and DDP on the fake process group in a fresh process each,
a 2-stage pipeline on two real gloo ranks. Plus the peak bookkeeping on a synthetic allocation log."""

from __future__ import annotations

import pytest

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.measure import _live, measure_isolated, measure_ranks
from torchnitro.distributed.plan import rank_memory
from torchnitro.nn.models import TransformerConfig

# activations dominate the peak at 4 samples x 32 tokens per rank: an error in their model shows
MODEL = TransformerConfig(vocab_size=100, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=160, max_seq_len=32)
SEQ, PER_RANK = 32, 4


def _planned(cfg: ParallelConfig, m) -> int:
    return rank_memory(MODEL, cfg, batch=m.batch, seq=m.seq, pp_rank=m.pp_rank, dp_shard_index=m.dp_shard_index,
                       device="cpu").total


def test_live_bytes_peak_inside_the_window_only():
    marks = {"nitro.start": 10, "nitro.forward_end": 20, "nitro.backward_end": 30, "nitro.end": 40}
    allocs = [(1, 500), (2, -400),  # before the window: a larger transient peak (500) is not the step's
              (11, 50), (15, 30), (21, 70), (22, -30), (31, 5), (41, 1000)]
    peak, phase, start, forward_left = _live(allocs, marks)
    assert (peak, phase, start, forward_left) == (250, "backward", 100, 80)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout,rank", [(dict(dp_replicate=2), 1), (dict(dp_shard=4), 3)])
def test_data_parallel_peak_within_5_percent(layout, rank):
    cfg = ParallelConfig(**layout)
    m = measure_isolated(MODEL, cfg, rank=rank, batch=PER_RANK * cfg.world_size, seq=SEQ)
    planned = _planned(cfg, m)
    assert m.phase == "backward"  # gradients start at None: the peak is the backward's, not the optimizer's
    assert abs(planned - m.peak) / m.peak <= 0.05, f"{layout}: planned {planned}, measured {m.peak}"


@pytest.mark.timeout(90)
def test_pipeline_peak_within_5_percent_on_every_rank():
    cfg = ParallelConfig(pp=2, microbatches=2)
    runs = measure_ranks(MODEL, cfg, batch=PER_RANK, seq=SEQ, timeout=80)
    assert sorted(m.pp_rank for m in runs) == [0, 1]
    for m in runs:
        planned = _planned(cfg, m)
        assert abs(planned - m.peak) / m.peak <= 0.05, f"pp rank {m.pp_rank}: planned {planned}, measured {m.peak}"


@pytest.mark.timeout(150)
def test_pipeline_times_replicas_peak_within_5_percent():
    """PP x DDP has no DDP buckets (its replicas average in one flat all-reduce after the schedule): counting
    buckets as for DDP put the plan 13-15% over the measured peak here (8.8% on the benchmark's shapes).

    Some runs, one replica of a stage peaks one stage-gradient-sized block higher than its twin (-8.5% in one
    benchmark run, results/distributed_memory.md, -14.6% on these smaller shapes in a CI run; which replica
    varies; the previous step's flat all-reduce buffer, not modelled): so every rank's measured peak must lie
    within 5% of the plan, or of the plan plus that one block, and per stage the closer replica within 5%."""
    cfg = ParallelConfig(pp=2, dp_replicate=2, microbatches=2)
    runs = measure_ranks(MODEL, cfg, batch=2 * PER_RANK, seq=SEQ, timeout=140)
    assert sorted(m.pp_rank for m in runs) == [0, 0, 1, 1]
    errors: dict[int, list[float]] = {}
    for m in runs:
        plan = rank_memory(MODEL, cfg, batch=m.batch, seq=m.seq, pp_rank=m.pp_rank,
                           dp_shard_index=m.dp_shard_index, device="cpu")
        planned, block = plan.total, plan.gradients
        err = (planned - m.peak) / m.peak
        assert planned <= 1.05 * m.peak and m.peak <= 1.05 * (planned + block), \
            f"rank {m.rank}: planned {planned} (+ a gradient block {block}), measured {m.peak} ({err:+.2%})"
        errors.setdefault(m.pp_rank, []).append(abs(err))
    assert all(min(e) <= 0.05 for e in errors.values()), errors


def test_peak_terms_add_up_and_follow_the_layout():
    fsdp = rank_memory(MODEL, ParallelConfig(dp_shard=4), batch=16, seq=SEQ, device="cpu")
    keep = rank_memory(MODEL, ParallelConfig(dp_shard=4, reshard_after_forward=False), batch=16, seq=SEQ, device="cpu")
    blocks = rank_memory(MODEL, ParallelConfig(dp_shard=4, checkpointing="blocks"), batch=16, seq=SEQ, device="cpu")
    assert fsdp.total == (fsdp.parameters + fsdp.optimizer_state + fsdp.live_gradients + fsdp.activations
                          + fsdp.comm_buffers + fsdp.temporaries)
    assert keep.comm_buffers > fsdp.comm_buffers  # every block stays gathered from forward to backward
    assert blocks.stored < fsdp.stored and blocks.temporaries > fsdp.temporaries  # recompute in backward
    # the last stage of 1F1B holds one micro-batch at every backward: the later ones, with the gradients, peak
    last = rank_memory(MODEL, ParallelConfig(pp=2, microbatches=4), batch=4, seq=SEQ, pp_rank=1, device="cpu")
    assert last.live_gradients == last.gradients > 0
