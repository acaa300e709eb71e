"""Check the planner against real steps: one rank of a layout, in this process, on the fake process group.

``check_layout(model_config, cfg, rank=r)`` starts PyTorch's fake backend (``FakeStore`` + ``"fake"``:
collectives return at once, so one process can be any rank of a 32-rank job), builds the layout as
``parallelize``/``pipeline`` would, runs one forward and backward under ``CommCounter`` and one AdamW
step, and returns what the rank holds and what it sent next to what ``planner``/``comm`` predict:

- state bytes: the distinct storages behind the parameters, their gradients and the AdamW state (DTensors:
  their local shards);
- collectives: calls and buffer bytes per (kind, mesh dim), for layouts without pipeline stages (a
  pipeline's micro-batch schedule cannot run on the fake backend: its sends carry no data).

The numbers are the fake backend's, the tensors' shapes and the FSDP/TP/DDP code paths are the real ones;
the values computed are meaningless (collectives move nothing), which is fine for bytes and shapes.

One process can check one rank of a mesh shape: DTensor's dispatch caches sharding decisions by mesh
layout, so a second fake group with a mesh of the same shape (another rank of the same layout) would be
handed the first group's process-group names. ``check_layout_isolated`` runs each check in a fresh
``python -m torchnitro.distributed.validate`` process instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchnitro.distributed.comm import collective_totals
from torchnitro.distributed.counter import CommCounter, group_dims
from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.planner import RankState, rank_state_bytes

__all__ = ["LayoutCheck", "check_layout", "check_layout_isolated", "fake_group", "storage_bytes"]


@dataclass
class LayoutCheck:
    cfg: ParallelConfig
    rank: int
    measured: RankState  # storages this rank holds
    predicted: RankState  # planner.rank_state_bytes
    comm_counted: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (kind, dim) -> (calls, bytes)
    comm_predicted: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)  # parameter -> "shape|local shape|placements"

    @property
    def memory_error(self) -> float:
        return abs(self.measured.total - self.predicted.total) / self.predicted.total

    @property
    def comm_error(self) -> float:
        """Largest relative byte error over the (kind, dim) pairs either side has (0 when both are empty)."""
        keys = set(self.comm_counted) | set(self.comm_predicted)
        err = 0.0
        for k in keys:
            got, want = self.comm_counted.get(k, (0, 0))[1], self.comm_predicted.get(k, (0, 0))[1]
            err = max(err, abs(got - want) / max(want, 1))
        return err


def fake_group(world_size: int, rank: int) -> None:
    """Replace any default group by a fake one of ``world_size`` ranks in which this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors: their local shards)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _record_ddp(model, group) -> None:
    """The fake backend's futures carry no tensor, which DDP's built-in reducer rejects: all-reduce each bucket
    from a hook instead (the same tensor on the same group as DDP's default)."""
    def hook(state, bucket):
        dist.all_reduce(bucket.buffer(), group=state)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(group, hook)


def _placements(model) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "placements"):
            out[name.removeprefix("module.")] = f"{tuple(p.shape)}|{tuple(p.to_local().shape)}|{p.placements}"
        else:
            out[name.removeprefix("module.")] = f"{tuple(p.shape)}|{tuple(p.shape)}|local"
    return out


def check_layout(model_config, cfg: ParallelConfig, *, rank: int = 0, batch: int = 0, seq: int = 16,
                 seed: int = 0) -> LayoutCheck:
    """Build ``cfg`` as rank ``rank`` of a fake ``cfg.world_size``-rank job, take one step, measure and predict."""
    from torchnitro import distributed as D
    from torchnitro.nn.models import TransformerLM

    fake_group(cfg.world_size, rank)
    try:
        mesh = D.init(cfg)
        dp = cfg.dp_replicate * cfg.dp_shard
        batch = batch or dp * (cfg.n_microbatches if cfg.pp > 1 else 1)
        torch.manual_seed(seed)
        model = TransformerLM(model_config)
        pp_rank = mesh.get_local_rank("pp") if cfg.pp > 1 else 0
        shard_index = mesh.get_local_rank("dp_shard") if cfg.dp_shard > 1 else 0
        counter = CommCounter()
        b = batch // dp
        if cfg.pp > 1:
            pipe = D.pipeline(model, cfg, mesh)
            owner, trainables = pipe.model, pipe.stages
        else:
            owner = D.parallelize(model, cfg, mesh)
            trainables = [owner]
            if cfg.strategy == "ddp":
                _record_ddp(owner, mesh["dp_replicate"].get_group())
        with counter:
            for st in trainables:  # one forward and backward per stage (pipelines: outside their schedule)
                first = getattr(st, "first", True)
                x = torch.randint(0, model_config.vocab_size, (b, seq)) if first else \
                    torch.randn(b, seq, model_config.dim, requires_grad=True)
                out = st(x)
                if out.shape[-1] == model_config.vocab_size:
                    F.cross_entropy(out.float().flatten(0, 1), torch.zeros(b * seq, dtype=torch.long)).backward()
                else:
                    out.float().sum().backward()
        params = list(owner.parameters())
        measured_p, measured_g = storage_bytes(params), storage_bytes(p.grad for p in params)
        opt = torch.optim.AdamW(params)
        opt.step()
        moments = storage_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
        counters = sum(4 for s in opt.state.values() if "step" in s)
        measured = RankState(measured_p, measured_g, moments + counters)
        predicted = rank_state_bytes(model_config, cfg, dp_shard_index=shard_index, pp_rank=pp_rank)
        check = LayoutCheck(cfg, rank, measured, predicted, placements=_placements(owner))
        if cfg.pp == 1:
            check.comm_counted = counter.by_dim(group_dims(mesh))
            check.comm_predicted = collective_totals(model_config, cfg, batch=batch, seq=seq)
        return check
    finally:
        dist.destroy_process_group()


def _to_json(c: LayoutCheck) -> dict:
    return {"cfg": asdict(c.cfg), "rank": c.rank, "measured": asdict(c.measured), "predicted": asdict(c.predicted),
            "comm_counted": [[*k, *v] for k, v in c.comm_counted.items()],
            "comm_predicted": [[*k, *v] for k, v in c.comm_predicted.items()], "placements": c.placements}


def _from_json(d: dict) -> LayoutCheck:
    return LayoutCheck(ParallelConfig(**d["cfg"]), d["rank"], RankState(**d["measured"]), RankState(**d["predicted"]),
                       {(k, g): (n, b) for k, g, n, b in d["comm_counted"]},
                       {(k, g): (n, b) for k, g, n, b in d["comm_predicted"]}, d["placements"])


def check_layout_isolated(model_config, cfg: ParallelConfig, *, rank: int = 0, batch: int = 0, seq: int = 16,
                          timeout: float = 300.0) -> LayoutCheck:
    """``check_layout`` in a fresh process (any number of ranks and layouts per caller)."""
    args = json.dumps({"model": asdict(model_config), "cfg": asdict(cfg), "rank": rank, "batch": batch, "seq": seq})
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                          "MASTER_PORT", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torchnitro.distributed.validate", args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"check_layout of {cfg} rank {rank} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    return _from_json(json.loads(lines[-1]))


if __name__ == "__main__":
    import warnings

    from torchnitro.nn.models import TransformerConfig

    warnings.filterwarnings("ignore")
    a = json.loads(sys.argv[1])
    result = check_layout(TransformerConfig(**a["model"]), ParallelConfig(**a["cfg"]), rank=a["rank"],
                          batch=a["batch"], seq=a["seq"])
    sys.stdout.write(json.dumps(_to_json(result)) + "\n")  # the parent reads the last JSON line of stdout
