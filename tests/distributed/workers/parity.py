"""Rank program: for each (name, ParallelConfig kwargs) given as JSON, train two steps of the tiny LM on
this rank's slice of the batch, evaluate a 13-sample dataset through the sharded loader, and (rank 0)
save the global losses, full gradients, global gradient norm and evaluation to OUT/name.pt. Pipeline
layouts run ``workers/pipeline.py``'s scenario; names in ``COMM_FOUR`` count one pipeline step's
collectives (``pp_comm.count_step``) and rank 0 writes every rank's counts to OUT/name.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root, for tests.distributed.common

import torch  # noqa: E402

from tests.distributed.common import COMM_FOUR, COMM_MODEL, tiny_lm, tokens, two_steps  # noqa: E402
from torchnitro import distributed as D  # noqa: E402
from torchnitro.distributed.parity import full_tensors  # noqa: E402
from torchnitro.distributed.pp_comm import _to_json, count_step  # noqa: E402
from torchnitro.distributed.train import clip_grad_norm_  # noqa: E402
from tests.distributed.workers.pipeline import scenario as pipeline_scenario  # noqa: E402


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors: their local shards)."""
    seen = {}
    for t in tensors:
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _state_bytes(model, x, measured) -> list:
    """Every rank's measured parameter, gradient and AdamW moment bytes (step counters: 4 B per tensor)."""
    opt = torch.optim.AdamW(model.parameters())
    model(x[:, :-1]).float().sum().backward()
    opt.step()
    moments = _storage_bytes(v for st in opt.state.values() for k, v in st.items() if k != "step")
    counters = sum(4 for st in opt.state.values() if "step" in st)
    mine = {**measured, "optimizer_state": moments + counters}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def _evaluate(mesh) -> tuple[float, int]:
    """Mean of i**2 over 13 samples (not a multiple of any world size here), read through the sharded loader."""
    data = torch.utils.data.TensorDataset(torch.arange(13, dtype=torch.float64))
    total, count = 0.0, 0
    for (batch,) in D.loader(data, mesh, batch_size=2):
        total, count = total + batch.pow(2).sum().item(), count + batch.numel()
    return D.exact_mean(total, count, mesh)


def _count_comm(out: Path, name: str, kwargs: dict) -> None:
    from torchnitro.nn.models import TransformerConfig

    mine = _to_json(count_step(TransformerConfig(**COMM_MODEL), D.ParallelConfig(**kwargs)))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if torch.distributed.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(everyone))
    torch.distributed.barrier()


def main(out: Path, scenarios: list) -> None:
    for name, kwargs in scenarios:
        if name in COMM_FOUR:  # the collectives of one pipeline step, counted
            _count_comm(out, name, kwargs)
            continue
        if kwargs.get("pp", 1) > 1:  # pipeline compositions: their own step (the 4-layer LM), same ranks
            pipeline_scenario(out, name, kwargs)
            continue
        cfg = D.ParallelConfig(timeout_s=60, **kwargs)
        mesh = D.init(cfg)
        model = D.parallelize(tiny_lm(), cfg, mesh)
        x = tokens()
        idx, size = D.dp_coords(mesh)
        b = x.shape[0] // size
        norms = []

        measured = {}

        def read(m):
            norms.append(clip_grad_norm_(m.parameters(), float("inf")))  # inf: measure, do not clip
            measured["parameters"] = _storage_bytes(p for p in m.parameters())
            measured["gradients"] = _storage_bytes(p.grad for p in m.parameters())
            return full_tensors(m, grads=True)

        losses, grads = two_steps(model, x[idx * b:(idx + 1) * b], reduce=lambda t: D.dp_sum(t, mesh) / size,
                                  grads=read)
        memory = _state_bytes(model, x[idx * b:(idx + 1) * b], measured)
        evaluation = _evaluate(mesh)
        if torch.distributed.get_rank() == 0:
            torch.save({"losses": losses, "grads": grads, "eval": evaluation, "grad_norm": norms[0],
                        "memory": memory}, out / f"{name}.pt")
    D.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
