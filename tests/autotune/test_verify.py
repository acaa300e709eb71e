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
