"""Result files with raw samples and ``torchnitro bench compare / history``: verdicts, exit codes, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torchnitro.bench.results import check_comparable, read_results, write_results
from torchnitro.bench.timing import Timing
from torchnitro.cli import main
from torchnitro.errors import ArtifactError, InputError

ENV = {"machine": "Test CPU, 2 cores", "torch threads": "2", "versions": "torch 2.13.0", "commit": "abc123"}


def _samples(seed: int, scale: float, n: int = 20, noise: float = 0.02) -> list[float]:
    return list(np.random.default_rng(seed).normal(1e-3 * scale, 1e-3 * scale * noise, n))


def _write(path, cases, env=ENV):
    return write_results(path, cases, env)


def test_round_trip_keeps_samples_and_environment(tmp_path):
    t = Timing(_samples(0, 1.0), calls_per_sample=4)
    r = read_results(_write(tmp_path / "a.json", {"mm/small": t, "mm/large": _samples(1, 2.0)}))
    assert r.cases["mm/small"] == t.samples and r.environment["machine"] == ENV["machine"]
    default_env = read_results(write_results(tmp_path / "b.json", {"x": _samples(2, 1.0)})).environment
    assert {"machine", "commit", "torch_threads", "allocator"} <= set(default_env)  # provenance + timing settings


@pytest.mark.parametrize("content,error,match", [
    ("", ArtifactError, "empty"),
    ('{"format": "torchnitro-bench", "cases": {"a": {"samples_s": [1e-3, 1', ArtifactError, "truncated"),
    ('{"title": "t", "columns": [], "rows": []}', InputError, "medians only"),
    ('{"format": "torchnitro-bench", "version": 1, "cases": {"a": {"samples_s": [1e-3, 2e-3]}}}', ArtifactError,
     "2 usable samples"),
    ('{"format": "torchnitro-bench", "version": 1, "cases": {}}', ArtifactError, "no cases"),
])
def test_bad_result_files_get_one_clear_error(tmp_path, content, error, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(error, match=match):
        read_results(p)


def test_files_from_different_machines_are_refused(tmp_path):
    a = read_results(_write(tmp_path / "a.json", {"x": _samples(0, 1.0)}))
    b = read_results(_write(tmp_path / "b.json", {"x": _samples(1, 1.0)}, {**ENV, "machine": "Other CPU, 64 cores"}))
    with pytest.raises(InputError, match="not comparable.*machine.*Other CPU"):
        check_comparable(a, b)
    c = read_results(_write(tmp_path / "c.json", {"x": _samples(1, 1.0)}, {**ENV, "commit": "def456"}))
    assert check_comparable(a, c) == ["commit: abc123 -> def456"]


def test_compare_exit_codes(tmp_path, capsys):
    base = _write(tmp_path / "base.json", {"attn/small": _samples(0, 1.0), "mlp": _samples(1, 1.0)})
    same = _write(tmp_path / "same.json", {"attn/small": _samples(2, 1.0), "mlp": _samples(3, 1.0)})
    slow = _write(tmp_path / "slow.json", {"attn/small": _samples(4, 1.10), "mlp": _samples(5, 1.0)})
    assert main(["bench", "compare", str(base), str(same)]) == 0
    assert main(["bench", "compare", str(base), str(slow), "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out[captured.out.index("{"):])
    verdicts = {v["case"]: v["verdict"] for v in data["verdicts"]}
    assert verdicts == {"attn/small": "slower", "mlp": "same"}
    assert "regression: 1 case(s) slower: attn/small" in captured.err
    other = _write(tmp_path / "other.json", {"mlp": _samples(6, 1.0)}, {**ENV, "torch threads": "8"})
    assert main(["bench", "compare", str(base), str(other)]) == 2
    assert "not comparable" in capsys.readouterr().err
    assert main(["bench", "compare", str(base), str(other), "--force"]) == 0
    (tmp_path / "empty.json").write_text("")
    assert main(["bench", "compare", str(base), str(tmp_path / "empty.json")]) == 2


def test_history_finds_the_step_and_plots(tmp_path, capsys):
    hist = tmp_path / "history"
    for run in range(12):
        scale = 1.0 if run < 7 else 1.15  # run 7 made mm 15% slower; ln stays flat
        _write(hist / f"2026-11-{run + 10:02d}.json", {"mm": _samples(run, scale), "ln": _samples(100 + run, 1.0)})
    assert main(["bench", "history", str(hist), "--plot"]) == 0
    out = capsys.readouterr().out
    assert "mm: step at run 7 (2026-11-17)" in out and "slower" in out
    assert "ln: no step over 12 runs" in out
    assert (hist / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "history", str(tmp_path / "nowhere")]) == 2


def test_bench_run_writes_a_comparable_result_file(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["bench", "run", "--suite", "attention", "--tier", "micro", "--quick", "--device", "cpu",
                 "--out", str(out)]) == 0
    r = read_results(out)
    assert set(r.cases) == {"attention/micro/sdpa", "attention/micro/math"}
    assert r.environment["device"] == "cpu" and "torch_threads" in r.environment
    assert main(["bench", "run", "--tier", "micro,huge", "--out", str(out)]) == 2
    assert "expected some of ['micro'" in capsys.readouterr().err
    assert main(["bench", "run", "--suite", "conv", "--out", str(out)]) == 2


def test_suite_tier_too_big_for_memory_is_skipped_with_a_reason():
    from torchnitro.bench.suites import run_suite
    from torchnitro.bench.timing import TimingConfig

    run = run_suite("attention", ["micro", "large"], timing=TimingConfig().quick(), free_bytes=64 * 2**20)
    assert set(run.timings) == {"attention/micro/sdpa", "attention/micro/math"}
    assert "more than half of the 64 MiB free" in run.skipped["attention/large"]


def _noisy(seed: int, scale: float, n: int = 20) -> list[float]:
    """A clean mode at ``scale`` ms with 2% noise and 60% of samples preempted (2x-5x): one-sided noise."""
    r = np.random.default_rng(seed)
    x = r.normal(1e-3 * scale, 2e-5 * scale, n)
    return list(np.where(r.random(n) < 0.6, x * r.uniform(2, 5, n), x))


def test_sequential_compare_asks_for_more_runs_then_decides(tmp_path, capsys):
    runs = [(_write(tmp_path / f"base{i}.json", {"mm": _noisy(10 * i, 1.0, 6)}),
             _write(tmp_path / f"new{i}.json", {"mm": _noisy(10 * i + 1, 1.15, 6)})) for i in range(4)]
    files = [str(p) for pair in runs for p in pair]
    assert main(["bench", "compare", *files[:2], "--sequential"]) == 3  # 6 noisy samples: not shown, not ruled out
    assert "inconclusive: 1 case(s) need more samples (mm)" in capsys.readouterr().err
    assert main(["bench", "compare", *files, "--sequential", "--json"]) == 1  # more runs of each show the 15% (beyond the 5% threshold)
    out = capsys.readouterr().out
    (v,) = json.loads(out[out.index("{"):])["verdicts"]
    assert v["verdict"] == "slower" and v["looks_used"] > 1 and v["history"][0]["verdict"] == "inconclusive"
    assert main(["bench", "compare", *files[:3], "--sequential"]) == 2  # an odd number of files: pairs expected
    assert "expected pairs" in capsys.readouterr().err
    assert main(["bench", "compare", *files[:4]]) == 2  # more files only with --sequential
    assert main(["bench", "compare", *files, "--sequential", "--looks", "3"]) == 2  # more runs than planned looks
