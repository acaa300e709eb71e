"""The benchmark's our-fault classifier counts every failure it cannot explain against us."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from fault_classes import classify, faults  # noqa: E402

# reasons that results/optimize_user_models.md (before this classifier) listed as nobody's fault
MISSED = [
    "openvino: RuntimeError: We ran into an error when deserializing the saved file. Please check the warnings "
    "above for possible errors.",
    "onnxruntime: RuntimeError: ONNX export failed: torchscript exporter: TypeError: BaseModel.forward() missing 1 "
    "required positional argument: 'input' | dynamo exporter: TorchExportError: Failed to export the model",
]


def test_failures_without_a_known_outside_cause_count_against_us():
    for reason in MISSED:
        v = classify(reason)
        assert v.kind == "unexplained" and v.counts_against_us, (reason, v)


def test_our_own_patterns_and_named_outside_causes():
    assert classify("failed: process exited with code 1: Loading weights:  40%|####  | 2/5").kind == "ours"
    assert classify("AttributeError: 'OneDnnInt8Linear' object has no attribute 'weight'").kind == "ours"
    ext = classify("RecipeError: mixed int8: with 3/6 layers kept in fp32 the calibration cosine is 0.95, expected "
                   ">= 0.994; int8 does not suit this model")
    assert ext.kind == "external" and not ext.counts_against_us
    assert classify("RecipeError: OpenVINO could not convert the model: torch module: OpConversionFailure: No "
                    "conversion rule found for operations: aten::foo").kind == "external"
    assert classify("budget: the child process had not started after the 2.0 s left").kind == "budget"


def test_faults_reads_failed_candidates_only():
    cands = [SimpleNamespace(recipe="a", status="failed", reason=MISSED[0]),
             SimpleNamespace(recipe="b", status="rejected", reason="cosine 0.9 < 0.99"),
             SimpleNamespace(recipe="c", status="failed", reason="budget: preparing the onnx program took 3 s")]
    assert [r for r, _ in faults(cands)] == ["a"]
