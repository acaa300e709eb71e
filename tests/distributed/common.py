"""The tiny LM, data and training steps that both the ranks and the single-process reference run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchnitro.nn.models import TransformerConfig, TransformerLM

__all__ = ["MODEL", "tiny_lm", "tokens", "two_steps", "TWO", "FOUR", "PIPE_TWO", "PIPE_FOUR", "PIPE_LAYERS",
           "COMM_MODEL", "COMM_FOUR"]

# GQA (2 kv heads for 4 query heads) so TP=2 splits both; hidden 128
MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)

# the scenarios one group of 2 and one of 4 real ranks run (tests/distributed/conftest.py); name -> ParallelConfig
TWO = {"ddp": dict(dp_replicate=2), "ddp_fp16": dict(dp_replicate=2, comm_hook="fp16"),
       "fsdp": dict(dp_shard=2), "fsdp_ckpt": dict(dp_shard=2, checkpointing="selective", prefetch=0),
       "tp": dict(tp=2), "fsdp_bf16": dict(dp_shard=2, mixed_precision="bf16")}
FOUR = {"hsdp": dict(dp_replicate=2, dp_shard=2), "fsdp_tp": dict(dp_shard=2, tp=2)}
# pipelines of the PIPE_LAYERS-layer LM (tests/distributed/workers/pipeline.py); "ckpt": also save with DCP
PIPE_LAYERS = 4
PIPE_TWO = {"pp_gpipe": dict(pp=2, pp_schedule="gpipe", microbatches=4),
            "pp_1f1b": dict(pp=2, pp_schedule="1f1b", microbatches=8, ckpt=True),
            "pp_interleaved": dict(pp=2, pp_schedule="interleaved1f1b", stages_per_rank=2),
            "pp_1f1b_ckpt": dict(pp=2, pp_schedule="1f1b", checkpointing="blocks")}
PIPE_FOUR = {"pp_fsdp": dict(pp=2, dp_shard=2, pp_schedule="1f1b", microbatches=2),
             "pp_ddp": dict(pp=2, dp_replicate=2, pp_schedule="1f1b", microbatches=2)}
# pipeline layouts whose collectives the 4-rank group counts (tests/distributed/test_pp_comm.py): one step of the
# COMM_MODEL LM per layout under CommCounter (pp_comm.count_step), run last (the pipelines above share the group)
COMM_MODEL = dict(vocab_size=100, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=160, max_seq_len=32)
COMM_FOUR = {"comm_pp2_ddp2": dict(pp=2, dp_replicate=2), "comm_pp2_fsdp2_m4": dict(pp=2, dp_shard=2, microbatches=4)}


def tiny_lm(n_layers: int = MODEL["n_layers"]) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**{**MODEL, "n_layers": n_layers}))


def tokens(batch: int = 8, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (batch, seq + 1), generator=g)  # (B, T+1): inputs and targets


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def two_steps(model: torch.nn.Module, x: torch.Tensor, reduce=lambda t: t, grads=None):
    """Loss, backward, SGD step, loss again: ([loss1, loss2], gradients of step 1).

    ``reduce`` turns a rank's local mean loss into the global one; ``grads(model)`` reads the gradients.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss1 = _loss(model, x)
    loss1.backward()
    g = grads(model)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        loss2 = _loss(model, x)
    return [reduce(loss1.detach()).item(), reduce(loss2).item()], g
