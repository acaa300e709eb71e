"""Distributed Checkpoint (DCP) saves that are atomic, keep the last N, and reshard on load.

Layout under the checkpoint directory (shared by every rank; multi-node jobs need a shared file system)::

    step_00000100/        a finished checkpoint: DCP shard files + .metadata
    step_00000200/
    .tmp-step_00000300/   a save in progress, or one killed half-way: never loaded

A save writes into ``.tmp-step_N`` and, once every rank's shards and the metadata are written,
rank 0 renames it to ``step_N`` (a rename within a directory is atomic on POSIX) and deletes all
but the newest ``keep`` finished checkpoints and any stale temporary ones. ``latest_step`` only
considers ``step_N`` directories that hold a ``.metadata`` file, so a killed save is never picked.

``load`` reads into the state you pass (a ``ModelState`` or tensors), laid out for *this* job's
mesh: DCP reshards, so a checkpoint saved by FSDP on 2 ranks loads on 1 rank or on 3.

Async saves (``async_=True``) copy the state to host memory, return, and write in a background
thread over a separate gloo group (collectives of the training loop keep the default group). The
rename happens in ``PendingSave.wait()``, which the next ``save`` calls for you; call it on every rank
before the process exits, or the last checkpoint stays temporary (and ignored).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from torchnitro.errors import ArtifactError, InputError

__all__ = ["ModelState", "PendingSave", "save", "load", "latest_step", "step_dir", "list_steps"]

_STEP = re.compile(r"step_(\d{8})")
_TMP = ".tmp-"
_async_group: dict[int, Any] = {}  # id(default group) -> the gloo group of background saves made under it
_pending: dict[str, "PendingSave"] = {}  # directory -> its unfinished async save


# optimizer state and hyper-parameters keyed by parameter name, not by position in a param group: a pipeline
# rank's optimizer holds some of the parameters only, so positional groups would not line up across layouts
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """A model and its optimizer as one DCP entry, through ``get_state_dict``/``set_state_dict``,
    so FSDP/TP shards are saved as shards and fully-qualified names match across layouts."""

    def __init__(self, model: nn.Module, optimizer: Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer

    def _optims(self) -> list[Optimizer]:
        return [self.optimizer] if self.optimizer is not None else []

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self._optims(), options=_OPTIONS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self._optims(), model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=_OPTIONS)


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def list_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the finished checkpoints in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
    steps = list_steps(directory)
    return steps[-1] if steps else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _finish(directory: Path, step: int, keep: int) -> None:
    """Rank 0: publish the temporary directory, then prune."""
    if _rank() != 0:
        return
    tmp, final = directory / f"{_TMP}step_{step:08d}", step_dir(directory, step)
    if final.exists():  # a re-save of the same step replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)  # make the rename durable before older checkpoints go
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in list_steps(directory)[:-keep]:
        shutil.rmtree(step_dir(directory, old), ignore_errors=True)
    for p in directory.glob(f"{_TMP}step_*"):
        m = _STEP.fullmatch(p.name[len(_TMP):])
        if m and int(m.group(1)) < step:  # a killed earlier save
            shutil.rmtree(p, ignore_errors=True)


class PendingSave:
    """An async save in flight; ``wait()`` blocks until written, then publishes it (idempotent)."""

    def __init__(self, future: Any, directory: Path, step: int, keep: int) -> None:
        self.future, self.directory, self.step, self.keep = future, directory, step, keep
        self.done = False

    def wait(self) -> Path:
        if not self.done:
            self.future.result()
            _finish(self.directory, self.step, self.keep)
            _barrier()  # like a sync save: every rank sees step_N once wait() returns
            self.done = True
            _pending.pop(str(self.directory), None)
        return step_dir(self.directory, self.step)


def save(state: dict[str, Any], directory: str | os.PathLike, step: int, *, async_: bool = False,
         keep: int = 3) -> Path | PendingSave:
    """Save ``state`` (DCP-savable values: ``ModelState``, tensors, numbers) as checkpoint ``step``.

    Every rank calls it. Returns the finished directory, or a ``PendingSave`` when ``async_``.
    """
    if step < 0 or keep < 1:
        raise InputError(f"save: received step={step}, keep={keep}; expected step >= 0 and keep >= 1.")
    directory = Path(directory)
    prev = _pending.get(str(directory))
    if prev is not None:  # one save at a time per directory, in order
        prev.wait()
    tmp = directory / f"{_TMP}step_{step:08d}"
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save of this step
    _barrier()
    if not async_:
        dcp.save(state, checkpoint_id=tmp)  # returns on every rank once the metadata is written
        _finish(directory, step, keep)
        _barrier()  # every rank sees step_N before anyone reads it
        return step_dir(directory, step)
    group = _background_group()
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
    pending = PendingSave(future, directory, step, keep)
    _pending[str(directory)] = pending
    return pending


def _background_group() -> Any:
    """A gloo group for background saves, one per default group (a re-initialised job gets a new one)."""
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _async_group:
        _async_group.clear()  # groups of a destroyed default group are dead
        _async_group[key] = dist.new_group(backend="gloo")
    return _async_group[key]


def _agreed(step: int | None) -> int | None:
    """Rank 0's choice of step for every rank: ranks listing a shared file system could disagree."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return step
    box = [step]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load(state: dict[str, Any], directory: str | os.PathLike, step: int | None = None) -> int | None:
    """Load checkpoint ``step`` (default: the latest finished one) into ``state`` in place.

    Returns the step loaded, or None when the directory holds no finished checkpoint (a fresh start).
    """
    directory = Path(directory)
    if step is None:
        step = _agreed(latest_step(directory))
        if step is None:
            return None
    elif step not in list_steps(directory):
        raise ArtifactError(f"load: received step={step}, but {directory} has no finished checkpoint of that step; "
                            f"finished steps: {list_steps(directory) or 'none'}.")
    try:
        dcp.load(state, checkpoint_id=step_dir(directory, step))
    except (RuntimeError, KeyError, ValueError, CheckpointException) as exc:  # the last is a BaseException
        raise ArtifactError(_incompatible(directory, step, exc)) from exc
    return step


def _incompatible(directory: Path, step: int, exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    why = lines[-1] if lines else type(exc).__name__  # DCP wraps each rank's traceback; its last line is the cause
    return (f"checkpoint {step_dir(directory, step)} does not fit the state it was loaded into ({why}). It was "
            "probably saved from a different model (other layer sizes or names) or optimizer; load it into the model "
            "config that wrote it.")
