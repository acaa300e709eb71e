"""ParallelConfig: every user error is one ConfigError (or BackendUnavailableError) naming what was received."""

from __future__ import annotations

import pytest
import torch

from torchnitro.distributed import ParallelConfig, ShardedSampler
from torchnitro.distributed import init, shutdown
from torchnitro.errors import BackendUnavailableError, ConfigError, InputError
from torchnitro.nn.models import TransformerConfig


def test_strategy_names():
    assert ParallelConfig().strategy == "none"
    assert ParallelConfig(dp_replicate=2).strategy == "ddp"
    assert ParallelConfig(dp_shard=4).strategy == "fsdp"
    assert ParallelConfig(dp_replicate=2, dp_shard=4, tp=2).strategy == "hsdp"
    assert ParallelConfig(dp_replicate=2, dp_shard=4, tp=2).world_size == 16


def test_product_not_world_size():
    with pytest.raises(ConfigError, match=r"dp_shard=4.*= 8, but the job has world size 6"):
        ParallelConfig(dp_shard=4, tp=2).check_world(6)
    ParallelConfig(dp_shard=3, tp=2).check_world(6)


@pytest.mark.parametrize("kw, pattern", [
    (dict(tp=0), r"ParallelConfig.tp: received 0, expected an integer >= 1"),
    (dict(dp_shard=2.0), r"dp_shard: received 2.0"),
    (dict(pp=2, tp=2), r"pp=2 with tp=2: pipeline stages are not tensor-parallel yet"),
    (dict(pp=2, pp_schedule="interleaved1f1b"), r"stages_per_rank=1; set stages_per_rank >= 2"),
    (dict(pp=2, stages_per_rank=2), r"pp_schedule='1f1b' runs one stage per pp rank"),
    (dict(pp=2, pp_schedule="zb"), r"pp_schedule: received 'zb', expected one of gpipe, 1f1b, interleaved1f1b"),
    (dict(pp=2, microbatches=-1), r"microbatches: received -1"),
    (dict(mixed_precision="fp8"), r"received 'fp8', expected one of fp32, bf16, fp16"),
    (dict(checkpointing="all"), r"checkpointing: received 'all'"),
    (dict(dp_shard=2, comm_hook="fp16"), r"applies to DDP only, but this config is 'fsdp'"),
    (dict(dp_replicate=2, tp=2), r"DDP does not support.*Use dp_shard=2"),
    (dict(timeout_s=0), r"timeout_s: received 0"),
])
def test_bad_fields(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ParallelConfig(**kw)


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match=r"n_heads=6 is not divisible by 4"):
        ParallelConfig(tp=4).check_model(TransformerConfig(dim=96, n_heads=6))
    with pytest.raises(ConfigError, match=r"n_kv_heads=2 is not divisible by 4"):
        ParallelConfig(tp=4).check_model(TransformerConfig(dim=64, n_heads=8, n_kv_heads=2))
    ParallelConfig(tp=2).check_model(TransformerConfig(dim=64, n_heads=8, n_kv_heads=2))


def test_bf16_compression_needs_nccl():
    cfg = ParallelConfig(dp_replicate=2, comm_hook="bf16")
    with pytest.raises(BackendUnavailableError, match=r"only the NCCL backend.*backend is 'gloo'"):
        cfg.check_backend("gloo")
    cfg.check_backend("nccl")


def test_multi_rank_config_without_launcher(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match=r"needs 2 processes.*torchnitro launch --nproc 2"):
        init(ParallelConfig(dp_shard=2))


def test_single_process_init_needs_no_launcher(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    try:
        mesh = init(ParallelConfig())
        assert mesh.mesh_dim_names == ("dp_shard",) and mesh.size() == 1
        assert torch.distributed.get_world_size() == 1
    finally:
        shutdown()


@pytest.mark.parametrize("n, size", [(13, 4), (8, 2), (3, 4), (0, 2)])
def test_sharded_sampler_covers_every_index_once(n, size):
    shards = [list(ShardedSampler(n, r, size, shuffle=True, seed=3)) for r in range(size)]
    assert sorted(i for s in shards for i in s) == list(range(n))  # no padding, no duplicates
    assert [len(ShardedSampler(n, r, size)) for r in range(size)] == [len(s) for s in shards]
    trimmed = [list(ShardedSampler(n, r, size, drop_last=True)) for r in range(size)]
    assert len({len(s) for s in trimmed}) == 1 and sum(map(len, trimmed)) == n - n % size


def test_sharded_sampler_bad_rank():
    with pytest.raises(InputError, match=r"received rank=2 with size=2"):
        ShardedSampler(10, 2, 2)
