"""Issue 15 item 9: real architectures (BERT, RoBERTa, XLM-R, DistilBERT, MPNet, ELECTRA, ALBERT, GPT-2, Llama,
T5 encoder, ViT, ResNet, MobileNetV2: ``coverage_models.CASES``) from their real config classes, tiny and random, optimized as users hold them.

For each: every listed recipe runs or says why not in one clean line that is not torchnitro's fault
(``coverage_models.OUR_FAULT``), the chosen variant is verified, and save/load round-trips with equal
outputs. Isolated recipes (ONNX Runtime) run on the HF class itself with ``finalists=0`` (no timing
child), in their child process for one architecture per distinct path (``_IN_CHILD``); in-process recipes
run on the user's wrapper and on dict inputs (but for ``_NO_DICT``) with one finalist, forced
(``min_speedup=0``) so a non-eager artifact is saved and loaded. The fuller per-model recipe sweep,
timed, is ``benchmarks/optimize_user_models.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import torchnitro  # noqa: E402
from coverage_models import CASES, example, held, ours  # noqa: E402
from torchnitro.autotune.recipe import get_recipe  # noqa: E402
from torchnitro.autotune.report import Status  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402

_RAN = (Status.CHOSEN, Status.VERIFIED, Status.REJECTED)
# a case whose model is another case's code under another name (transformers' XLMRobertaModel is RobertaModel's
# code, module for module: test_a_case_run_only_in_its_wrapper_is_another_cases_code): only its wrapper holding runs
# here, for what looks at its name (bert-unpad's SUPPORTED table); the benchmark
# (benchmarks/optimize_user_models.py --only coverage) runs it in every holding
_SAME_CODE = {"xlm-roberta": "roberta"}
# the architectures whose isolated recipe runs in its child process: one per distinct path through the child (the
# ONNX program's exporter, its inputs and its output structure): the dynamo exporter on ids and mask with a pooled
# output (bert), the TorchScript-based one on ids and mask (distilbert), the dynamo one on ids only with logits (gpt2),
# the TorchScript-based one on pixels with a pooled image output (resnet). The other cases run the same recipe in the
# test's process: the same export, ONNX Runtime session and verification, without a child's start-up each
_IN_CHILD = {"bert", "distilbert", "gpt2", "resnet"}
# a dict holding is the hf one with its inputs by keyword, mapped to positions by name whatever the class: it runs for
# every class the padding-free recipe reads (each its own path), and once per other input kind (gpt2: ids only, vit:
# pixels); these four run generic recipes on kinds covered so (their hf holding runs the same recipes positionally)
_NO_DICT = {"llama", "t5-encoder", "resnet", "mobilenet-v2"}


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # ModelOutput is a dict
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat(v)]
    return []


def _runnable(names: list[str]) -> list[str]:
    return [n for n in names if get_recipe(n).unavailable_reason(hardware_info()) is None]


def _check_report(om: Any, recipes: list[str]) -> None:
    rep = om.report
    by = {c.recipe: c for c in rep.candidates}
    assert set(recipes) <= set(by), (recipes, list(by))
    faults = {n: (c.status, c.reason, ours(c.reason)) for n, c in by.items() if ours(c.reason)}
    assert not faults, f"reasons that are torchnitro's fault: {faults}"
    for n in recipes:
        c = by[n]
        assert c.status in _RAN or (c.reason and "\n" not in c.reason), (n, c.status, c.reason)
    chosen = by[om.recipe]
    assert chosen.status == Status.CHOSEN and chosen.min_cosine is not None, (om.recipe, chosen.reason)


def _held_out(case, how: str, hf, batch: int = 3) -> tuple[tuple, dict]:
    x = example(case, hf, batch=batch, seq=16, seed=11)  # seq as the example's (a masked text model's sequence dim is dynamic too)
    return tuple(x.values()), x


def _round_trip(om: Any, model, args: tuple, kwargs: dict, tmp_path) -> None:
    """Saved and loaded, the variant gives the outputs it gave before saving."""
    loaded = torchnitro.load(om.save(tmp_path / "artifact"), model=model)
    assert loaded.recipe == om.recipe
    with torch.inference_mode():
        before, after = (om(**kwargs), loaded(**kwargs)) if kwargs else (om(*args), loaded(*args))
    a, b = _flat(before), _flat(after)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in CASES if n not in _SAME_CODE])
def test_hf_class_directly_with_an_isolated_recipe(name, fast_cfg, tmp_path, monkeypatch):
    """The HF class as ``from_pretrained`` returns it, positional tensors; an in-process and an isolated
    recipe (ONNX Runtime gets the exported program, never the model object; in its child for ``_IN_CHILD``)."""
    case = CASES[name]
    recipes = _runnable(case.recipes)
    isolated = [r for r in recipes if get_recipe(r).isolate]
    if name not in _IN_CHILD:
        for r in isolated:
            monkeypatch.setattr(get_recipe(r), "isolate", False)  # this instance only, undone after the test
    model, x, hf = held(case, "hf")
    om = torchnitro.optimize(model, x, fast_cfg(recipes=recipes, finalists=0, cache=False))
    _check_report(om, recipes)
    assert om.recipe == "eager"  # finalists=0: nothing is re-timed, so nothing may replace eager
    iso = [c for c in om.report.candidates if c.recipe in isolated]
    assert iso and all(c.status in _RAN and c.isolated == (name in _IN_CHILD) for c in iso), \
        [(c.recipe, c.isolated, c.status, c.reason) for c in iso]
    args, _ = _held_out(case, "hf", hf)
    _round_trip(om, model, args, {}, tmp_path)  # eager saved as a torch.export program


@pytest.mark.parametrize("name, how", [(n, h) for n in CASES for h in ("wrapper", "dict")
                                       if h == "wrapper" or n not in {*_SAME_CODE, *_NO_DICT}])
def test_user_wrapper_and_dict_inputs_get_a_verified_variant_that_saves(name, how, fast_cfg, tmp_path):
    """A class of the user's own around the HF model, or the HF class fed a tokenizer/processor dict:
    the in-process recipes apply, the forced best one is verified and its artifact loads back equal."""
    case = CASES[name]
    recipes = _runnable([r for r in case.recipes if not get_recipe(r).isolate])
    model, x, hf = held(case, how)
    om = torchnitro.optimize(model, x, fast_cfg(recipes=recipes, finalists=1, min_speedup=0.0, cache=False))
    _check_report(om, recipes)
    assert om.recipe in recipes, [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    args, kwargs = _held_out(case, how, hf)
    with torch.inference_mode():
        ref = _flat(model(**kwargs) if how == "dict" else model(*args))[0]
        out = _flat(om(**kwargs) if how == "dict" else om(*args))[0]
    cos = torch.nn.functional.cosine_similarity(out.flatten(1).float(), ref.flatten(1).float())
    if case.kind == "text" and out.dim() == 3:  # padding-free variants leave masked positions at zero
        real = kwargs["attention_mask"].bool()
        cos = torch.nn.functional.cosine_similarity(out[real].float(), ref[real].float())
    assert float(cos.min()) > 0.95, (om.recipe, float(cos.min()))
    _round_trip(om, model, args, kwargs if how == "dict" else {}, tmp_path)


def test_a_case_run_only_in_its_wrapper_is_another_cases_code():
    """``_SAME_CODE``'s premise on the installed transformers: module for module the same class and forward source
    but for the name's prefix (``XLM``), and the same parameters."""
    import inspect
    import re

    for name, same in _SAME_CODE.items():
        a, b = CASES[name].build(1), CASES[same].build(1)
        prefix = type(a).__name__.removesuffix(type(b).__name__)  # XLMRobertaModel, RobertaModel: "XLM"

        def code(m: torch.nn.Module) -> str:  # forward's source, the prefix, docstrings and comments left out
            src = re.sub(r'""".*?"""|#.*', "", inspect.getsource(type(m).forward), flags=re.S)
            return " ".join(src.replace(prefix, "").replace(prefix.lower() + "_", "").split())

        pairs = list(zip(a.named_modules(), b.named_modules()))
        assert prefix and len(pairs) == len(list(a.modules())) == len(list(b.modules()))
        differ = [n for (n, x), (k, y) in pairs
                  if n != k or type(x).__name__.replace(prefix, "") != type(y).__name__ or code(x) != code(y)]
        assert not differ, differ
        assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
