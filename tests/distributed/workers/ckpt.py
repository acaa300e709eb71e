"""Rank program: ``save DIR OUT``: FSDP over every rank, three AdamW steps with a checkpoint after each (the
last one async, keep=2), rank 0 writes the full parameters and optimizer state of step 3 to OUT/saved.pt.
``load DIR OUT``: a fresh model laid out for this world size loads the latest checkpoint; rank 0 writes
what it got to OUT/loaded_<world>.pt. Without a launcher's environment it runs as one process, in-process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root, for tests.distributed.common

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402

from tests.distributed.common import tiny_lm, tokens  # noqa: E402
from torchnitro import distributed as D  # noqa: E402
from torchnitro.distributed.checkpoint import ModelState, load, save  # noqa: E402
from torchnitro.distributed.parity import full_tensors  # noqa: E402


def _full_state(model, opt) -> dict:
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"params": full_tensors(model), "optim": optim}


def main(mode: str, directory: Path, out: Path) -> None:
    cfg = D.ParallelConfig(dp_shard=int(os.environ.get("WORLD_SIZE", "1")), timeout_s=60)
    mesh = D.init(cfg)
    world = torch.distributed.get_world_size()
    model = D.parallelize(tiny_lm(), cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"train": ModelState(model, opt), "step": torch.tensor(0)}
    if mode == "save":
        x = tokens()
        idx, size = D.dp_coords(mesh)
        b = x.shape[0] // size
        for step in (1, 2, 3):
            logits = model(x[idx * b:(idx + 1) * b, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[idx * b:(idx + 1) * b, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            state["step"] = torch.tensor(step)
            res = save(state, directory, step, async_=step == 3, keep=2)
        res.wait()  # the async save of step 3 is published here
        full = _full_state(model, opt)
        if torch.distributed.get_rank() == 0:
            torch.save(full, out / "saved.pt")
    else:
        got = load(state, directory)
        full = _full_state(model, opt)
        if torch.distributed.get_rank() == 0:
            torch.save({**full, "step": got, "step_tensor": int(state["step"])}, out / f"loaded_{world}.pt")
    D.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
