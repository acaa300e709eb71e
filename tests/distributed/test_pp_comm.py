"""Bytes per collective of pipeline layouts, counted on real gloo ranks, equal the planner's (``comm.collectives``):
the schedule's sends, the tied embedding's all-reduce, PP x DDP's flat all-reduce over the replicas, and PP x FSDP's
gathers (one per group in backward: the schedule keeps the parameters unsharded across the backward micro-batches).

The 4-rank layouts are counted in the session's group of 4 ranks (``COMM_FOUR``, the fixture ``ranks``, with
``pp_comm.count_step`` as ``check_pipeline_comm``'s ranks run it); ``check_pipeline_comm`` itself, which starts
its own ranks, runs on the 2-rank pipeline."""

from __future__ import annotations

import json

import pytest

from tests.distributed.common import COMM_FOUR, COMM_MODEL
from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.pp_comm import LOSS_KEY, RankComm, _from_json, check_pipeline_comm
from torchnitro.nn.models import TransformerConfig

MODEL = TransformerConfig(**COMM_MODEL)


def _check(ranks: list[RankComm], cfg: ParallelConfig) -> None:
    assert [r.rank for r in ranks] == list(range(cfg.world_size))
    for r in ranks:
        assert r.counted.get(("send", "pp"), (0, 0))[1] > 0, f"rank {r.rank}: no send counted"
        assert LOSS_KEY in r.counted  # the logging broadcast is seen, and kept out of the comparison
        assert r.error == 0.0, f"rank {r.rank}: counted {r.counted} planned {r.predicted}"
        if cfg.dp_shard > 1:  # forward: one gather per group and micro-batch; backward: one per group
            calls = r.counted[("all_gather", "dp_shard")][0]
            groups = r.counted[("reduce_scatter", "dp_shard")][0]
            assert calls == groups * (cfg.n_microbatches + 1)


@pytest.mark.parametrize("name", list(COMM_FOUR))
def test_counted_bytes_equal_planned_on_gloo(name, ranks):
    counted = [_from_json(d) for d in json.loads((ranks / f"{name}.json").read_text())]
    _check(counted, ParallelConfig(**COMM_FOUR[name]))


def test_check_pipeline_comm_starts_its_ranks_and_counts_the_plain_pipeline():
    cfg = ParallelConfig(pp=2)
    _check(check_pipeline_comm(MODEL, cfg, timeout=150), cfg)


def test_not_a_pipeline_is_refused():
    with pytest.raises(ValueError, match="received pp=1"):
        check_pipeline_comm(MODEL, ParallelConfig(dp_shard=2))
