"""``torchnitro serve DIR`` on artifacts it cannot load alone: one clear error before anything is announced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("uvicorn")


def _int8_artifact(path: Path, ref: dict | None = None) -> Path:
    """A dynamic-int8 artifact (not standalone: rebuilt from the eager model) of a 16 -> 4 linear model; ``ref``
    is the model reference the manifest records (None: a Python object with no factory reference)."""
    from torchnitro.autotune.artifact import EagerSource, write_artifact
    from torchnitro.autotune.recipe import CandidateFiles
    from torchnitro.autotune.report import Report

    torch.manual_seed(0)
    sig = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 16]}],
           "outputs": [{"name": "output", "dtype": "float32", "shape": [-1, 4]}]}
    return write_artifact(path, CandidateFiles(None, [], {}, False), EagerSource(model=nn.Linear(16, 4).eval(),
                                                                                  ref=dict(ref or {})),
                          recipe="dynamic-int8", numeric_class="int8", signature=sig,
                          report=Report(model="m", inputs="x", objective="o", hardware="h"), hardware="h")


def test_serve_refuses_an_artifact_that_needs_the_model_object_before_announcing(tmp_path, capsys):
    """It printed "serving ... on http://..." and then died in the worker's start-up with a lifespan traceback
    whose hint named a Python call serve has no equivalent for."""
    from torchnitro.cli import main

    art = _int8_artifact(tmp_path / "int8")
    assert main(["serve", str(art), "--port", "0", "--workers", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the paragraph
    assert "serving" not in err and "Traceback" not in err
    for part in ["dynamic-int8", "no factory reference", "has only the directory", "recipes=['onnxruntime'",
                 "--recipe onnxruntime", "'module:function' spec", "artifact_model(",
                 "torchnitro serve yourmodule:make"]:
        assert part in err, (part, err)


def test_an_artifact_that_names_its_factory_or_stands_alone_is_servable(tmp_path):
    from torchnitro.autotune.artifact import read_manifest
    from torchnitro.serve.models import unservable_reason

    named = _int8_artifact(tmp_path / "named", ref={"spec": "mlp"})
    assert unservable_reason(named, read_manifest(named)) is None
    bare = _int8_artifact(tmp_path / "bare")
    manifest = read_manifest(bare)
    assert "dynamic-int8" in unservable_reason(bare, manifest)
    assert unservable_reason(bare, {**manifest, "standalone": True}) is None


def test_the_offered_factory_serves_the_artifact_with_the_model_object(tmp_path, monkeypatch):
    """The error's way (2): a ``module:function`` factory returning ``artifact_model(dir, model=...)``, resolved
    as serve's workers resolve it; it computes the artifact's int8 model on the saved weights."""
    pytest.importorskip("torch.ao.quantization")
    from torchnitro.serve.models import resolve_model

    art = _int8_artifact(tmp_path / "int8")
    (tmp_path / "mk_int8_factory.py").write_text(
        "from torch import nn\nfrom torchnitro.serve.models import artifact_model\n"
        f"def make():\n    return artifact_model({str(art)!r}, model=nn.Linear(16, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        sm = resolve_model("mk_int8_factory:make", "int8")
        x = torch.randn(3, 16)
        (out,) = sm(x)
        torch.manual_seed(0)
        ref = nn.Linear(16, 4).eval()(x)  # the saved weights (same seed as the artifact's model)
        assert out.shape == (3, 4) and [s.name for s in sm.signature.inputs] == ["x"]
        torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)  # int8 dynamic quantization of a 16x4 layer
    finally:
        sys.modules.pop("mk_int8_factory", None)
