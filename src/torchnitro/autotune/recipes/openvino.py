"""OpenVINO, the runtime a CPU user would pick instead of us, as three candidates of the search:

- ``openvino``: the model converted with ``openvino.convert_model`` and compiled for the CPU plugin
  with ``INFERENCE_PRECISION_HINT=f32`` (OpenVINO's own default is bf16 on CPUs that have it, which
  would not be exact);
- ``openvino-bf16``: the same IR compiled with the bf16 inference-precision hint (only on CPUs with
  AVX512-BF16/AMX, where OpenVINO computes bf16 natively);
- ``openvino-int8``: NNCF post-training quantisation of the IR on the search's calibration inputs
  (the ones ``int8-mixed`` uses), the layers NNCF leaves unquantised in the CPU's best float precision.
  On a graph with attention: NNCF's transformer scheme, the FFN down-projections (MatMuls fed straight by
  the activation, whose post-GELU inputs carry outlier channels) left out of int8, and more calibration
  sets of varied length (``TRANSFORMER_CALIBRATION_SETS``).

All three run isolated (native code) and are standalone artifacts (``model.xml`` + ``model.bin``,
weights kept in f32), so ``load(directory, meta, None)`` needs neither the user's model nor its code.

Threads: ``INFERENCE_NUM_THREADS`` is the search's thread count, ``PERFORMANCE_HINT=LATENCY`` (one
stream, every thread on the one request, as the other candidates are timed) and
``ENABLE_CPU_PINNING=False``, so OpenVINO's TBB workers are not bound to the cores that torch's
OpenMP threads use in the same process. OpenVINO has no spin-wait setting: TBB's idle workers back off
and sleep on their own. The choice is written to the artifact's meta (``ov_config``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._layout import (FlatProgram, InputLayout, flat_call, input_layout, is_flat,
                                                 tensor_leaves)
from torchnitro.autotune.recipes._util import output_kind, restructure
from torchnitro.autotune.recipes.int8_mixed import varied_calibration_inputs
from torchnitro.autotune.recipes.onnx import _threads, export_onnx
from torchnitro.errors import RecipeError
from torchnitro.hardware import HardwareInfo

__all__ = ["OpenVino", "OpenVinoBF16", "OpenVinoInt8", "OvRunner", "convert_to_ov", "ov_config", "openvino_version",
           "ffn_down_projections", "TRANSFORMER_CALIBRATION_SETS"]

_INSTALL = "pip install 'torchnitro[openvino]'"


def openvino_version() -> str | None:
    """The installed OpenVINO version, or None."""
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing(*modules: str) -> str | None:
    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed ({_INSTALL})"
    return None


@functools.lru_cache(maxsize=1)
def _core() -> Any:
    import openvino as ov

    return ov.Core()


def ov_config(threads: int, precision: str) -> dict[str, Any]:
    """CPU plugin properties of a compiled model (JSON-safe; saved in the artifact's meta)."""
    return {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": max(1, threads),
            "ENABLE_CPU_PINNING": False, "INFERENCE_PRECISION_HINT": precision}


def _cpu_tensor_inputs(model: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    tensors = tensor_leaves(inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, (Tensor, Mapping, list, tuple)):
            return (f"OpenVINO takes tensors (or dicts/lists of them) as inputs; input {i} is a "
                    f"{type(x).__name__}")
    if not tensors:
        return "OpenVINO needs tensor inputs; the example inputs hold none"
    devices = {t.device.type for t in (*tensors, *model.parameters())}
    if devices - {"cpu"}:
        return f"OpenVINO runs on the CPU; this search runs on {sorted(devices - {'cpu'})[0]}"
    return None


def _static_shapes(ov_model: Any, inputs: tuple[Tensor, ...], dynamic_dims: dict[int, list[int]]) -> None:
    """Fix every dim the search does not declare dynamic (static shapes let the CPU plugin specialise)."""
    import openvino as ov

    shapes = {}
    for i, (port, x) in enumerate(zip(ov_model.inputs, inputs)):
        dims = [-1 if d in dynamic_dims.get(i, []) else int(n) for d, n in enumerate(x.shape)]
        shapes[port] = ov.PartialShape(dims)
    try:
        ov_model.reshape(shapes)
    except Exception as exc:  # noqa: BLE001 - one clean line naming the shapes asked for
        raise RecipeError(f"OpenVINO could not reshape the inputs to {[str(v) for v in shapes.values()]} "
                          f"(-1: dynamic): {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300]


def _from_program(program: Any) -> tuple[Any, str] | None:
    """What to convert in an isolated child: the program the search exported for it (OpenVINO converts a
    ``torch.export`` program directly, not the module it unflattens to)."""
    if program is None:
        return None
    if program.kind == "exported":
        return torch.export.load(str(program.path)), "torch.export program"
    if program.kind == "torchscript":
        return torch.jit.load(str(program.path)).eval(), "TorchScript program"
    if program.kind == "onnx":
        return str(program.path), "ONNX program"
    return None


def convert_to_ov(ctx: BuildContext) -> tuple[Any, dict[str, Any]]:
    """The candidate's model -> ``openvino.Model``: the search's exported program in a child process,
    else the torch module directly, through our ONNX export where that fails. Returns the model and
    meta: the eager output structure, what was converted and, for structured inputs (a feature dict),
    the flat input layout (``_layout``)."""
    import openvino as ov

    inputs, dims = ctx.example_inputs, ctx.dynamic_dims
    program = getattr(ctx, "program", None)
    module, layout = ctx.model, None
    if program is not None and program.meta.get("input_layout") is not None:
        layout = InputLayout.from_meta(program.meta["input_layout"])  # the program takes the flat tensors
    elif module is not None and not is_flat(inputs):
        layout, _ = input_layout(module, inputs)
        module = FlatProgram(module, layout)
    if layout is not None:
        dims = layout.dynamic_dims(inputs, dims)
    flat = tuple(layout.take(inputs)) if layout is not None else inputs
    if program is not None and program.meta.get("output_kind") is not None:
        kind = program.meta["output_kind"]  # the parent's record: names eager's output class, which a child lacks
    else:
        with torch.no_grad():
            kind = output_kind(ctx.model(*inputs))
    obj, converter = _from_program(program) or (module, "torch module")
    errors: list[str] = []
    ov_model = None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about the user's Python control flow
            if isinstance(obj, (str, torch.export.ExportedProgram)):
                ov_model = ov.convert_model(obj)
            else:
                ov_model = ov.convert_model(obj, example_input=flat)
    except Exception as exc:  # noqa: BLE001 - try the ONNX route before giving up
        errors.append(f"{converter}: {_first_line(exc)}")
    if ov_model is None:
        if ctx.model is None:
            raise RecipeError("OpenVINO could not convert the model: " + " | ".join(errors))
        onnx_path = ctx.workdir / "_export.onnx"
        try:
            export_onnx(ctx.model, inputs, onnx_path, ctx.dynamic_dims)
            ov_model = ov.convert_model(str(onnx_path))
        except Exception as exc:
            errors.append(f"through ONNX: {_first_line(exc)}")
            raise RecipeError("OpenVINO could not convert the model: " + " | ".join(errors)) from exc
        finally:
            onnx_path.unlink(missing_ok=True)
        converter = "ONNX export"
    if len(ov_model.inputs) != len(flat) or len(ov_model.outputs) != len(kind["names"]):
        raise RecipeError(f"OpenVINO's model has {len(ov_model.inputs)} inputs/{len(ov_model.outputs)} outputs; "
                          f"expected {len(flat)}/{len(kind['names'])} as eager ({kind['names']})")
    _static_shapes(ov_model, flat, dims)
    meta = {"output_kind": kind, "converter": converter, "convert_errors": errors}
    if layout is not None:
        meta["input_layout"] = layout.to_meta()
    return ov_model, meta


class OvRunner:
    """Callable wrapper of a compiled OpenVINO model: torch tensors in, torch tensors (eager's structure) out."""

    def __init__(self, model: Any, meta: dict[str, Any]):
        self.compiled = _core().compile_model(model, "CPU", meta["ov_config"])
        self.request = self.compiled.create_infer_request()
        self.kind = meta["output_kind"]
        self.layout = meta.get("input_layout")  # structured inputs: how a call is flattened

    @classmethod
    def from_dir(cls, directory: Path, meta: dict[str, Any]) -> OvRunner:
        xml = directory / "model.xml"
        if not xml.is_file():
            raise RecipeError(f"OpenVINO artifact {directory} has no model.xml; expected model.xml + model.bin "
                              "as written by the openvino recipes")
        return cls(_core().read_model(str(xml)), meta)

    def __call__(self, *xs: Any) -> Any:
        feed = [x.detach().cpu().contiguous().numpy() if isinstance(x, Tensor) else np.asarray(x)
                for x in flat_call(self.layout, xs)]
        # inputs are read in place (the call is synchronous); outputs are copies, so a later call
        # cannot overwrite what the caller holds. Halves the per-call overhead (~130 us) of a tiny model.
        res = self.request.infer(feed, share_inputs=True)
        return restructure(self.kind, [torch.from_numpy(o) for o in res.to_tuple()])


class _OpenVinoRecipe(Recipe):
    """Shared build/load; subclasses set the precision and may transform the IR (``transform``)."""

    isolate = True
    precision: ClassVar[str] = "f32"
    needs: ClassVar[tuple[str, ...]] = ("openvino",)

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return _missing(*self.needs)

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        return _cpu_tensor_inputs(model, example_inputs)

    def inference_precision(self, hw: HardwareInfo) -> str:
        return self.precision

    def transform(self, ov_model: Any, ctx: BuildContext, meta: dict[str, Any]) -> Any:
        return ov_model

    def build(self, ctx: BuildContext) -> Built:
        import openvino as ov

        if ctx.device.type != "cpu":
            raise RecipeError(f"{self.name} runs on the CPU; this search's device is {ctx.device}")
        ov_model, meta = convert_to_ov(ctx)
        ov_model = self.transform(ov_model, ctx, meta)
        ov.save_model(ov_model, str(ctx.workdir / "model.xml"), compress_to_fp16=False)  # f32 weights: exact
        precision = self.inference_precision(ctx.hardware)
        meta["ov_config"] = ov_config(_threads(ctx), precision)
        meta["openvino"] = openvino_version()
        runner = OvRunner(ov_model, meta)
        return Built(runner, ["model.xml", "model.bin"], meta, standalone=True,
                     notes=f"converted from the {meta['converter']}, {precision} inference precision"
                           + (f", {meta['notes']}" if meta.get("notes") else ""))

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return OvRunner.from_dir(directory, meta)


@register_recipe
class OpenVino(_OpenVinoRecipe):
    name = "openvino"
    numeric_class = NumericClass.EXACT
    description = "OpenVINO CPU plugin, f32 inference precision, threads = the search's"
    order = 21


@register_recipe
class OpenVinoBF16(_OpenVinoRecipe):
    name = "openvino-bf16"
    numeric_class = NumericClass.REDUCED
    description = "OpenVINO CPU plugin with the bf16 inference-precision hint (AVX512-BF16/AMX CPUs)"
    precision = "bf16"
    order = 27

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        if not hw.cpu_bf16:
            return "this CPU has no avx512_bf16/amx_bf16: OpenVINO would not compute bf16 natively"
        return super().unavailable_reason(hw)


def _has_attention(ov_model: Any) -> bool:
    """NNCF's transformer scheme (SmoothQuant, attention-aware ignored ops) fits graphs with attention;
    judged on the IR so an exported program (no module names left) is judged like the module."""
    return any(op.get_type_name() in ("Softmax", "ScaledDotProductAttention") for op in ov_model.get_ops())


_FFN_ACTIVATIONS = ("Gelu", "Swish", "HSwish", "Relu", "Mish", "Elu", "SoftPlus")
TRANSFORMER_CALIBRATION_SETS = 8  # extra length-varied sets beside the example (all-MiniLM-L6-v2, full-length
# text, worst held-out token row, bf16 for the float rest; batch 8: 2 sets 0.986, 8 sets 0.990)


def ffn_down_projections(ov_model: Any) -> list[str]:
    """Friendly names of the MatMuls whose input comes straight from an activation: a transformer's FFN
    down-projections. NNCF's per-tensor int8 activations clip their outlier channels: on all-MiniLM-L6-v2
    at full length, leaving them out lifted the worst held-out token-row cosine from 0.919 to 0.986."""
    return [op.get_friendly_name() for op in ov_model.get_ops()
            if op.get_type_name() == "MatMul" and op.input_value(0).get_node().get_type_name() in _FFN_ACTIVATIONS]


@register_recipe
class OpenVinoInt8(_OpenVinoRecipe):
    name = "openvino-int8"
    numeric_class = NumericClass.INT8
    description = "OpenVINO with NNCF post-training int8 quantisation on the search's calibration inputs"
    needs = ("openvino", "nncf")
    order = 41
    version = "2"  # transformer graphs: FFN down-projections kept in float, more calibration sets

    def inference_precision(self, hw: HardwareInfo) -> str:
        return "bf16" if hw.cpu_bf16 else "f32"  # for what NNCF leaves in float: OpenVINO's own default

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in model.modules()):
            return "no Linear/Conv layers to quantise"
        return super().inapplicable_reason(model, example_inputs)

    def transform(self, ov_model: Any, ctx: BuildContext, meta: dict[str, Any]) -> Any:
        import nncf

        transformer = _has_attention(ov_model)
        samples = _calibration_samples(ctx, TRANSFORMER_CALIBRATION_SETS if transformer else 2)
        kw: dict[str, Any] = {}
        kept = ffn_down_projections(ov_model) if transformer else []
        if transformer:
            kw["model_type"] = nncf.ModelType.TRANSFORMER
        if kept:
            kw["ignored_scope"] = nncf.IgnoredScope(names=kept, validate=False)
        with _quiet_nncf():
            q = nncf.quantize(ov_model, nncf.Dataset(samples), subset_size=len(samples), **kw)
        meta["nncf"] = importlib.metadata.version("nncf")
        meta["calibration_samples"] = len(samples)
        meta["float_matmuls"] = len(kept)
        meta["notes"] = (f"NNCF int8 ({'transformer' if transformer else 'default'} scheme, {len(samples)} calibration "
                         f"samples" + (f", {len(kept)} FFN down-projections kept in float" if kept else "") + ")")
        return q


@contextlib.contextmanager
def _quiet_nncf() -> Iterator[None]:
    """NNCF draws progress bars on stdout and logs at INFO: library code stays silent."""
    import nncf

    level = nncf.common.logging.nncf_logger.level
    nncf.set_log_level(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nncf.set_log_level(level)


def _calibration_samples(ctx: BuildContext, extra: int = 2) -> list[list[np.ndarray]]:
    """The calibration batches as NNCF samples, each batch whole: NNCF's activation ranges then cover every
    row (one row per sample averages the per-sample ranges, which clipped held-out rows in our tests).
    ``extra``: length-varied sets beside the example's (text inputs; ``varied_calibration_inputs``)."""
    layout = meta_layout(ctx)
    return [[x.detach().cpu().contiguous().numpy() for x in flat_call(layout, xs)]
            for xs in varied_calibration_inputs(ctx, extra=extra)]


def meta_layout(ctx: BuildContext) -> Any:
    """The saved input layout of the model being converted (None: tensor inputs, fed as they are)."""
    program = getattr(ctx, "program", None)
    if program is not None and program.meta.get("input_layout") is not None:
        return program.meta["input_layout"]
    if is_flat(ctx.example_inputs):
        return None
    return input_layout(ctx.model, ctx.example_inputs)[0].to_meta()
