from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.nn import TransformerConfig, TransformerLM, get_builtin, list_builtins


@pytest.mark.parametrize("name", ["encoder", "lm", "cnn", "mlp"])
def test_builtins_run_and_are_deterministic(name):
    b = get_builtin(name)
    m1, m2 = b.build(), b.build()
    x = b.inputs(2, 16, 0)
    with torch.no_grad():
        y1, y2 = m1(*x), m2(*x)
    assert torch.equal(y1, y2) and torch.isfinite(y1).all()
    assert not m1.training


def test_unknown_builtin_lists_known():
    with pytest.raises(InputError, match="known: .*encoder"):
        get_builtin("nope")
    assert {"encoder", "lm", "cnn", "mlp"} <= set(list_builtins())


def test_lm_is_causal_and_gqa():
    m = TransformerLM(TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)).eval()
    x = torch.randint(0, 64, (2, 10))
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 64
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)  # future tokens do not leak back
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    assert m.lm_head.weight is m.embed.weight


def test_bad_config():
    with pytest.raises(ValueError, match="not divisible"):
        TransformerConfig(dim=30, n_heads=4)
