"""The CUDA C++ four-step FFT bind kernel: its algorithm in NumPy on the CPU, the NVRTC build on a GPU."""

import numpy as np
import pytest
import torch

from torchnitro import hrr
from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import cuda_fft

DIMS = [256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_schedules_are_the_dft(n):
    """The butterfly schedules that generate the CUDA code: DIF gives the DFT in bit-reversed order,
    DIT takes bit-reversed input back to natural order (forward and inverse twiddles)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    rev = [cuda_fft._bitrev(i, n.bit_length() - 1) for i in range(n)]
    y = x.copy()
    cuda_fft._np_dif(y, n, inverse=False)
    np.testing.assert_allclose(y, np.fft.fft(x)[rev], atol=1e-12)
    z = y.copy()
    cuda_fft._np_dit(z, n, inverse=True)
    np.testing.assert_allclose(z / n, x, atol=1e-12)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("conj_b", [False, True])
def test_reference_model_binds(d, conj_b):
    """The kernel's data movement (lanes, registers, the shared-memory tile, per-row scaling) in float64
    NumPy equals numpy.fft's bind/unbind, rows of very different norms and a zero row included."""
    rng = np.random.default_rng(d + conj_b)
    a = rng.standard_normal((5, d))
    b = rng.standard_normal((5, d)) * np.logspace(-3, 3, 5)[:, None]
    b[2] = 0
    spec_b = np.fft.rfft(b)
    want = np.fft.irfft(np.fft.rfft(a) * (np.conj(spec_b) if conj_b else spec_b), n=d)
    got = cuda_fft.reference_bind(a, b, conj_b=conj_b)
    np.testing.assert_allclose(got, want, atol=1e-9 * np.abs(want).max())
    assert (got[2] == 0).all()


@pytest.mark.parametrize("d", DIMS)
def test_twiddle_tables(d):
    """Each lane's forward and inverse twiddles at the offsets the kernel reads them from."""
    t_lanes, p, q, _ = cuda_fft._layout(d)
    fwd, inv = cuda_fft.twiddle_tables(d)
    assert fwd.shape == inv.shape == (t_lanes, p)
    w = np.exp(-2j * np.pi / d)
    k1 = [cuda_fft._bitrev(r, p.bit_length() - 1) for r in range(p)]
    for lane in (0, 1, t_lanes - 1):
        np.testing.assert_allclose(fwd[lane], [w ** (lane * k) for k in k1], atol=1e-12)
        np.testing.assert_allclose(inv[lane], [np.conj(w ** (tt * (lane + t_lanes * qq)))
                                               for qq in range(q) for tt in range(t_lanes)], atol=1e-12)


@pytest.mark.parametrize("d", DIMS)
def test_gpu_twiddle_layout_matches_the_kernels_reads(d):
    """The float32 table sent to the GPU, read the way the generated code reads it (float4 entry
    ``(r / 2) T + t`` from the forward base and from ``D / 2`` on for the inverse), gives each lane's
    twiddles."""
    t_lanes, p, _, _ = cuda_fft._layout(d)
    fwd, inv = cuda_fft.twiddle_tables(d)
    tw = cuda_fft._twiddles(d, torch.device("cpu")).double().numpy()
    c = tw[:, 0] + 1j * tw[:, 1]
    src = cuda_fft.kernel_source(d, False, False)[0]
    assert "__ldg(twf + 1 * T)" in src and "twi + (i / 2) * T" in src and "tw + (D / 2) + t" in src
    for lane in range(t_lanes):
        np.testing.assert_allclose([c[2 * ((r // 2) * t_lanes + lane) + r % 2] for r in range(p)], fwd[lane], atol=1e-6)
        np.testing.assert_allclose([c[d + 2 * ((r // 2) * t_lanes + lane) + r % 2] for r in range(p)], inv[lane],
                                   atol=1e-6)


@pytest.mark.parametrize("d", DIMS)
def test_layout_fits_a_block(d):
    t, p, q, rows = cuda_fft._layout(d)
    assert t * p == d and p % t == 0 and q == p // t and t in (16, 32, 64)
    assert rows * p * (t + 1) * 8 <= cuda_fft.SMEM_LIMIT and rows * t <= cuda_fft.BLOCK_THREADS
    src, name, threads, rows2 = cuda_fft.kernel_source(d, conj_b=True, normalize=True)
    assert name in src and threads == rows * t and rows2 == rows
    assert "bp - T * j" in src and "bp + T * j" not in src  # the reversed read of unbind
    assert "bp + T * j" in cuda_fft.kernel_source(d, False, False)[0]
    assert "__shfl_xor_sync(0xffffffffu, ss, o)" in src  # the unit-norm epilogue
    assert "__shfl_xor_sync(0xffffffffu, ss, o)" not in cuda_fft.kernel_source(d, False, False)[0]


def test_cpu_tensors_are_refused_with_the_reason():
    a = torch.randn(4, 1024)
    assert "needs CUDA" in cuda_fft.cuda_bind_reason(a)
    with pytest.raises(InputError, match="needs CUDA"):
        cuda_fft.cuda_bind(a, a)
    with pytest.raises(ShapeError, match=r"received shapes \(4, 1024\) and \(1, 1024\)"):
        cuda_fft.cuda_bind(a, a[:1])


# --------------------------------------------------------------------------------------------- GPU

def _cuda_ok():
    return torch.cuda.is_available() and cuda_fft.cuda_bind_reason(torch.empty(1, 1024, device="cuda")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
def test_cuda_kernel_matches_torch_fft(d):
    """Every supported d: bind and unbind within 1e-5 of torch.fft, rows that are not a multiple of the
    rows per block, 3-D batches, a strided slice, norms spanning 1e6, a zero row, NaN and inf rows kept
    in their own rows, and the unit-norm epilogue."""
    if not _cuda_ok():
        pytest.skip(f"NVRTC build unavailable: {cuda_fft.cuda_bind_reason(torch.empty(1, d, device='cuda'))}")
    g = torch.Generator().manual_seed(d)
    a, b = (x.cuda() for x in hrr.random((2, 3001), d, generator=g))
    torch.testing.assert_close(cuda_fft.cuda_bind(a, b), hrr.bind(a, b, backend="torch"), atol=1e-5, rtol=0)
    torch.testing.assert_close(cuda_fft.cuda_bind(a, b, conj_b=True), hrr.unbind(a, b, backend="torch"),
                               atol=1e-5, rtol=0)
    a3, b3 = a[:21].reshape(3, 7, d), b[:21].reshape(3, 7, d)
    torch.testing.assert_close(cuda_fft.cuda_bind(a3, b3), hrr.bind(a3, b3, backend="torch"), atol=1e-5, rtol=0)
    wide = torch.randn(9, 2 * d, device="cuda", generator=None)
    sa, sb = wide[:, :d], wide[:, d // 2:d // 2 + d]
    torch.testing.assert_close(cuda_fft.cuda_bind(sa, sb), hrr.bind(sa, sb, backend="torch"), atol=1e-4, rtol=1e-5)
    scale = torch.logspace(-3, 3, a.shape[0], device="cuda")[:, None]
    bs = b * scale
    bs[7] = 0
    out = cuda_fft.cuda_bind(a, bs)
    assert bool((out[7] == 0).all())
    torch.testing.assert_close(out / scale, hrr.bind(a, bs, backend="torch") / scale, atol=1e-5, rtol=0)
    bad = b[:6].clone()
    bad[1, 3] = float("nan")
    bad[4, 0] = float("inf")
    out = cuda_fft.cuda_bind(a[:6], bad)
    assert bool(out[1].isnan().all()) and bool(out[4].isnan().all())
    keep = [0, 2, 3, 5]
    torch.testing.assert_close(out[keep], hrr.bind(a[keep], b[keep], backend="torch"), atol=1e-5, rtol=0)
    ref_n = hrr.normalize(hrr.bind(a, b, backend="torch"))
    torch.testing.assert_close(cuda_fft.cuda_bind(a, b, normalize=True), ref_n, atol=1e-5, rtol=0)
    assert cuda_fft.cuda_bind(a[:0], b[:0]).shape == (0, d)
    torch.testing.assert_close(cuda_fft.cuda_bind(a, b).cpu(), hrr.bind(a.cpu(), b.cpu()), atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_public_entry_points_take_the_cuda_kernel(monkeypatch):
    """hrr.bind / unbind / bind_normalize under "auto" (and backend="cuda") run the CUDA kernel on a large
    float32 CUDA batch, with torch.fft's results."""
    if not _cuda_ok():
        pytest.skip(f"NVRTC build unavailable: {cuda_fft.cuda_bind_reason(torch.empty(1, 1024, device='cuda'))}")
    from torchnitro.hrr import fused

    seen = []
    real = cuda_fft.cuda_bind
    monkeypatch.setattr(cuda_fft, "cuda_bind", lambda *a, **k: seen.append(k) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    a, b = (x.cuda() for x in hrr.random((2, 1000), 1024, generator=g))
    torch.testing.assert_close(hrr.bind(a, b), hrr.bind(a, b, backend="torch"), atol=1e-5, rtol=0)
    torch.testing.assert_close(hrr.unbind(a, b), hrr.unbind(a, b, backend="torch"), atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.bind_normalize(a, b), hrr.normalize(hrr.bind(a, b, backend="torch")),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(hrr.bind(a[:3], b[:3], backend="cuda"), hrr.bind(a[:3], b[:3], backend="torch"),
                               atol=1e-5, rtol=0)
    assert [(k["conj_b"], k["normalize"]) for k in seen] == [(False, False), (True, False), (False, True), (False, False)]


# ------------------------------------------------------------------------------------ dispatch (CPU)

class _FakeCuda:
    """Stands in for a CUDA float32 tensor in the dispatch rules (no kernel runs)."""

    is_cuda = True
    dtype = torch.float32
    requires_grad = False

    def __init__(self, rows, d):
        self.shape = (rows, d)

    def numel(self):
        return self.shape[0] * self.shape[1]


@pytest.fixture
def kernels(monkeypatch):
    """Both GPU kernels replaced by recorders; returns the list of (kernel, d, conj_b, normalize) calls."""
    import torchnitro.hrr.fft_kernel as fk
    from torchnitro.hrr import backend

    calls = []
    monkeypatch.setattr(backend.HEALTH, "cuda", None)
    monkeypatch.setattr(cuda_fft, "cuda_bind_reason",
                        lambda x: None if cuda_fft.MIN_D <= x.shape[-1] <= cuda_fft.MAX_D else "d out of range")
    monkeypatch.setattr(fk, "fft_bind_reason", lambda x: None)

    def rec(name):
        return lambda x, y, conj_b=False, normalize=False: calls.append((name, x.shape[-1], conj_b, normalize)) or name
    monkeypatch.setattr(cuda_fft, "cuda_bind", rec("cuda"))
    monkeypatch.setattr(fk, "fft_bind", rec("triton"))
    return calls


def test_auto_prefers_the_cuda_kernel_then_triton(kernels):
    from torchnitro.hrr import backend as ops

    rows = ops.FFT_KERNEL_MIN_ROWS
    for d, want in [(256, "cuda"), (1024, "cuda"), (4096, "cuda"), (8192, "triton"), (128, None)]:
        x = _FakeCuda(rows, d)
        assert ops.one_pass(x, x, "auto", conj_b=False) == want, d
    small = _FakeCuda(ops.CUDA_KERNEL_MIN_ROWS, 1024)  # one launch beats torch.fft's four at any batch
    assert ops.one_pass(small, small, "auto", conj_b=False) == "cuda"
    few = _FakeCuda(rows - 1, 8192)  # the Triton kernel keeps its row threshold
    assert ops.one_pass(few, few, "auto", conj_b=False) is None
    assert ops.one_pass(_FakeCuda(0, 1024), _FakeCuda(0, 1024), "auto", conj_b=False) is None  # empty: torch
    x = _FakeCuda(8, 1024)  # explicit backends ignore the row threshold
    assert ops.one_pass(x, x, "cuda", conj_b=True, normalize=True) == "cuda"
    assert ops.one_pass(x, x, "triton", conj_b=True) == "triton"
    assert kernels[-2:] == [("cuda", 1024, True, True), ("triton", 1024, True, False)]
    with pytest.raises(BackendUnavailableError, match="backend='cuda': d out of range"):
        ops.one_pass(_FakeCuda(8, 8192), _FakeCuda(8, 8192), "cuda", conj_b=False)
    with pytest.raises(InputError, match="received 'cufft'"):
        ops.one_pass(x, x, "cufft", conj_b=False)


def test_a_failed_build_warns_once_and_falls_back_to_triton(kernels, monkeypatch):
    from torchnitro.hrr import backend as ops

    def broken(*args, **kwargs):
        raise BackendUnavailableError("hrr.cuda_fft: building the d=1024 kernel failed: no NVRTC")
    monkeypatch.setattr(cuda_fft, "cuda_bind", broken)
    x = _FakeCuda(ops.FFT_KERNEL_MIN_ROWS, 1024)
    with pytest.warns(UserWarning, match="no NVRTC"):
        assert ops.one_pass(x, x, "auto", conj_b=False) == "triton"
    assert ops.one_pass(x, x, "auto", conj_b=False) == "triton"  # no second try, no second warning
    with pytest.raises(BackendUnavailableError, match="no NVRTC"):
        ops.one_pass(x, x, "cuda", conj_b=False)  # asked for explicitly: the error, not a fallback


@pytest.mark.parametrize("d", DIMS)
def test_launch_candidates_build_valid_sources(d):
    """Every layout the device may pick is a valid layout, the first is the default, none repeats."""
    cands = cuda_fft.launch_candidates(d)
    assert cands[0]["rows"] == cuda_fft._layout(d)[3] and cands[0]["min_blocks"] is None
    assert len({(c["rows"], c["min_blocks"]) for c in cands}) == len(cands) > 1
    for c in cands:
        src, name, threads, rows = cuda_fft.kernel_source(d, False, True, c["rows"], c["min_blocks"])
        assert rows == c["rows"] and threads % 32 == 0 and name in src


@pytest.mark.gpu
@pytest.mark.parametrize("d", [2048, 4096])
def test_every_launch_candidate_binds_correctly(d):
    if not _cuda_ok():
        pytest.skip(f"NVRTC build unavailable: {cuda_fft.cuda_bind_reason(torch.empty(1, d, device='cuda'))}")
    g = torch.Generator().manual_seed(d)
    a, b = (x.cuda() for x in hrr.random((2, 301), d, generator=g))
    want = hrr.bind(a, b, backend="torch")
    for c in cuda_fft.launch_candidates(d):
        got = cuda_fft.cuda_bind(a, b, rows_per_block=c["rows"], min_blocks=c["min_blocks"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{c}: {m}")
