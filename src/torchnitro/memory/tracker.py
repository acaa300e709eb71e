"""Exact live-tensor memory tracking through a dispatch mode: no GPU, no allocator hooks needed.

``track()`` installs a ``TorchDispatchMode`` that sees every tensor an ATen op returns. Each new
storage gets a record (bytes, phase it was born in, category) and a weakref whose callback fires
when the storage is freed, so live bytes are exact at every op boundary. Storages that existed
before tracking began (parameters, gradients, optimizer state, inputs) are counted from the model and
optimizer handed in, and from tensors seen as op inputs.

Phases are detected automatically: an op running inside an autograd node is ``backward``; an op
between a global optimizer pre-/post-step hook is ``optimizer``; anything else is ``forward``.
``tracker.phase("name")`` overrides this for a block.

Categories are settled by what a storage turned out to be:

- ``parameters``: storages of model parameters (and buffers);
- ``gradients``: storages that end up as a parameter's ``.grad``;
- ``optimizer_state``: storages held in ``optimizer.state``;
- ``activations``: born in forward and still alive when forward ended (saved for backward, outputs);
- ``temporaries``: everything else (freed inside the phase that made it, grads of activations...);
- ``inputs``: storages that existed before tracking and are none of the above.

Peaks keep references to the live records at the moment of the peak, so their category split uses
the settled categories, not the guess made when the op ran. Each record also remembers its owner:
the innermost module running (qualified name when the model was passed in) or, in backward, the
autograd node; ``PeakInfo.by_owner`` lists the ten largest owners of activations and temporaries.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchnitro.errors import InputError

__all__ = ["CATEGORIES", "PHASES", "MemoryTracker", "MemoryReport", "PeakInfo", "track"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs")
PHASES = ("forward", "backward", "optimizer")


class _Record:
    __slots__ = ("nbytes", "phase", "category", "freed_phase", "device", "owner", "__weakref__")

    def __init__(self, nbytes: int, phase: str, category: str, device: str, owner: str = ""):
        self.nbytes, self.phase, self.category, self.device = nbytes, phase, category, device
        self.owner = owner  # module (forward) or autograd node (backward) that allocated it
        self.freed_phase: str | None = None


@dataclass
class PeakInfo:
    """Live bytes at the highest point of a phase (or overall), split by category."""

    bytes: int
    phase: str
    by_category: dict[str, int]
    by_owner: dict[str, int] = field(default_factory=dict)  # largest allocating modules/nodes, bytes

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "phase": self.phase, "by_category": dict(self.by_category),
                "by_owner": dict(self.by_owner)}


@dataclass
class MemoryReport:
    """What ``MemoryTracker.report()`` returns; ``str()`` is a readable table."""

    peak: PeakInfo
    per_phase: dict[str, PeakInfo]
    baseline_bytes: int  # live bytes when tracking began (parameters, inputs, existing state)
    final_bytes: int  # live bytes when tracking ended
    timeline: list[tuple[float, str, int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak": self.peak.to_dict(),
            "per_phase": {k: v.to_dict() for k, v in self.per_phase.items()},
            "baseline_bytes": self.baseline_bytes,
            "final_bytes": self.final_bytes,
        }

    def __str__(self) -> str:
        cols = ["overall", *self.per_phase]
        peaks = [self.peak, *self.per_phase.values()]
        lines = ["memory (MiB)".ljust(18) + "".join(c.rjust(12) for c in cols)]
        for cat in CATEGORIES:
            vals = [p.by_category.get(cat, 0) for p in peaks]
            if any(vals):
                lines.append(cat.ljust(18) + "".join(f"{v / 2**20:12.2f}" for v in vals))
        lines.append("peak".ljust(18) + "".join(f"{p.bytes / 2**20:12.2f}" for p in peaks))
        return "\n".join(lines)


def _storage_key(st: torch.UntypedStorage) -> tuple[str, int]:
    return (str(st.device), st.data_ptr())


class MemoryTracker(TorchDispatchMode):
    """Counts live storage bytes op by op. Use through ``track()``."""

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 *, timeline: bool = False, round_to: int = 1):
        super().__init__()
        if round_to < 1:
            raise InputError(f"round_to: received {round_to}, expected a positive byte granularity (1, 512)")
        self._records: dict[tuple[str, int], _Record] = {}
        self._refs: dict[tuple[str, int], weakref.ref] = {}
        self._live = 0
        self._round = round_to
        self._forced_phase: list[str] = []
        self._opt_depth = 0
        self._current = "forward"
        self._peak = 0
        self._peak_phase = "forward"
        self._peak_recs: list[_Record] = []
        self._phase_peak: dict[str, tuple[int, list[_Record]]] = {}
        self._keep_timeline = timeline
        self._timeline: list[tuple[float, str, int]] = []
        self._t0 = time.perf_counter()
        self._models: list[nn.Module] = [model] if model is not None else []
        self._optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
        self._params: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._hooks: list[Any] = []
        self._module_stack: list[str] = []
        self.baseline_bytes = 0
        self.final_bytes = 0
        self._report: MemoryReport | None = None

    # -- bookkeeping --------------------------------------------------------------------------
    def _size(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        r = self._round
        return n if r == 1 else -(-n // r) * r

    def _add(self, t: torch.Tensor, phase: str, category: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, or wrapper tensors
            return
        n = self._size(st)
        if n == 0:
            return
        key = _storage_key(st)
        if key in self._records:
            return
        rec = _Record(n, phase, category, str(st.device), self._owner() if phase != "pre" else "")
        self._records[key] = rec
        self._refs[key] = weakref.ref(st, self._on_free(key, rec))
        self._live += n
        self._after_change(self._current if phase == "pre" else phase)

    def _on_free(self, key: tuple[str, int], rec: _Record):
        def cb(_ref: Any) -> None:
            if self._records.get(key) is rec:
                del self._records[key]
                self._refs.pop(key, None)
                self._live -= rec.nbytes
                phase = self._phase()
                rec.freed_phase = phase
                if rec.category == "activations" and phase == rec.phase:
                    rec.category = "temporaries"  # made and dropped inside forward: not saved
                if self._keep_timeline:
                    self._timeline.append((time.perf_counter() - self._t0, phase, self._live))
        return cb

    def _after_change(self, phase: str) -> None:
        live = self._live
        if self._keep_timeline:
            self._timeline.append((time.perf_counter() - self._t0, phase, live))
        if live > self._peak:
            self._peak, self._peak_phase = live, phase
            self._peak_recs = list(self._records.values())
        best = self._phase_peak.get(phase)
        if best is None or live > best[0]:
            self._phase_peak[phase] = (live, list(self._records.values()))

    def _owner(self) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        node = torch._C._current_autograd_node()
        return node.name() if node is not None else ""

    def _phase(self) -> str:
        if self._forced_phase:
            return self._forced_phase[-1]
        if self._opt_depth > 0:
            return "optimizer"
        if torch._C._current_autograd_node() is not None:
            return "backward"
        return "forward"

    def _settle(self) -> None:
        """Relabel records by what they turned out to be (params, grads, optimizer state)."""
        params: list[torch.Tensor] = list(self._params.values())
        for m in self._models:
            params += list(m.parameters()) + list(m.buffers())
        for opt in self._optimizers:
            for g in opt.param_groups:
                params += list(g["params"])
        for p in params:
            self._label(p, "parameters")
            if p.grad is not None:
                self._label(p.grad, "gradients")
        for opt in self._optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._label(v, "optimizer_state")

    def _label(self, t: torch.Tensor, category: str) -> None:
        try:
            rec = self._records.get(_storage_key(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return
        if rec is not None:
            rec.category = category

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase = self._phase()
        if phase != self._current:
            self._settle()
            self._current = phase
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                if isinstance(a, nn.Parameter):
                    self._params[id(a)] = a
                self._add(a, "pre", "parameters" if isinstance(a, nn.Parameter) else "inputs")
        out = func(*args, **kwargs)
        default = {"forward": "activations", "backward": "temporaries", "optimizer": "temporaries"}
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                self._add(o, phase, default.get(phase, "temporaries"))
        return out

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(opt: torch.optim.Optimizer, *_a: Any) -> None:
            if all(o is not opt for o in self._optimizers):
                self._optimizers.append(opt)
            self._opt_depth += 1

        def post(opt: torch.optim.Optimizer, *_a: Any) -> None:
            self._opt_depth = max(0, self._opt_depth - 1)

        names = {id(mod): name or type(mod).__name__ for m in self._models for name, mod in m.named_modules()}

        def enter(mod: nn.Module, *_a: Any) -> None:
            self._module_stack.append(names.get(id(mod), type(mod).__name__))

        def leave(mod: nn.Module, *_a: Any) -> None:
            if self._module_stack:
                self._module_stack.pop()

        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post),
                       register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
        for m in self._models:
            for t in [*m.parameters(), *m.buffers()]:
                self._add(t, "pre", "parameters")
                if t.grad is not None:
                    self._add(t.grad, "pre", "gradients")
        for opt in self._optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._add(v, "pre", "optimizer_state")
        self.baseline_bytes = self._live
        self._peak, self._phase_peak = self._live, {}
        self._peak_recs = list(self._records.values())
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._settle()
        self.final_bytes = self._live
        self._report = self._build_report()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute every allocation in this block to phase ``name``."""
        if not isinstance(name, str) or not name:
            raise InputError(f"phase name: received {name!r}, expected a non-empty string")
        self._forced_phase.append(name)
        try:
            yield
        finally:
            self._forced_phase.pop()

    @property
    def live_bytes(self) -> int:
        return self._live

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @staticmethod
    def _split(recs: list[_Record]) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for r in recs:
            out[r.category] = out.get(r.category, 0) + r.nbytes
        return out

    @staticmethod
    def _owners(recs: list[_Record], top: int = 10) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in recs:
            if r.owner and r.category in ("activations", "temporaries"):
                out[r.owner] = out.get(r.owner, 0) + r.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])

    def _build_report(self) -> MemoryReport:
        per = {p: PeakInfo(b, p, self._split(recs), self._owners(recs)) for p, (b, recs) in self._phase_peak.items()}
        peak = PeakInfo(self._peak, self._peak_phase, self._split(self._peak_recs), self._owners(self._peak_recs))
        return MemoryReport(peak, per, self.baseline_bytes, self.final_bytes, list(self._timeline))

    def report(self) -> MemoryReport:
        """Peak overall and per phase, by category. Call after the ``with`` block ends."""
        if self._report is None:
            self._settle()
            return self._build_report()
        return self._report

    # -- timeline export ----------------------------------------------------------------------
    def save_timeline(self, path: str | Path, format: str = "chrome") -> Path:
        """Write the live-bytes timeline as a Chrome trace (chrome://tracing, Perfetto) or JSON."""
        if not self._keep_timeline:
            raise InputError("no timeline was recorded; use memory.track(timeline=True) to record one")
        if format not in ("chrome", "json"):
            raise InputError(f"timeline format: received {format!r}, expected 'chrome' or 'json'")
        p = Path(path)
        if format == "json":
            data: Any = [{"t_s": t, "phase": ph, "live_bytes": b} for t, ph, b in self._timeline]
        else:
            data = {"traceEvents": [
                {"name": "live_bytes", "ph": "C", "ts": t * 1e6, "pid": 0, "tid": 0,
                 "args": {ph: b}} for t, ph, b in self._timeline]}
        p.write_text(json.dumps(data))
        return p


def track(model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
          timeline: bool = False, round_to: int = 1) -> MemoryTracker:
    """Track live tensor bytes in a ``with`` block; ``.report()`` afterwards.

    ``model`` and ``optimizer`` let storages that already exist (parameters, gradients, Adam state)
    be counted from the start; without them only storages the block touches are counted.
    ``round_to=512`` mimics the CUDA caching allocator's block rounding.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise InputError(f"model: received {type(model).__name__}, expected an nn.Module or None")
    return MemoryTracker(model, optimizer, timeline=timeline, round_to=round_to)
