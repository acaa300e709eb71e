"""benchmarks/optimize_user_models.py: which recipes a coverage search runs, and its --threads option.

The coverage sweep lists once left ``bert-unpad-bf16`` out for RoBERTa and DistilBERT (the variant that won the RoBERTa
search at 1 thread, 1.72x): every model that holds a BERT-family encoder now runs the whole padding-free family, found by
detection, not by a hand-kept list."""

from __future__ import annotations

import pytest
from _bench import load_benchmark

pytest.importorskip("transformers")


@pytest.fixture
def bench(monkeypatch):
    pytest.importorskip("sentence_transformers")
    return load_benchmark("optimize_user_models", monkeypatch)


def _runnable(name: str) -> bool:
    from torchnitro.autotune.recipe import get_recipe
    from torchnitro.hardware import hardware_info

    return get_recipe(name).unavailable_reason(hardware_info()) is None


@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert"])
def test_every_bert_family_model_runs_the_whole_padding_free_family(bench, name):
    case = bench.CASES[name]
    recipes = bench.coverage_recipes(case, case.build(1), quick=False)
    want = [r for r in ("bert-unpad", "bert-unpad-int8", "bert-unpad-bf16") if _runnable(r)]
    assert "bert-unpad" in want  # exact fp32: runs on every CPU
    assert [r for r in want if r not in recipes] == [], recipes
    assert len(recipes) == len(set(recipes)), recipes  # the sweep's own entries are not run twice
    assert {r for r in case.recipes + case.sweep if _runnable(r)} <= set(recipes)  # the case's own lists stay


def test_models_without_a_bert_encoder_and_quick_runs_keep_their_own_list(bench):
    gpt2 = bench.CASES["gpt2"]
    assert not [r for r in bench.coverage_recipes(gpt2, gpt2.build(1), quick=False) if r.startswith("bert-unpad")]
    roberta = bench.CASES["roberta"]
    quick = bench.coverage_recipes(roberta, roberta.build(1), quick=True)
    assert quick == [r for r in roberta.recipes if _runnable(r)]  # --quick: seconds, no sweep


def test_threads_option_rejects_a_negative_count(bench):
    with pytest.raises(SystemExit, match="--threads: received -1"):
        bench.main(["--threads", "-1", "--only", "coverage", "--models", "bert"])
