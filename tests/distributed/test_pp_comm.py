"""Bytes per collective of pipeline layouts, counted on real gloo ranks (4 processes, one deadline), equal the
planner's (``comm.collectives``): the schedule's sends, the tied embedding's all-reduce, PP x DDP's flat
all-reduce over the replicas, and PP x FSDP's gathers (one per group in backward: the schedule keeps the
parameters unsharded across the backward micro-batches)."""

from __future__ import annotations

import pytest

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.pp_comm import LOSS_KEY, check_pipeline_comm
from torchnitro.nn.models import TransformerConfig

MODEL = TransformerConfig(vocab_size=100, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=160, max_seq_len=32)


@pytest.mark.parametrize("kw", [dict(pp=2, dp_replicate=2), dict(pp=2, dp_shard=2, microbatches=4)],
                         ids=["pp2-ddp2", "pp2-fsdp2-m4"])
def test_counted_bytes_equal_planned_on_gloo(kw):
    cfg = ParallelConfig(**kw)
    ranks = check_pipeline_comm(MODEL, cfg, timeout=150)
    assert [r.rank for r in ranks] == list(range(cfg.world_size))
    for r in ranks:
        assert r.counted.get(("send", "pp"), (0, 0))[1] > 0, f"rank {r.rank}: no send counted"
        assert LOSS_KEY in r.counted  # the logging broadcast is seen, and kept out of the comparison
        assert r.error == 0.0, f"rank {r.rank}: counted {r.counted} planned {r.predicted}"
        if cfg.dp_shard > 1:  # forward: one gather per group and micro-batch; backward: one per group
            calls = r.counted[("all_gather", "dp_shard")][0]
            groups = r.counted[("reduce_scatter", "dp_shard")][0]
            assert calls == groups * (cfg.n_microbatches + 1)


def test_not_a_pipeline_is_refused():
    with pytest.raises(ValueError, match="received pp=1"):
        check_pipeline_comm(MODEL, ParallelConfig(dp_shard=2))
