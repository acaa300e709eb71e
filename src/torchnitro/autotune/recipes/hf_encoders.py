"""HF encoders of the BERT family, found anywhere in a user's model and mirrored padding-free in place.

A user holds an encoder as ``AutoModel.from_pretrained(...)`` returns it, inside a class of their own
(``forward(ids, mask) -> last_hidden_state``), or inside a task head (``BertForSequenceClassification``).
``find_encoders`` walks the module tree for HF base models (by module class and config, not by our
wrapper) and ``UnpaddedEncoder`` replaces each one it can mirror, keeping the HF call signature and
output type, so whatever the user wrapped around it runs unchanged.

Mirrored: ``model_type`` in ``SUPPORTED`` (BERT and MiniLM checkpoints, which are BertModel; RoBERTa,
XLM-R and CamemBERT, which share its layers; DistilBERT; MPNet, whose relative position bias is added
to each bucket's attention scores on real tokens only (``_unpad.position_bias_``); ELECTRA, with its
embedding projection), absolute position embeddings, exact (erf) GELU.

**What the fast path returns at masked (padded) positions**: ``last_hidden_state`` is exactly zero
there (eager BERT computes values for padded queries that every mask-aware pooling or head ignores);
at real positions it matches eager up to float reassociation. ``pooler_output`` (CLS token) matches
eager. The verification gate compares only the real positions when the inputs carry an attention
mask (``verify``). Calls the fast path does not mirror (``inputs_embeds``, ``position_ids``,
``output_hidden_states``/``output_attentions``, cross-attention, or a pooler with a padded first
position) run the original module unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipes._unpad import (LayerParts, PackedLayer, Packing, pack_tokens, position_bias_,
                                                run_layers)

__all__ = ["SUPPORTED", "FoundEncoder", "find_encoders", "encoders_reason", "UnpaddedEncoder", "unpad_encoders_"]

# HF model_type -> layer layout mirrored here
SUPPORTED: dict[str, str] = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta",
                             "distilbert": "distilbert", "mpnet": "mpnet", "electra": "electra"}
_NEUTRAL = {"use_cache": (None, False, True), "output_attentions": (None, False), "output_hidden_states": (None, False),
            "return_dict": (None, False, True)}  # arguments the fast path honours or may ignore (an encoder has no cache)


def _hf_known_kwargs() -> frozenset[str] | None:
    """The extra keywords HF models act on (``TransformersKwargs``); any other keyword an HF forward
    takes through ``**kwargs`` is ignored by the model, so the fast path may ignore it too (e.g.
    sentence-transformers passes its whole feature dict). None where transformers does not say."""
    try:
        from transformers.utils import TransformersKwargs
    except ImportError:
        return None
    return frozenset(getattr(TransformersKwargs, "__annotations__", {}))


@dataclass
class FoundEncoder:
    """An HF base model in the module tree."""

    name: str  # qualified submodule name ('' = the model itself)
    module: nn.Module
    reason: str | None  # why it cannot be mirrored; None: it can


def _is_hf_base_model(m: nn.Module) -> bool:
    cfg = getattr(m, "config", None)
    return (type(m).__module__.startswith("transformers.") and getattr(cfg, "model_type", None) is not None
            and getattr(m, "base_model", None) is m)


def _reason(m: nn.Module) -> str | None:
    cfg = m.config
    mt = cfg.model_type
    if mt not in SUPPORTED:
        return f"not supported yet: {type(m).__name__} (model_type {mt!r}); mirrored: {sorted(SUPPORTED)}"
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        return f"{type(m).__name__} is configured as a decoder / with cross-attention; only encoders are mirrored"
    if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        return f"{type(m).__name__}: relative position embeddings ({cfg.position_embedding_type!r}) are not mirrored"
    act = getattr(cfg, "activation", None) if SUPPORTED[mt] == "distilbert" else getattr(cfg, "hidden_act", None)
    if act != "gelu":
        return f"{type(m).__name__}: activation {act!r}; only exact (erf) 'gelu' is mirrored"
    if getattr(m, "embeddings", None) is None or not hasattr(m.embeddings, "word_embeddings"):
        return f"{type(m).__name__} has no standard embeddings module"
    if SUPPORTED[mt] == "mpnet" and not (hasattr(m.encoder, "relative_attention_bias")
                                         and hasattr(m.encoder, "relative_position_bucket")):
        return f"{type(m).__name__}: no relative_attention_bias / relative_position_bucket on its encoder"
    return None


def find_encoders(model: nn.Module) -> list[FoundEncoder]:
    """Every outermost HF base model in ``model``'s tree (a task head's encoder, a user wrapper's
    ``self.bert``, or ``model`` itself), with why it cannot be mirrored where it cannot."""
    found: list[FoundEncoder] = []
    for name, m in model.named_modules():
        if any(name.startswith(f.name + ".") or f.name == "" for f in found):
            continue  # inside an encoder already found
        if _is_hf_base_model(m):
            found.append(FoundEncoder(name, m, _reason(m)))
    return found


def encoders_reason(model: nn.Module) -> str | None:
    """None when ``model`` holds at least one encoder ``UnpaddedEncoder`` mirrors, and none it cannot."""
    found = find_encoders(model)
    if not found:
        return ("no HF encoder of the BERT family (BertModel, RobertaModel, XLMRobertaModel, DistilBertModel, "
                "MPNetModel, ElectraModel, MiniLM checkpoints) in the model tree")
    bad = [f"{f.name or type(f.module).__name__}: {f.reason}" for f in found if f.reason]
    return "; ".join(bad) if bad else None


def _roberta_positions(ids: Tensor, pad: int) -> Tensor:
    """RoBERTa's position ids: counted over non-pad tokens from ``pad + 1``, exactly as HF does."""
    real = ids.ne(pad).int()  # (B, T)
    return (torch.cumsum(real, dim=1).type_as(real) * real).long() + pad


# MPNetEncoder.forward calls compute_position_bias with its defaults: 32 buckets, max distance 128,
# whatever config.relative_attention_num_buckets says (transformers/models/mpnet/modeling_mpnet.py)
_MPNET_BUCKETS, _MPNET_MAX_DISTANCE = 32, 128

_OUTPUT = {"distilbert": "BaseModelOutput", "mpnet": "BaseModelOutputWithPooling",
           "electra": "BaseModelOutputWithPastAndCrossAttentions"}  # the class each HF forward returns


class UnpaddedEncoder(nn.Module):
    """An HF BERT-family base model on its real tokens only; same call signature and output type.

    ``out_dtype``: cast the outputs to it (a bf16 copy hands fp32 to the user's code); None: as computed."""

    attention_buckets = 4  # groups of similar-length sentences attended separately (1: the whole batch padded to T)

    def __init__(self, hf_model: nn.Module, out_dtype: torch.dtype | None = None):
        super().__init__()
        why = _reason(hf_model) if _is_hf_base_model(hf_model) else f"{type(hf_model).__name__} is not an HF base model"
        if why is not None:
            from torchnitro.errors import RecipeError

            raise RecipeError(f"UnpaddedEncoder: {why}")
        cfg = hf_model.config
        self.config = cfg  # code around the encoder reads it (sentence-transformers, user wrappers)
        self.arch = SUPPORTED[cfg.model_type]
        emb = hf_model.embeddings
        self.word, self.pos, self.ln_emb = emb.word_embeddings, emb.position_embeddings, emb.LayerNorm
        self.tok_type = getattr(emb, "token_type_embeddings", None)
        # RoBERTa and MPNet count positions over non-pad ids from padding_idx + 1
        self.pad_id = (int(getattr(emb, "padding_idx", cfg.pad_token_id or 0)) if self.arch in ("roberta", "mpnet")
                       else None)
        self.project = getattr(hf_model, "embeddings_project", None)  # ELECTRA: embedding_size -> hidden_size
        self.rel_bias = hf_model.encoder.relative_attention_bias if self.arch == "mpnet" else None  # (buckets, H)
        self._bucket = type(hf_model.encoder).relative_position_bucket if self.arch == "mpnet" else None
        if self.arch == "distilbert":
            layers, parts, heads = hf_model.transformer.layer, LayerParts.distilbert, cfg.n_heads
        else:
            parts = LayerParts.mpnet if self.arch == "mpnet" else LayerParts.bert
            layers, heads = hf_model.encoder.layer, cfg.num_attention_heads
        self.layers = nn.ModuleList(PackedLayer(parts(layer), heads) for layer in layers)
        self.pooler = getattr(hf_model, "pooler", None)
        self.out_dtype = out_dtype
        self.return_dict = bool(getattr(cfg, "return_dict", True))
        import transformers.modeling_outputs as mo

        self._out_cls = getattr(mo, _OUTPUT.get(self.arch, "BaseModelOutputWithPoolingAndCrossAttentions"))
        # the original module, for calls the fast path does not mirror; shares the weights, not a submodule
        # (int8 planning and state_dict see only the packed layers)
        object.__setattr__(self, "_eager", hf_model)
        self._sig = inspect.signature(type(hf_model).forward)
        self._hf_kwargs = _hf_known_kwargs()
        self.fallback_calls = 0  # calls handed to the original module (see _mirrored)

    def _mirrored(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The bound call when the fast path mirrors it, else None."""
        try:
            bound = dict(self._sig.bind(self._eager, *args, **kwargs).arguments)
        except TypeError:
            return None
        bound.pop("self", None)
        extra = bound.pop("kwargs", {})
        if self._hf_kwargs is not None:  # keywords the HF model ignores are ignored here too
            extra = {k: v for k, v in extra.items() if k in self._hf_kwargs or k in _NEUTRAL}
        bound.update(extra)
        for k, v in bound.items():
            if k in ("input_ids", "attention_mask", "token_type_ids"):
                continue
            if not (v is None or (k in _NEUTRAL and any(v is n for n in _NEUTRAL[k]))):
                return None
        ids, mask = bound.get("input_ids"), bound.get("attention_mask")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return None
        if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(ids.shape)):
            return None  # a 4-D additive mask or other layouts: the original handles them
        if self.pooler is not None and mask is not None and not bool((mask[:, 0] != 0).all()):
            return None  # the pooler reads position 0, which is padding here (left padding)
        return bound

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._mirrored(args, kwargs)
        if bound is None:
            self.fallback_calls += 1
            return self._eager(*args, **kwargs)
        ids = bound["input_ids"]  # (B, T)
        b, t = ids.shape
        mask = bound.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        x, p = self.packed(ids, mask, bound.get("token_type_ids"))
        hidden = p.scatter(x, b, t)  # (B, T, D), zeros at padded positions
        pooled = self.pooler(hidden) if self.pooler is not None else None  # (B, D)
        if self.out_dtype is not None:
            hidden = hidden.to(self.out_dtype)
            pooled = pooled.to(self.out_dtype) if pooled is not None else None
        fields = {"last_hidden_state": hidden}
        if self.arch not in ("distilbert", "electra"):
            fields["pooler_output"] = pooled
        rd = bound.get("return_dict")
        if rd is False or (rd is None and not self.return_dict):
            return tuple(v for v in fields.values() if v is not None)
        return self._out_cls(**fields)

    def packed(self, ids: Tensor, mask: Tensor, token_type_ids: Tensor | None = None) -> tuple[Tensor, Packing]:
        """``(B, T)`` ids and mask -> the last layer's ``(N, D)`` real-token rows and their packing."""
        t = ids.shape[1]
        p = pack_tokens(mask, self.attention_buckets)
        x = self.word(ids.reshape(-1)[p.idx])  # (N, D)
        if self.tok_type is not None:
            x = x + (self.tok_type.weight[0] if token_type_ids is None
                     else self.tok_type(token_type_ids.reshape(-1)[p.idx]))
        if self.pad_id is not None:
            pos = _roberta_positions(ids, self.pad_id).reshape(-1)[p.idx]
        else:
            pos = p.idx % t  # absolute position of each real token
        x = self.ln_emb(x + self.pos(pos))
        if self.project is not None:
            x = self.project(x)  # (N, D)
        if self.rel_bias is not None:
            position_bias_(p, t, self._relative_bias)
        return run_layers(self.layers, x, p), p

    def _relative_bias(self, rel: Tensor) -> Tensor:
        """MPNet: relative positions ``key - query`` -> ``(..., H)`` attention scores, HF's own bucketing."""
        return self.rel_bias(self._bucket(rel, num_buckets=_MPNET_BUCKETS, max_distance=_MPNET_MAX_DISTANCE))


def unpad_encoders_(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every BERT-family encoder in ``model`` by its ``UnpaddedEncoder`` in place (``dtype``:
    the encoder computes in it and hands fp32 on). Returns the model (a new object when ``model`` is
    itself the encoder)."""
    found = find_encoders(model)
    bad = [f for f in found if f.reason]
    if not found or bad:
        from torchnitro.errors import RecipeError

        raise RecipeError(f"padding-free encoder: {encoders_reason(model)}")
    for f in found:
        sub = f.module.to(dtype) if dtype is not None else f.module
        fast = UnpaddedEncoder(sub, out_dtype=torch.float32 if dtype is not None else None).eval()
        if f.name == "":
            return fast
        model.set_submodule(f.name, fast)
    return model
