"""benchmarks/kernels.py builds the issue-21 rows first in its default run, then the larger shapes; --issue21 keeps
only the FP8 block and the issue-21 rows; targets name the shape they were checked at (no GPU, nothing timed)."""

from __future__ import annotations

import pytest
import torch
from _bench import load_benchmark

ISSUE21 = [("rms_norm", "(4096, 4096)"), ("layer_norm", "(4096, 4096)"),
           ("rope(q,k)", "q(1,32,4096,128) k(1,8,4096,128)"),
           ("linear+cross_entropy", "x(2048, 4096) W(128256, 4096)"),
           ("linear+bias+gelu", "(2048, 4096) x (16384, 4096)"),
           ("flash_attention", "(1,16,4096,128)"), ("flash_attention causal", "(1,16,4096,128)")]


@pytest.fixture
def kernels_script(monkeypatch):
    mod = load_benchmark("kernels", monkeypatch, module_name="kernels_bench", on_path=True)
    stub = lambda name: mod.Case(name, "-", lambda: [], {})  # noqa: E731 - the full-size models are not built here
    monkeypatch.setattr(mod, "fp8_train_case", lambda *a, **k: stub("fp8_train Llama3-8B block"))
    monkeypatch.setattr(mod, "_lm_step_case", lambda *a, **k: stub("TransformerLM train step"))
    return mod


def _rows(cases):
    return [(c.op, c.shape) for c in cases]


def test_default_run_starts_with_the_issue21_rows_then_the_larger_shapes(kernels_script):
    cases = kernels_script.build_cases("cpu", torch.bfloat16, False, False, False, "all", True)
    rows = _rows(cases)
    assert rows[0][0].startswith("fp8_train") and cases[0].issue21
    assert rows[1:1 + len(ISSUE21)] == ISSUE21
    assert all(c.issue21 for c in cases[1:1 + len(ISSUE21)])
    later = rows[1 + len(ISSUE21):]
    for big in [("rms_norm", "(16384, 4096)"), ("linear+cross_entropy", "x(8192, 4096) W(128256, 4096)"),
                ("flash_attention", "(4,16,4096,128)"), ("flash_attention causal", "(4,16,8192,128)")]:
        assert big in later
    assert len(set(rows)) == len(rows)  # results are keyed by (op, shape, provider): no duplicates
    assert not any(c.issue21 for c in cases[1 + len(ISSUE21):])
    assert rows[-1] == ("flash_attention causal", "(4,16,8192,128)")  # the length sweep last, with --sweep only
    assert ("flash_attention causal", "(4,16,8192,128)") not in _rows(
        kernels_script.build_cases("cpu", torch.bfloat16, False, False, False))


def test_issue21_preset_keeps_only_those_rows(kernels_script):
    cases = kernels_script.build_cases("cpu", torch.bfloat16, False, False, False, "issue21")
    assert _rows(cases)[1:] == ISSUE21 and all(c.issue21 for c in cases)


def test_targets_name_their_shape(kernels_script):
    cases = kernels_script.build_cases("cpu", torch.bfloat16, False, False, False, "issue21")
    res = {(c.op, c.shape, p): {"x_liger": 1.3, "%copy_bw": 90.0, "fwdbwd_ms": 1.0, "peak_mb": 1.0, "x_eager": 1.1}
           for c in cases for p in ("torchnitro", "eager", "liger")}
    lines = kernels_script.check_targets(cases, res)
    assert "rms_norm (4096, 4096) fwd+bwd vs Liger 1.30x (target >= 1.20x): PASS" in lines
    assert any(line.startswith("fused linear+CE x(2048, 4096) W(128256, 4096) time vs Liger") for line in lines)
