"""The step profiler: categories, FLOPs, MFU, JSON round trip, the HTML report, bad input."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch import nn

import torchnitro
from torchnitro.errors import ArtifactError, InputError
from torchnitro.profile import Profile, ProfileConfig, category_of, profile
from torchnitro.profile.profiler import OpRecord, _Step, split_steps, step_categories
from torchnitro.profile.report import SECTIONS

FAST = ProfileConfig(warmup=1, steps=2, measure_peak=False, monitor=False)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 32))


@pytest.fixture(scope="module")
def train_profile() -> Profile:
    return profile(_mlp(), (torch.randn(8, 64),), FAST, train=True)


@pytest.mark.parametrize("name,cat", [
    ("aten::addmm", "matmul"), ("aten::conv2d", "matmul"), ("autograd::engine::evaluate_function: MmBackward0", "matmul"),
    ("aten::_scaled_dot_product_flash_attention", "attention"), ("ScaledDotProductEfficientAttentionBackward0", "attention"),
    ("aten::native_layer_norm", "norm"), ("NativeLayerNormBackward0", "norm"), ("aten::native_layer_norm_backward", "norm"),
    ("aten::gelu", "pointwise"), ("aten::add_", "pointwise"), ("torch::autograd::AccumulateGrad", "pointwise"),
    ("aten::_foreach_add_", "pointwise"), ("aten::copy_", "copy"), ("aten::_to_copy", "copy"), ("Memcpy HtoD", "copy"),
    ("c10d::allreduce_", "communication"), ("ncclKernel_AllReduce_RING", "communication"),
    ("aten::view", "cpu_overhead"), ("TBackward0", "cpu_overhead"), ("aten::embedding", "other"),
    ("ampere_sgemm_128x64_tn", "matmul"),
])
def test_category_table(name, cat):
    assert category_of(name) == cat


def test_categories_add_up_to_the_step(train_profile):
    p = train_profile
    assert p.clock == "cpu" and p.steps == 2 and len(p.step_times_s) == 2
    assert all(v >= 0 for v in p.categories.values())
    assert sum(p.categories.values()) == pytest.approx(p.step_time_s, rel=0.05)
    assert {"matmul", "norm", "pointwise"} <= set(p.categories)
    assert sum(p.shares.values()) == pytest.approx(1.0, rel=0.05)
    assert p.top_ops and p.top_ops[0].share >= p.top_ops[-1].share
    assert any(o.name == "aten::native_layer_norm" and o.category == "norm" for o in p.top_ops)
    assert any("[8, 64]" in o.shapes for o in p.top_ops)  # shapes were recorded


def test_all_matmul_model_is_matmul_dominant():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    p = profile(m, torch.randn(64, 256), FAST)
    assert max(p.categories, key=p.categories.get) == "matmul"
    assert p.shares["matmul"] > 0.5, p.summary()
    assert set(p.flops_by_category) == {"matmul"}


@pytest.mark.parametrize("b,i,o", [(8, 64, 32), (5, 37, 23)])
def test_linear_flops_are_the_hand_count(b, i, o):
    m = nn.Linear(i, o, bias=False)
    p = profile(m, torch.randn(b, i), FAST)
    assert p.flops == 2 * b * i * o
    assert p.achieved_flops == pytest.approx(p.flops / p.step_time_s)


def test_mfu_against_a_given_peak():
    p = profile(nn.Linear(32, 32), torch.randn(4, 32), ProfileConfig(warmup=1, steps=1, peak_flops=1e9, monitor=False))
    assert p.peak_source == "given" and p.mfu == pytest.approx(p.achieved_flops / 1e9)
    q = profile(nn.Linear(32, 32), torch.randn(4, 32), FAST)
    assert q.mfu is None and "measure_peak=False" in q.peak_source and "MFU: unavailable" in q.summary()


def test_step_fn_form_and_memory(train_profile):
    calls = []
    x = torch.randn(16, 16)
    p = profile(lambda: calls.append(x @ x), warmup=2, steps=3, config=FAST)
    # warm-up, recorded, the unprofiled steps it is checked against, and the one FLOP/memory counting step
    assert len(calls) == 2 + 3 + FAST.unprofiled_steps + 1 and len(p.unprofiled_step_times_s) == FAST.unprofiled_steps
    assert p.flops == 2 * 16 ** 3 and p.warmup == 2 and p.steps == 3
    assert train_profile.memory["peak_bytes"] > 0
    assert train_profile.memory["by_category"]["gradients"] > 0  # train=True ran backward


def test_device_clock_split_counts_idle_and_overlap():
    # two kernels on one stream, 40 us of the 100 us step without one; ops launched them
    s = split_steps([_Step(0.0, 100.0)], [OpRecord("aten::mm", 1.0, 5.0, 30.0), OpRecord("aten::add", 6.0, 2.0, 30.0),
                                          OpRecord("aten::mm", 150.0, 5.0, 30.0)],  # next step's op
                    [(10.0, 40.0), (70.0, 100.0), (150.0, 180.0)])[0]
    assert len(s.ops) == 2 and len(s.kernels) == 2
    cats = step_categories(s, device_clock=True)
    assert cats == pytest.approx({"matmul": 30.0, "pointwise": 30.0, "device_idle": 40.0})
    # the same kernels overlapping on two streams: 50 us busy, op shares scaled onto it
    s2 = split_steps([_Step(0.0, 100.0)], s.ops, [(10.0, 40.0), (20.0, 60.0)])[0]
    c2 = step_categories(s2, device_clock=True)
    assert sum(c2.values()) == pytest.approx(100.0) and c2["device_idle"] == pytest.approx(50.0)


def test_json_round_trip_and_report(train_profile, tmp_path):
    path = train_profile.save(tmp_path)
    assert {f.name for f in tmp_path.iterdir()} >= {"report.html", "profile.json", "trace.json",
                                                     "categories.png", "top_ops.png"}
    assert Profile.load(tmp_path) == train_profile
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(str(e.get("name", "")).startswith("ProfilerStep") for e in trace["traceEvents"])
    text = path.read_text()
    for sec in SECTIONS:
        assert f'id="{sec}"' in text
    assert text.count("data:image/png;base64,") == 3  # categories, top ops, op durations
    assert "http://" not in text.replace("ui.perfetto.dev", "") and "https://" not in text  # self-contained


def test_bad_input():
    with pytest.raises(InputError, match="expected a step function"):
        profile(42)
    with pytest.raises(InputError, match="no example_inputs"):
        profile(nn.Linear(2, 2))
    with pytest.raises(InputError, match="steps: received 0"):
        ProfileConfig(steps=0)

    def broken() -> None:
        raise RuntimeError("shape mismatch in layer 3")

    with pytest.raises(InputError, match="profiled step raised RuntimeError.*shape mismatch in layer 3"):
        profile(broken, config=FAST)


def test_bad_profile_files(tmp_path):
    (tmp_path / "profile.json").write_text('{"categories": {"matmul"')
    with pytest.raises(ArtifactError, match="truncated"):
        Profile.load(tmp_path)
    (tmp_path / "profile.json").write_text(json.dumps({"categories": {}, "version": 99}))
    with pytest.raises(ArtifactError, match="version 99"):
        Profile.load(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        Profile.load(tmp_path / "missing.json")


def test_torchnitro_profile_is_callable_whatever_was_imported_first():
    importlib.import_module("torchnitro.profile.categories")
    assert callable(torchnitro.profile) and torchnitro.profile.Profile is Profile
    p = torchnitro.profile(lambda: None, config=ProfileConfig(warmup=1, steps=1, count_flops=False,
                                                               track_memory=False, monitor=False))
    assert p.flops is None and "unattributed" in p.categories


def test_temp_trace_is_removed_on_error_and_with_the_profile(tmp_path, monkeypatch):
    import gc
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken() -> None:
        raise ValueError("boom")

    with pytest.raises(InputError):
        profile(broken, config=FAST)
    assert list(tmp_path.glob("torchnitro-trace-*")) == []
    p = profile(lambda: torch.ones(4) * 2, config=FAST)
    trace = p.trace_path
    assert trace is not None and trace.startswith(str(tmp_path))
    del p
    gc.collect()
    assert list(tmp_path.glob("torchnitro-trace-*")) == []


def test_model_dtype_picks_the_peak_and_train_needs_a_model():
    m = nn.Linear(16, 16).to(torch.bfloat16)
    p = profile(m, torch.randn(4, 16, dtype=torch.bfloat16), ProfileConfig(warmup=1, steps=1, monitor=False,
                                                                            measure_peak=False))
    assert p.flops == 2 * 4 * 16 * 16
    from torchnitro.profile.peak import probe_for

    with pytest.warns(UserWarning, match="MFU is unavailable"):  # no GEMM to time in int8: a warning, no peak
        assert probe_for(ProfileConfig(dtype="int8"), "cpu") is None
    with pytest.raises(InputError, match="train=True"):
        profile(lambda: None, train=True, config=FAST)


def _synthetic(categories: dict[str, float], clock: str = "device", **kw) -> Profile:
    total = sum(categories.values())
    return Profile(device="test", clock=clock, warmup=1, steps=1, step_time_s=total, step_times_s=[total],
                   categories=categories, **kw)


def test_findings_point_to_a_recipe():
    from torchnitro.profile.result import findings

    idle = findings(_synthetic({"matmul": 0.004, "device_idle": 0.006}))
    assert len(idle) == 1 and "device idle 60%" in idle[0] and "cuda-graphs" in idle[0]
    norm = findings(_synthetic({"matmul": 0.008, "norm": 0.002}, clock="cpu"))
    assert len(norm) == 1 and "normalisation takes 20%" in norm[0] and "fused-kernels" in norm[0]
    slow_gemm = _synthetic({"matmul": 0.9, "cpu_overhead": 0.1}, clock="cpu", flops=10**9, peak_flops=1e11)
    assert any("MFU is 1%" in f for f in findings(slow_gemm))
    assert findings(_synthetic({"matmul": 0.9, "cpu_overhead": 0.1}, clock="cpu")) == []
    assert "(10% of peak)" in _synthetic({"matmul": 1.0}, flops=10**9, flops_by_category={"matmul": 10**9},
                                         peak_flops=1e10).summary()
