"""The planner's per-rank peak memory against the allocator's measured peak of a real training step
(``distributed.measure``), on small layouts: FSDP and DDP on the fake process group in a fresh process each,
a 2-stage pipeline on two real gloo ranks. Plus the peak bookkeeping on a synthetic allocation log."""

from __future__ import annotations

import json

import pytest

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.measure import _freed_by_call_end, _live, _unseen_frees, measure_isolated, measure_ranks
from torchnitro.distributed.plan import rank_memory
from torchnitro.nn.models import TransformerConfig
from tests.distributed.spawn import run_ranks

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


def test_a_block_made_inside_a_collective_call_without_a_recorded_free_ends_with_the_call():
    calls = [(100, 200)]
    allocs = [(50, 10, 0xA), (110, 20, 0xB), (120, 30, 0xC), (150, -30, 0xC), (300, 5, 0xD)]
    # B (the backend's copy) has no free: it ends at 200; A and D were made outside a call and are left alone
    assert _freed_by_call_end(allocs, calls) == sorted(allocs + [(200, -20, 0xB)])
    # its address came back inside the call: the free goes just before that allocation
    back = [(110, 20, 0xB), (150, 8, 0xB)]
    assert _freed_by_call_end(back, calls) == [(110, 20, 0xB), (149, -20, 0xB), (150, 8, 0xB), (200, -8, 0xB)]


def test_live_bytes_end_a_block_whose_free_went_unrecorded_at_its_address_reuse():
    marks = {"nitro.start": 10, "nitro.forward_end": 20, "nitro.backward_end": 30, "nitro.end": 40}
    # A's free happened on a thread the profiler does not see: its address comes back without one
    allocs = [(11, 100, 0xA), (12, 50, 0xB), (13, -50, 0xB), (21, 100, 0xA), (22, 30, 0xC), (31, -100, 0xA)]
    assert _unseen_frees(allocs) == 100
    assert _live(allocs, marks) == (150, "forward", 0, 100)  # 100 + 30 at most after the reuse, not 230


@pytest.mark.timeout(60)
def test_measured_collectives_return_after_gloo_lets_go_of_their_tensors():
    """gloo's worker thread holds a collective's tensors for a moment after the call returns (about one call in
    five on 2 ranks here); a tensor it frees is a free the profiler never records. Under measure's wrapper no
    call returns before the worker lets go, sums stay right, and async callers (FSDP) still get a work object.
    gloo's reduce-scatter also copies its input into the work object: without ending those copies at the call's
    end, 125 calls left 160 KB-1.7 MB counted live; at most one 32 KB input may be left (the profiler's own
    rare lost free, see measure.py)."""
    outs = run_ranks("released.py", 2, "500", "1", timeout=50)
    for out in outs:
        r = json.loads(out.strip().splitlines()[-1])
        assert (r["held"], r["sums_ok"], r["async_ok"]) == (0, True, True), r
        assert 0 <= r["rs_left"] <= 2 * 4096 * 4, r


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

    Every rank, the planner alone: one replica of a stage used to measure one stage-gradient block above its
    twin, at random (-14.6% in a CI run, -8.5% in results/distributed_memory.md): the previous step's flat
    all-reduce buffer, freed by gloo's worker thread, a free the profiler did not record (its address was
    allocated again in the next step's forward); measure.py now waits for the worker to let go."""
    cfg = ParallelConfig(pp=2, dp_replicate=2, microbatches=2)
    runs = measure_ranks(MODEL, cfg, batch=2 * PER_RANK, seq=SEQ, timeout=140)
    assert sorted(m.pp_rank for m in runs) == [0, 0, 1, 1]
    for m in runs:
        planned = _planned(cfg, m)
        err = (planned - m.peak) / m.peak
        assert abs(err) <= 0.05, f"rank {m.rank}: planned {planned}, measured {m.peak} ({err:+.2%})"


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
