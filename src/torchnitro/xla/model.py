"""A decoder-only transformer LM in plain JAX, shaped like ``torchnitro.nn.TransformerLM``.

Same blocks as the PyTorch reference: token embedding, pre-norm blocks (RMSNorm -> causal
attention with RoPE on the two halves of each head and optional GQA; RMSNorm -> SwiGLU), final
RMSNorm, LM head tied to the embedding by default. ``from_torch_state_dict`` loads that model's
weights, so the two are tested against each other.

Parameters are a plain pytree of arrays; ``logical_axes(cfg)`` is the same tree with a tuple of
logical dimension names per leaf, which ``torchnitro.xla.rules`` resolves to mesh shardings.

Layout padding (``pad_multiple``, ``pad_heads_to``) stores vocab / width / MLP hidden / heads at
padded sizes with zeros in the padding, and computes exactly the unpadded function: RMSNorm divides
by the true width, padded vocab logits are masked out of the softmax, and zero rows/columns stay
zero under the gradient (see torchnitro.xla.layout for the report of what the padding costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from torchnitro.errors import ConfigError, ShapeError
from torchnitro.xla.flash import ATTENTION_IMPLS, blockwise_attention, flash_attention
from torchnitro.xla.remat import layer_policies, remat_block

__all__ = ["LMConfig", "Constrain", "Attend", "attention_fn", "init_params", "logical_axes", "param_spec", "true_index",
           "forward", "loss_fn",
           "from_torch_state_dict"]


# (activation, logical axes) -> the activation with a sharding constraint; identity when unsharded
Constrain = Callable[[jax.Array, tuple], jax.Array]


def _no_constraint(x: jax.Array, axes: tuple) -> jax.Array:
    return x


# causal attention on (B, H, T, Dh) q, k, v (K/V already repeated to H heads) -> (B, H, T, Dh)
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class LMConfig:
    """Sizes of the JAX LM; field names and defaults follow torchnitro.nn.TransformerConfig."""

    vocab_size: int = 8192  # token vocabulary
    dim: int = 256  # model width D
    n_layers: int = 4  # number of pre-norm blocks
    n_heads: int = 4  # query heads H; head dim = dim // n_heads
    n_kv_heads: int | None = None  # GQA: fewer K/V heads; None means n_heads
    ffn_dim: int | None = None  # SwiGLU hidden; None: 8/3 * dim rounded up to a multiple of 64 (as in torch)
    max_seq_len: int = 1024  # RoPE table length
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = True  # LM head is the embedding transposed
    pad_multiple: int = 1  # store vocab, width and MLP hidden rounded up to this (128: the TPU MXU tile)
    pad_heads_to: int = 1  # store the head count rounded up to this (e.g. the tensor-parallel degree)
    attention: str = "plain"  # "plain" (materialises (B, H, T, T) scores), "blockwise" (jnp scan) or "flash" (Pallas)
    attn_block: int = 128  # query/key block of blockwise and flash attention (128: one TPU MXU tile)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"attention={self.attention!r}; expected one of {', '.join(ATTENTION_IMPLS)}")
        if self.pad_multiple < 1 or self.pad_heads_to < 1:
            raise ConfigError(f"pad_multiple={self.pad_multiple}, pad_heads_to={self.pad_heads_to}: expected >= 1")
        if self.pad_heads_to > 1 and self.kv_heads != self.n_heads and self.padded_heads != self.n_heads:
            raise ConfigError(f"pad_heads_to={self.pad_heads_to} with GQA (n_heads={self.n_heads}, n_kv_heads="
                              f"{self.kv_heads}) would regroup query heads; pad heads only for multi-head attention")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim if self.ffn_dim is not None else 64 * math.ceil(int(8 * self.dim / 3) / 64)

    @property
    def padded_vocab(self) -> int:
        return _round_up(self.vocab_size, self.pad_multiple)

    @property
    def padded_dim(self) -> int:
        return _round_up(self.dim, self.pad_multiple)

    @property
    def padded_hidden(self) -> int:
        return _round_up(self.hidden_dim, self.pad_multiple)

    @property
    def padded_heads(self) -> int:
        return _round_up(self.n_heads, self.pad_heads_to)

    @property
    def padded_kv_heads(self) -> int:
        return self.padded_heads if self.kv_heads == self.n_heads else self.kv_heads


def _layer_shapes(c: LMConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    D, H, K, Dh, F = c.padded_dim, c.padded_heads, c.padded_kv_heads, c.head_dim, c.padded_hidden
    return {
        "attn_norm": ((D,), ("norm",)),
        "wq": ((D, H, Dh), ("embed", "heads", "head_dim")),
        "wk": ((D, K, Dh), ("embed", "kv_heads", "head_dim")),
        "wv": ((D, K, Dh), ("embed", "kv_heads", "head_dim")),
        "wo": ((H, Dh, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ((D,), ("norm",)),
        "w1": ((D, F), ("embed", "mlp")),  # gate
        "w3": ((D, F), ("embed", "mlp")),  # up
        "w2": ((F, D), ("mlp", "embed")),  # down
    }


def _top_shapes(c: LMConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    top = {"embed": ((c.padded_vocab, c.padded_dim), ("vocab", "embed")), "norm": ((c.padded_dim,), ("norm",))}
    if not c.tie_embeddings:
        top["lm_head"] = ((c.padded_dim, c.padded_vocab), ("embed", "vocab"))
    return top


def logical_axes(cfg: LMConfig) -> dict[str, Any]:
    """The parameter tree with a tuple of logical dimension names at each leaf."""
    tree: dict[str, Any] = {k: ax for k, (_, ax) in _top_shapes(cfg).items()}
    tree["layers"] = [{k: ax for k, (_, ax) in _layer_shapes(cfg).items()} for _ in range(cfg.n_layers)]
    return tree


def true_index(cfg: LMConfig, axes: tuple[str, ...]) -> tuple[slice, ...]:
    """The unpadded block of an array with these logical axes: ``padded[true_index(...)]``."""
    true = {"vocab": cfg.vocab_size, "embed": cfg.dim, "norm": cfg.dim, "mlp": cfg.hidden_dim,
            "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim}
    return tuple(slice(0, true[a]) for a in axes)


def _true_mask(c: LMConfig, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """1 on the unpadded block of a parameter, 0 on its layout padding."""
    m = np.zeros(shape, np.float32)
    m[true_index(c, {**_top_shapes(c), **_layer_shapes(c)}[name][1])] = 1.0
    return m


def _build(cfg: LMConfig, leaf: Callable[[str, tuple[int, ...]], Any]) -> dict[str, Any]:
    """The parameter tree with ``leaf(name, padded_shape)`` at each position."""
    tree: dict[str, Any] = {k: leaf(k, s) for k, (s, _) in _top_shapes(cfg).items()}
    tree["layers"] = [{k: leaf(k, s) for k, (s, _) in _layer_shapes(cfg).items()} for _ in range(cfg.n_layers)]
    return tree


def init_params(cfg: LMConfig, seed: int = 0) -> dict[str, Any]:
    """Weights ~ N(0, 0.02) (norms = 1) like the torch reference; layout padding is exactly zero.

    Drawn with numpy on the host: no compile (jax.random's threefry takes seconds to compile on a
    busy CPU), deterministic per seed; place them with ``TrainStep.init`` or ``shard_tree``.
    """
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...]) -> jax.Array:
        w = np.ones(shape, np.float32) if "norm" in name else rng.normal(0.0, 0.02, shape).astype(np.float32)
        return jnp.asarray(w * _true_mask(cfg, name, shape))

    return _build(cfg, make)


def param_spec(cfg: LMConfig) -> Any:
    """ShapeDtypeStructs of the parameters (no memory is allocated)."""
    return _build(cfg, lambda _, shape: jax.ShapeDtypeStruct(shape, jnp.float32))


def _rms_norm(x: jax.Array, w: jax.Array, true_dim: int, eps: float) -> jax.Array:
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / true_dim  # padded columns are zero: the sum is the true one
    return x * jax.lax.rsqrt(ms + eps) * w


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (B, T, H, Dh); rotate (first half, second half) pairs, as torchnitro.nn.models.apply_rope."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, Dh/2)
    return jnp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def attention_fn(cfg: LMConfig) -> Attend | None:
    """The unsharded attention of ``cfg.attention`` (None: the plain einsum path inside the block)."""
    if cfg.attention == "plain":
        return None
    fn = flash_attention if cfg.attention == "flash" else blockwise_attention
    return lambda q, k, v: fn(q, k, v, causal=True, block=cfg.attn_block)


def _block(c: LMConfig, p: Mapping[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array,
           attend: Attend | None = None) -> jax.Array:
    h = _rms_norm(x, p["attn_norm"], c.dim, c.norm_eps)  # (B, T, D)
    q = _rope(jnp.einsum("btd,dhk->bthk", h, p["wq"]), cos, sin)  # (B, T, H, Dh)
    k = _rope(jnp.einsum("btd,dhk->bthk", h, p["wk"]), cos, sin)  # (B, T, Hkv, Dh)
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    rep = q.shape[2] // k.shape[2]  # GQA: query head i reads kv head i // rep (torch enable_gqa)
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    if attend is None:
        T = x.shape[1]
        s = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(c.head_dim)  # (B, H, T, T)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
        y = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v)
    else:  # blockwise / flash: (B, H, T, Dh) in and out, no (T, T) scores kept
        y = attend(*(t.transpose(0, 2, 1, 3) for t in (q, k, v))).transpose(0, 2, 1, 3)  # (B, T, H, Dh)
    x = x + jnp.einsum("bthk,hkd->btd", y, p["wo"])
    h = _rms_norm(x, p["mlp_norm"], c.dim, c.norm_eps)
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def forward(params: Mapping[str, Any], tokens: jax.Array, cfg: LMConfig, remat: str | Sequence[str] = "none",
            constrain: Constrain = _no_constraint, attend: Attend | None = None) -> jax.Array:
    """tokens (B, T) int -> logits (B, T, padded_vocab); padded vocab entries are a large negative.

    ``constrain`` pins the residual stream and the logits to their logical axes (MaxText's activation
    rules), so the partitioner keeps the batch split instead of guessing from the weights.
    ``attend`` overrides ``attention_fn(cfg)`` (the train step passes flash attention under shard_map).
    """
    if tokens.ndim != 2:
        raise ShapeError(f"tokens: received shape {tuple(tokens.shape)}, expected (batch, seq)")
    T = tokens.shape[1]
    if T > cfg.max_seq_len:
        raise ShapeError(f"sequence length {T} exceeds max_seq_len={cfg.max_seq_len}")
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim)
    ang = jnp.outer(jnp.arange(T, dtype=jnp.float32), inv)  # (T, Dh/2)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    resid = ("activation_batch", "activation_length", "activation_embed")
    x = constrain(params["embed"][tokens], resid)  # (B, T, D)
    attend = attend or attention_fn(cfg)
    for lp, pol in zip(params["layers"], layer_policies(remat, cfg.n_layers)):
        x = constrain(remat_block(lambda p_, x_: _block(cfg, p_, x_, cos, sin, attend), pol)(lp, x), resid)
    x = _rms_norm(x, params["norm"], cfg.dim, cfg.norm_eps)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = constrain(x @ head, ("activation_batch", "activation_length", "activation_vocab"))  # (B, T, Vp)
    if cfg.padded_vocab != cfg.vocab_size:  # padded tokens never win the softmax
        logits = jnp.where(jnp.arange(cfg.padded_vocab) < cfg.vocab_size, logits, jnp.finfo(logits.dtype).min)
    return logits


def loss_fn(params: Mapping[str, Any], batch: Mapping[str, jax.Array], cfg: LMConfig,
            remat: str | Sequence[str] = "none", constrain: Constrain = _no_constraint,
            attend: Attend | None = None) -> jax.Array:
    """Mean next-token cross-entropy; batch = {"tokens": (B, T), "targets": (B, T)} int32."""
    logits = forward(params, batch["tokens"], cfg, remat, constrain, attend)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def from_torch_state_dict(sd: Mapping[str, Any], cfg: LMConfig) -> dict[str, Any]:
    """Parameters from a ``torchnitro.nn.TransformerLM`` state dict (tensors or arrays), unpadded."""
    if cfg.pad_multiple != 1 or cfg.pad_heads_to != 1:
        raise ConfigError("from_torch_state_dict loads unpadded weights; use a config with pad_multiple=1, "
                          "pad_heads_to=1 and pad afterwards (torchnitro.xla.layout.pad_params)")
    a = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, np.float32) for k, v in sd.items()}
    D, Dh = cfg.dim, cfg.head_dim

    def heads(w: np.ndarray) -> jnp.ndarray:  # torch Linear (H*Dh, D) -> (D, H, Dh)
        return jnp.asarray(w.T.reshape(D, -1, Dh))

    params: dict[str, Any] = {"embed": jnp.asarray(a["embed.weight"]), "norm": jnp.asarray(a["norm.weight"])}
    if not cfg.tie_embeddings:
        params["lm_head"] = jnp.asarray(a["lm_head.weight"].T)
    params["layers"] = []
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        params["layers"].append({
            "attn_norm": jnp.asarray(a[p + "attn_norm.weight"]), "mlp_norm": jnp.asarray(a[p + "mlp_norm.weight"]),
            "wq": heads(a[p + "attn.wq.weight"]), "wk": heads(a[p + "attn.wk.weight"]),
            "wv": heads(a[p + "attn.wv.weight"]),
            "wo": jnp.asarray(a[p + "attn.wo.weight"].T.reshape(-1, Dh, D)),
            "w1": jnp.asarray(a[p + "mlp.w1.weight"].T), "w3": jnp.asarray(a[p + "mlp.w3.weight"].T),
            "w2": jnp.asarray(a[p + "mlp.w2.weight"].T),
        })
    return params
