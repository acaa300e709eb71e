"""Remat policies change what is stored, never what is computed."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.xla.lm import random_batch  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params, loss_fn  # noqa: E402
from torchnitro.xla.remat import layer_policies  # noqa: E402

CFG = LMConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)


def test_remat_gradients_equal_no_remat():
    params, batch = init_params(CFG, 0), random_batch(CFG, 2, 8, 1)

    def grads(remat):
        return jax.jit(jax.value_and_grad(partial(loss_fn, cfg=CFG, remat=remat)))(params, batch)

    want_loss, want = grads("none")
    for remat in ("nothing_saveable", ["dots_saveable", "none"]):  # one name, and one policy per layer
        loss, got = grads(remat)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def test_unknown_policy_and_wrong_length_raise():
    with pytest.raises(ConfigError, match="unknown remat policy 'dots'; known: none, dots_saveable"):
        layer_policies("dots", 2)
    with pytest.raises(ConfigError, match="got 3 per-layer policies for 2 layers"):
        layer_policies(["none"] * 3, 2)
