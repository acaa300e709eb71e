"""Bytes per collective of pipeline layouts, counted on real gloo ranks, against ``comm.collectives``.

The fake process group cannot run a pipeline schedule (its sends carry no data), so ``validate`` counts
only the state bytes of pipeline layouts. ``check_pipeline_comm(model_config, cfg)`` starts
``cfg.world_size`` real processes on gloo (env:// rendezvous on a free port, one deadline for all), each
builds ``pipeline(...)`` for its rank, takes one warm-up step (the schedule's first step also exchanges
shapes), then counts one ``Pipeline.step`` under ``CommCounter``: the schedule's sends, the replicas'
all-reduce (PP x DDP), the tied embedding's all-reduce, FSDP's gathers. Per rank it returns the counted
and the predicted (calls, bytes) per (kind, mesh dim). The loss's broadcast over the pp group (one fp32
scalar, for logging) is counted but is not part of the planner's model; it is reported under its own key.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from torchnitro.distributed.config import ParallelConfig

__all__ = ["RankComm", "check_pipeline_comm", "count_step"]

# the loss broadcast Pipeline.step runs for logging: not a training collective, kept apart from the comparison
LOSS_KEY = ("broadcast", "pp")


@dataclass
class RankComm:
    rank: int
    pp_rank: int
    counted: dict[tuple[str, str], tuple[int, int]]  # (kind, dim) -> (calls, bytes)
    predicted: dict[tuple[str, str], tuple[int, int]]

    @property
    def error(self) -> float:
        """Largest relative byte error over the (kind, dim) pairs either side has, the loss broadcast left out."""
        keys = (set(self.counted) | set(self.predicted)) - {LOSS_KEY}
        err = 0.0
        for k in keys:
            got, want = self.counted.get(k, (0, 0))[1], self.predicted.get(k, (0, 0))[1]
            err = max(err, abs(got - want) / max(want, 1))
        return err


def _count(model_config, cfg: ParallelConfig, seq: int) -> RankComm:
    """One rank: join the group, count one step (``count_step``), leave the group."""
    from torchnitro import distributed as D

    try:
        return count_step(model_config, cfg, seq)
    finally:
        D.shutdown()


def count_step(model_config, cfg: ParallelConfig, seq: int = 16) -> RankComm:
    """This rank of ``cfg`` (the process group created, or reused where one exists: ranks that run other work
    before or after): build the pipeline, warm up, count one step. The group is left as it is."""
    import torch
    import torch.distributed as dist

    from torchnitro import distributed as D
    from torchnitro.distributed.comm import collective_totals
    from torchnitro.distributed.counter import CommCounter, group_dims
    from torchnitro.nn.models import TransformerLM

    mesh = D.init(cfg)
    torch.manual_seed(0)
    model = TransformerLM(model_config)
    pipe = D.pipeline(model, cfg, mesh)
    dp = cfg.dp_replicate * cfg.dp_shard
    batch = dp * cfg.n_microbatches
    b = batch // dp
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_config.vocab_size, (b, seq), generator=gen)
    targets = torch.randint(0, model_config.vocab_size, (b, seq), generator=gen)
    names = group_dims(mesh)
    if pipe.tied_group is not None:
        names[pipe.tied_group.group_name] = "pp"  # the planner books the tied weight's sum on the pp dim
    for p in pipe.model.parameters():
        p.grad = None
    pipe.step(tokens, targets)  # warm-up: the schedule's first step also sends shapes
    for p in pipe.model.parameters():
        p.grad = None
    with CommCounter(track_modules=False) as counter:
        pipe.step(tokens, targets)
    pp_rank = mesh.get_local_rank("pp")
    return RankComm(dist.get_rank(), pp_rank, counter.by_dim(names),
                    collective_totals(model_config, cfg, batch=batch, seq=seq, pp_rank=pp_rank))


def check_pipeline_comm(model_config, cfg: ParallelConfig, *, seq: int = 16, timeout: float = 120.0) -> list[RankComm]:
    """Run ``cfg.world_size`` gloo ranks of ``cfg`` (pp > 1); one ``RankComm`` per rank, rank order.

    Raises ``RuntimeError`` with every rank's output tail when a rank fails or the deadline passes (every rank
    is then killed).
    """
    from torchnitro.distributed.launch import run_local_ranks

    if cfg.pp < 2:
        raise ValueError(f"check_pipeline_comm: received pp={cfg.pp}, expected a pipeline layout (pp >= 2); "
                         "validate.check_layout counts the other layouts on the fake process group.")
    arg = json.dumps({"model": asdict(model_config), "cfg": asdict(cfg), "seq": seq})
    run = run_local_ranks([sys.executable, "-m", "torchnitro.distributed.pp_comm", arg], cfg.world_size, timeout)
    lines = [[ln for ln in o.splitlines() if ln.startswith("{")] for o in run.outputs]
    if run.failed or not all(lines):
        why = f"timed out after {timeout:.0f} s" if run.timed_out else "failed"
        raise RuntimeError(f"check_pipeline_comm of {cfg} on {cfg.world_size} gloo ranks {why}:\n{run.log(2000)}")
    return [_from_json(json.loads(ls[-1])) for ls in lines]


def _to_json(r: RankComm) -> dict:
    return {"rank": r.rank, "pp_rank": r.pp_rank, "counted": [[*k, *v] for k, v in r.counted.items()],
            "predicted": [[*k, *v] for k, v in r.predicted.items()]}


def _from_json(d: dict) -> RankComm:
    return RankComm(d["rank"], d["pp_rank"], {(k, g): (n, b) for k, g, n, b in d["counted"]},
                    {(k, g): (n, b) for k, g, n, b in d["predicted"]})


if __name__ == "__main__":
    import warnings

    from torchnitro.nn.models import TransformerConfig

    warnings.filterwarnings("ignore")
    a = json.loads(sys.argv[1])
    result = _count(TransformerConfig(**a["model"]), ParallelConfig(**a["cfg"]), a["seq"])
    sys.stdout.write(json.dumps(_to_json(result)) + "\n")  # the parent reads the last JSON line
