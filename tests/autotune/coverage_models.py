"""The coverage set of issue 15 item 9 (BERT, RoBERTa, DistilBERT, XLM-R, MPNet, ELECTRA, ALBERT, GPT-2, Llama,
T5 encoder, ViT, ResNet, MobileNetV2): real architectures from their real config classes, shrunk to
tiny sizes, random weights (no download), each as users hold them. Shared by
``test_coverage_models.py`` and ``benchmarks/optimize_user_models.py`` (which times them at larger sizes).

A ``Case`` builds the HF model and its example inputs; ``held(case, how, ...)`` gives the model as a
user holds it: ``hf`` (the HF class itself, positional tensors), ``dict`` (the HF class, a tokenizer-
or processor-style dict by argument name) or ``wrapper`` (a class of the user's own around it that
returns one tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Case", "CASES", "held", "OUR_FAULT", "ours", "HOLDINGS"]

HOLDINGS = ("hf", "dict", "wrapper")


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[int], nn.Module]  # scale -> the HF model, eval, random weights (scale 1: tiny for tests)
    kind: str  # 'text' (ids, mask), 'ids' (ids only: causal LM) or 'image' (pixel_values)
    recipes: list[str]  # the short list the unit test runs: eager-kind, in-process and isolated recipes
    pick: Callable[[Any], torch.Tensor]  # HF output -> the tensor a wrapper returns
    sweep: list[str] = field(default_factory=list)  # extra recipes for the benchmark's fuller sweep


def _auto(config: Any, attn: str = "sdpa") -> nn.Module:
    from transformers import AutoModel

    torch.manual_seed(0)
    return AutoModel.from_config(config, attn_implementation=attn).float().eval()


def _bert(scale: int) -> nn.Module:
    from transformers import BertConfig

    return _auto(BertConfig(vocab_size=1024, hidden_size=32 * scale, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64 * scale, max_position_embeddings=160))


def _roberta(scale: int) -> nn.Module:
    from transformers import RobertaConfig

    return _auto(RobertaConfig(vocab_size=1024, hidden_size=32 * scale, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64 * scale, max_position_embeddings=160, pad_token_id=1))


def _distilbert(scale: int) -> nn.Module:
    from transformers import DistilBertConfig

    return _auto(DistilBertConfig(vocab_size=1024, dim=32 * scale, n_layers=2, n_heads=4, hidden_dim=64 * scale,
                                  max_position_embeddings=160))


def _xlm_roberta(scale: int) -> nn.Module:
    from transformers import XLMRobertaConfig

    return _auto(XLMRobertaConfig(vocab_size=1024, hidden_size=32 * scale, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64 * scale, max_position_embeddings=160, pad_token_id=1))


def _mpnet(scale: int) -> nn.Module:
    from transformers import MPNetConfig

    # transformers has no SDPA attention for MPNet (its relative position bias): the eager attention a user gets
    return _auto(MPNetConfig(vocab_size=1024, hidden_size=32 * scale, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64 * scale, max_position_embeddings=160, pad_token_id=1), attn="eager")


def _electra(scale: int) -> nn.Module:
    from transformers import ElectraConfig

    # embedding_size < hidden_size, as in ELECTRA-small/base discriminators: the embeddings are projected
    return _auto(ElectraConfig(vocab_size=1024, embedding_size=16 * scale, hidden_size=32 * scale, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64 * scale, max_position_embeddings=160))


def _albert(scale: int) -> nn.Module:
    from transformers import AlbertConfig

    # one layer's weights shared by both layers and a factorised embedding, as ALBERT is; its gelu_new is HF's default
    return _auto(AlbertConfig(vocab_size=1024, embedding_size=16 * scale, hidden_size=32 * scale, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64 * scale, max_position_embeddings=160))


def _gpt2(scale: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1024, n_embd=32 * scale, n_layer=2, n_head=4, n_positions=160, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).float().eval()


def _llama(scale: int) -> nn.Module:
    from transformers import LlamaConfig

    return _auto(LlamaConfig(vocab_size=1024, hidden_size=32 * scale, intermediate_size=64 * scale,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=160, use_cache=False))


def _t5_encoder(scale: int) -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=1024, d_model=32 * scale, d_kv=8 * scale, d_ff=64 * scale, num_layers=2, num_heads=4,
                   use_cache=False)
    return T5EncoderModel(cfg).float().eval()


def _vit(scale: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32 * scale, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64 * scale, num_labels=10)
    return ViTForImageClassification(cfg).float().eval()


def _resnet(scale: int) -> nn.Module:
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16 * scale, hidden_sizes=[16 * scale, 32 * scale], depths=[1, 1],
                       layer_type="basic")
    return ResNetModel(cfg).float().eval()


def _mobilenet(scale: int) -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2Model

    torch.manual_seed(0)
    model = MobileNetV2Model(MobileNetV2Config(image_size=32, depth_multiplier=0.25 * scale)).float().eval()
    for m in model.modules():  # HF's init (std 0.02) fades to ~1e-26 through 17 blocks: take a trained net's scale
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return model


def _hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state


def _logits(out: Any) -> torch.Tensor:
    return out.logits


def _pooled(out: Any) -> torch.Tensor:
    return out.pooler_output.flatten(1)


_TEXT = ["dynamic-int8", "onnxruntime"]
_IMAGE = ["conv-bn-fold", "onnxruntime"]
CASES: dict[str, Case] = {c.name: c for c in [
    Case("bert", _bert, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bert-unpad-bf16", "bf16", "compile", "onnxruntime-int8", "openvino"]),
    Case("roberta", _roberta, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bf16", "onnxruntime-int8", "openvino"]),
    Case("distilbert", _distilbert, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bf16", "onnxruntime-int8", "openvino"]),
    Case("xlm-roberta", _xlm_roberta, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bf16", "onnxruntime-int8", "openvino"]),
    Case("mpnet", _mpnet, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bf16", "onnxruntime-int8", "openvino"]),
    Case("electra", _electra, "text", ["bert-unpad", "dynamic-int8", "onnxruntime"], _hidden,
         ["bert-unpad-int8", "bf16", "onnxruntime-int8", "openvino"]),
    Case("albert", _albert, "text", ["bert-unpad"] + _TEXT + ["int8-mixed"], _hidden,  # bert-unpad: says why not
         ["bf16", "torchscript", "onnxruntime-int8", "openvino"]),
    Case("gpt2", _gpt2, "ids", _TEXT, _logits, ["int8-mixed", "bf16", "torchscript", "openvino"]),
    Case("llama", _llama, "text", _TEXT, _hidden, ["int8-mixed", "bf16", "torchscript", "openvino"]),
    Case("t5-encoder", _t5_encoder, "text", _TEXT + ["int8-mixed"], _hidden, ["bf16", "torchscript", "openvino"]),
    Case("vit", _vit, "image", ["dynamic-int8", "onnxruntime"], _logits, ["bf16", "torchscript", "openvino"]),
    Case("resnet", _resnet, "image", _IMAGE, _pooled, ["channels-last", "bf16", "torchscript", "openvino"]),
    Case("mobilenet-v2", _mobilenet, "image", _IMAGE, _pooled, ["channels-last", "bf16", "openvino"]),
]}


def _text(batch: int, seq: int, seed: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and their mask, lengths drawn per row (the last row full)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1024, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()  # (B, T)
    return ids * mask + pad_id * (1 - mask), mask


def example(case: Case, model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """The inputs by forward-argument name, as a tokenizer or image processor would hand them."""
    if case.kind == "image":
        g = torch.Generator().manual_seed(seed)
        size = int(getattr(model.config, "image_size", 32))
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g)}  # (B, C, H, W)
    ids, mask = _text(batch, seq, seed, int(getattr(model.config, "pad_token_id", None) or 0))
    return {"input_ids": ids} if case.kind == "ids" else {"input_ids": ids, "attention_mask": mask}


class UserWrapper(nn.Module):
    """What a user writes in a script: their own class around the HF model, one tensor out."""

    def __init__(self, model: nn.Module, pick: Callable[[Any], torch.Tensor], names: list[str]):
        super().__init__()
        self.model, self.pick, self.names = model, pick, names  # pick: a plain function, not a module

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.pick(self.model(**dict(zip(self.names, xs))))


def held(case: Case, how: str, scale: int = 1, **shape: int) -> tuple[nn.Module, Any, nn.Module]:
    """(model as held, its example inputs, the HF model inside) for ``how`` in ``HOLDINGS``."""
    if how not in HOLDINGS:
        raise ValueError(f"how: received {how!r}, expected one of {HOLDINGS}")
    hf = case.build(scale)
    x = example(case, hf, **shape)
    if how == "dict":
        return hf, x, hf
    if how == "hf":
        return hf, tuple(x.values()), hf
    return UserWrapper(hf, case.pick, list(x)), tuple(x.values()), hf


# Reasons that would be torchnitro's fault, not the model's or the runtime's: a leaked traceback or
# tensor repr, terminal codes or progress bars, pickling of user classes, attribute errors in our code.
OUR_FAULT = [re.compile(p) for p in (
    r"Traceback", r"tensor\(", r"\x1b\[", r"\d+%\|", r"[Pp]ickl", r"Can't get attribute", r"__main__",
    r"AttributeError: .*torchnitro", r"torchnitro[./]\S*\.py", r"NameError", r"UnboundLocalError",
    r"object has no attribute '(_fn|fn|meta|files|program)'",
    r"'(OneDnnInt8Linear|RowwiseInt8Linear|SmoothedInt8Linear|OneDnnBf16Linear|PackedLayer|UnpaddedEncoder)' object",
)]


def ours(reason: str) -> list[str]:
    """The our-fault patterns ``reason`` matches."""
    return [p.pattern for p in OUR_FAULT if p.search(reason or "")]
