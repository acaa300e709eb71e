"""The sharded step computes the single-device step, and the parameters are split as the rules say."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import optax  # noqa: E402

from torchnitro.xla.lm import lm_train_step, random_batch  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params, loss_fn  # noqa: E402

# every split divides 8: heads 8, kv heads 8, MLP hidden 192, vocab 128, width 64
CFG = LMConfig(vocab_size=128, dim=64, n_layers=1, n_heads=8, max_seq_len=32)
B, T, LR = 8, 16, 1.0


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients on one device, no mesh, no sharding."""
    params = init_params(CFG, seed=0)
    batch = random_batch(CFG, B, T, seed=1)
    loss, grads = jax.jit(jax.value_and_grad(partial(loss_fn, cfg=CFG)))(params, batch)
    return params, batch, float(loss), grads


MESHES = [("data_parallel", "8x1x1"), ("fsdp", "1x8x1"), ("tensor_parallel", "1x1x8"), ("fsdp_tp", "1x2x4")]


@pytest.mark.parametrize("rules,shape", MESHES)
def test_sharded_loss_and_gradients_equal_one_device(reference, rules, shape):
    params, batch, want_loss, want_grads = reference
    mesh = make_mesh(shape)
    # plain SGD with lr=1: the parameter change is exactly minus the gradient the sharded step computed
    step = lm_train_step(CFG, optax.sgd(LR), mesh, rules, B, T, donate=False)
    p, opt = step.init(params)
    new_p, _, loss = step(p, opt, step.place_batch(batch))
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    got_grads = jax.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / LR, p, new_p)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)


def test_fsdp_tp_shards_as_the_rules_say_and_tracks_one_device_with_momentum(reference):
    params, batch, _, _ = reference
    opt = optax.sgd(0.1, momentum=0.9)
    step = lm_train_step(CFG, opt, make_mesh("2x2x2"), "fsdp_tp", B, T)
    one = lm_train_step(CFG, opt, make_mesh("1x1x1", devices=jax.devices()[:1]), "fsdp_tp", B, T)
    p, o = step.init(params)
    p1, o1 = one.init(params)
    for _ in range(2):
        p, o, loss = step(p, o, step.place_batch(batch))
        p1, o1, l1 = one(p1, o1, one.place_batch(batch))
        assert float(loss) == pytest.approx(float(l1), rel=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    def shard_shapes(x):
        return {s.data.shape for s in x.addressable_shards}

    layer = p["layers"][0]
    assert shard_shapes(p["embed"]) == {(64, 32)}  # (vocab/tensor, width/fsdp)
    assert shard_shapes(layer["wq"]) == {(32, 4, 8)}  # (width/fsdp, heads/tensor, head_dim)
    assert shard_shapes(layer["wo"]) == {(4, 8, 32)}  # (heads/tensor, head_dim, width/fsdp)
    assert shard_shapes(layer["w2"]) == {(96, 32)}  # (mlp/tensor, width/fsdp)
    assert shard_shapes(layer["attn_norm"]) == {(64,)}  # replicated
    assert layer["w1"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    momentum = o[0].trace  # the SGD momentum follows its parameter
    assert momentum["layers"][0]["wq"].sharding == layer["wq"].sharding
    assert shard_shapes(step.place_batch(batch)["tokens"]) == {(2, T)}  # batch over data x fsdp = 4 ways
    assert params["embed"].is_deleted() is False  # init copied: the donated buffers were not the caller's
