"""``torchnitro profile``: built-in models, a train step, the files it writes, exit codes on bad input."""

from __future__ import annotations

import json

from torchnitro.cli import main

_FAST = ["--steps", "1", "--warmup", "1", "--no-peak"]


def test_profile_builtin_train_step_writes_the_report(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", "--model", "mlp", "--batch", "2", "--train", "--out", str(out), *_FAST]) == 0
    text = capsys.readouterr().out
    assert "(train step)" in text and "time by category" in text and "matmul" in text
    assert {"report.html", "trace.json", "profile.json", "categories.png", "top_ops.png"} <= {
        p.name for p in out.iterdir()}
    saved = json.loads((out / "profile.json").read_text())
    assert saved["memory"]["by_category"]["gradients"] > 0 and saved["flops"] > 0


def test_profile_json_output(capsys):
    assert main(["profile", "--model", "mlp", "--batch", "3", "--json", *_FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 1 and abs(sum(data["categories"].values()) - data["step_time_s"]) < 1e-6 * 50


def test_profile_bad_input_exits_2(tmp_path, capsys):
    assert main(["profile", "--model", "mlp", "--batch", "0", *_FAST]) == 2
    assert "expected positive integers" in capsys.readouterr().err
    assert main(["profile", "--model", str(tmp_path), *_FAST]) == 2  # a folder that is no artifact
    assert "manifest.json" in capsys.readouterr().err
    assert main(["profile", "--model", str(tmp_path), "--train", *_FAST]) == 2
    assert "inference-only" in capsys.readouterr().err
    assert main(["profile", "--model", "no-such-model", *_FAST]) == 2
