"""Built-in workloads by name: a model factory plus a matching input generator.

``get_builtin("encoder")`` returns a ``Builtin``; ``builtin.build()`` makes the model (eval mode,
seeded weights) and ``builtin.inputs(batch, seq, seed)`` makes example inputs. Other modules add
entries with ``@register_builtin``. Built-ins that need an optional extra are named in ``EXTRAS``
("module:factory", imported on first use): this module never imports an extra, and an extra that
fails to import shows its own ImportError instead of an unknown name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import importlib

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError

__all__ = ["Builtin", "register_builtin", "get_builtin", "list_builtins", "DEFAULT_BUILTIN", "EXTRAS"]

DEFAULT_BUILTIN = "encoder"

# built-ins of optional extras: name -> "module:factory" returning a Builtin (the hf extra)
EXTRAS: dict[str, str] = {
    "minilm": "torchnitro.hf:minilm_builtin",
    "hf-bert-tiny": "torchnitro.hf:bert_tiny_builtin",
    "hf-gpt2-tiny": "torchnitro.hf:gpt2_tiny_builtin",
    "hf-llama-tiny": "torchnitro.hf:llama_tiny_builtin",
}


@dataclass
class Builtin:
    name: str
    build: Callable[[], nn.Module]  # returns the model in eval mode with seeded weights
    inputs: Callable[[int, int, int], tuple[Tensor, ...]]  # (batch, seq, seed) -> example inputs
    description: str
    default_batch: int = 8
    default_seq: int = 128
    dynamic_dims: dict[int, list[int]] = field(default_factory=dict)  # input index -> dynamic dims


_REGISTRY: dict[str, Callable[[], Builtin]] = {}


def register_builtin(name: str) -> Callable[[Callable[[], Builtin]], Callable[[], Builtin]]:
    """Register a zero-argument function returning a ``Builtin`` under ``name``."""

    def deco(fn: Callable[[], Builtin]) -> Callable[[], Builtin]:
        if name in _REGISTRY or name in EXTRAS:
            raise ValueError(f"built-in model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def list_builtins() -> list[str]:
    """Every built-in name, those of optional extras included (whether or not the extra is installed)."""
    return sorted({*_REGISTRY, *EXTRAS})


def get_builtin(name: str) -> Builtin:
    if name in EXTRAS:
        mod_name, _, factory = EXTRAS[name].partition(":")
        return getattr(importlib.import_module(mod_name), factory)()  # a missing extra raises its ImportError
    if name not in _REGISTRY:
        raise InputError(
            f"unknown built-in model {name!r}; known: {list_builtins()}. "
            "Pass one of those, or a 'module:function' factory, or 'hf:/path/to/folder'."
        )
    return _REGISTRY[name]()


def _seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def _token_inputs(vocab: int) -> Callable[[int, int, int], tuple[Tensor, ...]]:
    def make(batch: int, seq: int, seed: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return make


@register_builtin("encoder")
def _encoder() -> Builtin:
    from torchnitro.nn.models import TransformerEncoder

    return Builtin("encoder", lambda: _seeded(TransformerEncoder), _token_inputs(8192),
                   "pre-norm transformer encoder, 4 layers, dim 256 (tokens -> hidden states)",
                   default_batch=8, default_seq=128, dynamic_dims={0: [0, 1]})


@register_builtin("lm")
def _lm() -> Builtin:
    from torchnitro.nn.models import TransformerLM

    return Builtin("lm", lambda: _seeded(TransformerLM), _token_inputs(8192),
                   "pre-norm decoder LM, 4 layers, dim 256, RoPE, SwiGLU, RMSNorm (tokens -> logits)",
                   default_batch=4, default_seq=128, dynamic_dims={0: [0, 1]})


@register_builtin("cnn")
def _cnn() -> Builtin:
    from torchnitro.nn.models import ResNetCNN

    def make(batch: int, seq: int, seed: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 3, 64, 64, generator=g),)

    return Builtin("cnn", lambda: _seeded(ResNetCNN), make,
                   "ResNet-style CNN, 6 basic blocks (images 3x64x64 -> 10 logits)",
                   default_batch=16, default_seq=0, dynamic_dims={0: [0]})


@register_builtin("mlp")
def _mlp() -> Builtin:
    from torchnitro.nn.models import MLP

    def make(batch: int, seq: int, seed: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 512, generator=g),)

    return Builtin("mlp", lambda: _seeded(MLP), make, "3-layer Linear+GELU MLP (512 -> 1024 -> 1024 -> 512)",
                   default_batch=64, default_seq=0, dynamic_dims={0: [0]})
