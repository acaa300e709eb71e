"""Trace analysis (``profile.trace``) on synthetic Chrome traces whose answers are worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchnitro.cli import main
from torchnitro.errors import ArtifactError, InputError
from torchnitro.profile import ProfileConfig, TraceConfig, analyze_trace, profile
from torchnitro.profile.result import Profile, findings
from torchnitro.profile.trace import _pct, intersection_us, union_us


def _x(cat: str, name: str, ts: float, dur: float, pid: object = 0, tid: object = 7, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _k(name: str, ts: float, dur: float, corr: int, stream: int = 7, cat: str = "kernel") -> dict:
    return _x(cat, name, ts, dur, 0, stream, device=0, stream=stream, correlation=corr)


def _rt(ts: float, dur: float, corr: int) -> dict:
    return _x("cuda_runtime", "cudaLaunchKernel", ts, dur, 100, 100, correlation=corr)


def one_stream() -> dict:
    """Kernels 0-100, 110-150, 300-304 and a memcpy 400-450 on one stream, each with its launch call.

    Gap 100-110: k2's launch ended at 90, before k1 finished, gap 10 <= 30 -> kernel wait.
    Gap 150-300: k3's launch ended at 288, after k2 finished -> host wait 150.
    Gap 304-400: the memcpy's launch ended at 206, queued long before, gap 96 > 30 -> other.
    """
    return {"traceEvents": [
        _k("sm90_gemm_tn", 0, 100, 1), _rt(-20, 5, 1),
        _k("elementwise_kernel", 110, 40, 2), _rt(80, 10, 2),
        _k("vectorized_elementwise_kernel", 300, 4, 3), _rt(280, 8, 3),
        _k("Memcpy DtoH (Device -> Pageable)", 400, 50, 4, cat="gpu_memcpy"), _rt(200, 6, 4),
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ]}


def test_temporal_and_idle_breakdown_of_one_stream():
    a = analyze_trace(one_stream())
    assert a.clock == "device" and a.span_us == 450
    t = a.total
    assert (t["compute"], t["communication"], t["memory"], t["idle"]) == (144, 0, 50, 256)
    idle = a.idle[0]
    assert (idle["host_wait_us"], idle["kernel_wait_us"], idle["other_us"], idle["idle_us"]) == (150, 10, 96, 256)
    # a smaller kernel-wait threshold turns the 10 us gap into "other"
    idle2 = analyze_trace(one_stream(), TraceConfig(kernel_wait_us=5)).idle[0]
    assert (idle2["kernel_wait_us"], idle2["other_us"]) == (0, 106)


def test_launch_statistics():
    ln = analyze_trace(one_stream()).launch
    # delays: kernel start - launch end = 15, 20, 12, 194
    assert ln["kernels"] == 4 and ln["unmatched"] == 0
    assert ln["delay_p50_us"] == pytest.approx(17.5) and ln["delay_max_us"] == 194
    assert ln["short_kernels"] == 1 and ln["short_share"] == 0.25  # the 4 us kernel took an 8 us launch
    assert ln["long_delays"] == 1  # 194 > 100


def test_kernel_duration_distribution():
    d = analyze_trace(one_stream()).durations
    assert d["count"] == 4 and d["total_us"] == 194 and d["max_us"] == 100
    assert [r["name"] for r in d["by_name"]][:2] == ["sm90_gemm_tn", "Memcpy DtoH (Device -> Pageable)"]
    assert d["by_name"][0]["share"] == pytest.approx(100 / 194)
    # log2 buckets: 4 -> [4, 8), 40 and 50 -> [32, 64), 100 -> [64, 128)
    assert d["histogram"]["counts"] == [0, 0, 0, 1, 0, 0, 2, 1]
    assert d["histogram"]["edges_us"][:9] == [0, 1, 2, 4, 8, 16, 32, 64, 128]


def test_communication_overlap_across_streams_and_rank():
    trace = {"distributedInfo": {"rank": 3, "world_size": 4}, "traceEvents": [
        _k("sm90_gemm_tn", 0, 100, 1, stream=7),
        _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100, 2, stream=20)]}
    a = analyze_trace(trace)
    assert a.rank == 3 and a.span_us == 150
    t = a.total  # a moment with both running counts as compute
    assert (t["compute"], t["communication"], t["idle"]) == (100, 50, 0)
    assert a.overlap == {"communication_us": 100, "overlapped_us": 50, "percent": 50.0}
    rows = {r["stream"]: r for r in a.temporal}
    assert rows["0:20"]["communication"] == 100 and rows["0:20"]["span"] == 100
    assert a.launch is None  # no launch calls in this trace


def cpu_trace() -> dict:
    return {"traceEvents": [
        _x("user_annotation", "ProfilerStep#0", 0, 100, 1, 1),
        _x("cpu_op", "aten::mm", 0, 60, 1, 1), _x("cpu_op", "aten::addmm", 10, 40, 1, 1),  # nested: not counted
        _x("cpu_op", "aten::add", 70, 10, 1, 1), _x("cpu_op", "aten::view", 80, 5, 1, 1),
        _x("cpu_op", "aten::copy_", 90, 5, 1, 1),
        _x("cpu_op", "c10d::allreduce_", 20, 20, 1, 2),  # another thread, under the mm
        _x("cpu_op", "aten::mm", 200, 100, 1, 1),  # outside the step range
    ]}


def test_cpu_trace_breakdown_by_thread():
    a = analyze_trace(cpu_trace())
    assert a.clock == "cpu" and a.span_us == 100 and a.idle == [] and a.launch is None
    t = a.total
    assert (t["compute"], t["communication"], t["memory"], t["other"], t["idle"]) == (70, 0, 5, 5, 20)
    rows = {r["stream"]: r for r in a.temporal}
    assert rows["1:2"]["communication"] == 20 and rows["1:2"]["idle"] == 80
    assert a.overlap["percent"] == 100.0  # the allreduce ran entirely under the mm
    d = a.durations
    assert d["count"] == 5 and d["by_name"][0]["name"] == "aten::mm" and d["by_name"][0]["count"] == 1


def test_interval_helpers_and_percentile():
    assert union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert intersection_us([(0, 10), (20, 30)], [(5, 25)]) == 10
    vals = [3.0, 1.0, 7.0, 2.0, 10.0]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert _pct(vals, q) == pytest.approx(np.percentile(vals, 100 * q))


def test_bad_trace_files(tmp_path):
    with pytest.raises(InputError, match="no such trace file"):
        analyze_trace(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("  ")
    with pytest.raises(ArtifactError, match="empty"):
        analyze_trace(tmp_path / "empty.json")
    (tmp_path / "cut.json").write_text(json.dumps(one_stream())[:100])
    with pytest.raises(ArtifactError, match="truncated"):
        analyze_trace(tmp_path / "cut.json")
    with pytest.raises(InputError, match="traceEvents"):
        analyze_trace({"rows": []})
    with pytest.raises(InputError, match="kernel_wait_us"):
        TraceConfig(kernel_wait_us=-1)
    assert analyze_trace(one_stream()["traceEvents"]).span_us == 450  # the JSON array form is a trace too


def test_profile_carries_the_analysis_of_its_own_trace(tmp_path):
    a, b = torch.randn(96, 96), torch.randn(96, 96)
    prof = profile(lambda: torch.mm(a, b).relu(), config=ProfileConfig(warmup=1, steps=2, monitor=False,
                                                                        measure_peak=False))
    t = prof.trace_analysis
    assert t["clock"] == "cpu" and "aten::mm" in {r["name"] for r in t["durations"]["by_name"]}
    row = next(r for r in t["temporal"] if r["stream"] == "all")
    assert sum(row[k] for k in ("compute", "communication", "memory", "other", "idle")) == pytest.approx(row["span"])
    assert "trace analysis" in prof.summary()
    prof.save(tmp_path)
    assert Profile.load(tmp_path).trace_analysis == json.loads(json.dumps(t))
    assert 'id="trace-analysis"' in (tmp_path / "report.html").read_text() and (tmp_path / "durations.png").exists()


def test_trace_findings():
    p = Profile(device="gpu", clock="device", warmup=1, steps=1, step_time_s=1e-3, step_times_s=[1e-3],
                categories={"matmul": 1e-3})
    assert findings(p) == []
    p.trace_analysis = analyze_trace(one_stream()).to_dict()  # host wait 150 of 450 us
    assert any("waited on the CPU for 33%" in f for f in findings(p))
    comm = {"traceEvents": [_k("gemm", 0, 10, 1), _k("ncclDevKernel_AllGather", 20, 80, 2, stream=9)]}
    p.trace_analysis = analyze_trace(comm).to_dict()
    assert any("only 0% of communication overlaps" in f for f in findings(p))


def test_cli_trace(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(one_stream()))
    assert main(["profile", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host wait 59%" in out and "kernel wait 4%" in out and "25% shorter than their launch call" in out
    assert main(["profile", "--trace", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["idle"][0]["host_wait_us"] == 150
    assert main(["profile", "--trace", str(path), "--model", "mlp"]) == 2
    assert main(["profile", "--trace", str(tmp_path / "nope.json")]) == 2
