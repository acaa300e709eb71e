"""The gate's numbers on known perturbations, and output flattening."""

from __future__ import annotations

import pytest
import torch

from torchnitro.autotune.verify import collect, compare_outputs, flatten_outputs, judge


def _refs(fn, sets):
    return [f for f, _, _, _ in collect(fn, sets)]


@pytest.mark.parametrize("shape", [(2, 128, 64), (5, 123, 13)])
def test_exact_gate_passes_reassociation_and_rejects_one_percent(shape):
    x = torch.randn(*shape)
    w = torch.randn(shape[-1], shape[-1])
    sets = [(x,)]
    ref = _refs(lambda a: a @ w, sets)
    reassoc = collect(lambda a: (a.double() @ w.double()).float(), sets)
    assert judge(reassoc, ref, {"rel": 1e-4}).passed
    off = collect(lambda a: (a @ w) * 1.01, sets)
    res = judge(off, ref, {"rel": 1e-4})
    assert not res.passed and res.norm_rel == pytest.approx(0.01, rel=1e-4) and "relative error" in res.reason


@pytest.mark.parametrize("dtype,cos", [(torch.bfloat16, 0.999), (torch.float16, 0.999)])
def test_reduced_precision_passes_cosine(dtype, cos):
    x, w = torch.randn(4, 64, 64), torch.randn(64, 64)
    sets = [(x,)]
    ref = _refs(lambda a: a @ w, sets)
    low = collect(lambda a: (a.to(dtype) @ w.to(dtype)).float(), sets)
    res = judge(low, ref, {"cosine": cos})
    assert res.passed and 0.999 < res.min_cosine < 1.0
    assert not judge(low, ref, {"rel": 1e-4}).passed


def test_shape_count_and_nan_mismatch():
    a = [("out", torch.ones(2, 3))]
    assert "shape" in compare_outputs(a, [("out", torch.ones(3, 2))])
    assert "returned 2" in compare_outputs(a, a + a)
    assert "NaN" in compare_outputs(a, [("out", torch.full((2, 3), float("nan")))])


def test_flatten_tuple_dict_and_modeloutput_like():
    t = torch.zeros(1)
    assert [n for n, _ in flatten_outputs(t)] == ["output"]
    assert [n for n, _ in flatten_outputs((t, (t, None)))] == ["output_0", "output_1_0"]
    assert [n for n, _ in flatten_outputs({"logits": t, "hidden": [t, t]})] == ["logits", "hidden_0", "hidden_1"]
    from collections import OrderedDict

    assert [n for n, _ in flatten_outputs(OrderedDict(last_hidden_state=t, pooler_output=None))] == ["last_hidden_state"]


def test_nondeterministic_candidate_rejected():
    sets = [(torch.randn(4, 8),)]
    ref = _refs(lambda a: a * 2, sets)
    res = judge(collect(lambda a: a * 2 + torch.randn_like(a) * 1e-2, sets), ref, {"cosine": 0.9})
    assert not res.passed and "disagree" in res.reason


def test_one_bad_row_fails_the_cosine_gate():
    x = torch.randn(64, 32)
    sets = [(x,)]
    ref = _refs(lambda a: a, sets)

    def one_bad(a):
        out = a.clone()
        out[7] = -out[7]  # one sample flipped: whole-tensor cosine ~0.97, that row's cosine -1
        return out

    res = judge(collect(one_bad, sets), ref, {"cosine": 0.9})
    assert not res.passed and res.min_cosine == pytest.approx(-1.0)


# ---- padding: masked positions are not compared ---------------------------------------------------

def _token_sets(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (4, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.tensor([[3], [12], [7], [1]])).long()  # (B, T) right padding
    return [(ids, mask)]


def _hidden(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.sin(ids[..., None] * torch.arange(1, 9))  # (B, T, 8): a value at every position


def test_garbage_at_masked_positions_passes_and_a_changed_real_position_fails():
    from torchnitro.autotune.verify import padding_masks

    sets = _token_sets()
    ref = _refs(_hidden, sets)
    masks = padding_masks(_hidden, sets)
    assert masks is not None and torch.equal(masks[0], sets[0][1])

    def garbage(ids, mask):
        return torch.where(mask[..., None] != 0, _hidden(ids, mask), torch.full((1,), 1e4))

    res = judge(collect(garbage, sets), ref, {"rel": 1e-4}, masks=masks)
    n_real = int(sets[0][1].sum())
    assert res.passed and f"{n_real} of 48 rows" in res.compared and "compare_padding" in res.compared
    assert not judge(collect(garbage, sets), ref, {"rel": 1e-4}).passed  # all positions (compare_padding=True)

    def one_real_changed(ids, mask):
        out = _hidden(ids, mask).clone()
        out[2, 6] += 0.1  # position 6 of sentence 2 is real (length 7)
        return out

    res = judge(collect(one_real_changed, sets), ref, {"rel": 1e-4}, masks=masks)
    assert not res.passed and "relative error" in res.reason


def test_mask_index_by_signature_by_token_layout_and_by_name():
    from torchnitro.autotune.verify import mask_index
    from torchnitro.errors import ConfigError

    ids, mask = _token_sets()[0]

    class HF(torch.nn.Module):
        def forward(self, input_ids, token_type_ids=None, attention_mask=None):
            return input_ids

    class Tokens(torch.nn.Module):
        def forward(self, a, b):
            return a

    assert mask_index(HF(), (ids, torch.zeros_like(ids), mask)) == 2
    assert mask_index(Tokens(), (ids, mask)) == 1
    assert mask_index(Tokens(), (torch.randn(4, 12), torch.randn(4, 12))) is None  # not a token model
    assert mask_index(Tokens(), (ids, ids)) is None  # second input is not 0/1
    assert mask_index(Tokens(), (ids, ids), named="b") == 1
    with pytest.raises(ConfigError, match="padding_mask: received 'mask'"):
        mask_index(Tokens(), (ids, mask), named="mask")


def test_padding_masks_off_with_compare_padding_and_sentence_outputs_compared_whole():
    from torchnitro.autotune.verify import padding_masks

    sets = _token_sets()
    assert padding_masks(_hidden, sets, compare_padding=True) is None
    masks = padding_masks(_hidden, sets)
    ref = _refs(lambda i, m: _hidden(i, m).sum(1), sets)  # (B, 8): one row per sentence, no positions to mask
    res = judge(collect(lambda i, m: _hidden(i, m).sum(1) * 1.01, sets), ref, {"rel": 1e-4}, masks=masks)
    assert not res.passed and res.compared == ""


# ---- classifiers: top-1 agreement ---------------------------------------------------------------

def test_one_flipped_top1_fails_the_gate_at_high_cosine():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=g)
    logits[:, 0] += 0.05  # class 0 leads by a small margin in every row... (B, C)
    top = logits.argmax(1)
    sets = [(logits,)]
    ref = _refs(lambda x: x, sets)

    def flip_one(x):
        out = x.clone()
        second = x[1].topk(2).indices[1]
        out[1, second], out[1, top[1]] = x[1, top[1]], x[1, second]  # row 1: the two best classes swap
        return out

    res = judge(collect(flip_one, sets), ref, {"cosine": 0.99, "top1": 1.0})
    assert res.min_cosine > 0.99 and not res.passed
    assert "top-1 class changed on 25.0% of the 4 rows of 'output'" in res.reason
    assert res.top1 == 0.75 and res.top5 == 1.0
    assert judge(collect(flip_one, sets), ref, {"cosine": 0.99, "top1": 0.75}).passed
    assert judge(collect(flip_one, sets), ref, {"cosine": 0.99, "top1": 1.0}, classifier=False).passed


def test_embeddings_and_token_logits_are_not_gated_on_top1_by_default():
    from torchnitro.autotune.verify import class_logits

    emb = torch.nn.functional.normalize(torch.randn(4, 16), dim=1)
    assert class_logits("output", emb) == (False, False)  # unit rows: sentence embeddings
    assert class_logits("logits", torch.randn(4, 10)) == (True, True)
    assert class_logits("output", torch.randn(4, 10)) == (True, True)
    assert class_logits("logits", torch.randn(2, 5, 50)) == (True, False)  # token-level: reported only
    assert class_logits("logits", torch.randn(2, 5, 50), classifier=True) == (True, True)
    assert class_logits("output", torch.randn(4, 1)) == (False, False)
    assert class_logits("input_ids", torch.randint(0, 100, (4, 10)).float()) == (False, False)  # ids handed back


def test_named_outputs_that_are_not_logits_are_not_gated_on_top1():
    """HF BERT/RoBERTa return pooler_output (B, H): a tanh-pooled embedding whose argmax flips between
    near-equal entries, so every int8/bf16 recipe was rejected on 'top-1 class changed' and the coverage
    search chose eager. Named outputs are logits only when named so; unnamed ones keep the shape rule."""
    from torchnitro.autotune.verify import class_logits

    pooled = torch.tanh(torch.randn(4, 10) * 5)
    for name in ("pooler_output", "last_hidden_state", "sentence_embedding", "output.pooler_output", "hidden_0"):
        assert class_logits(name, pooled) == (False, False), name
    for name in ("output", "output_0", "output_1_0", "start_logits", "output.logits"):
        assert class_logits(name, pooled) == (True, True), name
    ref = [("last_hidden_state", torch.randn(4, 3, 10)), ("pooler_output", pooled)]
    flipped = [(n, t.clone()) for n, t in ref]
    flipped[1][1][0] = flipped[1][1][0].flip(-1)  # row 0's top-1 moves; cosine stays high over the batch
    errs = compare_outputs(ref, flipped)
    assert all(e.top1 is None for e in errs)


def test_feature_dict_input_carries_its_mask():
    from torchnitro.autotune.verify import padding_masks

    ids, mask = _token_sets()[0]

    class Features(torch.nn.Module):  # sentence-transformers: forward(features) -> features + embeddings
        def forward(self, features):
            return {"token_embeddings": _hidden(features["input_ids"], features["attention_mask"])}

    sets = [({"input_ids": ids, "attention_mask": mask},)]
    masks = padding_masks(Features(), sets)
    assert masks is not None and torch.equal(masks[0], mask)
