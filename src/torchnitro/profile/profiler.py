"""``profile(step_fn)`` / ``profile(model, example_inputs)``: a step profile on ``torch.profiler``.

How a profile is taken:

1. ``torch.profiler`` runs the step under a schedule (``wait`` idle steps, ``warmup`` steps recorded
   and thrown away, then ``steps`` recorded ones) with input shapes and memory recorded; the
   Chrome/Perfetto trace is exported when the active window closes.
2. The recorded events are split per step (the profiler's ``ProfilerStep#N`` ranges). The time of
   each *outermost* op (an aten op, collective or autograd node not nested in another one) goes to
   its category (``profile.categories``); on CPU the rest of the step (Python, dispatch between ops,
   waiting) is ``unattributed``, so the categories add up to the profiled step. When GPU
   kernels were recorded, kernel time is attributed to the op that launched them and step time with
   no kernel running is ``device_idle`` (kernels overlapping on several streams are scaled to the
   busy time, so categories still add up to the step).
3. One extra step (not in the trace) runs under ``FlopCounterMode`` and ``torchnitro.memory.track``:
   FLOPs per step and by category, and the live-memory peak by category. SDPA on CPU and causal
   attention get their formulas from ``profile.flops`` (torch counts 0 and the full square).
4. MFU divides the achieved FLOP/s by a GEMM peak measured in the same run (``profile.peak``: the
   best of plain-GEMM timings just before and just after the recorded steps, same dtype and threads),
   or ``ProfileConfig.peak_flops``; with neither, MFU is reported as unavailable.
5. A few unprofiled steps run right after the profiler closes, interleaved with the peak's GEMM
   timings: the profiled step is reported beside them, so the profiler's own cost is visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.profile.categories import category_of
from torchnitro.profile.peak import peak_of, probe_for
from torchnitro.profile.result import OpStat, Profile, findings

__all__ = ["ProfileConfig", "profile", "make_step", "OpRecord", "split_steps"]

_COUNTED = ("aten::", "c10d::", "nccl:", "gloo:", "autograd::engine::evaluate_function: ", "torch::autograd::")


@dataclass(frozen=True)
class ProfileConfig:
    warmup: int = 3  # steps recorded and thrown away: lazy init, allocator growth, autotuning
    steps: int = 5  # recorded steps; every number is per step (mean over these)
    wait: int = 0  # steps run before warm-up with the profiler idle (torch.profiler schedule)
    record_shapes: bool = True  # top ops list their input shapes
    profile_memory: bool = True  # allocations in the trace (Perfetto's memory view)
    count_flops: bool = True  # one extra step under FlopCounterMode: FLOPs, achieved FLOP/s, MFU
    track_memory: bool = True  # the same extra step under torchnitro.memory.track: peak by category
    peak_flops: float | None = None  # FLOP/s for MFU; None: measure it when measure_peak
    measure_peak: bool = True  # time a plain GEMM around the recorded steps for the peak (profile.peak)
    peak_timings: int = 4  # those GEMM timings, half before and half after the recorded steps
    peak_gemm: int | None = None  # side n of the (n, n) @ (n, n) GEMM timed; None: 1024 on CPU, 4096 on GPU
    unprofiled_steps: int = 3  # plain steps timed right after the profiler: what the profiled step is checked against
    dtype: str = "float32"  # which measured peak MFU is taken against (the model's dtype when given one)
    top: int = 15  # ops listed in the summary
    monitor: bool = True  # sample energy (RAPL / NVML) while the recorded steps run, where readable

    def __post_init__(self) -> None:
        for name, low in (("warmup", 0), ("steps", 1), ("wait", 0), ("top", 1), ("peak_timings", 1),
                          ("unprofiled_steps", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise InputError(f"ProfileConfig.{name}: received {v!r}; expected an integer >= {low}")
        if self.peak_gemm is not None and (not isinstance(self.peak_gemm, int) or self.peak_gemm < 1):
            raise InputError(f"ProfileConfig.peak_gemm: received {self.peak_gemm!r}; expected a GEMM side >= 1 or None")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise InputError(f"ProfileConfig.peak_flops: received {self.peak_flops!r}; expected FLOP/s > 0 or None")


@dataclass
class OpRecord:
    """One outermost op of a recorded step, as the aggregation needs it (times in microseconds)."""

    name: str
    start_us: float
    host_us: float  # time on the host, children included
    device_us: float = 0.0  # kernel time it launched, children included


@dataclass
class _Step:
    start_us: float
    end_us: float
    ops: list[OpRecord] = field(default_factory=list)
    kernels: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of GPU kernels


def make_step(model: nn.Module, inputs: Sequence[Any], *, train: bool = False) -> Callable[[], Any]:
    """The step ``profile(model, inputs)`` runs: a forward (no grad), or forward + backward + SGD update."""
    args = tuple(inputs)
    if not train:
        def infer() -> Any:
            with torch.inference_mode():
                return model(*args)
        return infer
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def train_step() -> Any:
        out = model(*args)
        loss = _loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return train_step


def _loss(out: Any) -> Tensor:
    """A scalar to backpropagate from whatever the model returned (its ``loss`` when it has one)."""
    if isinstance(out, Tensor):
        return out.float().mean()
    loss = getattr(out, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (
        out.to_tuple() if hasattr(out, "to_tuple") else ())
    tensors = [t for t in items if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        raise InputError(f"profile(train=True): the model returned {type(out).__name__} with no floating-point "
                         "tensor to backpropagate from; expected a tensor, a tuple/dict of tensors or an output "
                         "with .loss. Pass your own step function instead.")
    return tensors[0].float().mean()


def _counted(name: str) -> bool:
    return name.startswith(_COUNTED)


def _events_to_steps(events: Any) -> list[_Step]:
    """ProfilerStep ranges with their outermost ops and GPU kernel intervals."""
    steps = [_Step(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")]
    steps.sort(key=lambda s: s.start_us)
    ops: list[OpRecord] = []
    kernels: list[tuple[float, float]] = []
    for e in events:
        if getattr(e.device_type, "name", "CPU") != "CPU":  # a GPU kernel or memcpy
            kernels.append((e.time_range.start, e.time_range.end))
            continue
        if not _counted(e.name):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if _counted(parent.name):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            dev = getattr(e, "device_time_total", None)
            dev = getattr(e, "cuda_time_total", 0.0) if dev is None else dev
            ops.append(OpRecord(e.name, e.time_range.start, e.cpu_time_total, float(dev or 0.0)))
    return split_steps(steps, ops, kernels)


def split_steps(steps: list[_Step], ops: list[OpRecord], kernels: list[tuple[float, float]]) -> list[_Step]:
    """Assign ops (by start) and kernels (clipped) to the step ranges they fall in."""
    for s in steps:
        s.ops = [o for o in ops if s.start_us <= o.start_us < s.end_us]
        s.kernels = [(max(a, s.start_us), min(b, s.end_us)) for a, b in kernels if b > s.start_us and a < s.end_us]
    return steps


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_categories(step: _Step, device_clock: bool) -> dict[str, float]:
    """Microseconds by category for one step; the values add up to the step's duration."""
    dur = step.end_us - step.start_us
    cats: dict[str, float] = defaultdict(float)
    for o in step.ops:
        cats[category_of(o.name)] += o.device_us if device_clock else o.host_us
    used = sum(cats.values())
    if device_clock:
        busy = _union_us(step.kernels)
        if used > busy > 0:  # overlapping streams: scale the op shares onto the busy time
            cats = defaultdict(float, {k: v * busy / used for k, v in cats.items()})
            used = busy
        cats["device_idle"] += max(0.0, dur - used)
    else:
        cats["unattributed"] += max(0.0, dur - used)
    scale = dur / sum(cats.values()) if sum(cats.values()) > dur > 0 else 1.0  # nested threads overlapping
    return {k: v * scale for k, v in cats.items()}


def _top_ops(events: Any, device_clock: bool, n_steps: int, step_s: float, top: int) -> list[OpStat]:
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if getattr(e.device_type, "name", "CPU") != "CPU" or not _counted(e.name):
            continue
        t = (getattr(e, "self_device_time_total", 0.0) or 0.0) if device_clock else e.self_cpu_time_total
        shapes = ", ".join(str(list(s)) for s in (e.input_shapes or []) if s) if e.input_shapes else ""
        a = agg[(e.name, shapes)]
        a[0] += t
        a[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return [OpStat(name, category_of(name), shapes, calls / n_steps, t / 1e6 / n_steps,
                   (t / 1e6 / n_steps) / step_s if step_s > 0 else 0.0) for (name, shapes), (t, calls) in rows]


def _flop_category(op: Any) -> str:
    return category_of(str(op).replace("aten.", "aten::"))


@contextlib.contextmanager
def _accounting(model: nn.Module | None, flops: bool, memory: bool) -> Iterator[dict[str, Any]]:
    """FLOPs and live memory of one step, counted by dispatch modes (both run on CPU and GPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torchnitro.memory.tracker import track
    from torchnitro.profile.flops import attention_mapping

    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        fc = stack.enter_context(FlopCounterMode(display=False, custom_mapping=attention_mapping())) if flops else None
        tr = stack.enter_context(track(model)) if memory else None
        yield out
    if fc is not None:
        by_cat: dict[str, int] = defaultdict(int)
        for op, n in fc.get_flop_counts().get("Global", {}).items():
            by_cat[_flop_category(op)] += int(n)
        out["flops"], out["flops_by_category"] = int(fc.get_total_flops()), dict(by_cat)
    if tr is not None:
        rep = tr.report()
        out["memory"] = {"peak_bytes": rep.peak.bytes, "by_category": dict(rep.peak.by_category),
                         "source": "torchnitro.memory.track (live tensor bytes, one step)"}


def _environment(device: str) -> dict[str, str]:
    from torchnitro.bench.provenance import git_commit, machine_description, package_versions

    return {"machine": machine_description(device), "versions": package_versions(("torch", "triton")),
            "torch threads": str(torch.get_num_threads()), "commit": git_commit()}


def profile(target: Callable[[], Any] | nn.Module, example_inputs: Any = None, config: ProfileConfig | None = None,
            *, warmup: int | None = None, steps: int | None = None, train: bool = False) -> Profile:
    """Profile a step: ``profile(step_fn, warmup=5, steps=10)`` or ``profile(model, example_inputs)``.

    ``step_fn`` takes no arguments and runs one whole step (close over model, data and optimizer).
    With a model, the step is a forward under ``inference_mode``, or with ``train=True`` forward +
    backward + an SGD update. ``warmup``/``steps`` override the config's.
    """
    cfg = config or ProfileConfig()
    overrides = {k: v for k, v in (("warmup", warmup), ("steps", steps)) if v is not None}
    model = target if isinstance(target, nn.Module) else None
    if model is not None:
        if example_inputs is None:
            raise InputError("profile(model): received no example_inputs; expected profile(model, example_inputs)")
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        step = make_step(model, inputs, train=train)
        numel: dict[str, int] = defaultdict(int)
        for prm in model.parameters():
            numel[str(prm.dtype).removeprefix("torch.")] += prm.numel()
        if numel and cfg.peak_flops is None:  # MFU against the peak of the dtype most weights have
            overrides["dtype"] = max(numel, key=numel.__getitem__)
    elif callable(target):
        if example_inputs is not None or train:
            raise InputError("profile(step_fn, example_inputs / train=True): a step function takes no inputs and "
                             "is run as it is; close over the inputs and write the backward into it, or pass an "
                             "nn.Module with its example inputs")
        step = target
    else:
        raise InputError(f"profile: received {type(target).__name__}; expected a step function (no arguments) "
                         "or an nn.Module with example inputs")
    # a step function may use the GPU, so it is recorded whenever there is one
    cuda = torch.cuda.is_available() and (model is None or any(p.is_cuda for p in model.parameters()))
    return _run(step, model, dataclasses.replace(cfg, **overrides), cuda)


def _call(step: Callable[[], Any], when: str) -> Any:
    try:
        return step()
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"the profiled step raised {type(exc).__name__} during {when}: {exc}; expected the step "
                         "to run on its own (run it once outside the profiler to debug)") from exc


def _run(step: Callable[[], Any], model: nn.Module | None, cfg: ProfileConfig, cuda: bool) -> Profile:
    from torch.profiler import ProfilerActivity

    device = "cuda" if cuda else "cpu"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fd, trace = tempfile.mkstemp(prefix="torchnitro-trace-", suffix=".json")
    os.close(fd)
    try:
        return _record(step, model, cfg, device, acts, trace)
    except BaseException:
        _remove(trace)
        raise


def _record(step: Callable[[], Any], model: nn.Module | None, cfg: ProfileConfig, device: str, acts: list[Any],
            trace: str) -> Profile:
    from torch.profiler import schedule

    from torchnitro.bench.timing import synchronize
    from torchnitro.profile.monitor import monitors

    got: dict[str, Any] = {}

    def ready(p: Any) -> None:
        got["events"] = p.events()
        p.export_chrome_trace(trace)

    total = cfg.wait + cfg.warmup + cfg.steps
    probe = probe_for(cfg, device)  # half its GEMM timings now, half after the recorded steps
    sampler = monitors(device) if cfg.monitor else None
    try:
        with torch.profiler.profile(activities=acts, record_shapes=cfg.record_shapes,
                                    profile_memory=cfg.profile_memory, on_trace_ready=ready,
                                    schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.steps, repeat=1)
                                    ) as prof:
            for i in range(total):
                if sampler is not None and i == cfg.wait + cfg.warmup:
                    synchronize(device)
                    sampler.start()
                _call(step, f"profiled step {i}")
                synchronize(device)
                prof.step()
    finally:  # a step that raises must not leave a sampler thread running
        monitor = sampler.stop(cfg.steps) if sampler is not None else {}
    if "events" not in got:
        raise InputError(f"torch.profiler recorded no active window over {total} steps; expected one")
    plain = _unprofiled(step, cfg, device, probe)
    acc: dict[str, Any] = {}
    if cfg.count_flops or cfg.track_memory:
        with _accounting(model, cfg.count_flops, cfg.track_memory) as acc:
            _call(step, "the FLOP/memory counting step")
    return _build(got["events"], cfg, device, trace, acc, monitor, plain, probe)


def _unprofiled(step: Callable[[], Any], cfg: ProfileConfig, device: str, probe: Any) -> list[float]:
    """Seconds of plain steps (same sync as the profiled ones), alternating with the peak's remaining timings."""
    import time

    from torchnitro.bench.timing import synchronize

    out: list[float] = []
    left = cfg.peak_timings // 2 if probe is not None else 0
    for i in range(max(cfg.unprofiled_steps, left)):
        if i < cfg.unprofiled_steps:
            synchronize(device)
            t = time.perf_counter()
            _call(step, f"unprofiled step {i}")
            synchronize(device)
            out.append(time.perf_counter() - t)
        if i < left:
            probe.sample(1)
    return out


def _build(events: Any, cfg: ProfileConfig, device: str, trace: str, acc: dict[str, Any],
           monitor: dict[str, Any], plain: list[float], probe: Any) -> Profile:
    device_clock = any(getattr(e.device_type, "name", "CPU") != "CPU" for e in events)
    steps = [s for s in _events_to_steps(events) if s.end_us > s.start_us][-cfg.steps:]
    if not steps:
        raise InputError("torch.profiler recorded no step ranges; expected ProfilerStep events in the trace")
    per_step = [step_categories(s, device_clock) for s in steps]
    names = sorted({k for d in per_step for k in d})
    cats = {k: statistics.fmean(d.get(k, 0.0) for d in per_step) / 1e6 for k in names}
    times = [(s.end_us - s.start_us) / 1e6 for s in steps]
    step_s = statistics.fmean(times)
    peak, source, peak_info = peak_of(cfg, probe, acc.get("flops"), times) if acc.get("flops") is not None else \
        (None, "FLOPs not counted", {})
    if device == "cuda":
        from torchnitro.hardware import hardware_info

        dev_name = hardware_info().gpu_name or "cuda"
    else:
        dev_name = "cpu"
    p = Profile(device=dev_name, clock="device" if device_clock else "cpu", warmup=cfg.warmup, steps=len(steps),
                step_time_s=step_s, step_times_s=times, categories=cats,
                top_ops=_top_ops(events, device_clock, len(steps), step_s, cfg.top),
                flops=acc.get("flops"), flops_by_category=acc.get("flops_by_category", {}),
                peak_flops=peak, peak_source=source, peak=peak_info, unprofiled_step_times_s=plain,
                memory=acc.get("memory", {}), monitor=monitor,
                environment=_environment(device), trace_path=trace)
    p.trace_analysis = _analyze(trace)
    p.findings = findings(p)
    weakref.finalize(p, _remove, trace)  # the temp trace goes with the Profile; save() keeps a copy
    return p


def _analyze(trace: str) -> dict[str, Any]:
    """The trace analysis of the exported trace; a failure there is a warning, never a lost profile."""
    import warnings

    from torchnitro.profile.trace import analyze_trace

    try:
        return analyze_trace(trace).to_dict()
    except Exception as exc:  # the profile itself is complete without it
        warnings.warn(f"trace analysis of {trace} failed ({type(exc).__name__}: {exc}); the profile has none",
                      stacklevel=3)
        return {}


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
