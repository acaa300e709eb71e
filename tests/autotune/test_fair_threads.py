"""The thread-count knob: the chosen variant is timed with fewer intra-op threads in fresh processes, a smaller count
is recorded only when faster beyond the noise, and ONNX Runtime / OpenVINO / serve read the recorded count."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import torchnitro
from torchnitro.autotune import fair_threads
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.timing import TimingConfig
from torchnitro.errors import InputError

_FAST = TimingConfig(warmup=1, warmup_s=0.0, min_iters=4, min_time_s=0.0, max_time_s=5.0, min_sample_s=1e-4)


def thread_probe(path: str, meta: dict[str, Any]) -> Callable[..., Any]:
    """A ChildTimer loader (run in the child): writes torch's thread count and the meta it was given to ``path``."""
    Path(path).write_text(json.dumps({"torch_threads": torch.get_num_threads(), "meta": meta}))
    return lambda x: x


class FakeThreads:
    """Stands for a ChildTimer: ``seconds[k]`` per call with ``k`` threads; ``again`` records what it was given."""

    times_itself = True

    def __init__(self, seconds: dict[int, float], threads: int, kwargs: dict[str, Any] | None = None):
        self.seconds, self.spec = seconds, {"threads": threads, "kwargs": kwargs or {"meta": {"threads": threads}}}
        self.name, self.failed, self.closed, self.spawned = "v", None, False, []

    def again(self, env, *, threads=None, kwargs=None, name=None) -> "FakeThreads":
        child = FakeThreads(self.seconds, threads, kwargs)
        self.spawned.append(child)
        return child

    def wait_ready(self) -> None:
        pass

    def __call__(self, k: int) -> float:
        return self.seconds[self.spec["threads"]]

    def close(self) -> None:
        self.closed = True


def test_thread_options_are_half_and_one():
    assert fair_threads.thread_options(1) == []
    assert fair_threads.thread_options(2) == [1]
    assert fair_threads.thread_options(3) == [1]
    assert fair_threads.thread_options(16) == [8, 1]


def test_meta_with_threads_sets_torchs_and_each_runtimes_own_count_on_a_copy():
    ort = {"threads": 2, "ort_spinning": True}
    got = fair_threads.meta_with_threads(ort, 1)
    assert got == {"threads": 1, "ort_spinning": True, "torch_threads": 1} and ort["threads"] == 2
    ov = {"ov_config": {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2}}
    got = fair_threads.meta_with_threads(ov, 1)
    assert got["ov_config"]["INFERENCE_NUM_THREADS"] == 1 and ov["ov_config"]["INFERENCE_NUM_THREADS"] == 2
    assert fair_threads.meta_with_threads({}, 3) == {"torch_threads": 3}
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError, match="threads: received"):
            fair_threads.meta_with_threads({}, bad)


def test_fewer_threads_are_recorded_only_when_faster_beyond_the_noise():
    faster_alone = FakeThreads({2: 2e-3, 1: 1e-3}, 2)
    trial = fair_threads.tune_threads(faster_alone, _FAST)
    assert trial.chosen == 1 and trial.threads == 2 and trial.ratio == pytest.approx(2.0)
    assert trial.p50_ms == pytest.approx({2: 2.0, 1: 1.0})
    spawned = faster_alone.spawned[0]
    assert spawned.spec["threads"] == 1 and spawned.spec["kwargs"]["meta"] == {"threads": 1, "torch_threads": 1}
    assert spawned.closed and not faster_alone.closed
    assert "1 recorded in the artifact" in trial.text()
    for seconds in ({2: 1e-3, 1: 2e-3}, {2: 1e-3, 1: 0.99e-3}):  # slower, or faster by 1% (< MIN_THREAD_GAIN)
        kept = fair_threads.tune_threads(FakeThreads(seconds, 2), _FAST)
        assert kept.chosen == 2 and "kept 2" in kept.text()
    assert fair_threads.tune_threads(FakeThreads({1: 1e-3}, 1), _FAST) is None  # nothing fewer to try


def test_a_fresh_process_gets_the_fewer_threads_and_the_rewritten_meta(tmp_path):
    save_inputs([(torch.ones(2),)], tmp_path / "in.pt")
    out = tmp_path / "probe.json"
    with ChildTimer("test_fair_threads:thread_probe", {"path": str(out), "meta": {"threads": 2}}, tmp_path / "in.pt",
                    threads=2, gate=None) as timer:
        timer.wait_ready()
        assert json.loads(out.read_text())["torch_threads"] == 2
        trial = fair_threads.tune_threads(timer, _FAST)
    got = json.loads(out.read_text())  # the last process to start was the one-thread trial
    assert got == {"torch_threads": 1, "meta": {"threads": 1, "torch_threads": 1}}
    assert trial is not None and set(trial.p50_ms) == {2, 1}


def _one_thread_wins(timer, tc, options=None, started=None):
    return fair_threads.ThreadTrial(timer.spec["threads"], 1, {2: 2.0, 1: 1.0}, 2.0, 0.01)


def test_a_recorded_count_goes_into_the_artifact_and_serve_reads_it(fake_recipes, fast_cfg, monkeypatch, tmp_path):
    from torchnitro.autotune.artifact import read_manifest
    from torchnitro.serve.cli import _recorded_threads_per_worker

    monkeypatch.setattr(fair_threads, "tune_threads", _one_thread_wins)
    # min_speedup below 1: the candidate is chosen however loaded the machine is (no noise bar); this is about
    # what the trial records, not about the comparison
    opt = torchnitro.optimize(fake_recipes.SlowModel(), fake_recipes.tiny_inputs(), fast_cfg(
        recipes=["test-faster"], final_alone=True, tune_threads=True, threads=2, min_speedup=0.5))
    assert opt.recipe == "test-faster"
    assert any(n.startswith("thread count: ") and "1 recorded in the artifact" in n for n in opt.report.notes)
    assert opt.candidate.meta["torch_threads"] == 1
    opt.save(tmp_path / "art")
    meta = read_manifest(tmp_path / "art")["meta"]
    assert meta["torch_threads"] == 1 and meta["threads_trial"] == {"2": 2.0, "1": 1.0}
    assert fair_threads.recorded_threads(tmp_path / "art") == 1
    assert _recorded_threads_per_worker(1, 1) == 1 and _recorded_threads_per_worker(None, 1) is None
    # timed in this process (no fresh processes to start): with tune_threads on, the trial would still leave its
    # "thread count not tried" note, so the flag is what keeps both out
    off = torchnitro.optimize(fake_recipes.SlowModel(), fake_recipes.tiny_inputs(), fast_cfg(
        recipes=["test-faster"], final_alone=False, tune_threads=False, threads=2, min_speedup=0.5,
        cache=False))
    assert "torch_threads" not in off.candidate.meta
    assert not any(n.startswith("thread count") for n in off.report.notes)


def _artifact_with_threads(path: Path, threads: int, **meta: Any) -> Path:
    from torchnitro.autotune.artifact import EagerSource, write_artifact
    from torchnitro.autotune.recipe import CandidateFiles
    from torchnitro.autotune.report import Report

    cand = path.parent / f"{path.name}-cand"
    cand.mkdir()
    (cand / "model.onnx").write_bytes(b"not really onnx")
    write_artifact(path, CandidateFiles(cand, ["model.onnx"], {"threads": threads, "torch_threads": threads, **meta},
                                        True),
                   EagerSource(), recipe="onnxruntime", numeric_class="exact", signature={},
                   report=Report(model="m", inputs="x", objective="o", hardware="h"), hardware="h")
    return path


@pytest.mark.parametrize("args, yaml_text, want", [
    ([], None, 6),  # recorded 6, 8 cores, one worker
    (["--workers", "4"], None, 2),  # at most the cores per worker
    (["--workers", "0"], None, 6),  # in-process: the server's own threads
    (["--threads", "3"], None, 3),  # the flag wins
    ([], "serve:\n  workers: 4\n", 2),  # the config file's workers split the cores too
    ([], "serve:\n  threads: 5\n", 5),  # the config file's own thread count wins over the recorded one
    (["--workers", "2"], "serve:\n  workers: 4\n", 4),  # the flag's workers over the file's
])
def test_serve_gives_workers_the_recorded_count_unless_flag_or_config_set_one(tmp_path, monkeypatch, args, yaml_text,
                                                                              want):
    import typer
    from typer.testing import CliRunner

    import torchnitro.serve.cli as serve_cli
    import torchnitro.serve.workers as workers_mod

    art = _artifact_with_threads(tmp_path / "art", 6)
    real = workers_mod.threads_per_worker
    monkeypatch.setattr(workers_mod, "threads_per_worker", lambda workers, cores=None: real(workers, 8))
    seen: list[Any] = []
    monkeypatch.setattr(serve_cli, "_start_server", lambda model, mname, batching, scfg, ray, replicas:
                        seen.append(scfg))
    monkeypatch.setattr("torchnitro.autotune.fair.apply_recorded_allocator", lambda d: {})
    extra = []
    if yaml_text is not None:
        (tmp_path / "serve.yaml").write_text(yaml_text)
        extra = ["--config", str(tmp_path / "serve.yaml")]
    app = typer.Typer()
    serve_cli.register(app)
    app.command("noop")(lambda: None)  # a second command: typer keeps 'serve' as a subcommand
    result = CliRunner().invoke(app, ["serve", str(art), *args, *extra])
    assert result.exit_code == 0, result.output
    assert seen and seen[0].threads == want, (seen[0].threads, seen[0].workers)


def test_a_chosen_variant_whose_process_died_is_noted_as_such_not_as_timed_here(tmp_path):
    """Its process may die in the allocator trial just before: the thread trial's note names that failure."""
    from types import SimpleNamespace

    from torchnitro.autotune import fair, final_trials
    from torchnitro.autotune.recipe import CandidateFiles
    from torchnitro.autotune.report import Report

    dead = object.__new__(ChildTimer)  # a timer whose process is gone: only ``failed`` is read
    dead.failed = "the timing process did not answer within 120 s (killed)"
    s = SimpleNamespace(where={"v": CandidateFiles(tmp_path, [], {}, True)},
                        cfg=SimpleNamespace(final_min_time_s=0.01), device=SimpleNamespace(type="cpu"))
    report = Report(model="m", inputs="x", objective="o", hardware="h")
    final_trials._tune_threads(final_trials._Chosen(s, report, "v", {"v": fair.Steady(dead)}))
    assert report.notes == ["thread count not tried: the chosen variant's timing process failed (the timing process "
                            "did not answer within 120 s (killed))"]


@pytest.mark.parametrize("meta, runtime", [({"threads": 2}, "ONNX Runtime"),
                                           ({"ov_config": {"INFERENCE_NUM_THREADS": 2}}, "OpenVINO"),
                                           ({}, None)])
def test_the_note_names_what_uses_a_recorded_count(meta, runtime):
    """torchnitro.load applies a recorded count only through a runtime's own session setting; for a torch-only
    variant the note must not claim that load uses it."""
    trial = fair_threads.tune_threads(FakeThreads({2: 2e-3, 1: 1e-3}, 2, {"meta": meta}), _FAST)
    assert trial.chosen == 1 and trial.runtime == runtime
    text = trial.text()
    assert "torchnitro serve's workers run that many torch threads" in text
    if runtime is None:
        assert "ONNX Runtime" not in text and "OpenVINO" not in text and "torchnitro.load" not in text
    else:
        assert f"torchnitro.load builds its {runtime} session with it" in text


def test_a_recorded_count_reaches_the_runtime_sessions_that_load_builds(tmp_path):
    """meta_with_threads rewrites the setting each standalone runtime's load path reads: ONNX Runtime's session
    (intra_op_num_threads from meta["threads"]) and OpenVINO's compiled model (ov_config's INFERENCE_NUM_THREADS)."""
    from torchnitro.autotune.recipes._util import output_kind

    model, x = torch.nn.Linear(4, 3).eval(), torch.randn(2, 4)
    kind = output_kind(model(x))
    pytest.importorskip("onnxruntime", reason="ONNX Runtime is an optional extra (torchnitro[onnx])")
    from torchnitro.autotune.recipes.onnx import OnnxRuntime, export_onnx

    ort_dir = tmp_path / "ort"
    ort_dir.mkdir()
    meta = export_onnx(model, (x,), ort_dir / "model.onnx", {})
    runner = OnnxRuntime().load(ort_dir, fair_threads.meta_with_threads({**meta, "threads": 2}, 1), None)
    assert runner.session.get_session_options().intra_op_num_threads == 1
    torch.testing.assert_close(runner(x), model(x), rtol=1e-5, atol=1e-5)
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("OpenVINO is an optional extra (torchnitro[openvino]); ONNX Runtime checked above")
    import openvino as ov

    from torchnitro.autotune.recipes.openvino import OpenVino, ov_config

    ov_dir = tmp_path / "ov"
    ov_dir.mkdir()
    ov.save_model(ov.convert_model(model, example_input=x), str(ov_dir / "model.xml"), compress_to_fp16=False)
    ov_meta = fair_threads.meta_with_threads({"ov_config": ov_config(2, "f32"), "output_kind": kind}, 1)
    ov_runner = OpenVino().load(ov_dir, ov_meta, None)
    assert int(ov_runner.compiled.get_property("INFERENCE_NUM_THREADS")) == 1


def test_serve_reads_and_verifies_the_manifest_once_for_its_allocator_and_thread_settings(tmp_path, monkeypatch):
    """Reading a manifest hashes every file of the artifact: serve's start-up reads it once and gives the meta to
    both the allocator setting and the recorded thread count."""
    import os

    import typer
    from typer.testing import CliRunner

    import torchnitro.autotune.artifact as artifact_mod
    import torchnitro.bench.environment as env_mod
    import torchnitro.serve.cli as serve_cli
    import torchnitro.serve.workers as workers_mod

    for k in env_mod.ALLOCATOR_SETTING:  # absent now and after the test, whatever serve puts into os.environ
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    monkeypatch.setattr(env_mod, "_mallopt", lambda param, value: True)
    art = _artifact_with_threads(tmp_path / "art", 6, environment=dict(env_mod.ALLOCATOR_SETTING))
    real_read = artifact_mod.read_manifest
    reads: list[Any] = []
    monkeypatch.setattr(artifact_mod, "read_manifest", lambda d: reads.append(d) or real_read(d))
    real_threads = workers_mod.threads_per_worker
    monkeypatch.setattr(workers_mod, "threads_per_worker", lambda workers, cores=None: real_threads(workers, 8))
    seen: list[Any] = []
    monkeypatch.setattr(serve_cli, "_start_server", lambda model, mname, batching, scfg, ray, replicas: seen.append(
        (scfg.threads, {k: os.environ.get(k) for k in env_mod.ALLOCATOR_SETTING})))
    app = typer.Typer()
    serve_cli.register(app)
    app.command("noop")(lambda: None)  # a second command: typer keeps 'serve' as a subcommand
    result = CliRunner().invoke(app, ["serve", str(art)])
    assert result.exit_code == 0, result.output
    assert seen == [(6, env_mod.ALLOCATOR_SETTING)]  # both settings applied ...
    assert len(reads) == 1, reads  # ... from one read of the manifest


def test_recorded_settings_read_from_a_meta_or_a_directory(tmp_path):
    from torchnitro.autotune import fair

    art = _artifact_with_threads(tmp_path / "art", 3)
    assert fair_threads.recorded_threads(art) == 3 == fair_threads.recorded_threads({"torch_threads": 3})
    assert fair_threads.recorded_threads({}) is None and fair_threads.recorded_threads({"torch_threads": True}) is None
    assert fair.recorded_meta(str(art))["threads"] == 3
    with pytest.raises(InputError, match="artifact: received int; expected its directory"):
        fair.recorded_meta(3)  # type: ignore[arg-type]


def _ort_artifact(path: Path, threads: int) -> Path:
    """A real ONNX Runtime artifact (a Linear layer) whose meta records ``threads`` intra-op threads."""
    pytest.importorskip("onnxruntime", reason="ONNX Runtime is an optional extra (torchnitro[onnx])")
    from torchnitro.autotune.artifact import EagerSource, write_artifact
    from torchnitro.autotune.recipe import CandidateFiles
    from torchnitro.autotune.recipes.onnx import export_onnx
    from torchnitro.autotune.report import Report

    model, x = torch.nn.Linear(4, 3).eval(), torch.randn(2, 4)
    cand = path.parent / f"{path.name}-cand"
    cand.mkdir()
    meta = export_onnx(model, (x,), cand / "model.onnx", {})
    sig = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
           "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 3]}]}
    write_artifact(path, CandidateFiles(cand, ["model.onnx"], {**meta, "threads": threads}, True), EagerSource(),
                   recipe="onnxruntime", numeric_class="exact", signature=sig,
                   report=Report(model="m", inputs="x", objective="o", hardware="h"), hardware="h")
    return path


def _session_threads(fn: Any) -> int:
    return fn._fn.session.get_session_options().intra_op_num_threads  # an OptimizedModel around an OrtRunner


def test_serve_threads_reach_the_onnx_runtime_session_load_builds(tmp_path):
    """``serve --threads N`` (or the config file's threads) sets torch's threads in each worker, and the ONNX Runtime
    / OpenVINO session the artifact is loaded into gets N too, instead of the count the artifact records."""
    from types import SimpleNamespace

    from torchnitro.serve.models import resolve_model
    from torchnitro.serve.server import ServeConfig, make_pool
    from torchnitro.serve.workers import InlinePool, ProcessPool

    art = _ort_artifact(tmp_path / "art", 2)
    assert _session_threads(torchnitro.load(art)) == 2  # the recorded count, unless told otherwise
    assert _session_threads(torchnitro.load(art, threads=1)) == 1
    assert _session_threads(resolve_model(str(art), "m", threads=1).fn) == 1
    old = torch.get_num_threads()
    try:  # in-process (workers 0): make_pool sets this process's torch threads too
        pool = make_pool(str(art), "m", ServeConfig(workers=0, threads=1, device="cpu"))
    finally:
        torch.set_num_threads(old)
    assert isinstance(pool, InlinePool) and _session_threads(pool.model.fn) == 1
    spawned: list[tuple[Any, ...]] = []

    class Ctx:  # stands for multiprocessing's spawn context: records what a worker would be started with
        def Pipe(self, duplex: bool) -> tuple[Any, Any]:
            return SimpleNamespace(close=lambda: None), SimpleNamespace(close=lambda: None)

        def Process(self, target: Any, args: tuple[Any, ...], name: str, daemon: bool) -> Any:
            spawned.append(args)
            return SimpleNamespace(start=lambda: None)

    for threads, want in ((3, 3), (None, None)):
        workers = ProcessPool(str(art), "m", workers=1, threads=threads)
        workers._ctx = Ctx()
        workers._spawn(0, arena=torch.empty(1, dtype=torch.uint8))
        assert spawned[-1][4] == workers.threads and spawned[-1][6] == want  # torch's threads, the session's
