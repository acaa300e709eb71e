"""An artifact is data: editing its manifest (and recomputing the unkeyed hash, as anyone can) must not
make ``torchnitro.load`` run code, read outside the folder, or accept files the manifest does not list."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import torchnitro
from torchnitro.autotune.inputs import model_and_inputs
from torchnitro.errors import ArtifactError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A non-standalone (dynamic-int8: weights + factory reference) and a TorchScript artifact of the mlp."""
    from fake_recipes import fast_config

    tmp = tmp_path_factory.mktemp("safe")
    model, inputs, info = model_and_inputs("mlp", batch=4)
    out = {}
    for name in ("dynamic-int8", "torchscript"):
        cfg = fast_config(tmp, recipes=[name], min_speedup=0.0, cache=False)
        opt = torchnitro.optimize(model, inputs, cfg, info=info)
        assert opt.recipe == name, opt.report
        out[name] = (opt, opt.save(tmp / name))
    return out


def _copy(saved, name, dst: Path) -> Path:
    shutil.copytree(saved[name][1], dst)
    return dst


def _rewrite(d: Path, edit) -> None:
    """Edit manifest.json the way an attacker would: change it, then recompute its (unkeyed) hash."""
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    m["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _payload(path: Path, marker: Path) -> None:
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
                    "def make():\n    from torchnitro.nn.zoo import get_builtin\n"
                    "    return get_builtin('mlp').build()\n")


def test_py_file_spec_outside_is_not_executed(saved, tmp_path):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    marker, evil = tmp_path / "marker", tmp_path / "evil.py"
    _payload(evil, marker)
    _rewrite(d, lambda m: m["model"].update(spec=f"{evil}:make"))
    with pytest.raises(ArtifactError, match=r"(?s)evil\.py:make.*trust_code=True.*--trust-code"):
        torchnitro.load(d)
    assert not marker.exists()
    loaded = torchnitro.load(d, trust_code=True)  # the explicit opt-in runs it, as asked
    assert marker.exists()
    x = torch.randn(3, 512)
    torch.testing.assert_close(loaded(x), saved["dynamic-int8"][0](x), rtol=0, atol=0)


def test_py_file_inside_the_artifact_is_not_executed(saved, tmp_path, monkeypatch):
    """Even listed with its hash, and importable as a module because the user runs from the folder."""
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    marker = tmp_path / "marker"
    _payload(d / "evilmod.py", marker)
    monkeypatch.chdir(d)
    monkeypatch.syspath_prepend(str(d))

    def edit(m):
        m["model"]["spec"] = "evilmod:make"
        m["files"]["evilmod.py"] = _sha(d / "evilmod.py")

    _rewrite(d, edit)
    with pytest.raises(ArtifactError, match=r"evilmod:make.*inside the artifact"):
        torchnitro.load(d)
    assert not marker.exists()


def test_module_spec_of_an_installed_module_loads(tmp_path, fast_cfg):
    """A 'module:function' reference to importable code the user installed is not code the artifact carries."""
    from fake_recipes import tiny_inputs, tiny_model

    model, inputs = tiny_model(), tiny_inputs()
    opt = torchnitro.optimize(model, inputs, fast_cfg(recipes=["dynamic-int8"], min_speedup=0.0, cache=False))
    opt.source.ref = {"spec": "fake_recipes:tiny_model", "name": "tiny", "extra": {}}
    d = opt.save(tmp_path / "a")
    loaded = torchnitro.load(d)
    torch.testing.assert_close(loaded(*inputs), opt(*inputs), rtol=0, atol=0)

    _rewrite(d, lambda m: m["model"].update(spec="not_a_module_here_xyz:make"))
    with pytest.raises(ArtifactError, match="not_a_module_here_xyz.*not installed"):
        torchnitro.load(d)


@pytest.mark.parametrize("key", ["../outside.bin", "/etc/hostname", "candidate/../../outside.bin"])
def test_key_outside_the_directory_refused(saved, tmp_path, key):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    target = Path(key) if key.startswith("/") else d / key
    digest = _sha(target) if target.is_file() else "0" * 64
    _rewrite(d, lambda m: m["files"].update({key: digest}))
    with pytest.raises(ArtifactError, match=r"not a plain relative path inside the artifact"):
        torchnitro.load(d)


def test_symlink_out_of_the_directory_refused(saved, tmp_path):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    real = tmp_path / "weights.safetensors"
    shutil.move(d / "weights.safetensors", real)
    (d / "weights.safetensors").symlink_to(real)  # same bytes, same hash: only the link gives it away
    with pytest.raises(ArtifactError, match=r"weights\.safetensors is a symbolic link"):
        torchnitro.load(d)


def test_symlinked_folder_refused(saved, tmp_path):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    (tmp_path / "elsewhere").mkdir()
    (d / "candidate").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ArtifactError, match=r"candidate is a symbolic link"):
        torchnitro.load(d)


@pytest.mark.parametrize("rel", ["extra.py", "candidate/notes.txt"])
def test_unlisted_file_refused(saved, tmp_path, rel):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    (d / rel).parent.mkdir(parents=True, exist_ok=True)
    (d / rel).write_text("print('hi')\n")
    with pytest.raises(ArtifactError, match=rf"{rel} is not listed in manifest\.json"):
        torchnitro.load(d)


def test_the_directory_itself_may_be_a_symlink(saved, tmp_path):
    link = tmp_path / "latest"
    link.symlink_to(saved["dynamic-int8"][1], target_is_directory=True)
    assert torchnitro.load(link).recipe == "dynamic-int8"


def test_torchscript_needs_trust_code(saved, tmp_path):
    """torch.jit.load runs the program in the archive: refused unless trusted."""
    opt, path = saved["torchscript"]
    with pytest.raises(ArtifactError, match=r"(?s)candidate/model\.ts.*TorchScript.*trust_code=True"):
        torchnitro.load(path)
    loaded = torchnitro.load(path, trust_code=True)
    x = torch.randn(2, 512)
    torch.testing.assert_close(loaded(x), opt(x), rtol=0, atol=0)


def test_torchscript_renamed_still_recognised(saved, tmp_path):
    """The check reads the file's format, not its name or the recipe the manifest claims."""
    d = _copy(saved, "torchscript", tmp_path / "a")
    _rewrite(d, lambda m: m.update(recipe="onnxruntime"))
    with pytest.raises(ArtifactError, match="TorchScript"):
        torchnitro.load(d)


def test_serve_model_refuses_then_trust_code(saved, tmp_path):
    d = _copy(saved, "dynamic-int8", tmp_path / "a")
    marker, evil = tmp_path / "marker", tmp_path / "evil.py"
    _payload(evil, marker)
    _rewrite(d, lambda m: m["model"].update(spec=f"{evil}:make"))
    from torchnitro.serve.models import resolve_model as serve_model

    with pytest.raises(ArtifactError, match="--trust-code"):
        serve_model(str(d))
    assert not marker.exists()
    sm = serve_model(str(d), trust_code=True)
    assert marker.exists() and [s.name for s in sm.signature.inputs] == ["x"]


def test_cli_serve_refuses_without_the_flag(saved, tmp_path, capsys):
    """`torchnitro serve DIR` refuses before serving anything; the error names the flag."""
    from torchnitro.cli import main

    d = _copy(saved, "torchscript", tmp_path / "a")
    rc = main(["serve", str(d), "--workers", "0", "--device", "cpu", "--port", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--trust-code" in err and "Traceback" not in err, err


def test_trust_code_reaches_worker_processes(saved):
    """ServeConfig.trust_code travels to the spawned worker that loads the artifact itself."""
    import asyncio

    from torchnitro.serve.protocol import InferItem
    from torchnitro.serve.server import ServeConfig, make_pool

    opt, path = saved["torchscript"]
    x = torch.randn(2, 512)

    async def go():
        pool = make_pool(str(path), "ts", ServeConfig(workers=1, threads=1, device="cpu", trust_code=True))
        await pool.start()
        try:
            return await pool.run([InferItem([x], 2, None)])
        finally:
            await pool.close()

    torch.testing.assert_close(asyncio.run(go())[0][0], opt(x), rtol=0, atol=0)
