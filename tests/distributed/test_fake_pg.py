"""32-rank layouts in one process on PyTorch's fake process group: every parameter's global and local shape and
placements, the state bytes the rank holds, and the bytes of every collective of one step, against the
planner (``validate.check_layout``). One mesh shape per test: DTensor's dispatch cache keys on the mesh shape.
"""

from __future__ import annotations

import math

import pytest

from torchnitro.distributed import ParallelConfig
from torchnitro.distributed.validate import check_layout
from torchnitro.nn.models import TransformerConfig

# 100 vocab rows and 160 MLP rows: uneven FSDP shards at 32 ranks (the last ranks hold fewer or no rows)
MODEL = TransformerConfig(vocab_size=100, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=160, max_seq_len=32)


def _check(cfg: ParallelConfig, rank: int):
    c = check_layout(MODEL, cfg, rank=rank)
    assert c.measured == c.predicted, f"{cfg.degrees} rank {rank}: measured {c.measured}, planned {c.predicted}"
    return c


def test_fsdp_32_last_rank_shapes_bytes_and_collectives():
    c = _check(ParallelConfig(dp_shard=32), rank=31)
    shape, local, placements = c.placements["embed.weight"].split("|")
    assert shape == "(100, 64)" and local == "(0, 64)" and "Shard(dim=0)" in placements  # 4 rows each: none left
    assert c.placements["blocks.0.mlp.w1.weight"].startswith("(160, 64)|(5, 64)|")
    assert c.comm_counted == c.comm_predicted
    # forward + backward all-gather of the root and 4 blocks, one reduce-scatter each, 32 padded shards
    calls, nbytes = c.comm_counted[("all_gather", "dp_shard")]
    assert calls == 10 and c.comm_counted[("reduce_scatter", "dp_shard")][0] == 5
    assert nbytes % (32 * 4) == 0


def test_hsdp_4x4_tp2_middle_rank():
    c = _check(ParallelConfig(dp_replicate=4, dp_shard=4, tp=2), rank=17)
    shape, local, placements = c.placements["blocks.2.attn.wq.weight"].split("|")
    assert shape == "(64, 64)" and local == f"({64 // 2 // 4}, 64)"  # TP rows / 2, then FSDP rows / 4
    assert "Replicate()" in placements  # the dp_replicate dim
    assert c.comm_counted == c.comm_predicted
    kinds = {k for k, _ in c.comm_counted}
    assert kinds == {"all_gather", "reduce_scatter", "all_reduce"}
    assert c.comm_counted[("all_reduce", "tp")][0] == 7 * MODEL.n_layers  # 2 forward + 5 backward per block


def test_pipeline_2_by_fsdp_16_last_stage():
    cfg = ParallelConfig(pp=2, dp_shard=16)
    c = _check(cfg, rank=31)  # pp rank 1: blocks 2, 3, the final norm and its copy of the tied embedding
    assert set(c.placements) == {"embed.weight", "norm.weight"} | {
        n for n in c.placements if n.startswith(("blocks.2.", "blocks.3."))}
    assert not any(n.startswith(("blocks.0.", "blocks.1.")) for n in c.placements)
    assert c.measured.parameters == 4 * sum(math.ceil(r / 16) * k for r, k in
                                            [(100, 64), (64, 1)] + [(64, 64), (32, 64), (32, 64), (64, 64),
                                                                    (160, 64), (160, 64), (64, 160), (64, 1),
                                                                    (64, 1)] * 2)
