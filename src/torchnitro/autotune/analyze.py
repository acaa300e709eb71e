"""``torchnitro.analyze(model, inputs)``: what the model costs, what this machine can do, what to fix.

- size: parameters and their bytes;
- work: FLOPs of one forward (``torch.utils.flop_counter.FlopCounterMode``);
- machine: measured peak GEMM FLOP/s (fp32, and bf16/fp16 where native) and memory bandwidth (a large
  copy), timed with ``torchnitro.bench`` and cached per process and device;
- roofline: ``max(FLOPs / peak, bytes / bandwidth)`` with bytes = parameters + every activation written
  and read once, against the measured eager latency ("eager is 3.1x from its roofline");
- findings: layer dims that are not multiples of 8 / 64 (tensor-core and SIMD alignment), attention
  built from matmul + softmax instead of ``scaled_dot_product_attention``, Linear + activation and
  Conv + BatchNorm (+ ReLU) chains a compiler or recipe can fuse, dropout or training mode left on.

The op chains are recorded with a ``TorchFunctionMode`` during one forward, so functional calls
(``F.gelu``) count as well as modules.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from torchnitro.bench import TimingConfig, measure
from torchnitro.errors import InputError
from torchnitro.hardware import roofline_gemm_n

__all__ = ["Analysis", "Finding", "MachineRoofline", "analyze", "machine_roofline", "trace_ops"]

_ACTS = {"gelu", "relu", "relu_", "silu", "tanh", "sigmoid", "hardswish", "mish", "leaky_relu", "elu"}
_TIMING = TimingConfig(warmup=2, warmup_s=0.05, min_iters=5, min_time_s=0.3, max_time_s=5.0)


@dataclass
class Finding:
    kind: str  # alignment | attention | fusion | training | dropout
    severity: str  # info | warn
    message: str  # one sentence: what, and what to do
    where: list[str] = field(default_factory=list)  # module names or op chains (first few)


@dataclass(frozen=True)
class MachineRoofline:
    device: str
    peak_flops: dict[str, float]  # dtype -> measured GEMM FLOP/s
    bandwidth: float  # measured bytes/s of a large copy (read + write)


@dataclass
class Analysis:
    parameters: int
    parameter_bytes: int
    flops: int  # one forward on the example inputs
    activation_bytes: int  # sum of op outputs (each written once, read at least once)
    dtype: str  # dtype of most parameters (sets the roofline's peak)
    inputs: str  # signature of the example inputs
    machine: MachineRoofline | None = None
    eager_s: float | None = None  # median eager latency
    findings: list[Finding] = field(default_factory=list)

    @property
    def compute_s(self) -> float | None:
        if self.machine is None:
            return None
        peak = self.machine.peak_flops.get(self.dtype) or self.machine.peak_flops.get("float32")
        return self.flops / peak if peak else None

    @property
    def memory_s(self) -> float | None:
        if self.machine is None or not self.machine.bandwidth:
            return None
        return (self.parameter_bytes + 2 * self.activation_bytes) / self.machine.bandwidth

    @property
    def roofline_s(self) -> float | None:
        """The faster-than-this-is-impossible estimate: max of compute time and memory time."""
        c, m = self.compute_s, self.memory_s
        return None if c is None or m is None else max(c, m)

    @property
    def bound(self) -> str | None:
        c, m = self.compute_s, self.memory_s
        return None if c is None or m is None else ("compute" if c >= m else "memory")

    @property
    def gap(self) -> float | None:
        """Eager latency / roofline (1.0 = at the roofline)."""
        r = self.roofline_s
        return self.eager_s / r if self.eager_s and r else None

    @property
    def achieved_flops(self) -> float | None:
        return self.flops / self.eager_s if self.eager_s else None

    def summary_rows(self) -> list[tuple[str, str]]:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.3f} ms"

        rows = [("inputs", self.inputs), ("parameters", f"{self.parameters:,} ({self.parameter_bytes / 2**20:.1f} MiB, {self.dtype})"),
                ("FLOPs / forward", f"{self.flops / 1e9:.3f} GFLOP"),
                ("activation bytes", f"{self.activation_bytes / 2**20:.1f} MiB")]
        if self.machine is not None:
            peaks = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in self.machine.peak_flops.items())
            rows += [("machine", self.machine.device), ("peak GEMM GFLOP/s (measured)", peaks),
                     ("memory bandwidth (measured)", f"{self.machine.bandwidth / 1e9:.1f} GB/s"),
                     ("roofline: compute / memory", f"{ms(self.compute_s)} / {ms(self.memory_s)} ({self.bound}-bound)")]
        rows.append(("eager latency (median)", ms(self.eager_s)))
        if self.gap is not None:
            rows.append(("eager vs roofline", f"{self.gap:.2f}x slower than the roofline "
                         f"({(self.achieved_flops or 0) / 1e9:.0f} GFLOP/s achieved)"))
        return rows

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(compute_s=self.compute_s, memory_s=self.memory_s, roofline_s=self.roofline_s, bound=self.bound,
                 gap=self.gap, achieved_flops=self.achieved_flops)
        return d

    def to_markdown(self) -> str:
        lines = ["### analysis", "", "| item | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in self.summary_rows()]
        lines += ["", "#### findings", ""]
        if not self.findings:
            lines.append("- none")
        for f in self.findings:
            where = f" ({', '.join(f.where[:4])}{', ...' if len(f.where) > 4 else ''})" if f.where else ""
            lines.append(f"- **{f.kind}** [{f.severity}]: {f.message}{where}")
        return "\n".join(lines) + "\n"

    def rich(self):  # -> rich.console.Group
        from rich.console import Group
        from rich.table import Table

        t = Table(title="analysis")
        t.add_column("item")
        t.add_column("value")
        for k, v in self.summary_rows():
            t.add_row(k, v)
        ft = Table(title="findings")
        for c in ("kind", "severity", "message", "where"):
            ft.add_column(c)
        for f in self.findings:
            ft.add_row(f.kind, f.severity, f.message, ", ".join(f.where[:4]) + (" ..." if len(f.where) > 4 else ""))
        return Group(t, ft)


# ---- the machine -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def machine_roofline(device: str = "cpu") -> MachineRoofline:
    """Measured peak GEMM FLOP/s per dtype and copy bandwidth of ``device`` (cached per process)."""
    from torchnitro.hardware import hardware_info

    dev = torch.device(device)
    cfg = TimingConfig(**{**asdict(_TIMING), "device": dev.type})
    n = roofline_gemm_n(dev.type)
    dtypes = [torch.float32]
    hw = hardware_info()
    if dev.type == "cuda":
        dtypes += [torch.float16, torch.bfloat16]
    elif hw.cpu_bf16:
        dtypes.append(torch.bfloat16)
    peaks: dict[str, float] = {}
    for dt in dtypes:
        a = torch.randn(n, n, device=dev).to(dt)
        b = torch.randn(n, n, device=dev).to(dt)
        t = measure(lambda: torch.mm(a, b), cfg)
        peaks[str(dt).replace("torch.", "")] = 2 * n**3 / t.median
    src = torch.empty(128 * 2**20 // 4, device=dev)  # 128 MiB each way: beyond server L3 caches (~100 MiB)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), cfg)
    name = hw.gpu_name if dev.type == "cuda" and hw.gpu_name else f"{hw.cpu_name} ({hw.cpu_cores} cores)"
    return MachineRoofline(name, peaks, 2 * src.numel() * src.element_size() / t.median)


# ---- op trace ----------------------------------------------------------------------------------

class _Trace(TorchFunctionMode):
    """Records (op name, producer op indices of tensor args) for every torch function called."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[int]]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.out_bytes = 0
        self._recent: collections.OrderedDict[int, tuple[int, Tensor]] = collections.OrderedDict()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name.startswith("__") or name in ("size", "dim", "numel", "is_floating_point", "__get__"):
            return out
        srcs = []
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, Tensor) and id(a) in self._recent:
                srcs.append(self._recent[id(a)][0])
        idx = len(self.ops)
        self.ops.append((name, srcs))
        self.kwargs.append({k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float))})
        if name == "dropout" and len(args) >= 3:
            self.kwargs[-1]["p"], self.kwargs[-1]["training"] = args[1], args[2]
        if isinstance(out, Tensor):
            self.out_bytes += out.numel() * out.element_size()
            self._recent[id(out)] = (idx, out)  # hold the tensor so its id is not reused
            if len(self._recent) > 256:
                self._recent.popitem(last=False)
        return out


def trace_ops(model: nn.Module, inputs: tuple[Any, ...]) -> _Trace:
    tr = _Trace()
    with torch.no_grad(), tr:
        model(*inputs)
    tr._recent.clear()
    return tr


def _chains(tr: _Trace) -> dict[str, list[str]]:
    """Fusable producer -> consumer chains, by kind."""
    found: dict[str, list[str]] = {"linear_act": [], "conv_bn": [], "conv_bn_relu": []}
    for i, (name, srcs) in enumerate(tr.ops):
        producers = [tr.ops[s][0] for s in srcs]
        if name in _ACTS and "linear" in producers:
            found["linear_act"].append(f"linear->{name}")
        if name == "batch_norm" and any(p.startswith("conv") for p in producers):
            found["conv_bn"].append(f"op{i}")
        if name in ("relu", "relu_") and any(tr.ops[s][0] == "batch_norm" and
                                             any(tr.ops[q][0].startswith("conv") for q in tr.ops[s][1]) for s in srcs):
            found["conv_bn_relu"].append(f"op{i}")
    return found


# ---- findings ----------------------------------------------------------------------------------

def _alignment(model: nn.Module, inputs: tuple[Any, ...]) -> list[Finding]:
    off8, off64 = [], []
    for name, m in model.named_modules():
        dims: list[int] = []
        if isinstance(m, nn.Linear):
            dims = [m.in_features, m.out_features]
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            dims = [m.in_channels, m.out_channels]
        elif isinstance(m, nn.Embedding):
            dims = [m.embedding_dim]
        if any(d % 8 for d in dims):
            off8.append(f"{name or type(m).__name__} {tuple(dims)}")
        elif any(d % 64 for d in dims):
            off64.append(f"{name or type(m).__name__} {tuple(dims)}")
    out = []
    if off8:
        out.append(Finding("alignment", "warn", f"{len(off8)} layer(s) have dims that are not multiples of 8; tensor "
                           "cores and SIMD GEMMs pad or fall back. Pad the dims (e.g. vocab to a multiple of 64).", off8))
    if off64:
        out.append(Finding("alignment", "info", f"{len(off64)} layer(s) have dims that are multiples of 8 but not 64; "
                           "GEMM tiles are 64-wide, so some compute is wasted.", off64))
    odd = [f"input {i} {tuple(x.shape)}" for i, x in enumerate(inputs)
           if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[-1] % 8 and x.is_floating_point()]
    if odd:
        out.append(Finding("alignment", "info", "the last input dim is not a multiple of 8; pad it (or the sequence "
                           "length) so kernels use aligned tiles.", odd))
    return out


def _op_findings(model: nn.Module, tr: _Trace) -> list[Finding]:
    out = []
    names = [n for n, _ in tr.ops]
    if "softmax" in names and "scaled_dot_product_attention" not in names and any(
            n in ("matmul", "bmm", "einsum", "baddbmm") for n in names):
        out.append(Finding("attention", "warn", "attention is computed with matmul + softmax; "
                           "F.scaled_dot_product_attention uses fused flash / memory-efficient kernels "
                           "(HF: attn_implementation='sdpa').", [f"{names.count('softmax')} softmax call(s)"]))
    ch = _chains(tr)
    if ch["linear_act"]:
        kinds = collections.Counter(ch["linear_act"])
        out.append(Finding("fusion", "info", f"{len(ch['linear_act'])} Linear+activation pair(s): a fused GEMM epilogue "
                           "(torch.compile, torchnitro FusedLinearGELU) saves one activation round trip each.",
                           [f"{k} x{v}" for k, v in kinds.items()]))
    if ch["conv_bn"]:
        relu = len(ch["conv_bn_relu"])
        out.append(Finding("fusion", "info", f"{len(ch['conv_bn'])} Conv+BatchNorm pair(s) ({relu} followed by ReLU): "
                           "fold BN into the conv weights for inference (the conv-bn-fold recipe).",
                           [f"conv->batch_norm x{len(ch['conv_bn'])}", f"conv->batch_norm->relu x{relu}"]))
    if model.training:
        out.append(Finding("training", "warn", "the model is in training mode; call model.eval() for inference "
                           "(dropout and BatchNorm statistics change the outputs and the speed).", []))
    drops = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training]
    fdrop = sum(1 for (n, _), kw in zip(tr.ops, tr.kwargs) if n == "dropout" and kw.get("training") and kw.get("p", 0) > 0)
    if drops or fdrop:
        out.append(Finding("dropout", "warn", f"dropout is active ({len(drops)} module(s), {fdrop} functional call(s)); "
                           "it randomises outputs and costs a mask per call. Use model.eval().", drops))
    return out


def _dominant_dtype(model: nn.Module) -> str:
    count: collections.Counter[str] = collections.Counter()
    for p in model.parameters():
        count[str(p.dtype).replace("torch.", "")] += p.numel()
    return count.most_common(1)[0][0] if count else "float32"


def analyze(model: nn.Module, example_inputs: Any, *, measure_machine: bool = True,
            timing: TimingConfig | None = None) -> Analysis:
    """Size, FLOPs, roofline and findings of ``model`` on ``example_inputs`` (see the module doc)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torchnitro.autotune.inputs import input_signature

    if not isinstance(model, nn.Module):
        raise InputError(f"analyze: received {type(model).__name__}; expected a torch.nn.Module")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (
        tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,))
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    try:
        with torch.no_grad():
            fc = FlopCounterMode(display=False)
            with fc:
                model(*inputs)
        tr = trace_ops(model, inputs)
    except Exception as exc:
        raise InputError(f"analyze: the model raised {type(exc).__name__}: {exc} on inputs {input_signature(inputs)}; "
                         "expected it to run on the example inputs. Check shapes and dtypes.") from exc
    a = Analysis(parameters=n_params, parameter_bytes=p_bytes, flops=int(fc.get_total_flops()),
                 activation_bytes=int(tr.out_bytes), dtype=_dominant_dtype(model), inputs=input_signature(inputs))
    a.findings = _alignment(model, inputs) + _op_findings(model, tr)
    if measure_machine:
        dev = next((x.device for x in inputs if isinstance(x, Tensor)), torch.device("cpu"))
        a.machine = machine_roofline(str(dev.type))
        cfg = timing or TimingConfig(**{**asdict(_TIMING), "device": dev.type})
        with torch.inference_mode():
            a.eager_s = measure(lambda: model(*inputs), cfg).median
    return a
