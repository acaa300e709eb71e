"""A padded layout computes exactly the unpadded model; its padding stays zero under the gradient."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from torchnitro.errors import ConfigError, ShapeError  # noqa: E402
from torchnitro.xla.layout import pad_config, pad_params, pad_report, unpad_params  # noqa: E402
from torchnitro.xla.lm import random_batch  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params, logical_axes, loss_fn, param_spec, true_index  # noqa: E402
from torchnitro.xla.rules import is_axes, tree_shardings  # noqa: E402

# odd sizes on purpose: nothing is a multiple of 128, 5 heads split over no tensor axis > 1
CFG = LMConfig(vocab_size=100, dim=40, n_layers=1, n_heads=5, max_seq_len=16)


def test_padded_loss_and_gradients_equal_unpadded():
    padded = pad_config(CFG, multiple=128, heads_to=8)
    params = init_params(CFG, seed=0)
    batch = random_batch(CFG, 3, 7, seed=1)
    want_loss, want_g = jax.jit(jax.value_and_grad(partial(loss_fn, cfg=CFG)))(params, batch)
    pp = pad_params(params, padded)
    got_loss, got_g = jax.jit(jax.value_and_grad(partial(loss_fn, cfg=padded)))(pp, batch)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for g, w in zip(jax.tree.leaves(unpad_params(got_g, padded)), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    # every gradient entry outside the true block is exactly zero: SGD/Adam never move the padding
    def padding_of(axes, g):
        a = np.array(g)
        a[true_index(padded, axes)] = 0
        return a

    for rest in jax.tree.leaves(jax.tree.map(padding_of, logical_axes(padded), got_g, is_leaf=is_axes)):
        assert not rest.any()
    assert jax.tree.map(lambda a, b: a.shape == b.shape, unpad_params(pp, padded), params)


def test_report_states_the_waste_per_dim_and_in_parameters():
    rep = pad_report(CFG, multiple=128, heads_to=8)
    by = {d.name: d for d in rep.dims}
    assert (by["vocab"].true, by["vocab"].padded) == (100, 128)
    assert (by["dim"].true, by["dim"].padded) == (40, 128)
    assert (by["heads"].true, by["heads"].padded) == (5, 8)
    assert by["dim"].waste == pytest.approx(1 - 40 / 128)
    # unpadded: embed 100*40, attention 4 * 40*5*8, MLP 3 * 40*128 (hidden 8/3*40 -> 128), 2 norms of 40, final norm
    assert rep.true_params == 100 * 40 + 4 * 40 * 40 + 3 * 40 * 128 + 3 * 40
    assert rep.padded_params == 128 * 128 + 4 * 128 * 8 * 8 + 3 * 128 * 128 + 3 * 128
    assert "| dim | 40 | 128 | 68.8% |" in rep.table()


def test_heads_padding_makes_a_tensor_split_possible():
    mesh = make_mesh("1x1x8")
    cfg = dataclasses.replace(CFG, vocab_size=128)  # only the heads are in the way
    with pytest.raises(ShapeError, match=r"heads'\) has size 5, not divisible by the 8-way"):
        tree_shardings(logical_axes(cfg), param_spec(cfg), "tensor_parallel", mesh)
    padded = pad_config(cfg, multiple=128, heads_to=8)
    sh = tree_shardings(logical_axes(padded), param_spec(padded), "tensor_parallel", mesh)
    assert sh["layers"][0]["wq"].spec == jax.sharding.PartitionSpec(None, "tensor", None)


def test_pad_config_refuses_bad_multiples_and_double_padding():
    with pytest.raises(ConfigError, match="multiple=0"):
        pad_config(CFG, multiple=0)
    with pytest.raises(ConfigError, match="already padded"):
        pad_config(pad_config(CFG), multiple=128)
