"""A checkpoint saved on one mesh restores, bit for bit, onto a different mesh and rule set."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")
pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed: pip install 'torchnitro[xla]'")

import optax  # noqa: E402

from torchnitro.errors import ArtifactError  # noqa: E402
from torchnitro.xla.checkpoint import restore_train_state, save_checkpoint  # noqa: E402
from torchnitro.xla.lm import lm_train_step  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params  # noqa: E402

CFG = LMConfig(vocab_size=128, dim=64, n_layers=1, n_heads=8, max_seq_len=32)


def test_fsdp_checkpoint_restores_onto_a_tensor_parallel_mesh(tmp_path):
    opt = optax.sgd(0.1, momentum=0.9)
    a = lm_train_step(CFG, opt, make_mesh("1x8x1"), "fsdp", 8, 16)
    p, o = a.init(init_params(CFG, 0))
    o = jax.tree.map(lambda x: x + 1.0, o)  # non-trivial optimizer state
    save_checkpoint(tmp_path / "ckpt", {"params": p, "opt_state": o})
    b = lm_train_step(CFG, opt, make_mesh("2x1x4"), "fsdp_tp", 8, 16)
    p2, o2 = restore_train_state(tmp_path / "ckpt", CFG, b)
    for x, y in zip(jax.tree.leaves((p, o)), jax.tree.leaves((p2, o2))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert p2["layers"][0]["wq"].sharding == b.param_shardings["layers"][0]["wq"]
    assert {s.data.shape for s in p2["layers"][0]["wq"].addressable_shards} == {(64, 2, 8)}  # heads 8 / tensor 4
    with pytest.raises(ArtifactError, match="already exists"):
        save_checkpoint(tmp_path / "ckpt", {"params": p})
    with pytest.raises(ArtifactError, match="does not exist"):
        restore_train_state(tmp_path / "missing", CFG, b)
