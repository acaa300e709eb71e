"""Rank program: for each (name, ParallelConfig kwargs) given as JSON, pipeline the 4-layer tiny LM, run one
step on this data-parallel rank's slice of the batch, take an SGD step, run a second step for its loss, and
(rank 0) save the global losses, every full gradient of step 1 (merged over the pp ranks) and the largest
difference between the two copies of a tied weight to OUT/name.pt. With ``"ckpt": true`` in the kwargs, the
state after the SGD step is also saved with DCP to OUT/name-ckpt.
The parity worker runs ``scenario`` for its configs with pp > 1, in the same group of ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root, for tests.distributed.common

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.distributed.common import PIPE_LAYERS, tiny_lm, tokens  # noqa: E402
from torchnitro import distributed as D  # noqa: E402
from torchnitro.distributed.mesh import dp_dims  # noqa: E402
from torchnitro.distributed.parity import full_tensors  # noqa: E402




def _dp_mean(loss: float, mesh) -> float:
    """Mean of the per-data-parallel-rank mean losses (equal shards: the global mean)."""
    dims = dp_dims(mesh)
    if not dims:
        return loss
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    t = torch.tensor([loss], dtype=torch.float64)
    group = sub._flatten().get_group() if len(dims) > 1 else sub.get_group()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _merge(per_rank: list) -> tuple[dict, float]:
    """One {name: tensor} from every rank's dict; the largest difference where two ranks hold the same name."""
    out, diff = {}, 0.0
    for d in per_rank:
        for k, v in d.items():
            if k in out:
                diff = max(diff, (out[k] - v).abs().max().item())
            else:
                out[k] = v
    return out, diff


def scenario(out: Path, name: str, kwargs: dict) -> None:
    kwargs = dict(kwargs)
    save_ckpt = kwargs.pop("ckpt", False)
    cfg = D.ParallelConfig(timeout_s=60, **kwargs)
    mesh = D.init(cfg)
    pipe = D.pipeline(tiny_lm(PIPE_LAYERS), cfg, mesh)
    opt = torch.optim.SGD(pipe.model.parameters(), lr=0.5)
    x = tokens()
    idx, size = D.dp_coords(mesh)
    b = x.shape[0] // size
    xs = x[idx * b:(idx + 1) * b]
    loss1 = _dp_mean(pipe.step(xs[:, :-1], xs[:, 1:]), mesh)
    grads = full_tensors(pipe.model, grads=True)
    opt.step()
    opt.zero_grad()
    params = full_tensors(pipe.model)
    if save_ckpt:
        D.save({"train": D.ModelState(pipe.model, opt)}, out / f"{name}-ckpt", step=1)
    loss2 = _dp_mean(pipe.step(xs[:, :-1], xs[:, 1:]), mesh)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (grads, params))
    if dist.get_rank() == 0:
        g, gdiff = _merge([e[0] for e in everyone])
        p, pdiff = _merge([e[1] for e in everyone])
        torch.save({"losses": [loss1, loss2], "grads": g, "params": p, "copy_diff": max(gdiff, pdiff)},
                   out / f"{name}.pt")
    dist.barrier()


def main(out: Path, scenarios: list) -> None:
    for name, kwargs in scenarios:
        scenario(out, name, kwargs)
    D.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
