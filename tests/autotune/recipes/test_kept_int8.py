"""The Linears an int8 plan kept out of int8, tried again with their outlier input channels in fp32: all at
the first ratio (most channels first) that holds the target, else one at a time; the recipe records what it
moved and reloads it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torchnitro.autotune.recipe import BuildContext, get_recipe  # noqa: E402
from torchnitro.autotune.recipes._kept_int8 import KEPT_RATIOS, retry_kept_in_int8  # noqa: E402
from torchnitro.autotune.recipes.onednn_int8 import Int8LinearBase, onednn_int8_reason  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from torchnitro.hf import bert_config, random_hf_model  # noqa: E402


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _Off(nn.Module):
    """``base``'s output plus an error that grows with each Linear named (a stand-in for int8 rounding)."""

    def __init__(self, base: nn.Module, err: float):
        super().__init__()
        self.base, self.err = base, err

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y + self.err * torch.ones_like(y) * y.norm(dim=-1, keepdim=True)


def _calib() -> list[tuple[torch.Tensor]]:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 20.0  # one outlier input channel of `a`
    return [(x,)]


def test_all_kept_at_the_first_ratio_that_holds():
    base, seen = _Two().eval(), []

    def make(names, outl):
        seen.append((list(names), {k: v.tolist() for k, v in outl.items()}))
        return _Off(base, 0.0)

    r = retry_kept_in_int8(base, ["a", "b"], _calib(), 0.999, make)
    assert r.names == ["a", "b"] and r.cosine == pytest.approx(1.0)
    assert seen == [(["a", "b"], {"a": [3]})]  # one try: the first ratio; channel 3 is a's outlier
    assert "2/2 kept Linears int8" in r.note and f"{KEPT_RATIOS[0]:g}x" in r.note


def test_one_at_a_time_least_sensitive_first_when_all_together_miss():
    base, seen = _Two().eval(), []

    def make(names, outl):
        seen.append(list(names))
        return _Off(base, 0.05 * len(names))  # cosine 0.990 with one Linear, 0.960 with two

    r = retry_kept_in_int8(base, ["a", "b"], _calib(), 0.98, make)
    assert seen[:len(KEPT_RATIOS)] == [["a", "b"]] * len(KEPT_RATIOS)
    assert seen[len(KEPT_RATIOS):] == [["b"], ["b", "a"]]  # the plan's order is most sensitive first
    assert r.names == ["b"] and set(r.outliers) <= {"b"} and isinstance(r.model, _Off)


def test_nothing_moved_when_no_variant_holds_and_the_note_says_why():
    base = _Two().eval()
    r = retry_kept_in_int8(base, ["a"], _calib(), 0.999, lambda names, outl: _Off(base, 1.0))
    assert r.names == [] and r.model is None and r.cosine is None
    assert "stay out of int8" in r.note and "< 0.9990" in r.note
    assert retry_kept_in_int8(base, [], _calib(), 0.9, lambda n, o: base).note == ""


def _ragged(batch: int, seq: int, seed: int, shortest: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1024, (batch, seq), generator=g)
    lens = torch.randint(shortest, seq + 1, (batch,), generator=g)
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask, mask


def _forced_build(tmp_path, monkeypatch, x):
    """bert-unpad-int8 on a tiny BERT whose plan is made to keep one FFN down-projection out of int8 (the
    tiny model needs nothing kept); returns (model, recipe, built, that Linear's name)."""
    import torchnitro.autotune.recipes.int8_mixed as im
    import torchnitro.autotune.recipes.bert_unpad as bu

    real, forced = im.plan_mixed_int8, []

    def keep_one(*a, **kw):
        plan = real(*a, **kw)
        forced[:] = [n for n in plan["int8"] if n.endswith("ffn_out")][:1]
        return dict(plan, fp32=forced[:], int8=[n for n in plan["int8"] if n not in forced])

    monkeypatch.setattr(im, "plan_mixed_int8", keep_one)
    monkeypatch.setattr(im, "_engine_reasons", lambda: {"onednn": None})
    monkeypatch.setattr(bu, "_choose_attention", lambda *a, **k: "attention: SDPA")  # not what is tested here
    model = random_hf_model(bert_config()).eval()
    ctx = BuildContext(model=copy.deepcopy(model), example_inputs=x, hardware=hardware_info(),
                       device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={0: [0, 1], 1: [0, 1]})
    recipe = get_recipe("bert-unpad-int8")
    return model, recipe, recipe.build(ctx), forced[0]


needs_onednn = pytest.mark.skipif(onednn_int8_reason() is not None, reason=f"oneDNN int8: {onednn_int8_reason()}")


@needs_onednn
def test_recipe_moves_a_kept_linear_into_int8_records_it_and_reloads(tmp_path, monkeypatch):
    """Full-length text: the retry quantises the kept Linear (the old build left it in bf16/fp32), with its
    outlier channels in the artifact, which reloads to the same variant."""
    model, recipe, built, forced = _forced_build(tmp_path, monkeypatch, _ragged(4, 16, 6, shortest=14))
    assert forced in built.meta["int8"] and built.meta["fp32"] == []
    assert isinstance(built.fn.get_submodule(forced), Int8LinearBase)
    assert "1/1 kept Linears int8" in built.notes
    held = _ragged(3, 12, 7)
    with torch.inference_mode():
        again = recipe.load(tmp_path, built.meta, model)
        torch.testing.assert_close(again(*held), built.fn(*held))
    lin = again.get_submodule(forced)
    want = built.meta["outliers"].get(forced)
    assert (lin.out_idx.tolist() if lin.out_idx is not None else None) == want


@needs_onednn
def test_short_sentences_keep_the_plan_and_the_note_says_why(tmp_path, monkeypatch):
    """Outlier channels chosen on short sentences missed long text (bert_unpad.RETRY_MIN_REAL): not retried."""
    ids, _ = _ragged(4, 16, 6)
    mask = (torch.arange(16)[None] < torch.tensor([2, 3, 5, 16])[:, None]).long()  # 26 of 64 positions real
    _, _, built, forced = _forced_build(tmp_path, monkeypatch, (ids * mask, mask))
    assert built.meta["fp32"] == [forced] and forced not in built.meta["int8"]
    assert "kept Linears not retried in int8" in built.notes and "of the example's tokens are real" in built.notes
