"""Save/load round trips give the same outputs; any tampering is caught before anything loads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import torchnitro
from torchnitro.autotune.inputs import ModelInfo, model_and_inputs
from torchnitro.errors import ArtifactError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One ONNX (standalone) and one dynamic-int8 (state dict + factory) artifact of the mlp."""
    from fake_recipes import fast_config

    tmp = tmp_path_factory.mktemp("art")
    model, inputs, info = model_and_inputs("mlp", batch=4)
    out = {}
    for name in ("onnxruntime", "dynamic-int8"):
        cfg = fast_config(tmp, recipes=[name], min_speedup=0.0, cache=False)  # min_speedup 0: take it even if slower
        opt = torchnitro.optimize(model, inputs, cfg, info=info)
        assert opt.recipe == name, opt.report
        out[name] = (opt, opt.save(tmp / name))
    return out


@pytest.mark.parametrize("name", ["onnxruntime", "dynamic-int8"])
@pytest.mark.parametrize("batch", [4, 7])
def test_round_trip_same_outputs(saved, name, batch):
    opt, path = saved[name]
    loaded = torchnitro.load(path)
    assert loaded.recipe == name and loaded.candidate.standalone == (name == "onnxruntime")
    x = torch.randn(batch, 512)
    torch.testing.assert_close(loaded(x), opt(x), rtol=0, atol=0)
    assert loaded.signature == opt.signature
    assert loaded.signature["inputs"] == [{"name": "x", "dtype": "float32", "shape": [-1, 512]}]
    assert loaded.report.chosen == name


def test_manifest_lists_sha256_of_every_file(saved):
    _, path = saved["dynamic-int8"]
    m = json.loads((path / "manifest.json").read_text())
    assert set(m["files"]) == {"weights.safetensors", "report.json", "report.md"}
    assert m["model"]["spec"] == "mlp" and not m["standalone"]
    _, onnx_path = saved["onnxruntime"]
    assert "candidate/model.onnx" in json.loads((onnx_path / "manifest.json").read_text())["files"]


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("what", ["flip-byte", "delete", "edit-manifest", "no-manifest", "bad-json"])
def test_tampering_detected(saved, tmp_path, what):
    _, path = saved["onnxruntime"]
    d = _copy(path, tmp_path / "a")
    target = d / "candidate" / "model.onnx"
    if what == "flip-byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        match = "checksum"
    elif what == "delete":
        target.unlink()
        match = "missing"
    elif what == "edit-manifest":
        m = json.loads((d / "manifest.json").read_text())
        m["recipe"] = "eager"
        (d / "manifest.json").write_text(json.dumps(m))
        match = "edited"
    elif what == "no-manifest":
        (d / "manifest.json").unlink()
        match = "no manifest"
    else:
        (d / "manifest.json").write_text("{not json")
        match = "not valid JSON"
    with pytest.raises(ArtifactError, match=match):
        torchnitro.load(d)


def test_missing_directory_and_python_object_without_factory(tmp_path, fast_cfg):
    with pytest.raises(ArtifactError, match="not a directory"):
        torchnitro.load(tmp_path / "nope")
    from fake_recipes import tiny_inputs, tiny_model

    class NoExport(torch.nn.Module):  # data-dependent control flow: torch.export refuses it
        def __init__(self):
            super().__init__()
            self.inner = tiny_model()

        def forward(self, x):
            return self.inner(x) if float(x.sum()) > -1e9 else x

    model = NoExport().eval()
    opt = torchnitro.optimize(model, tiny_inputs(), fast_cfg(recipes=[]))
    with pytest.warns(UserWarning, match="torch.export failed"):
        path = opt.save(tmp_path / "eager")
    with pytest.raises(ArtifactError, match="model="):
        torchnitro.load(path)
    loaded = torchnitro.load(path, model=NoExport())
    x = tiny_inputs(2)[0]
    torch.testing.assert_close(loaded(x), model(x))


def test_eager_python_object_saved_as_exported_program(tmp_path, fast_cfg):
    from fake_recipes import tiny_inputs, tiny_model

    model = tiny_model()
    opt = torchnitro.optimize(model, tiny_inputs(), fast_cfg(recipes=[]))
    path = opt.save(tmp_path / "eager")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["standalone"] and "candidate/model.pt2" in manifest["files"]
    with pytest.warns(UserWarning, match="torch.export program"):  # a program, though not Python code
        loaded = torchnitro.load(path)  # no model code needed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchnitro.load(path, trust_code=True)  # the opt-in acknowledges it: no warning
    for batch in (4, 9):
        x = tiny_inputs(batch)[0]
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_save_refuses_to_overwrite_a_non_artifact_folder(tmp_path, fast_cfg):
    from fake_recipes import tiny_inputs, tiny_model

    (tmp_path / "keep.txt").write_text("user data")
    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=[]))
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        opt.save(tmp_path)
    assert (tmp_path / "keep.txt").exists()


def test_recipe_that_cannot_rebuild_gives_artifact_error(saved, tmp_path, monkeypatch):
    from torchnitro.autotune.recipes import onnx as onnx_recipes

    _, path = saved["onnxruntime"]

    def broken(*a, **k):
        raise ImportError("onnxruntime is not installed")

    monkeypatch.setattr(onnx_recipes, "OrtRunner", broken)
    with pytest.raises(ArtifactError, match="could not rebuild.*onnxruntime is not installed"):
        torchnitro.load(path)


@pytest.mark.parametrize("name", ["onnxruntime", "dynamic-int8"])
def test_a_loaded_model_saves_again_like_an_optimized_one(saved, tmp_path, name):
    from torchnitro.autotune.artifact import read_manifest

    opt, path = saved[name]
    again = torchnitro.load(path).save(tmp_path / "again")
    first, second = read_manifest(path), read_manifest(again)  # checksums and layout pass
    same = ("recipe", "numeric_class", "standalone", "meta", "candidate_files", "model", "signature")
    assert {k: second[k] for k in same} == {k: first[k] for k in same}
    stored = [f for f in first["files"] if not f.startswith("report.")]  # the candidate's files, weights
    assert stored and {f: second["files"][f] for f in stored} == {f: first["files"][f] for f in stored}
    x = torch.randn(5, 512)
    torch.testing.assert_close(torchnitro.load(again)(x), opt(x), rtol=0, atol=0)


def test_saving_over_the_folder_it_was_loaded_from_is_refused(saved, tmp_path):
    _, path = saved["dynamic-int8"]
    d = _copy(path, tmp_path / "a")
    with pytest.raises(ArtifactError, match="loaded from"):
        torchnitro.load(d).save(d)
    torchnitro.load(d)  # untouched


def test_a_recipe_that_converts_the_eager_model_on_load_saves_its_fp32_weights_again(tmp_path, fast_cfg):
    """bf16 casts the model it loads in place: a re-save keeps the artifact's fp32 weights, byte for byte."""
    from fake_recipes import tiny_inputs, tiny_model

    from torchnitro.autotune.recipe import register_recipe, unregister_recipe
    from torchnitro.autotune.recipes.precision import _Cast

    class AnyCpuBF16(_Cast):
        name, dtype = "test-bf16", torch.bfloat16

    register_recipe(AnyCpuBF16)
    try:
        model = tiny_model()
        opt = torchnitro.optimize(model, tiny_inputs(), fast_cfg(recipes=["test-bf16"], min_speedup=0.0, cache=False))
        assert opt.recipe == "test-bf16", opt.report
        opt.source.ref = {"spec": "fake_recipes:tiny_model"}  # rebuilt from the factory on load
        first = opt.save(tmp_path / "first")
        loaded = torchnitro.load(first, trust_code=True)
        again = loaded.save(tmp_path / "again")
        assert (again / "weights.safetensors").read_bytes() == (first / "weights.safetensors").read_bytes()
        x = tiny_inputs(3)[0]
        torch.testing.assert_close(torchnitro.load(again, trust_code=True)(x), loaded(x), rtol=0, atol=0)
    finally:
        unregister_recipe("test-bf16")
