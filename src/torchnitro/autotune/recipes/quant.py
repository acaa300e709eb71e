"""PyTorch dynamic int8 for Linear layers (weights int8 per tensor, activations quantised per call).

On CPUs with VNNI the int8 GEMMs are fast; the gate (cosine >= 0.99 by default) decides whether the
accuracy loss is acceptable for this model. Not standalone: rebuilt by quantising the eager model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import is_linear, linear_view
from torchnitro.hardware import HardwareInfo

__all__ = ["DynamicInt8", "quantize_linear_dynamic", "slow_path_transformer_layers_"]


def quantize_linear_dynamic(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every nn.Linear (HF Conv1D included, as the Linear it is) dynamic int8."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
        q = torch.ao.quantization.quantize_dynamic(linear_view(model.eval()), {nn.Linear}, dtype=torch.qint8)
    slow_path_transformer_layers_(q)
    return q


def slow_path_transformer_layers_(model: nn.Module, swapped: Collection[str] = ()) -> int:
    """Keep every ``nn.TransformerEncoderLayer`` whose feed-forward Linears are not plain ``nn.Linear``
    (an int8 or bf16 module put in their place), or are named in ``swapped`` (swapped in place later, as
    int8-mixed's planning does), off PyTorch's fused fast path. Returns how many layers were changed.

    The fast path (``torch._transformer_encoder_layer_fwd``, taken in eval under no_grad) reads
    ``linear1/linear2.weight`` as float tensors: with a packed int8 Linear, whose ``weight`` is a method,
    it raised "'function' object has no attribute 'device'". ``activation_relu_or_gelu`` is the layer's
    own fast-path flag (the slow path computes with ``self.activation``); an encoder holding such layers
    must not turn a padded batch into a nested tensor either, which only the fast path takes.
    MultiheadAttention's projections are not ``nn.Linear`` (packed ``in_proj_weight``, a
    ``NonDynamicallyQuantizableLinear`` out_proj), so the int8 recipes leave them, and MHA's own fast path, in float.
    """
    changed = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.TransformerEncoderLayer) or not m.activation_relu_or_gelu:
            continue
        ff = {f"{name}.{a}" if name else a: getattr(m, a) for a in ("linear1", "linear2")}
        if any(type(lin) is not nn.Linear or n in swapped for n, lin in ff.items()):
            m.activation_relu_or_gelu = 0
            changed += 1
    if changed:
        for m in model.modules():
            if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False) and any(
                    isinstance(layer, nn.TransformerEncoderLayer) and not layer.activation_relu_or_gelu
                    for layer in m.layers):
                m.use_nested_tensor = False
                m.register_forward_hook(_padded_as_nested, with_kwargs=True)
    return changed


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _nested_padding(enc: nn.TransformerEncoder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The padding mask (True: pad, (B, T)) when the float encoder would have run this call as a nested tensor
    (the conditions of ``nn.TransformerEncoder.forward``, which ``use_nested_tensor`` was True for), else None."""
    src, mask, kpm = _arg(args, kwargs, 0, "src"), _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2,
                                                                                       "src_key_padding_mask")
    first = enc.layers[0]
    if (kpm is None or mask is not None or not isinstance(src, Tensor) or src.dim() != 3 or src.is_nested
            or not torch.backends.mha.get_fastpath_enabled() or first.training or torch.is_autocast_enabled()):
        return None
    if torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in first.parameters())):
        return None
    pad = kpm if kpm.dtype == torch.bool else kpm != 0  # a float mask adds -inf where it pads
    if getattr(enc, "mask_check", True) and (torch.compiler.is_compiling()
                                             or not torch._nested_tensor_from_mask_left_aligned(src, ~pad)):
        return None
    return pad


def _padded_as_nested(enc: nn.TransformerEncoder, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> Any:
    """Forward hook: the padded positions as the float encoder's nested-tensor path returns them (zeros, then
    ``enc.norm``), not the slow path's values there, so the variant computes what the float model does on a
    padded batch. Uses ``enc`` (not a closure), so a deep copy of the model hooks its own encoder."""
    pad = _nested_padding(enc, args, kwargs)
    if pad is None or not isinstance(out, Tensor) or out.shape[:2] != pad.shape:
        return None
    fill = out.new_zeros(out.shape[-1])  # (D,)
    if enc.norm is not None:
        fill = enc.norm(fill)
    return torch.where(pad.unsqueeze(-1), fill, out)  # (B, T, D)


@register_recipe
class DynamicInt8(Recipe):
    name = "dynamic-int8"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.INT8
    description = "torch.ao dynamic int8 quantisation of nn.Linear and HF Conv1D (CPU)"
    order = 45
    version = "2"  # 2: HF Conv1D quantised as Linear

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        engines = torch.backends.quantized.supported_engines
        if not any(e in engines for e in ("x86", "fbgemm", "onednn", "qnnpack")):
            return f"no quantized CPU engine in this torch build (engines: {engines})"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(is_linear(m) for m in model.modules()):
            return "no nn.Linear layers"
        if any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            return "dynamic int8 kernels run on the CPU only"
        return None

    def build(self, ctx: BuildContext) -> Built:
        q = quantize_linear_dynamic(ctx.model)
        n = sum(1 for m in q.modules() if type(m).__name__ == "Linear" and "quantized" in type(m).__module__)
        return Built(fn=q, notes=f"{n} Linear layers int8")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if model is None:
            raise ValueError("dynamic-int8 artifacts need the eager model")
        return quantize_linear_dynamic(model)
