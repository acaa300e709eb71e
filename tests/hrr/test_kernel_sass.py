"""benchmarks/kernel_sass.py: the FFT bind kernel compiles for sm_90 on a machine without a GPU, and
the instruction counts it reports are those of real machine code."""

from pathlib import Path

import pytest
from _bench import load_benchmark


def _tool():
    return load_benchmark("kernel_sass")


def test_counts_sass_of_the_fft_kernel_without_a_gpu(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton", reason="Triton is not installed")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip(f"this Triton build has no bundled ptxas/cuobjdump under {tools}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    tool = _tool()
    kernel = tool._load_kernel(None)
    bind = tool._sass_counts(kernel, 16, 1, 1, False, 90, tmp_path)
    unbind = tool._sass_counts(kernel, 16, 1, 1, True, 90, tmp_path)
    for c in (bind, unbind):
        ops = c["ops"]
        # two 4-stage complex FFTs spread over 32 threads: butterflies, twiddle products, exchanges
        assert ops["FADD"] >= 8 and ops["FFMA"] + ops["FMUL"] >= 8 and ops["SHFL"] >= 1, ops
        assert ops["STG"] >= 1 and ops["EXIT"] >= 1, ops
        assert c["total"] == sum(ops.values()) and 0 < c["regs"] <= 255
    # a wider row needs more instructions per thread on the same single warp
    wide = tool._sass_counts(kernel, 64, 1, 1, False, 90, tmp_path)
    assert wide["total"] > bind["total"]


def test_counts_sass_of_the_cuda_kernel_without_a_gpu(tmp_path):
    """--cuda: hrr.cuda_fft's generated source builds with NVRTC for sm_90 and its machine code has the
    two shared-memory transposes, no spills, and more work at a larger d. Needs libnvrtc
    (nvidia-cuda-nvrtc wheel or TORCHNITRO_NVRTC), which CI does not install."""
    tool = _tool()
    try:
        tool._nvrtc()
    except RuntimeError as exc:
        if not str(exc).startswith("no libnvrtc found"):
            raise  # only a missing library is a reason to skip; any other failure is a test failure
        pytest.skip(str(exc))
    pytest.importorskip("triton", reason="Triton is not installed (its bundled cuobjdump)")
    small = tool._cuda_sass_counts(256, False, False, 90, tmp_path)
    big = tool._cuda_sass_counts(1024, True, True, 90, tmp_path)
    for c in (small, big):
        ops = c["ops"]
        assert ops["STS"] >= 2 * 16 and ops["LDS"] >= 2 * 16, ops  # each lane's P values, out and back
        assert ops["STL"] + ops["LDL"] == 0 and ops["SHFL"] >= 4, ops  # no spills; the per-row max
        assert c["total"] == sum(ops.values()) and 0 < c["regs"] <= 255
    assert big["total"] * big["threads"] // big["rows"] > small["total"] * small["threads"] // small["rows"]
