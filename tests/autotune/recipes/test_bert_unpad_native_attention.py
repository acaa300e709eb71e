"""The native varlen attention in the padding-free encoders: matches eager at real positions whatever the
padding, is chosen only where measured faster (and, for int8, where the calibration target holds), says
which attention ran and why, is recorded and reloaded, and falls back to SDPA where it cannot be built."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torchnitro.autotune.recipe import get_recipe  # noqa: E402
from torchnitro.autotune.recipes import _native_attention as na_mod  # noqa: E402
from torchnitro.autotune.recipes._native_attention import choose_attention_, set_native_attention_  # noqa: E402
from torchnitro.autotune.recipes._unpad import PackedLayer  # noqa: E402
from torchnitro.autotune.recipes.bert_unpad import unpad_model  # noqa: E402
from torchnitro.autotune.recipes.int8_mixed import row_cosine  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from torchnitro.kernels import cpu_attention as ca  # noqa: E402

from test_bert_unpad_graph_attention import _ctx, user_model  # noqa: E402,F401  (shared builders: a user script class)

needs_cc = pytest.mark.skipif(shutil.which(ca.COMPILER) is None, reason=f"no C compiler ({ca.COMPILER!r} not on PATH)")


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """One build of the kernel for the module, in a private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path_factory.mktemp("tn_cache")))
    ca._state.clear()
    yield
    mp.undo()
    ca._state.clear()


def _ragged(batch: int, seq: int, seed: int, holes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[0], lens[-1] = 1, seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    if holes:  # masked positions inside sentences (position 0 stays real: the pooler reads it)
        mask[1:, 2] = 0
    return ids * mask, mask


def _timed(native_ms: float, sdpa_ms: float):
    return lambda fns, rounds: {"native": native_ms / 1e3, "sdpa": sdpa_ms / 1e3}


def _native_layers(m: nn.Module) -> list:
    return [l.native_attention for l in m.modules() if isinstance(l, PackedLayer)]


@needs_cc
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["right", "holes", "dense"])
def test_native_attention_matches_eager_at_real_positions(user_model, compute, layout):
    m = unpad_model(copy.deepcopy(user_model))
    assert set_native_attention_(m, compute) == 2
    x = (_ragged(5, 37, 1, holes=layout == "holes") if layout != "dense"
         else (torch.randint(1, 1000, (3, 19)), torch.ones(3, 19, dtype=torch.long)))
    with torch.inference_mode():
        ref, out = user_model(*x), m(*x)
    keep = x[1].bool()
    if compute == "fp32":
        torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-5)  # the same math, reassociated
    else:
        assert row_cosine(ref[keep], out[keep]) >= 0.999
    assert (out[~keep] == 0).all()  # padded positions: zeros, as without it
    assert m.bert.fallback_calls == 0  # the packed path ran, not the original module


@needs_cc
def test_chosen_where_faster_and_the_note_says_which(user_model, monkeypatch):
    m = unpad_model(copy.deepcopy(user_model))
    monkeypatch.setattr(na_mod, "_time", _timed(1.0, 3.0))
    choice = choose_attention_(m, _ragged(4, 16, 2), ("fp32",))
    assert choice.compute == "fp32" and choice.native_ms == pytest.approx(1.0)
    assert choice.note.startswith("attention: native ") and "varlen (1.00 ms vs SDPA 3.00 ms CPU" in choice.note
    assert all(a is not None and a.compute == "fp32" for a in _native_layers(m))


@needs_cc
def test_slower_keeps_sdpa_and_says_both_times(user_model, monkeypatch):
    m = unpad_model(copy.deepcopy(user_model))
    monkeypatch.setattr(na_mod, "_time", _timed(5.0, 2.0))
    choice = choose_attention_(m, _ragged(4, 16, 2), ("bf16", "fp32"))
    assert choice.compute is None
    assert choice.note == ("attention: SDPA (native bf16 slower here: 5.00 ms vs 2.00 ms CPU per layer at 1 thread; "
                           "native fp32 slower here: 5.00 ms vs 2.00 ms CPU per layer at 1 thread)")
    assert all(a is None for a in _native_layers(m))


@needs_cc
def test_a_refused_compute_falls_to_the_next(user_model, monkeypatch):
    m = unpad_model(copy.deepcopy(user_model))
    monkeypatch.setattr(na_mod, "_time", _timed(1.0, 3.0))
    seen = []

    def accept():
        seen.append(_native_layers(m)[0].compute)
        return "calibration cosine 0.9 < 0.99" if seen[-1] == "bf16" else None

    choice = choose_attention_(m, _ragged(4, 16, 2), ("bf16", "fp32"), accept)
    assert seen == ["bf16", "fp32"] and choice.compute == "fp32"
    assert "native bf16: calibration cosine 0.9 < 0.99" in choice.note
    assert all(a.compute == "fp32" for a in _native_layers(m))


def test_without_a_compiler_sdpa_runs_and_the_note_says_why(user_model, monkeypatch):
    monkeypatch.setattr(ca, "COMPILER", "no-such-cc-torchnitro")
    try:
        m = unpad_model(copy.deepcopy(user_model))
        choice = choose_attention_(m, _ragged(4, 16, 2), ("bf16", "fp32"))
        assert choice.compute is None and "no-such-cc-torchnitro" in choice.note
        assert choice.note.count("no C compiler") == 1  # said once, not per compute tried
        assert all(a is None for a in _native_layers(m))
    finally:
        monkeypatch.undo()
        ca._state.clear()


@needs_cc
@pytest.mark.parametrize("name", ["bert-unpad", "bert-unpad-bf16", "bert-unpad-int8"])
def test_recipes_record_the_native_attention_and_reload_it(user_model, tmp_path, monkeypatch, name):
    r = get_recipe(name)
    if r.unavailable_reason(hardware_info()) is not None:
        pytest.skip(r.unavailable_reason(hardware_info()))
    monkeypatch.setattr(na_mod, "_time", _timed(1.0, 3.0))
    built = r.build(_ctx(user_model, _ragged(8, 32, 6), tmp_path))
    compute = built.meta["native_attention"]
    assert compute in (("fp32",) if name == "bert-unpad" else ("bf16",) if name == "bert-unpad-bf16"
                       else ("bf16", "fp32")), built.notes
    assert "attention: native" in built.notes
    held = _ragged(6, 24, 7)
    with torch.inference_mode():
        out = built.fn(*held)
        again = r.load(tmp_path, built.meta, user_model)
        torch.testing.assert_close(again(*held), out)
    assert all(a is not None and a.compute == compute for a in _native_layers(again))
    monkeypatch.setattr(ca, "COMPILER", "no-such-cc-torchnitro")  # the artifact on a machine without a compiler
    try:
        plain = r.load(tmp_path, built.meta, user_model)
        assert all(a is None for a in _native_layers(plain))
        with torch.inference_mode():
            keep = held[1].bool()
            assert row_cosine(out[keep], plain(*held)[keep]) >= 0.999
    finally:
        monkeypatch.undo()
        ca._state.clear()
