"""The JAX LM computes what torchnitro.nn.TransformerLM computes, from the same weights."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")
torch = pytest.importorskip("torch")

from torchnitro.errors import ConfigError, ShapeError  # noqa: E402
from torchnitro.nn.models import TransformerConfig, TransformerLM  # noqa: E402
from torchnitro.xla.model import LMConfig, forward, from_torch_state_dict  # noqa: E402


@pytest.mark.parametrize("sizes", [dict(vocab_size=96, dim=32, n_layers=2, n_heads=4),
                                   dict(vocab_size=77, dim=48, n_layers=1, n_heads=6, n_kv_heads=2,
                                        tie_embeddings=False, ffn_dim=80)])
def test_logits_match_the_torch_reference(sizes):
    torch.manual_seed(0)
    ref = TransformerLM(TransformerConfig(max_seq_len=64, **sizes)).eval()
    cfg = LMConfig(max_seq_len=64, **sizes)
    params = from_torch_state_dict(ref.state_dict(), cfg)
    tokens = torch.randint(0, sizes["vocab_size"], (3, 13))
    with torch.no_grad():
        want = ref(tokens).numpy()
    got = np.asarray(jax.jit(forward, static_argnums=2)(params, jax.numpy.asarray(tokens.numpy()), cfg))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bad_config_and_tokens_raise():
    with pytest.raises(ConfigError, match="dim=30 is not divisible by n_heads=4"):
        LMConfig(dim=30, n_heads=4)
    with pytest.raises(ConfigError, match="with GQA"):
        LMConfig(dim=48, n_heads=6, n_kv_heads=2, pad_heads_to=4)
    cfg = LMConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, max_seq_len=4)
    params = from_torch_state_dict(TransformerLM(TransformerConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2,
                                                                   max_seq_len=4)).state_dict(), cfg)
    with pytest.raises(ShapeError, match="expected \\(batch, seq\\)"):
        forward(params, jax.numpy.zeros((4,), "int32"), cfg)
    with pytest.raises(ShapeError, match="exceeds max_seq_len=4"):
        forward(params, jax.numpy.zeros((1, 5), "int32"), cfg)
