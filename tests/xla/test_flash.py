"""Flash attention (Pallas, interpret mode on CPU) and the blockwise fallback equal plain attention, fwd and bwd."""

from __future__ import annotations

import dataclasses
import importlib.util
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import optax  # noqa: E402

from torchnitro.errors import ConfigError, ShapeError  # noqa: E402
from torchnitro.xla.flash import blockwise_attention, flash_attention, reference_attention  # noqa: E402
from torchnitro.xla.lm import lm_train_step, random_batch  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params, loss_fn  # noqa: E402


def _qkvd(shape, seed=0):
    r = np.random.default_rng(seed)
    return [jax.numpy.asarray(r.normal(size=shape).astype(np.float32)) for _ in range(4)]


def _fwd_bwd(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


@pytest.mark.parametrize("impl", ["flash", "blockwise"])
@pytest.mark.parametrize("shape,block,causal", [((2, 3, 37, 16), 16, True),  # odd length: padded, masked keys
                                                ((1, 2, 32, 8), 8, False)])
def test_attention_equals_plain_forward_and_backward(impl, shape, block, causal):
    q, k, v, do = _qkvd(shape)
    fn = flash_attention if impl == "flash" else blockwise_attention
    got = jax.jit(partial(_fwd_bwd, partial(fn, causal=causal, block=block)))(q, k, v, do)
    want = jax.jit(partial(_fwd_bwd, partial(reference_attention, causal=causal)))(q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_lm_with_sharded_flash_attention_equals_the_plain_lm_on_one_device():
    """fsdp_tp on 2x2x2: the kernel runs under shard_map on (batch/4, heads/2) shards."""
    cfg = LMConfig(vocab_size=128, dim=64, n_layers=1, n_heads=8, max_seq_len=32)
    params, batch = init_params(cfg, 0), random_batch(cfg, 8, 16, 1)
    want_loss, want = jax.jit(jax.value_and_grad(partial(loss_fn, cfg=cfg)))(params, batch)
    flash = dataclasses.replace(cfg, attention="flash", attn_block=8)  # two key blocks: the online softmax runs
    step = lm_train_step(flash, optax.sgd(1.0), make_mesh("2x2x2"), "fsdp_tp", 8, 16, donate=False)
    p, o = step.init(params)
    new_p, _, loss = step(p, o, step.place_batch(batch))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for a, b, w in zip(jax.tree.leaves(p), jax.tree.leaves(new_p), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_what_was_received():
    q = jax.numpy.zeros((1, 2, 8, 4))
    with pytest.raises(ShapeError, match=r"received q \(1, 2, 8, 4\), k \(1, 2, 8\)"):
        flash_attention(q, q[..., 0], q)
    with pytest.raises(ConfigError, match="block=0"):
        blockwise_attention(q, q, q, block=0)
    with pytest.raises(ConfigError, match="attention='ring'; expected one of plain, blockwise, flash"):
        LMConfig(attention="ring")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: AOT TPU compiles need it (torchnitro[xla])")
def test_pallas_kernels_compile_for_a_tpu_topology_under_shard_map():
    """The Mosaic (TPU) lowering of forward and backward, AOT for v5e:2x2 on this CPU; nothing runs."""
    from jax.sharding import NamedSharding, PartitionSpec

    from torchnitro.xla.flash import sharded_flash_attention

    mesh = make_mesh("2x2x1", target="v5e:2x2")
    spec = PartitionSpec(("data", "fsdp"), None, None, None)
    attend = sharded_flash_attention(mesh, spec, causal=True, block=128, interpret=False)
    x = jax.ShapeDtypeStruct((8, 2, 256, 128), jax.numpy.float32, sharding=NamedSharding(mesh, spec))
    grad = jax.grad(lambda q, k, v: jax.numpy.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2))
    hlo = jax.jit(grad).trace(x, x, x).lower().compile().as_text()
    assert hlo.count("tpu_custom_call") >= 3  # forward, dk/dv and dq kernels, not an interpreted loop
