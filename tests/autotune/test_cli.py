"""``torchnitro optimize / inspect``: a working run, and one-paragraph errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from torchnitro.cli import main


@pytest.fixture
def run(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path / "cache"))

    def go(*args):
        rc = main(list(args))
        out = capsys.readouterr()
        return rc, out.out, out.err

    return go


def test_optimize_writes_artifact_and_prints_report(run, tmp_path):
    cfg = tmp_path / "c.yaml"
    # the finalists timed in this process, no allocator trial: no fresh timing process (tests/autotune/test_fair_*)
    cfg.write_text("version: 1\noptimize:\n  timing_min_iters: 2\n  timing_min_time_s: 0.01\n"
                   "  final_min_iters: 3\n  final_min_time_s: 0.02\n  threads: 1\n"
                   "  final_alone: false\n  tune_allocator: false\n")
    out = tmp_path / "opt"
    rc, stdout, err = run("optimize", "--model", "mlp", "--batch", "4", "--recipe", "torchscript", "--out", str(out),
                          "--config", str(cfg), "--shape", "2")
    assert rc == 0, err
    assert "float32[4x512] + float32[2x512]" in stdout
    assert "torchscript" in stdout and "eager" in stdout and "artifact written" in stdout
    assert (out / "manifest.json").is_file()
    rc, stdout, err = run("inspect", str(out))
    assert rc == 0 and "files verified" in stdout and '"shape"' in stdout
    m = json.loads((out / "manifest.json").read_text())
    (out / "report.md").write_text("tampered")
    rc, _, err = run("inspect", str(out))
    assert rc == 2 and "checksum" in err and "Traceback" not in err
    assert m["signature"]["inputs"][0]["shape"] == [-1, 512]


def _factory(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\ndef build():\n    return torch.nn.Linear(8, 2)\n")
    return f


@pytest.mark.parametrize("case", ["bad-input", "missing-path", "missing-hf", "unknown-recipe", "yaml-unknown",
                                  "model-fails", "missing-config", "bad-shape", "unavailable"])
def test_errors_are_one_paragraph_exit_2(run, tmp_path, case):
    if case == "unavailable":
        from torchnitro.autotune.recipe import get_recipe
        from torchnitro.hardware import hardware_info

        if get_recipe("tensorrt").unavailable_reason(hardware_info()) is None:
            pytest.skip("tensorrt can run here")
    f = _factory(tmp_path)
    args = {
        "bad-input": ["--model", f"{f}:build", "--input", "8xfoo"],
        "missing-path": ["--model", f"{tmp_path}/nope.py:build", "--input", "2x8"],
        "missing-hf": ["--model", f"hf:{tmp_path}/no-folder"],
        "unknown-recipe": ["--recipe", "turbo"],
        "yaml-unknown": ["--config", str(tmp_path / "c.yaml")],
        "model-fails": ["--model", f"{f}:build", "--input", "2x5", "--recipe", "torchscript"],
        "missing-config": ["--config", str(tmp_path / "absent.yaml")],
        "bad-shape": ["--model", "mlp", "--shape", "2x3x4"],
        "unavailable": ["--model", "mlp", "--recipe", "tensorrt"],
    }[case]
    (tmp_path / "c.yaml").write_text("version: 1\noptimize:\n  budgett: 3\n")
    expect = {"bad-input": "not an input spec", "missing-path": "does not exist", "missing-hf": "does not exist",
              "unknown-recipe": "unknown recipe 'turbo'", "yaml-unknown": "budgett",
              "model-fails": "example inputs", "missing-config": "does not exist",
              "bad-shape": "BATCHxSEQ", "unavailable": "cannot run here"}[case]
    rc, _, err = run("optimize", "--out", str(tmp_path / "o"), *args)
    assert rc == 2, err
    assert expect in err and "Traceback" not in err and "--debug" in err
    assert not (tmp_path / "o").exists()


def test_debug_shows_traceback(tmp_path, monkeypatch):
    from torchnitro.errors import InputError

    with pytest.raises(InputError):
        main(["--debug", "optimize", "--model", "mlp", "--input", "8xfoo"])


def test_analyze_is_registered(run):
    rc, stdout, err = run("analyze", "--help")
    assert rc == 0 and "roofline" in stdout
