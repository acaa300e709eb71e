"""Conv nets: Conv+BatchNorm folding (exact up to rounding) and channels_last memory format.

``conv-bn-fold`` runs the model once with hooks to find each BatchNorm fed directly by a Conv and
folds it into that Conv's weight and bias (``torch.nn.utils.fusion.fuse_conv_bn_eval``). ``channels-last``
stores conv weights and 4-D inputs as NHWC, the layout oneDNN and cuDNN convolutions prefer.
``conv-bn-fold+channels-last`` does both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["ConvBNFold", "ChannelsLast", "ConvBNFoldChannelsLast", "fold_conv_bn", "ChannelsLastInputs"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _pairs(model: nn.Module, example_inputs: tuple[Any, ...]) -> list[tuple[str, str]]:
    """(conv name, bn name) where the BatchNorm's input *is* the Conv's output tensor in a real run.

    Found with forward hooks, so models with Python control flow (which torch.fx cannot trace) work.
    If a conv's raw output is also used elsewhere, folding changes that use: the gate catches it.
    """
    names = {m: n for n, m in model.named_modules()}
    outputs: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []

    def on_conv(mod: nn.Module, args: Any, out: Any) -> None:
        outputs[id(out)] = names[mod]

    def on_bn(mod: nn.Module, args: Any) -> None:
        conv = outputs.get(id(args[0])) if args else None
        if conv is not None and (conv, names[mod]) not in pairs:
            pairs.append((conv, names[mod]))

    hooks = [m.register_forward_hook(on_conv) for m in model.modules() if isinstance(m, _CONV)]
    hooks += [m.register_forward_pre_hook(on_bn) for m in model.modules() if isinstance(m, _BN)]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return pairs


def fold_conv_bn(model: nn.Module, example_inputs: tuple[Any, ...]) -> nn.Module:
    """Fold every eval-mode BatchNorm that directly consumes a Conv's output into that Conv."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    model = model.eval()
    for conv_name, bn_name in _pairs(model, example_inputs):
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        if bn.track_running_stats and bn.running_mean is not None:
            model.set_submodule(conv_name, fuse_conv_bn_eval(conv, bn))
            model.set_submodule(bn_name, nn.Identity())
    return model


class ChannelsLastInputs:
    def __init__(self, model: Callable[..., Any]):
        self.model = model

    def __call__(self, *xs: Any) -> Any:
        return self.model(*(x.contiguous(memory_format=torch.channels_last)
                            if isinstance(x, Tensor) and x.dim() == 4 else x for x in xs))


class _Vision(Recipe):
    numeric_class = NumericClass.EXACT
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    fold: ClassVar[bool] = False
    channels_last: ClassVar[bool] = False

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if self.channels_last and not any(isinstance(m, nn.Conv2d) for m in model.modules()):
            return "no Conv2d layers (channels_last only changes conv layouts)"
        if self.fold:
            mods = list(model.modules())
            if not any(isinstance(m, _CONV) for m in mods) or not any(isinstance(m, _BN) for m in mods):
                return "no Conv + BatchNorm pairs to fold"
        return None

    def _make(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> Callable[..., Any]:
        m = fold_conv_bn(model, example_inputs) if self.fold else model
        if self.channels_last:
            return ChannelsLastInputs(m.to(memory_format=torch.channels_last))
        return m

    def build(self, ctx: BuildContext) -> Built:
        n_bn = sum(isinstance(m, _BN) for m in ctx.model.modules())
        fn = self._make(ctx.model, ctx.example_inputs)
        left = sum(isinstance(m, _BN) for m in (fn.model if isinstance(fn, ChannelsLastInputs) else fn).modules())
        shapes = [list(x.shape) if isinstance(x, Tensor) else None for x in ctx.example_inputs]
        dtypes = [str(x.dtype).replace("torch.", "") if isinstance(x, Tensor) else None for x in ctx.example_inputs]
        return Built(fn=fn, meta={"shapes": shapes, "dtypes": dtypes},
                     notes=f"{n_bn - left}/{n_bn} BatchNorms folded" if self.fold else "NHWC")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if model is None:
            raise ValueError(f"{self.name} artifacts need the eager model")
        probe = tuple(torch.zeros(s, dtype=getattr(torch, d)) if s is not None else None
                      for s, d in zip(meta.get("shapes", []), meta.get("dtypes", [])))
        return self._make(model, probe)  # the pairs come from one run on zeros of the example's shapes


@register_recipe
class ConvBNFold(_Vision):
    name = "conv-bn-fold"
    description = "fold eval-mode BatchNorm into the preceding Conv (torch.fx)"
    fold = True
    order = 12


@register_recipe
class ChannelsLast(_Vision):
    name = "channels-last"
    description = "channels_last (NHWC) memory format for conv weights and 4-D inputs"
    channels_last = True
    order = 13


@register_recipe
class ConvBNFoldChannelsLast(_Vision):
    name = "conv-bn-fold+channels-last"
    description = "Conv+BN folding, then channels_last"
    fold = True
    channels_last = True
    order = 14
