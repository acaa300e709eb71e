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


def test_profile_an_optimize_artifact(tmp_path, capsys):
    import torchnitro
    from torchnitro.autotune.config import OptimizeConfig
    from torchnitro.autotune.inputs import model_and_inputs

    model, inputs, info = model_and_inputs("mlp", batch=2)
    # the finalists timed in this process, no allocator trial: no fresh timing process (tests/autotune/test_fair_*)
    cfg = OptimizeConfig(recipes=["dynamic-int8"], min_speedup=0.0, cache=False, timing_min_iters=2,
                         timing_min_time_s=0.01, final_min_iters=3, final_min_time_s=0.02, progress=False,
                         candidate_timeout_s=60.0, held_out=2, threads=1, final_alone=False, tune_allocator=False)
    art = torchnitro.optimize(model, inputs, cfg, info=info).save(tmp_path / "art")
    assert main(["profile", "--model", str(art), "--batch", "3", *_FAST]) == 0
    out = capsys.readouterr().out
    assert "dynamic-int8" in out and "[3, 512]" in out  # the artifact ran on a batch of 3 from its signature
