"""``CommCounter``: count the collectives a block of code dispatches and the bytes of their buffers.

Its own module so that importing ``torchnitro.distributed`` (every rank of a training job, every restart)
does not import ``torch.distributed.tensor.debug``, which pulls in torch._dynamo and inductor (about 0.8 s of
a fresh process's start on the 2-core CPU machine).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommCounter", "group_dims"]


class CommCounter(CommDebugMode):
    """Counts the collectives a block of code dispatches and the bytes of their full buffers, by group.

    A ``CommDebugMode`` (torch.distributed.tensor.debug) that also reads each collective's tensors:
    ``totals()`` -> {(kind, group name): (count, bytes)}. c10d ops (FSDP2, DDP) and functional
    collectives (DTensor) are both seen, and point-to-point sends (pipeline schedules; received bytes are
    the peer's sends, not counted twice); it works on gloo and on the fake process group.

    ``track_modules=False`` leaves out ``CommDebugMode``'s per-module tracker, whose forward hooks fail
    (IndexError on its parent list) inside a ``torch.distributed.pipelining`` schedule; the totals do not use it.
    """

    _KINDS = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
              "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
              "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
              "allreduce_": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced_": "all_reduce",
              "all_reduce_coalesced": "all_reduce", "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send"}

    def __init__(self, track_modules: bool = True) -> None:
        super().__init__()
        self.track_modules = track_modules
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def __enter__(self):
        if self.track_modules:
            return super().__enter__()
        self.comm_counts.clear()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        if self.track_modules:
            return super().__exit__(*args)
        return TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.track_modules:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        elif isinstance(func, torch._ops.HigherOrderOperator):  # no overload packet, never a collective
            return func(*args, **(kwargs or {}))
        elif any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, as CommDebugMode does
        else:
            out = func(*args, **(kwargs or {}))
        if out is not NotImplemented:
            op = str(func._overloadpacket).rsplit(".", 1)[-1]
            kind = self._KINDS.get(op)
            if kind is not None:
                key = (kind, _group_name(args))
                self.bytes[key] += _buffer_bytes(op, args)
                self.calls[key] += 1
        return out

    def totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(kind, group name): (calls, bytes)}."""
        return {k: (self.calls[k], self.bytes[k]) for k in self.calls}

    def by_dim(self, dims: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
        """{(kind, mesh dim): (calls, bytes)}: ``totals()`` with each group name read through ``dims`` (group name
        -> mesh dim, e.g. ``group_dims(mesh)``; a group not in it keeps its name). ``comm.collective_totals`` gives
        the planner's side in the same form."""
        calls: Counter = Counter()
        nbytes: Counter = Counter()
        for (kind, group), (n, size) in self.totals().items():
            key = (kind, dims.get(group, group))
            calls[key] += n
            nbytes[key] += size
        return {k: (calls[k], nbytes[k]) for k in calls}


def group_dims(mesh) -> dict[str, str]:
    """{process group name: mesh dim name} of a ``DeviceMesh``, for ``CommCounter.by_dim``."""
    return {mesh[d].get_group().group_name: d for d in mesh.mesh_dim_names or ()}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _buffer_bytes(op: str, args: tuple) -> int:
    """The full buffer: all-gather output, reduce-scatter input, all-reduce/broadcast tensors."""
    if op in ("_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_",
              "reduce_scatter_tensor_coalesced_"):
        ts = _tensors(args[0]) if "allgather" in op else _tensors(args[1])
        return sum(t.nbytes for t in ts)
    if op == "all_gather_into_tensor":  # functional: (input, group_size, group_name)
        return args[0].nbytes * int(args[1])
    return sum(t.nbytes for t in _tensors(args[0]))


def _group_name(args: tuple) -> str:
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).group_name
            except RuntimeError:
                continue
    strings = [a for a in args if isinstance(a, str)]
    return strings[-1] if strings else "?"
