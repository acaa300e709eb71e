"""``torchnitro xla plan``: one compile per cell on the host devices, a table, and clear errors."""

from __future__ import annotations

import json

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from torchnitro.cli import main  # noqa: E402


def test_plan_compiles_each_cell_and_writes_the_rows(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["xla", "plan", "--model", "tiny", "--batch", "8", "--remat", "none,full", "--seq", "32",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "tiny (2x128, vocab 512) on host" in text and "full" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["remat"], r["batch"]) for r in rows] == [("none", 8), ("full", 8)]
    for r in rows:  # on host devices the argument estimate is exact; every cell was compiled
        assert r["argument"] == r["est_argument"] and r["temp"] > 0 and r["hbm"] is None


def test_plan_estimate_only_against_a_tpu_budget(tmp_path, capsys):
    pytest.importorskip("libtpu", reason="libtpu is not installed: TPU targets need it (torchnitro[xla])")
    out = tmp_path / "plan.json"
    rc = main(["xla", "plan", "--model", "lm", "--target", "v5e:2x2", "--batch", "4,4096", "--remat", "none",
               "--seq", "512", "--no-compile", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    small, huge = json.loads(out.read_text())["rows"]
    assert small["hbm"] == 16 * 2**30 and small["fits"] is True and huge["fits"] is False
    assert "argument" not in small  # nothing was compiled


@pytest.mark.parametrize("args,match", [(["--model", "gpt5"], "not a preset; known: tiny, lm, lm-1b"),
                                        (["--batch", "8,x"], "expected comma-separated integers"),
                                        (["--remat", "dots"], "unknown remat policy 'dots'")])
def test_plan_bad_input_exits_2_with_the_reason(args, match, capsys):
    assert main(["xla", "plan", "--no-compile", "--model", "tiny", "--seq", "32", *args]) == 2
    assert match in capsys.readouterr().err.replace("\n", " ")
