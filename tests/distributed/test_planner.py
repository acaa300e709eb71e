"""The planner: per-rank state bytes (measured against real ranks in test_parity.py, on the fake process group in
test_fake_pg.py), collectives and their alpha-beta times, layouts ranked by plan-parallel."""

from __future__ import annotations

import math

import pytest

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.comm import Cluster, Collective, Link, collective_time, collectives, link_of
from torchnitro.distributed.plan import MODELS, explain, plan_parallel, rank_memory
from torchnitro.distributed.planner import rank_state_bytes, tp_local_shapes
from torchnitro.errors import ConfigError, InputError
from torchnitro.memory.planner import gradient_term, optimizer_state_term, parameter_terms, step_shape
from torchnitro.nn.models import TransformerConfig

MODEL = TransformerConfig(vocab_size=100, dim=48, n_layers=3, n_heads=6, n_kv_heads=3, ffn_dim=96, max_seq_len=64)


def test_one_replica_is_the_memory_planner():
    s = step_shape(MODEL, batch=1, seq=1)
    got = rank_state_bytes(MODEL, ParallelConfig(dp_replicate=4))
    assert got.parameters == parameter_terms(s)[0].bytes and got.gradients == gradient_term(s).bytes
    assert got.optimizer_state == optimizer_state_term(s, "adamw").bytes


@pytest.mark.parametrize("n", [3, 7])  # 100 vocab rows, 48-wide norms: uneven shards
def test_fsdp_shards_add_up_to_the_replica(n):
    whole = rank_state_bytes(MODEL, ParallelConfig())
    ranks = [rank_state_bytes(MODEL, ParallelConfig(dp_shard=n), dp_shard_index=i) for i in range(n)]
    assert len({r.parameters for r in ranks}) == 1 and ranks[0].parameters >= whole.parameters / n  # padded, equal
    counters = 4 * len(tp_local_shapes(MODEL, 1))
    moments = [r.optimizer_state - counters for r in ranks]
    assert sum(moments) == whole.optimizer_state - counters  # unpadded: every element once
    assert moments[-1] < moments[0]  # the last shard is short


def test_tp_splits_only_the_block_matrices():
    shapes = tp_local_shapes(MODEL, 3)
    assert shapes[0] == (100, 48)  # embedding (tied head) replicated
    assert (16, 48) in shapes and (8, 48) in shapes and (48, 16) in shapes  # wq, wk/wv, wo split by 3
    whole, tp = rank_state_bytes(MODEL, ParallelConfig()), rank_state_bytes(MODEL, ParallelConfig(tp=3))
    assert tp.parameters == 4 * sum(math.prod(s) for s in shapes) < whole.parameters


def test_bad_planner_input():
    with pytest.raises(InputError, match=r"dp_shard_index=2, expected 0 <= index < dp_shard=2"):
        rank_state_bytes(MODEL, ParallelConfig(dp_shard=2), dp_shard_index=2)
    with pytest.raises(ConfigError, match=r"n_heads=6 is not divisible by 4"):
        rank_state_bytes(MODEL, ParallelConfig(tp=4))


# --- plan-parallel: collectives, alpha-beta times, layouts -------------------------------------------------------



def test_ring_times():
    link = Link(bandwidth=1e9, alpha_s=1e-3)
    assert collective_time(Collective("all_reduce", "dp_shard", 4, 10**9, 1, "backward"), link) == \
        pytest.approx(2 * 3 * 1e-3 + 1.5)
    assert collective_time(Collective("all_gather", "dp_shard", 4, 10**9, 2, "forward"), link) == \
        pytest.approx(2 * (3e-3 + 0.75))
    assert collective_time(Collective("all_reduce", "tp", 1, 10**9, 5, "forward"), link) == 0.0


def test_links_follow_the_mesh_placement():
    cl = Cluster(gpus=32, gpus_per_node=8)
    cfg = ParallelConfig(dp_shard=4, tp=8)
    assert link_of("tp", cfg, cl) is cl.intra and link_of("dp_shard", cfg, cl) is cl.inter
    cfg = ParallelConfig(dp_replicate=8, dp_shard=4)
    assert link_of("dp_shard", cfg, cl) is cl.intra and link_of("dp_replicate", cfg, cl) is cl.inter


def test_collectives_per_strategy():
    whole = rank_state_bytes(MODEL, ParallelConfig()).parameters
    ddp = collectives(MODEL, ParallelConfig(dp_replicate=2), batch=4, seq=8)
    assert sum(c.bytes * c.count for c in ddp if c.kind == "all_reduce") == whole  # every gradient once, fp32
    fsdp = collectives(MODEL, ParallelConfig(dp_shard=2, mixed_precision="bf16"), batch=4, seq=8)
    gathers = [c for c in fsdp if c.kind == "all_gather"]
    assert len(gathers) == 2 * (1 + MODEL.n_layers) and all(c.bytes % 2 == 0 for c in gathers)
    rs = sum(c.bytes for c in fsdp if c.kind == "reduce_scatter")
    assert rs == 2 * sum(c.bytes for c in gathers if c.phase == "forward")  # fp32 reduction of bf16-gathered params
    tp = collectives(MODEL, ParallelConfig(tp=3), batch=4, seq=8)
    assert {(c.phase, c.count, c.bytes) for c in tp} == {("forward", 2 * 3, 4 * 8 * 48 * 4),
                                                         ("backward", 5 * 3, 4 * 8 * 48 * 4)}
    pp = collectives(MODEL, ParallelConfig(pp=3, microbatches=4), batch=8, seq=8, pp_rank=1)
    assert [(c.kind, c.count, c.bytes) for c in pp] == [("send", 4, 2 * 8 * 48 * 4), ("send", 4, 2 * 8 * 48 * 4)]


def test_pipeline_times_replicas_is_planned_with_an_exposed_all_reduce():
    """PP x DDP: listed among the layouts; one all-reduce of the rank's stage gradients after the schedule, all
    of it on the critical path (nothing left to overlap it with)."""
    from torchnitro.distributed.plan import enumerate_layouts, layout_name, step_time

    names = {layout_name(c) for c in enumerate_layouts(MODEL, 4, batch=8)}
    assert "pp2 x rep2 (1f1b, m2)" in names and "pp2 x shard2 (1f1b, m2) bf16" in names
    cfg = ParallelConfig(pp=2, dp_replicate=2)
    cols = collectives(MODEL, cfg, batch=8, seq=8, pp_rank=1)
    ar = [c for c in cols if c.dim == "dp_replicate"]
    assert [(c.kind, c.count, c.phase) for c in ar] == [("all_reduce", 1, "after_backward")]
    assert ar[0].bytes == rank_state_bytes(MODEL, cfg, pp_rank=1).gradients  # the stage's gradients, tied copy too
    cl = Cluster(gpus=4, flops=1e18)  # compute ~0: only an exposed all-reduce can make the step long
    t = step_time(MODEL, cfg, cl, batch=8, seq=8, dtype="fp32", pp_rank=1)
    assert t.exposed_dp_s == pytest.approx(t.dp_s) and t.dp_s == pytest.approx(collective_time(ar[0], cl.intra))
    assert t.total_s >= t.dp_s


def test_pipeline_ranks_hold_their_stages():
    cfg = ParallelConfig(pp=3)
    whole = rank_state_bytes(MODEL, ParallelConfig()).parameters
    per = [rank_state_bytes(MODEL, cfg, pp_rank=r).parameters for r in range(3)]
    assert sum(per) == whole + 4 * 100 * 48  # the last stage's copy of the tied embedding


def test_plan_ranks_fitting_layouts_by_speed():
    mc = TransformerConfig(**MODELS["llama3-8b"])
    cl = Cluster(gpus=8)
    rows = plan_parallel(mc, cl, batch=16, seq=4096, checkpointing=("none", "blocks"))
    fits = [r for r in rows if r.fits]
    assert fits and rows[:len(fits)] == fits
    assert [r.tokens_per_s_per_gpu for r in fits] == sorted((r.tokens_per_s_per_gpu for r in fits), reverse=True)
    names = {r.cfg.strategy for r in rows} | {"tp" for r in rows if r.cfg.tp > 1} | {"pp" for r in rows if r.cfg.pp > 1}
    assert {"ddp", "fsdp", "hsdp", "tp", "pp"} <= names
    ddp = next(r for r in rows if r.cfg.strategy == "ddp" and r.cfg.pp == 1)
    assert not ddp.fits  # 8B with AdamW does not fit 80 GB unsharded (PP x DDP holds half of it per rank)
    assert explain(rows, cl).startswith(rows[0].name)
    m = rank_memory(mc, ParallelConfig(dp_shard=8), batch=16, seq=4096)
    # the peak: gradients are made in backward as activations are freed, so only the live ones count
    assert m.total == (m.parameters + m.optimizer_state + m.live_gradients + m.activations + m.comm_buffers
                       + m.temporaries)


def test_quantities():
    from torchnitro.distributed.cli import parse_quantity

    assert parse_quantity("80GB", "x") == 80e9 and parse_quantity("400Gb/s", "x") == 50e9
    assert parse_quantity("989T", "x") == 989e12 and parse_quantity("16GiB", "x") == 16 * 2**30
    with pytest.raises(ConfigError, match=r"--ib: received 'fast'"):
        parse_quantity("fast", "--ib")
