"""The liveness walk behind the temp estimate: which values get a buffer, and when they die."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from torchnitro.xla.estimate import estimate_memory  # noqa: E402
from torchnitro.xla.liveness import pack, simulate  # noqa: E402
from torchnitro.xla.lm import lm_train_step  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig  # noqa: E402

CFG = LMConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=128)
X = jax.ShapeDtypeStruct((64, 32), jnp.float32)  # 8 KiB
W = jax.ShapeDtypeStruct((32, 32), jnp.float32)  # 4 KiB


def _args(i, shape):
    return "arg"


def test_elementwise_chains_fuse_and_only_matmul_outputs_take_memory():
    def f(x, w):
        h = jnp.tanh(x * 2.0 + 1.0)  # fused into the matmul: no buffer
        y = h @ w  # (64, 32) f32: the one temp buffer
        return jnp.exp(y) - y  # fused into the output

    walk = simulate(f, (X, W), _args, tpu=False)
    assert walk.peak == 64 * 32 * 4
    assert walk.at_peak == {"dots": 64 * 32 * 4}


def test_a_fused_value_read_late_keeps_its_matmul_inputs_alive():
    def f(x, w):
        a = x @ w  # 8 KiB
        b = a @ w  # 8 KiB, while a is still needed below
        return (b @ w) + jnp.sin(a)  # sin(a) is recomputed here, so a lives to the end

    walk = simulate(f, (X, W), _args, tpu=False)
    assert walk.peak == 3 * 64 * 32 * 4  # a, b and the last product together
    assert walk.heap == walk.peak  # nested live ranges pack without gaps


def test_heap_packing_reuses_space_of_buffers_dead_in_time():
    # (bytes, first, last): three buffers live together at step 4 stack up
    assert pack([(4, 0, 5), (3, 4, 9), (3, 4, 9)]) == 10
    # largest first: the 5-byte buffer takes [0, 5); the long 4-byte one goes above it; the 4- and 3-byte ones
    # that do not overlap the 5-byte one in time reuse its place
    assert pack([(4, 0, 1), (4, 0, 9), (3, 5, 9), (5, 2, 3)]) == 9
    # a short buffer leaves a hole that a later, smaller one reuses
    assert pack([(8, 0, 1), (8, 2, 3), (4, 2, 3)]) == 12
    assert pack([(8, 0, 1), (4, 2, 3)]) == 8


def test_gathered_inputs_live_from_first_to_last_use_and_count_as_weights():
    def f(x, w):
        return jnp.sum((x @ w) @ w)

    walk = simulate(f, (X, W), lambda i, s: "weights" if i == 1 else "arg", tpu=False)
    assert walk.at_peak["weights"] == 32 * 32 * 4
    # on a TPU the (32, 32) weight is stored in (8, 128) tiles, and gathered in bf16 (only matmuls read it)
    tpu = simulate(f, (X, W), lambda i, s: "weights" if i == 1 else "arg", tpu=True)
    assert tpu.at_peak["weights"] == 32 * 128 * 2


@pytest.mark.parametrize("mesh,rules", [("1x8x1", "fsdp"), ("2x2x2", "fsdp_tp")])
def test_lm_walk_orders_remat_policies(mesh, rules):
    m = make_mesh(mesh)
    temp = {}
    for remat in ("none", "dots_saveable", "nothing_saveable"):
        step = lm_train_step(CFG, optax.adamw(1e-3), m, rules, 16, 128, remat=remat)
        e = estimate_memory(CFG, step, 16, 128, remat)
        temp[remat] = e.temp
        assert e.temp >= sum(e.at_peak.values())  # the packed heap is at least the live peak
    # the walk keeps matmul outputs and recomputes elementwise residuals: none and dots_saveable keep the
    # same buffers; nothing_saveable keeps only each block's input
    assert temp["none"] >= temp["dots_saveable"] > temp["nothing_saveable"], temp


def _two_layer_grads(w1, w2, x):
    def loss(w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)


def _sharded_grads(i, shape):
    return ("grads", 16) if i in (1, 2) else ("", 0)  # both gradients are synchronised as 16-byte shards


def test_grad_sync_scatter_keeps_shards_combined_keeps_whole_gradients_to_the_end():
    args = (W, W, X)
    scatter = simulate(_two_layer_grads, args, _args, False, _sharded_grads, grad_sync="scatter")
    combined = simulate(_two_layer_grads, args, _args, False, _sharded_grads, grad_sync="combined")
    # scatter: at the peak only the finished gradient's shard waits; combined: w2's whole (32, 32) gradient,
    # finished first, waits for the one all-reduce at the end beside w1's
    assert scatter.at_peak["grads"] == 16
    assert combined.at_peak["grads"] == 2 * 32 * 32 * 4
    assert combined.peak == scatter.peak - 16 - 32 * 32 * 4 + 2 * 32 * 32 * 4


def test_grad_sync_deferred_moves_the_gradient_matmuls_and_keeps_their_operands():
    walk = simulate(_two_layer_grads, (W, W, X), _args, False, _sharded_grads, grad_sync="deferred")
    # the two weight-gradient matmuls leave their place (no (32, 32) buffer is live before the end); their
    # operands that are not inputs wait, stored at their own size: tanh(x @ w1) and the back-propagated
    # (64, 32) gradient; x is an input and the all-ones cotangent is built from a constant
    assert walk.at_peak["deferred"] == 2 * 64 * 32 * 4
    assert all(shape != (32, 32) for _, shape, *_ in walk.live)


def test_grad_sync_rejects_unknown_modes():
    with pytest.raises(ValueError, match="grad_sync='eager'"):
        simulate(_two_layer_grads, (W, W, X), _args, False, _sharded_grads, grad_sync="eager")


def test_lm_fsdp_estimate_keeps_whole_gradients_by_default():
    step = lm_train_step(CFG, optax.adamw(1e-3), make_mesh("1x8x1"), "fsdp", 16, 128, remat="nothing_saveable")
    default = estimate_memory(CFG, step, 16, 128, "nothing_saveable")
    scatter = estimate_memory(CFG, step, 16, 128, "nothing_saveable", grad_sync="scatter")
    assert default.temp >= scatter.temp
    assert default == estimate_memory(CFG, step, 16, 128, "nothing_saveable", grad_sync="combined")


def test_on_a_tpu_weights_read_only_by_matmuls_are_gathered_in_bf16():
    def f(x, w):
        return jnp.sum(x @ w.T)  # read through a transpose by a matmul only

    gathered = lambda i, s: "weights" if i == 1 else "arg"  # noqa: E731
    tpu = simulate(f, (X, W), gathered, tpu=True)
    assert tpu.at_peak["weights"] == 32 * 128 * 2  # (32, 32) in (8, 128) tiles, bf16
    assert simulate(f, (X, W), gathered, tpu=False).at_peak["weights"] == 32 * 32 * 4  # host: as traced

    def g(x, w):
        return jnp.sum(x @ w) + jnp.sum(jnp.exp(w))  # an elementwise reader needs the f32 values

    assert simulate(g, (X, W), gathered, tpu=True).at_peak["weights"] == 32 * 128 * 4


def test_lookups_of_a_row_local_table_read_its_shards():
    table = jax.ShapeDtypeStruct((512, 32), jnp.float32)  # 64 KiB
    idx = jax.ShapeDtypeStruct((64,), jnp.int32)

    def f(t, i, w):
        e = jnp.take(t, i, axis=0)  # (64, 32) lookup at the start
        h = e @ w  # (64, 32)
        return jnp.sum(h @ t.T)  # (64, 512): the table as the tied output head

    gathered = lambda i, s: "weights" if i == 0 else "arg"  # noqa: E731
    whole = simulate(f, (table, idx, W), gathered, tpu=False)
    local = simulate(f, (table, idx, W), gathered, tpu=False, row_local=frozenset({0}))
    # gathered for the lookup, the table lives from the gather (equation 4) through the matmul after it (5) to
    # the head; looked up on the shards, only from the head's transpose (6)
    assert [r[4] for r in whole.live if r[0].startswith("weights")] == [4]
    assert [r[4] for r in local.live if r[0].startswith("weights")] == [6]
