"""Per-rank state bytes (the planner's first part); measured against real ranks in test_parity.py."""

from __future__ import annotations

import math

import pytest

from torchnitro.distributed import ParallelConfig
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
