"""The native varlen CPU attention (kernels/cpu_attention.c via ctypes): matches SDPA per sequence, checks its
inputs, shares torch's OpenMP runtime, and says why where it cannot be built."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from torchnitro.kernels import cpu_attention as ca

pytestmark = pytest.mark.skipif(shutil.which(ca.COMPILER) is None,
                                reason=f"no C compiler ({ca.COMPILER!r} not on PATH): the kernel cannot be built")
LENGTHS = [1, 7, 128, 129, 300]
TOL = {"fp32": 1e-5, "bf16": 2e-2}  # relative (Frobenius) difference from fp32 SDPA on the same inputs


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The kernel, compiled once for this module into a private cache directory."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path_factory.mktemp("tn_cache")))
    ca._state.clear()
    k = ca.load_kernel()
    assert k is not None, ca.cpu_attention_reason()
    yield k
    mp.undo()


def _reference(qkv: torch.Tensor, cu: torch.Tensor, heads: int) -> torch.Tensor:
    """fp32 SDPA per sequence (no mask: each sequence alone)."""
    n, d = qkv.shape[0], qkv.shape[1] // 3
    out = torch.zeros(n, d)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            q, k, v = qkv[s:e].float().view(e - s, 3, heads, d // heads).permute(1, 2, 0, 3)  # 3 x (H, L, Dh)
            out[s:e] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(e - s, d)
    return out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("heads,head_dim", [(12, 32), (12, 64), (1, 48), (2, 20)])
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_varlen_matches_sdpa_per_sequence(kernel, heads, head_dim, compute):
    torch.manual_seed(0)
    lens = LENGTHS + [0, 33]  # an empty sequence among them
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0))
    qkv = torch.randn(int(cu[-1]), 3 * heads * head_dim)
    out = ca.varlen_attention(qkv, cu, heads, compute=compute)
    assert out.shape == (qkv.shape[0], heads * head_dim) and out.dtype == torch.float32
    ref = _reference(qkv if compute == "fp32" else qkv.bfloat16(), cu, heads)  # bf16: the same rounded inputs
    assert _rel(out, ref) < TOL[compute]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):  # every sequence, the length-1 one included
        if e > s:
            assert _rel(out[s:e], ref[s:e]) < TOL[compute] * 2, (s, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_inputs_and_outputs(kernel, dtype):
    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 135], dtype=torch.int32)  # int32 offsets too
    qkv = torch.randn(135, 3 * 4 * 32).to(dtype)
    out = ca.varlen_attention(qkv, cu, 4, compute="bf16", out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(qkv.bfloat16(), cu.long(), 4)) < TOL["bf16"]


def test_a_row_stride_wider_than_the_row_is_read_as_rows(kernel):
    torch.manual_seed(2)
    wide = torch.randn(50, 3 * 64 + 5)
    qkv = wide[:, : 3 * 64]  # stride (197, 1): rows contiguous, not the whole tensor
    cu = torch.tensor([0, 20, 50])
    assert _rel(ca.varlen_attention(qkv, cu, 2), _reference(qkv.contiguous(), cu, 2)) < TOL["fp32"]


def test_no_rows_give_an_empty_output(kernel):
    out = ca.varlen_attention(torch.empty(0, 96), torch.zeros(3, dtype=torch.long), 1)
    assert out.shape == (0, 32)


def test_thread_counts_agree(kernel):
    torch.manual_seed(3)
    cu = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0))
    qkv = torch.randn(int(cu[-1]), 3 * 12 * 32)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ca.varlen_attention(qkv, cu, 12, compute="bf16")
        torch.set_num_threads(max(2, prev))
        many = ca.varlen_attention(qkv, cu, 12, compute="bf16")
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, many)  # each (sequence, head) is computed by one thread, the same way


def test_one_openmp_runtime_in_the_process(kernel):
    """The kernel adds no OpenMP runtime of its own: in a fresh interpreter (this test process may have loaded
    another library's libgomp before, which says nothing about the kernel) torch's parallel regions and the
    kernel run on one libgomp. The kernel is already built in this cache directory, so the child only loads it."""
    code = ("import torch; from torchnitro.kernels import cpu_attention as ca; "
            "torch.set_num_threads(torch.get_num_threads()); torch.randn(64, 64) @ torch.randn(64, 64); "
            "ca.varlen_attention(torch.randn(8, 96), torch.tensor([0, 8]), 1); print(repr(ca.loaded_libgomp()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCHNITRO_CACHE_DIR": os.environ["TORCHNITRO_CACHE_DIR"]})
    assert out.returncode == 0, out.stderr[-2000:]
    gomp = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(gomp) <= 1, f"two OpenMP runtimes loaded: {gomp}"


@pytest.mark.parametrize("call,match", [
    (lambda: ca.varlen_attention(torch.randn(4, 96, 1), torch.tensor([0, 4]), 1), r"2-D \(N, 3D\).*\(4, 96, 1\)"),
    (lambda: ca.varlen_attention(torch.randn(4, 96).half(), torch.tensor([0, 4]), 1), r"float32 or bfloat16.*float16"),
    (lambda: ca.varlen_attention(torch.randn(96, 4).t(), torch.tensor([0, 4]), 1), r"contiguous.*\(1, 4\)"),
    (lambda: ca.varlen_attention(torch.randn(4, 96), torch.tensor([0, 3]), 1), r"end at N = 4.*0 \.\. 3"),
    (lambda: ca.varlen_attention(torch.randn(4, 96), torch.tensor([0, 3, 2, 4]), 1), r"never decrease"),
    (lambda: ca.varlen_attention(torch.randn(4, 96), torch.tensor([0.0, 4.0]), 1), r"int32/int64.*torch.float32"),
    (lambda: ca.varlen_attention(torch.randn(4, 96), torch.tensor([0, 4]), 5), r"3 \* n_heads.*n_heads=5"),
    (lambda: ca.varlen_attention(torch.randn(4, 96), torch.tensor([0, 4]), 1, compute="int8"),
     r"'fp32' or 'bf16'.*'int8'"),
])
def test_bad_input_is_named(kernel, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_missing_compiler_says_why_and_callers_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ca, "COMPILER", "no-such-cc-torchnitro")
    try:
        assert ca.load_kernel() is None
        why = ca.cpu_attention_reason()
        assert why is not None and "no-such-cc-torchnitro" in why and "\n" not in why
        with pytest.raises(RuntimeError, match="no-such-cc-torchnitro"):
            ca.varlen_attention(torch.randn(4, 96), torch.tensor([0, 4]), 1)
    finally:
        monkeypatch.undo()
        ca._state.clear()  # the next caller builds (or finds in its cache) the real kernel again


def test_a_failing_build_says_why(monkeypatch, tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: error: unsupported target' >&2\nexit 3\n")
    bad.chmod(0o755)
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ca, "COMPILER", str(bad))
    try:
        assert ca.load_kernel() is None
        assert "exited with 3: cc: error: unsupported target" in ca.cpu_attention_reason()
    finally:
        monkeypatch.undo()
        ca._state.clear()


def test_the_library_is_cached_by_source_compiler_and_cpu(kernel):
    assert kernel.path.parent.name == "kernels" and kernel.path.name.startswith("cpu_attention-")
    ca._state.clear()
    again = ca.load_kernel()  # from the disk cache: the same file, no rebuild
    assert again is not None and again.path == kernel.path


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="builds for baseline x86-64")
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_the_portable_path_matches_sdpa(monkeypatch, tmp_path, compute):
    """The #else path (no AVX512), as a CPU without it compiles the file: built here for baseline x86-64."""
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ca, "_FLAGS", ("-O3", "-march=x86-64", "-fPIC", "-std=c11"))
    ca._state.clear()
    try:
        assert ca.kernel_name(compute).startswith("native portable"), ca.kernel_name(compute)
        torch.manual_seed(4)
        cu = F.pad(torch.tensor([1, 7, 129, 0, 40]).cumsum(0), (1, 0))
        qkv = torch.randn(int(cu[-1]), 3 * 2 * 24)
        out = ca.varlen_attention(qkv, cu, 2, compute=compute)
        assert _rel(out, _reference(qkv if compute == "fp32" else qkv.bfloat16(), cu, 2)) < TOL[compute]
    finally:
        monkeypatch.undo()
        ca._state.clear()
