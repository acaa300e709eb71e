"""Reading XLA's buffer-assignment dumps: allocations per memory space, live peaks, aliased slots."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import jax.numpy as jnp  # noqa: E402

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.xla.dump import read_buffer_dump, read_schedule  # noqa: E402

# the shape of libtpu's dump: an HBM temp allocation (color 0) and a VMEM one (color 1); a.1 and b.2 share
# offset 0 with overlapping ranges (one buffer updated in place), c.3 lives after them at the same offset
BUFFERS = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[1024]| at ShapeIndex {}, maybe-live-out:
 value: <1 param @0> (size=4096,offset=0): f32[1024]{0}
allocation 1: size 3000, preallocated-temp:
 value: <2 a.1 @0> (size=1000,offset=0): f32[250]{0}
 value: <3 b.2 @0> (size=1000,offset=0): f32[250]{0}
 value: <4 c.3 @0> (size=500,offset=0): f32[125]{0}
 value: <5 d.4 @0> (size=1000,offset=2000): f32[250]{0}
allocation 2: size 512, color 1, preallocated-temp:
 value: <6 e.5 @1> (size=512,offset=0): f32[128]{0:S(1)}
"""
RANGES = """HloLiveRange (max 9):
  BufferLiveRange:
    param{}:0-9
    a.1{}:1-3
    b.2{}:3-4
    c.3{}:5-6
    d.4{}:2-6
    e.5{}:2-2
  Live ranges at 2 (peak):
    param{}: 4096 bytes (cumulative: 4096 bytes)
    a.1{}: 1000 bytes (cumulative: 5096 bytes)
    d.4{}: 1000 bytes (cumulative: 6096 bytes)
    e.5{}: 512 bytes (cumulative: 6608 bytes)
"""


def _write(tmp_path, stem="module_0001.jit_step.cl_1"):
    (tmp_path / f"{stem}.after_optimizations-buffer-assignment.txt").write_text(BUFFERS)
    (tmp_path / f"{stem}.after_optimizations-live-range.txt").write_text(RANGES)


def test_allocations_live_peak_and_aliased_slots(tmp_path):
    _write(tmp_path)
    d = read_buffer_dump(str(tmp_path))
    assert d.module == "module_0001.jit_step.cl_1"
    assert d.temp_by_color == {0: 3000, 1: 512}
    assert d.live_peak_by_color == {0: 2000, 1: 512}  # the parameter is not temp
    assert d.peak_step == 2
    # a.1 and b.2 are one 1000-byte buffer over 1-4, beside d.4 (2-6): 2000 at 2-4, then c.3 + d.4 = 1500;
    # summing the two aliased values would give 3000 at step 3
    assert d.values_peak_by_color == {0: 2000, 1: 512}


def test_without_live_ranges_only_allocations(tmp_path):
    (tmp_path / "module_0001.jit_step.after_optimizations-buffer-assignment.txt").write_text(BUFFERS)
    d = read_buffer_dump(str(tmp_path))
    assert d.temp_by_color == {0: 3000, 1: 512} and d.live_peak_by_color == {} and d.peak_step == -1


def test_missing_dump_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="xla_dump_to"):
        read_buffer_dump(str(tmp_path))


def test_host_compile_temp_is_the_preallocated_temp_allocation(tmp_path):
    # on the CPU backend memory_analysis().temp is exactly the temp allocation XLA dumps (on a TPU it is not:
    # results/xla_tpu_quick_buffers.md)
    def f(x, w):
        h = jnp.tanh(x @ w)  # (256, 128)
        return (h @ w.T).sum() + (h * h).sum()

    x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    c = jax.jit(f).lower(x, w).compile(compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
    d = read_buffer_dump(str(tmp_path), module="jit_f")
    assert d.temp_by_color[0] == c.memory_analysis().temp_size_in_bytes
    assert 256 * 128 * 4 <= d.live_peak_by_color[0] <= d.temp_by_color[0]


# a scheduled entry computation as libtpu prints it: a gradient matmul run as a while loop (a collective
# matmul) after the peak, a combined gradient all-reduce, and an async copy whose source is a remat product
HLO = """HloModule jit_step, is_scheduled=true

%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
}

ENTRY %main (param: f32[1024]) -> f32[1024] {
  %param = f32[1024]{0} parameter(0), metadata={op_name="params['w']"}
  %fusion.1 = bf16[250]{0} fusion(%param), kind=kLoop, calls=%body, metadata={op_name="jit(step)/transpose(jvp())/checkpoint/rematted_computation/mul"}
  %copy-start = (bf16[250]{0}, bf16[250]{0:S(1)}, u32[]{:S(2)}) copy-start(%fusion.1)
  %all-reduce.3 = (f32[256]{0}, f32[128]{0}) all-reduce(%fusion.1, %param), metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %while.4 = (f32[8]{0}) while(%param), body=%body, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %while.5 = (f32[8]{0}) while(%param), body=%body, metadata={op_name="jit(step)/jvp()/dot_general"}
  %all-gather.6 = bf16[4096]{0} all-gather(%fusion.1), dimensions={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
}
"""
SCHEDULE = """HloLiveRange (max 6):
  InstructionSequence:
    0:param
    1:fusion.1
    2:copy-start
    3:all-reduce.3
    4:while.4
    5:while.5
  BufferLiveRange:
    param{}:0-6
    fusion.1{}:1-2
    copy-start{0}:2-5
  Live ranges at 2 (peak):
    param{}: 4096 bytes (cumulative: 4096 bytes)
    copy-start{0}: 500 bytes (cumulative: 4596 bytes)
    fusion.1{}: 500 bytes (cumulative: 5096 bytes)
"""


def test_schedule_names_the_peaks_sources_and_the_gradient_sync(tmp_path):
    stem = "module_0001.jit_step.cl_1"
    _write(tmp_path, stem)
    (tmp_path / f"{stem}.after_optimizations-live-range.txt").write_text(SCHEDULE)
    (tmp_path / f"{stem}.after_optimizations.txt").write_text(HLO)
    s = read_schedule(str(tmp_path))
    assert (s.length, s.peak_step) == (6, 2)
    by_name = {v.name: v for v in s.peak}
    # the async copy is named by the value it copies; the parameter keeps its own name
    assert by_name["copy-start{0}"].source.endswith("rematted_computation/mul")
    assert (by_name["copy-start{0}"].first, by_name["copy-start{0}"].last) == (2, 5)
    assert by_name["param{}"].source == "params['w']"
    assert s.grad_all_reduces == ((3, 256 * 4 + 128 * 4),)
    assert s.grad_loops == (4,)  # the forward's while loop (position 5) is not a gradient matmul
    assert s.gathers == {"bf16 dot_general": 1}


def test_schedule_without_the_optimised_hlo_names_the_flag(tmp_path):
    _write(tmp_path)
    with pytest.raises(ConfigError, match="xla_dump_hlo_as_text"):
        read_schedule(str(tmp_path))
