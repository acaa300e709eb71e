"""``ParallelConfig``: the one config every distributed verb reads, and its checks.

The degrees multiply to the world size: ``pp * dp_replicate * dp_shard * tp == world``. The mesh
dims are laid out outermost first in that order (torchtitan's layout): tensor parallelism, the
most communication-hungry, sits on the innermost dim, so its ranks are neighbours (one host).

Which strategy a config means:

===========================  =======================================================
dp_shard > 1                 FSDP2 ``fully_shard`` per block and on the root
dp_replicate > 1, dp_shard>1 HSDP: ``fully_shard`` on the 2-D (replicate, shard) mesh
dp_replicate > 1 only        DDP (bucket size and communication hook from the config)
tp > 1                       tensor parallelism (``parallelize_module``), composable with FSDP/HSDP
pp > 1                       pipeline parallelism (``torch.distributed.pipelining``): the layers are
                             split into stages, ``pp_schedule`` runs ``microbatches`` through them;
                             composes with FSDP/HSDP per stage, or with replicas (DDP's
                             role) averaged after each step; not with TP yet
===========================  =======================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchnitro.errors import BackendUnavailableError, ConfigError

__all__ = ["ParallelConfig", "MESH_DIMS", "PRECISIONS", "COMM_HOOKS", "CHECKPOINTING", "PP_SCHEDULES"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first
PRECISIONS = ("fp32", "bf16", "fp16")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
CHECKPOINTING = ("none", "blocks", "selective")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # data-parallel replicas (DDP alone, or the outer dim of HSDP)
    dp_shard: int = 1  # FSDP2 shard degree (the inner dim of HSDP)
    tp: int = 1  # tensor-parallel degree; must divide the attention heads
    pp: int = 1  # pipeline-parallel ranks (each holds stages_per_rank stages of consecutive layers)
    mixed_precision: str = "fp32"  # fp32, bf16, fp16: FSDP2 param dtype (reductions stay fp32)
    checkpointing: str = "none"  # activation checkpointing per block: none, blocks, selective
    comm_hook: str = "none"  # DDP gradient compression: none, fp16, bf16 (NCCL only), powersgd
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (PyTorch's default)
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (ZeRO-3); False: ZeRO-2
    prefetch: int = 1  # FSDP2: blocks to all-gather ahead in forward/backward (0 = PyTorch's implicit)
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved1f1b (the last needs stages_per_rank >= 2)
    microbatches: int = 0  # micro-batches per pipeline step; 0: pp * stages_per_rank (fills the pipeline)
    stages_per_rank: int = 1  # pipeline stages per pp rank ("virtual stages"; > 1 only with interleaved1f1b)
    timeout_s: float = 120.0  # process-group timeout: a dead peer is an error after this, not a 30-min hang

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def strategy(self) -> str:
        """A short name for the data-parallel part: none, ddp, fsdp, hsdp."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ParallelConfig.{name}: received {v!r}, expected an integer >= 1 "
                                  "(1 means this kind of parallelism is off).")
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("comm_hook", self.comm_hook, COMM_HOOKS)
        _choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        self._check_pipeline()
        if self.comm_hook != "none" and self.strategy != "ddp":
            raise ConfigError(f"ParallelConfig.comm_hook={self.comm_hook!r} applies to DDP only, but this config "
                              f"is {self.strategy!r} (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}); "
                              "FSDP/HSDP compress through mixed_precision instead. Set comm_hook='none'.")
        if self.strategy == "ddp" and self.tp > 1:
            raise ConfigError(f"dp_replicate={self.dp_replicate} with tp={self.tp} and dp_shard=1 would put DDP over "
                              "tensor-parallel (DTensor) parameters, which DDP does not support. Use "
                              f"dp_shard={self.dp_replicate} (FSDP2 + TP) or HSDP (dp_replicate and dp_shard > 1).")
        if self.timeout_s <= 0:
            raise ConfigError(f"ParallelConfig.timeout_s: received {self.timeout_s}, expected seconds > 0.")

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp * self.stages_per_rank

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def _check_pipeline(self) -> None:
        for name in ("microbatches", "stages_per_rank"):
            v, low = getattr(self, name), 0 if name == "microbatches" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"ParallelConfig.{name}: received {v!r}, expected an integer >= {low}.")
        interleaved = self.pp_schedule == "interleaved1f1b"
        if self.pp > 1 and interleaved and self.stages_per_rank < 2:
            raise ConfigError(f"pp_schedule='interleaved1f1b' runs several stages on each pp rank, but stages_per_rank="
                              f"{self.stages_per_rank}; set stages_per_rank >= 2, or use pp_schedule='1f1b'.")
        if self.pp > 1 and not interleaved and self.stages_per_rank != 1:
            raise ConfigError(f"pp_schedule={self.pp_schedule!r} runs one stage per pp rank, but stages_per_rank="
                              f"{self.stages_per_rank}; set stages_per_rank=1, or use pp_schedule='interleaved1f1b'.")
        if self.pp == 1:
            return
        if self.comm_hook != "none":
            raise ConfigError(f"pp={self.pp} with comm_hook={self.comm_hook!r}: a pipeline averages its replicas' "
                              "gradients with a plain all-reduce; use comm_hook='none' with pp > 1.")
        if self.tp > 1:
            raise ConfigError(f"pp={self.pp} with tp={self.tp}: pipeline stages are not tensor-parallel yet. Use one of "
                              "them, and spread the other ranks over dp_shard/dp_replicate (FSDP/HSDP per stage).")

    def check_world(self, world_size: int) -> None:
        """The degrees must multiply to the number of processes that were launched."""
        if self.world_size != world_size:
            deg = " * ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS)
            raise ConfigError(
                f"the parallel degrees multiply to {deg} = {self.world_size}, but the job has world size "
                f"{world_size}. Every rank must sit in exactly one place of the mesh: change the degrees so their "
                f"product is {world_size}, or launch {self.world_size} processes (torchnitro launch --nproc "
                f"{self.world_size} ...).")

    def check_model(self, model_config: Any) -> None:
        """TP splits attention by heads and the MLP by its hidden size: both must divide by ``tp``; PP needs at
        least one layer per stage."""
        layers = getattr(model_config, "n_layers", None)
        if self.pp > 1 and layers is not None and layers < self.n_stages:
            raise ConfigError(f"pipeline parallelism splits the model's {layers} layers into pp * stages_per_rank = "
                              f"{self.n_stages} stages, but a stage needs at least one layer. Use fewer stages "
                              f"(pp * stages_per_rank <= {layers}) or a deeper model.")
        if self.tp == 1:
            return
        heads = getattr(model_config, "n_heads", None)
        kv = getattr(model_config, "kv_heads", heads)
        hidden = getattr(model_config, "hidden_dim", None)
        for what, n in (("n_heads", heads), ("n_kv_heads", kv), ("MLP hidden size", hidden)):
            if n is not None and n % self.tp:
                raise ConfigError(
                    f"tensor parallelism splits the model's {what} across tp={self.tp} ranks, but {what}={n} is not "
                    f"divisible by {self.tp}. Pick a tp that divides {what} (for example "
                    f"{_divisors(n, self.tp)}), or a model whose {what} is a multiple of {self.tp}.")

    def check_backend(self, backend: str) -> None:
        """What the process-group backend cannot do, said before a TypeError deep inside a hook."""
        if self.comm_hook == "bf16" and backend != "nccl":
            raise BackendUnavailableError(
                f"comm_hook='bf16' compresses gradients to bfloat16 for the all-reduce, which only the NCCL backend "
                f"supports; this job's backend is {backend!r}. Use comm_hook='fp16' or 'powersgd' on {backend}, or "
                "run on CUDA GPUs (NCCL).")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"ParallelConfig.{name}: received {value!r}, expected one of {', '.join(allowed)}.")


def _divisors(n: int, near: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    ds.sort(key=lambda d: (abs(d - near), d))
    return ", ".join(str(d) for d in sorted(ds[:3]))
