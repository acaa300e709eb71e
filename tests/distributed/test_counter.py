"""The two sides of a collective comparison in one form, {(kind, mesh dim): (calls, bytes)}: what ``CommCounter``
counted, by mesh dim (``by_dim``), and what the planner lists (``comm.collective_totals``). Real counts on the fake
process group are in test_fake_pg.py, on gloo ranks in test_pp_comm.py."""

from __future__ import annotations

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.comm import collective_totals, collectives
from torchnitro.distributed.counter import CommCounter
from torchnitro.nn.models import TransformerConfig

MODEL = TransformerConfig(vocab_size=100, dim=48, n_layers=3, n_heads=6, n_kv_heads=3, ffn_dim=96, max_seq_len=64)


def test_by_dim_sums_the_groups_of_one_dim_and_keeps_unknown_groups():
    counter = CommCounter(track_modules=False)
    for (kind, group), (n, size) in {("all_reduce", "g1"): (2, 100), ("all_reduce", "g2"): (1, 30),
                                     ("send", "g1"): (4, 8), ("broadcast", "other"): (1, 4)}.items():
        counter.calls[(kind, group)] += n
        counter.bytes[(kind, group)] += size
    got = counter.by_dim({"g1": "pp", "g2": "pp"})  # two groups on one dim: a pipeline's tied-weight group
    assert got == {("all_reduce", "pp"): (3, 130), ("send", "pp"): (4, 8), ("broadcast", "other"): (1, 4)}


def test_collective_totals_sum_calls_and_bytes_per_kind_and_dim():
    cfg = ParallelConfig(pp=3, dp_shard=2, microbatches=4)
    cols = collectives(MODEL, cfg, batch=8, seq=8, pp_rank=1)
    totals = collective_totals(MODEL, cfg, batch=8, seq=8, pp_rank=1)
    assert set(totals) == {(c.kind, c.dim) for c in cols} and len(totals) >= 3
    for (kind, dim), (calls, nbytes) in totals.items():
        mine = [c for c in cols if (c.kind, c.dim) == (kind, dim)]
        assert calls == sum(c.count for c in mine) and nbytes == sum(c.bytes * c.count for c in mine)
