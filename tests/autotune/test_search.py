"""The search survives bad candidates, the gate rejects wrong ones, and eager wins unless beaten."""

from __future__ import annotations

import pytest
import torch

import torchnitro
from torchnitro.autotune.inputs import ModelInfo
from torchnitro.autotune.report import Status


def _run(fr, cfg, model=None, inputs=None):
    model = model or fr.tiny_model()
    return torchnitro.optimize(model, inputs or fr.tiny_inputs(), cfg)


def test_search_survives_raise_hang_exit_and_segfault(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-raises", "test-hangs", "test-hangs-isolated", "test-exits",
                                     "test-segfault", "test-bad-check"], candidate_timeout_s=1.0))
    rep = opt.report
    assert rep.get("test-bad-check").status == Status.SKIPPED and "raised KeyError" in rep.get("test-bad-check").reason
    assert rep.get("test-raises").status == Status.FAILED and "boom from test-raises" in rep.get("test-raises").reason
    assert rep.get("test-hangs").status == Status.FAILED and rep.get("test-hangs").reason == "ran past its 1 s limit"
    assert rep.get("test-hangs-isolated").status == Status.FAILED  # cut at its own limit, not at start-up's
    assert rep.get("test-hangs-isolated").reason == "ran past its 1 s limit (process killed)"
    assert rep.get("test-exits").status == Status.FAILED and "code 3" in rep.get("test-exits").reason
    assert rep.get("test-segfault").status == Status.FAILED and "SIGSEGV" in rep.get("test-segfault").reason
    assert opt.recipe == "eager" and rep.get("eager").status == Status.CHOSEN
    x = fr.tiny_inputs(3)[0]
    torch.testing.assert_close(opt(x), fr.tiny_model()(x))


def test_gate_rejects_wrong_and_buffer_reusing_recipes(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-wrong", "test-reuses-buffer"]))
    wrong = opt.report.get("test-wrong")
    assert wrong.status == Status.REJECTED
    assert "relative error" in wrong.reason and wrong.norm_rel == pytest.approx(0.01, rel=1e-3)
    assert wrong.p50_ms is not None  # rejected candidates keep their numbers
    reuse = opt.report.get("test-reuses-buffer")
    assert reuse.status == Status.REJECTED and "reused buffer" in reuse.reason
    assert opt.recipe == "eager"


def test_faster_exact_candidate_is_chosen_slower_never(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-faster", "test-slower"]), model=fr.SlowModel())
    assert opt.recipe == "test-faster"
    assert opt.report.get("test-faster").speedup > 1.5
    assert opt.report.get("test-slower").status == Status.VERIFIED
    assert opt.report.get("test-slower").speedup < 1


def test_finalists_screen_a_candidate_whose_early_sample_was_noisy(noisy_search):
    opt = noisy_search()
    rep = opt.report
    est = {n: rep.get(n).p50_ms for n in ("test-decoy-a", "test-decoy-b", "test-noisy-start")}
    assert opt.recipe == "test-noisy-start", (est, rep.notes)
    assert any("screened" in n for n in rep.notes)
    dropped = [c for c in rep.candidates if c.recipe.startswith("test-decoy") and "screen" in c.notes]
    assert len(dropped) == 2 and all(c.interleaved for c in dropped)


def test_without_the_noise_band_the_noisy_winner_is_missed(noisy_search, monkeypatch):
    """The failure the screen exists for: top-k by one early sample finalises the two decoys."""
    import torchnitro.autotune.final as final_mod

    monkeypatch.setattr(final_mod, "NOISE_BAND", 1.0)
    opt = noisy_search()
    assert opt.recipe in ("test-decoy-a", "test-decoy-b")
    assert not any("screened" in n for n in opt.report.notes)


def test_finalist_pool_band_and_cap():
    from torchnitro.autotune.report import CandidateResult
    from torchnitro.autotune.final import NOISE_BAND, finalist_pool

    ranked = [CandidateResult(f"r{i}", "exact", Status.VERIFIED, p50_ms=ms)
              for i, ms in enumerate([10, 12, 15, 19, 25, 100, 200])]
    key = lambda c: c.p50_ms  # noqa: E731
    pool = [c.recipe for c in finalist_pool(ranked, key, 2)]
    assert pool == [c.recipe for c in ranked if c.p50_ms <= 10 * NOISE_BAND][:4]
    assert [c.recipe for c in finalist_pool(ranked[4:], key, 2)] == ["r4", "r5"]  # top k even outside the band
    assert finalist_pool([], key, 3) == [] and finalist_pool(ranked, key, 0) == []


def test_metric_fn_replaces_class_tolerance(fake_recipes, fast_cfg):
    fr = fake_recipes
    calls = []

    def metric(ref, cand):
        calls.append((type(ref), type(cand)))
        return float(torch.nn.functional.cosine_similarity(ref.flatten(), cand.flatten(), dim=0))

    opt = _run(fr, fast_cfg(recipes=["test-wrong"], metric_fn=metric, metric_threshold=0.999))
    wrong = opt.report.get("test-wrong")
    assert wrong.status == Status.VERIFIED and wrong.metric > 0.999  # a uniform 1% scale keeps the direction
    assert calls and all(t is torch.Tensor for pair in calls for t in pair)
    strict = _run(fr, fast_cfg(recipes=["test-wrong"], metric_fn=lambda r, c: -float((r - c).abs().max()),
                               metric_threshold=-1e-6))
    assert strict.report.get("test-wrong").status == Status.REJECTED


def test_budget_exhausted_skips_remaining(fake_recipes, fast_cfg, monkeypatch):
    """A candidate that starts within the budget has its whole limit; the ones after it are skipped."""
    import itertools

    import torchnitro.autotune.search as search_mod

    fr = fake_recipes
    # budget clock: start 0, eager 0.4, test-hangs 0.8 (1.16 s left), test-wrong 1.2 (0.76 s); the candidates have
    # 1.96 s of the 2.2 s: 0.24 s are kept for the final comparison (3 finalists + eager x 0.02 s x 3, final_budget)
    ticks = itertools.count(0.0, 0.4)
    monkeypatch.setattr(search_mod, "_clock", lambda: next(ticks))
    opt = _run(fr, fast_cfg(recipes=["test-hangs", "test-wrong"], budget_s=2.2, candidate_timeout_s=3.0))
    hangs, wrong = opt.report.get("test-hangs"), opt.report.get("test-wrong")
    assert hangs.status == Status.FAILED and hangs.reason == "ran past its 3 s limit"  # not cut at the budget
    assert wrong.status == Status.SKIPPED and wrong.reason.startswith("budget:")


def test_model_failing_on_inputs_is_input_error(fast_cfg):
    from torchnitro.errors import InputError

    model = torch.nn.Linear(16, 4)
    with pytest.raises(InputError, match="example inputs"):
        torchnitro.optimize(model, (torch.randn(2, 5),), fast_cfg(recipes=[]))


def test_dynamic_shapes_timed_at_each_size(fast_cfg):
    from torchnitro.nn.zoo import get_builtin

    b = get_builtin("mlp")
    info = ModelInfo("mlp", "mlp", b.inputs, {0: [0]}, 8, 0)
    opt = torchnitro.optimize(b.build(), b.inputs(8, 0, 0), fast_cfg(recipes=["torchscript"], shapes=[[2], [16]]),
                              info=info)
    ts = opt.report.get("torchscript")
    assert set(ts.shape_ms) == {"8x512", "2x512", "16x512"}
    assert set(ts.first_call_ms) == {"2x512", "16x512"}
    assert "float32[2x512]" in opt.report.objective
    assert opt.signature["inputs"][0]["shape"] == [-1, 512] and opt.signature["outputs"][0]["shape"] == [-1, 512]


def test_isolate_all_runs_in_child(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-wrong"], isolate_all=True))
    wrong = opt.report.get("test-wrong")
    assert wrong.isolated and wrong.status == Status.REJECTED and "relative error" in wrong.reason


@pytest.mark.parametrize("kw,text", [({"objective": "throughput"}, "throughput (items/s) on float32[4x16]"),
                                     ({"percentile": "p99"}, "latency p99 on float32[4x16]")])
def test_objective_is_stated(fake_recipes, fast_cfg, kw, text):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-faster"], **kw), model=fr.SlowModel())
    assert opt.report.objective == text
    assert opt.recipe == "test-faster" and opt.report.get("test-faster").interleaved


def test_min_speedup_below_one_forces_a_slower_verified_recipe(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = _run(fr, fast_cfg(recipes=["test-slower", "test-wrong"], min_speedup=0.0))
    assert opt.recipe == "test-slower" and opt.report.get("test-slower").speedup < 1
    assert opt.report.get("test-wrong").status == Status.REJECTED  # forcing never bypasses the gate


def test_explicit_unavailable_recipe_raises_auto_selected_is_skipped(fast_cfg):
    from torchnitro.errors import BackendUnavailableError
    from fake_recipes import tiny_inputs, tiny_model

    if torch.cuda.is_available():
        pytest.skip("cuda-graphs is available on this machine")
    with pytest.raises(BackendUnavailableError, match="'cuda-graphs' was requested but cannot run here"):
        torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=["cuda-graphs"]))
    from torchnitro.autotune.recipe import list_recipes

    others = [n for n in list_recipes() if n not in ("eager", "cuda-graphs")]
    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(exclude=others))  # auto-selected: skipped
    assert opt.report.get("cuda-graphs").status == Status.SKIPPED and "CUDA" in opt.report.get("cuda-graphs").reason


def test_model_from_factory_file_runs_isolated(fast_cfg, tmp_path):
    from torchnitro.autotune.inputs import model_and_inputs

    f = tmp_path / "netfile.py"
    f.write_text("import torch\n"
                 "class FileNet(torch.nn.Module):\n"
                 "    def __init__(self):\n"
                 "        super().__init__()\n"
                 "        self.lin = torch.nn.Linear(8, 4)\n"
                 "    def forward(self, x):\n"
                 "        return self.lin(x).tanh()\n"
                 "def build():\n"
                 "    return FileNet()\n")
    model, inputs, info = model_and_inputs(f"{f}:build", ["4x8"])
    opt = torchnitro.optimize(model, inputs, fast_cfg(recipes=["onnxruntime"], min_speedup=0.0), info=info)
    c = opt.report.get("onnxruntime")
    assert c.isolated and c.status == Status.CHOSEN, c.reason
