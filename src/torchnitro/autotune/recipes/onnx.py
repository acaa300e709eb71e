"""ONNX export + ONNX Runtime (all graph optimisations, intra-op threads = usable cores), and ORT
dynamic int8 quantisation with per-channel weight scales. Both run in a subprocess during the search
(native code that can crash) and are standalone artifacts (``model.onnx``)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import output_kind, restructure
from torchnitro.hardware import HardwareInfo

__all__ = ["OnnxRuntime", "OnnxRuntimeInt8", "export_onnx", "OrtRunner"]


def export_onnx(model: nn.Module, inputs: tuple[Any, ...], path: Path, dynamic_dims: dict[int, list[int]]) -> dict[str, Any]:
    """Export with dynamic axes; TorchScript-based exporter first (fast), dynamo exporter as fallback."""
    with torch.no_grad():
        out = model(*inputs)
    kind = output_kind(out)
    in_names = [f"input_{i}" for i in range(len(inputs))]
    out_names = [f"output_{i}" for i in range(len(kind["names"]))]
    axes = {in_names[i]: {d: f"in{i}_d{d}" for d in dims} for i, dims in dynamic_dims.items() if i < len(inputs)}
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, inputs, str(path), dynamo=False, input_names=in_names, output_names=out_names,
                              dynamic_axes=axes or None, opset_version=17, do_constant_folding=True)
            exporter = "torchscript"
        except Exception as exc:  # noqa: BLE001 - try the other exporter
            errors.append(f"torchscript exporter: {type(exc).__name__}: {exc}"[:300])
            from torch.export import Dim

            shapes = tuple({d: Dim.AUTO for d in dynamic_dims.get(i, [])} for i in range(len(inputs)))
            try:
                torch.onnx.export(model, inputs, str(path), dynamo=True, input_names=in_names,
                                  output_names=out_names, dynamic_shapes=shapes, external_data=False)
            except Exception as exc2:
                errors.append(f"dynamo exporter: {type(exc2).__name__}: {exc2}"[:300])
                raise RuntimeError("ONNX export failed: " + " | ".join(errors)) from exc2
            exporter = "dynamo"
    return {"output_kind": kind, "input_names": in_names, "exporter": exporter}


class OrtRunner:
    """Callable wrapper of an ORT session: torch tensors in, torch tensors out (eager's structure)."""

    def __init__(self, path: Path, meta: dict[str, Any], threads: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = max(1, threads)
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        if not torch.cuda.is_available():
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), so, providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.kind = meta["output_kind"]

    def __call__(self, *xs: Any) -> Any:
        feed = {n: (x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x))
                for n, x in zip(self.input_names, xs)}
        outs = self.session.run(None, feed)
        return restructure(self.kind, [torch.from_numpy(np.ascontiguousarray(o)) for o in outs])


def _ort_missing() -> str | None:
    for mod in ("onnx", "onnxruntime"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install 'torchnitro[onnx]')"
    return None


def _threads(ctx: BuildContext) -> int:
    return ctx.config.resolved_threads() if ctx.config is not None else ctx.hardware.cpu_cores


@register_recipe
class OnnxRuntime(Recipe):
    name = "onnxruntime"
    numeric_class = NumericClass.EXACT
    description = "ONNX export + ONNX Runtime, graph optimisations on, intra-op threads = cores"
    isolate = True
    order = 20

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return _ort_missing()

    def build(self, ctx: BuildContext) -> Built:
        meta = export_onnx(ctx.model, ctx.example_inputs, ctx.workdir / "model.onnx", ctx.dynamic_dims)
        meta["threads"] = _threads(ctx)
        return Built(OrtRunner(ctx.workdir / "model.onnx", meta, meta["threads"]), ["model.onnx"], meta,
                     standalone=True, notes=f"{meta['exporter']} exporter")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return OrtRunner(directory / "model.onnx", meta, meta.get("threads", 1))


@register_recipe
class OnnxRuntimeInt8(Recipe):
    name = "onnxruntime-int8"
    numeric_class = NumericClass.INT8
    description = "ONNX Runtime dynamic int8 (per-channel weights, activations quantised per call)"
    isolate = True
    order = 40

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return _ort_missing()

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(isinstance(m, (nn.Linear, nn.Conv2d, nn.Conv1d)) for m in model.modules()):
            return "no Linear/Conv layers to quantise"
        return None

    def build(self, ctx: BuildContext) -> Built:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fp32 = ctx.workdir / "fp32.onnx"
        meta = export_onnx(ctx.model, ctx.example_inputs, fp32, ctx.dynamic_dims)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(str(fp32), str(ctx.workdir / "model.onnx"), per_channel=True, weight_type=QuantType.QInt8)
        fp32.unlink()
        meta["threads"] = _threads(ctx)
        return Built(OrtRunner(ctx.workdir / "model.onnx", meta, meta["threads"]), ["model.onnx"], meta,
                     standalone=True, notes="per-channel int8 weights")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return OrtRunner(directory / "model.onnx", meta, meta.get("threads", 1))
