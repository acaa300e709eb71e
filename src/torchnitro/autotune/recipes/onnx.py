"""ONNX export + ONNX Runtime (all graph optimisations, intra-op threads = usable cores), and ORT
dynamic int8 quantisation with per-channel weight scales. Both run in a subprocess during the search
(native code that can crash) and are standalone artifacts (``model.onnx``).

Spinning: ORT's idle intra-op threads spin after each call by default, which is often fastest alone
but takes the cores from anything else timed in the same process (issue 14: eager looked 1.5-2x
slower right after an ORT call). The build times the session alone with spinning on and off and
stores the faster in ``meta["ort_spinning"]`` (what a deployed artifact uses); inside
``bench.isolated.shared_process()`` (the search) a session never spins."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import is_dataclass
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from torchnitro.autotune.failure import clean_line
from torchnitro.autotune.limits import timed_out
from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._layout import FlatProgram, flat_call, input_layout, is_flat
from torchnitro.autotune.recipes._util import output_kind, restructure
from torchnitro.autotune.verify import flatten_outputs
from torchnitro.bench.isolated import process_is_shared
from torchnitro.bench.timing import Timing, TimingConfig, measure
from torchnitro.hardware import HardwareInfo

__all__ = ["OnnxRuntime", "OnnxRuntimeInt8", "export_onnx", "OrtRunner", "choose_spinning"]


class _GivenOnly(nn.Module):
    """The model called with exactly the inputs given, its outputs as the flat tensors ``output_kind`` names.
    The TorchScript-based exporter binds every defaulted forward argument it was not given, so a default such
    as ``scale=1.0`` became a graph input that no call feeds (ORT: "Required inputs ... are missing");
    through ``*inputs`` the defaults stay constants. Neither exporter takes a user's dataclass output."""

    def __init__(self, model: nn.Module, flat_outputs: bool):
        super().__init__()
        self.model, self.flat_outputs = model, flat_outputs
        self.train(model.training)

    def forward(self, *inputs: Any) -> Any:
        out = self.model(*inputs)
        return tuple(t for _, t in flatten_outputs(out)) if self.flat_outputs else out


def export_onnx(model: nn.Module, inputs: tuple[Any, ...], path: Path, dynamic_dims: dict[int, list[int]]) -> dict[str, Any]:
    """Export with dynamic axes; TorchScript-based exporter first (fast), dynamo exporter as fallback.

    Structured inputs (a feature dict, ``_layout``) are exported as their flat tensors, and the meta's
    ``input_layout`` tells the runner how to flatten a call; tensor inputs are exported as they are."""
    layout = None
    if is_flat(inputs):
        with torch.no_grad():
            out = model(*inputs)
        if is_dataclass(out) and not isinstance(out, dict):  # neither exporter takes it (an HF ModelOutput does)
            model = _GivenOnly(model, flat_outputs=True)
    else:
        layout, out = input_layout(model, inputs)
        dynamic_dims = layout.dynamic_dims(inputs, dynamic_dims)
        model, inputs = FlatProgram(model, layout), tuple(layout.take(inputs))
    kind = output_kind(out)
    in_names = [f"input_{i}" for i in range(len(inputs))]
    out_names = [f"output_{i}" for i in range(len(kind["names"]))]
    axes = {in_names[i]: {d: f"in{i}_d{d}" for d in dims} for i, dims in dynamic_dims.items() if i < len(inputs)}
    exporter = _export_file(model, inputs, path, in_names, out_names, axes, dynamic_dims)
    if not isinstance(model, (_GivenOnly, FlatProgram)) and _unfed_inputs(path, in_names):
        # a defaulted forward argument (``scale=1.0``) became a graph input no call feeds: export again
        # through ``*inputs`` (not by default: that changes some HF traces, e.g. GPT-2's ``logits_to_keep``)
        exporter = _export_file(_GivenOnly(model, flat_outputs=False), inputs, path, in_names, out_names, axes,
                                dynamic_dims)
    meta = {"output_kind": kind, "input_names": in_names, "exporter": exporter}
    if layout is not None:
        meta["input_layout"] = layout.to_meta()
    return meta


def _export_file(model: nn.Module, inputs: tuple[Any, ...], path: Path, in_names: list[str], out_names: list[str],
                 axes: dict[str, dict[int, str]], dynamic_dims: dict[int, list[int]]) -> str:
    """One ONNX export to ``path``: the TorchScript-based exporter, else the dynamo one; returns which."""
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, inputs, str(path), dynamo=False, input_names=in_names, output_names=out_names,
                              dynamic_axes=axes or None, opset_version=17, do_constant_folding=True)
            why = _traced_size(model, inputs, path, in_names, out_names, axes, dynamic_dims)
            if why is None:
                return "torchscript"
            raise RuntimeError(why)
        except Exception as exc:  # noqa: BLE001 - try the other exporter
            if timed_out(exc) is not None:
                raise  # the time limit, not the exporter: no second export on the clock
            errors.append(clean_line(f"torchscript exporter: {type(exc).__name__}: {exc}", limit=300))
            from torch.export import Dim

            shapes = tuple({d: Dim.AUTO for d in dynamic_dims.get(i, [])} for i in range(len(inputs)))
            try:
                torch.onnx.export(model, inputs, str(path), dynamo=True, input_names=in_names,
                                  output_names=out_names, dynamic_shapes=shapes, external_data=False)
            except Exception as exc2:
                if timed_out(exc2) is not None:
                    raise
                errors.append(clean_line(f"dynamo exporter: {type(exc2).__name__}: {exc2}", limit=300))
                raise RuntimeError("ONNX export failed: " + " | ".join(errors)) from exc2
            return "dynamo"


def _traced_size(model: nn.Module, inputs: tuple[Any, ...], path: Path, in_names: list[str], out_names: list[str],
                 axes: dict[str, dict[int, str]], dynamic_dims: dict[int, list[int]]) -> str | None:
    """Why the TorchScript exporter's graph at ``path`` cannot be trusted at another length, or None.

    A trace records Python ints: a reshape to the example's length (``nn.MultiheadAttention``'s) is a
    constant, and the graph failed on the next batch of another length. Where a dim past the batch is
    dynamic, the model is exported again one shorter along it: a graph that does not depend on the length
    comes out the same; one that does differs, and the dynamo exporter (symbolic sizes) is used instead."""
    import onnx

    shorter = []
    for i, t in enumerate(inputs):
        for d in [d for d in dynamic_dims.get(i, []) if 0 < d < t.dim() and t.shape[d] > 2]:
            t = t.narrow(d, 0, t.shape[d] - 1)
        shorter.append(t)
    if all(a is b for a, b in zip(shorter, inputs)):
        return None  # only the batch varies: a trace does not depend on it here
    other = path.with_name(path.stem + "_shorter.onnx")
    try:
        torch.onnx.export(model, tuple(shorter), str(other), dynamo=False, input_names=in_names,
                          output_names=out_names, dynamic_axes=axes or None, opset_version=17, do_constant_folding=True)
        same = onnx.load(str(path)).graph.SerializeToString() == onnx.load(str(other)).graph.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - the model does not take a shorter input: nothing to compare
        if timed_out(exc) is not None:
            raise
        return None
    finally:
        other.unlink(missing_ok=True)
    return None if same else "its graph changes with the input's length (a traced size), so it would fail at another one"


def _unfed_inputs(path: Path, in_names: list[str]) -> list[str]:
    """Graph inputs of the file at ``path`` that are not among the names a call feeds."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in in_names and i.name not in inits]


class OrtRunner:
    """Callable wrapper of an ORT session: torch tensors in, torch tensors out (eager's structure).

    ``spinning``: whether idle intra-op threads spin between calls. None: the choice the build measured
    (``meta["ort_spinning"]``, ORT's default of on when absent), and never inside ``shared_process()``."""

    def __init__(self, path: Path, meta: dict[str, Any], threads: int, spinning: bool | None = None):
        import onnxruntime as ort

        if spinning is None:
            spinning = bool(meta.get("ort_spinning", True)) and not process_is_shared()
        self.spinning = spinning
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = max(1, threads)
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        if not torch.cuda.is_available():
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), so, providers=providers)
        graph_inputs = [i.name for i in self.session.get_inputs()]
        # by the export's names: an input the graph does not read may have been dropped from it
        self.input_names = [n if n in graph_inputs else None for n in meta.get("input_names", graph_inputs)]
        self.kind = meta["output_kind"]
        self.layout = meta.get("input_layout")  # structured inputs: how a call is flattened

    def __call__(self, *xs: Any) -> Any:
        feed = {n: (x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x))
                for n, x in zip(self.input_names, flat_call(self.layout, xs)) if n is not None}
        outs = self.session.run(None, feed)
        return restructure(self.kind, [torch.from_numpy(np.ascontiguousarray(o)) for o in outs])


def _ort_missing() -> str | None:
    for mod in ("onnx", "onnxruntime"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install 'torchnitro[onnx]')"
    return None


def _onnx_from(ctx: BuildContext, path: Path) -> dict[str, Any]:
    """The model as ONNX at ``path``: in a child process the export the search prepared (shared by
    both recipes; the child has no model object), else a fresh export. Returns the export's meta."""
    if ctx.program is not None and ctx.program.kind == "onnx":
        shutil.copyfile(ctx.program.path, path)
        return dict(ctx.program.meta)
    return export_onnx(ctx.model, ctx.example_inputs, path, ctx.dynamic_dims)


def _threads(ctx: BuildContext) -> int:
    return ctx.config.resolved_threads() if ctx.config is not None else ctx.hardware.cpu_cores


_SPIN_TIMING = TimingConfig(warmup=2, warmup_s=0.0, min_iters=5, min_time_s=0.2, max_time_s=1.0)


def choose_spinning(path: Path, meta: dict[str, Any], inputs: tuple[Any, ...]) -> OrtRunner:
    """Time the session alone with spinning on, then off; store the choice in ``meta`` and return a runner.

    Spinning is kept only when it wins by more than the noise (3% or the cv): a spinning pool costs
    cores that a server's other threads (batcher, HTTP) may need."""
    times: dict[bool, Timing] = {}
    for spin in (True, False):  # one session at a time: a live spinning pool would slow the other
        runner = OrtRunner(path, meta, meta["threads"], spinning=spin)
        times[spin] = measure(lambda: runner(*inputs), _SPIN_TIMING)
    on, off = times[True], times[False]
    meta["ort_spinning"] = on.median < off.median * (1 - max(0.03, off.cv))
    meta["ort_spin_p50_ms"] = {"on": on.median * 1e3, "off": off.median * 1e3}
    if meta["ort_spinning"] and not process_is_shared():
        runner = OrtRunner(path, meta, meta["threads"])
    return runner  # the spinning-off session when that is what this process should run


def _built(ctx: BuildContext, meta: dict[str, Any], notes: str) -> Built:
    meta["threads"] = _threads(ctx)
    runner = choose_spinning(ctx.workdir / "model.onnx", meta, ctx.example_inputs)
    ms = meta["ort_spin_p50_ms"]
    spin = f"spinning {'on' if meta['ort_spinning'] else 'off'} ({ms['on']:.2f} vs {ms['off']:.2f} ms alone)"
    return Built(runner, ["model.onnx"], meta, standalone=True, notes=f"{notes}; {spin}")


@register_recipe
class OnnxRuntime(Recipe):
    name = "onnxruntime"
    numeric_class = NumericClass.EXACT
    description = "ONNX export + ONNX Runtime, graph optimisations on, intra-op threads = cores"
    isolate = True
    isolated_input = "onnx"
    order = 20
    version = "2"  # meta records the measured spinning choice

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return _ort_missing()

    def build(self, ctx: BuildContext) -> Built:
        meta = _onnx_from(ctx, ctx.workdir / "model.onnx")
        return _built(ctx, meta, f"{meta['exporter']} exporter")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return OrtRunner(directory / "model.onnx", meta, meta.get("threads", 1))


@register_recipe
class OnnxRuntimeInt8(Recipe):
    name = "onnxruntime-int8"
    numeric_class = NumericClass.INT8
    description = "ONNX Runtime dynamic int8 (per-channel weights, activations quantised per call)"
    isolate = True
    isolated_input = "onnx"
    order = 40
    version = "2"  # meta records the measured spinning choice

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return _ort_missing()

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(isinstance(m, (nn.Linear, nn.Conv2d, nn.Conv1d)) for m in model.modules()):
            return "no Linear/Conv layers to quantise"
        return None

    def build(self, ctx: BuildContext) -> Built:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fp32 = ctx.workdir / "fp32.onnx"
        meta = _onnx_from(ctx, fp32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(str(fp32), str(ctx.workdir / "model.onnx"), per_channel=True, weight_type=QuantType.QInt8)
        fp32.unlink()
        return _built(ctx, meta, "per-channel int8 weights")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return OrtRunner(directory / "model.onnx", meta, meta.get("threads", 1))
