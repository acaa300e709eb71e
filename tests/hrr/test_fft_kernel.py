"""The one-pass FFT bind kernel against torch.fft (Triton interpreter on CPU, compiled on a GPU)."""

import pytest
import torch

from torchnitro import hrr
from tests.hrr._interpreted import run_interpreted
from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import backend
from torchnitro.hrr.fft_kernel import fft_bind, fft_bind_reason

_INTERPRETED = r"""
import torch
from torchnitro import hrr
from torchnitro.hrr.fft_kernel import fft_bind
g = torch.Generator().manual_seed(0)
for d in (16, 32, 128, 512):
    for lead in ((1,), (5,), (2, 3)):  # rows not a multiple of the rows per program, 3-D batches
        a, b = hrr.random((*lead,), d, generator=g), hrr.random((*lead,), d, generator=g)
        torch.testing.assert_close(fft_bind(a, b), hrr.bind(a, b, backend="torch"), atol=1e-6, rtol=0)
        torch.testing.assert_close(fft_bind(a, b, conj_b=True), hrr.unbind(a, b, backend="torch"), atol=1e-6, rtol=0)
# rows with a stride larger than d (a slice of a wider buffer), and the public entry points
wide = torch.randn(7, 96, generator=g)
a, b = wide[:, :64], wide[:, 32:96]
torch.testing.assert_close(hrr.bind(a, b, backend="triton"), hrr.bind(a, b, backend="torch"), atol=1e-5, rtol=0)
torch.testing.assert_close(hrr.unbind(a, b, backend="triton"), hrr.unbind(a, b, backend="torch"), atol=1e-5, rtol=0)
# rows whose norms differ by 1e6 keep their precision (the packed complex transform is scaled per row),
# a zero row gives exact zeros and a NaN or inf row stays in its own row
a, b = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None]
b[2] = 0
a[3, 5], b[4, 9] = float("nan"), float("inf")
out = fft_bind(a, b)
ref = torch.fft.irfft(torch.fft.rfft(a.double()) * torch.fft.rfft(b.double()), n=64)
assert bool((out[2] == 0).all()) and bool(out[3].isnan().all()) and bool(out[4].isnan().all())
keep = [0, 1, 5]
err = (out[keep].double() - ref[keep]).abs().amax(dim=1) / (a[keep].norm(dim=1) * b[keep].norm(dim=1)).double()
assert float(err.max()) < 1e-6, err
# normalize=True: unit rows in the same pass, ops.normalize's eps for a zero row
a, b = torch.randn(5, 128, generator=g), torch.randn(5, 128, generator=g)
b[1] = 0
for conj in (False, True):
    want = hrr.normalize(hrr.unbind(a, b, backend="torch") if conj else hrr.bind(a, b, backend="torch"))
    torch.testing.assert_close(fft_bind(a, b, conj_b=conj, normalize=True), want, atol=1e-6, rtol=0)
# the approximate inverse still recovers the filler
x, y = hrr.random((2,), 256, generator=g)
c = hrr.bind(x, y, backend="triton")
assert float(hrr.cosine(hrr.unbind(c, x, backend="triton"), y)) > 0.6
print("ok")
"""


def test_kernel_matches_torch_fft_interpreted():
    run_interpreted(_INTERPRETED)


def test_reasons_and_errors_name_what_was_received(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = torch.randn(4, 64)
    if not torch.cuda.is_available():
        assert "needs CUDA" in fft_bind_reason(a)
        with pytest.raises(BackendUnavailableError, match="backend='triton'.*needs CUDA"):
            hrr.bind(a, a, backend="triton")
    fake = type("T", (), {"shape": (4, 100), "dim": lambda self: 2, "is_cuda": True, "dtype": torch.float32})()
    if fft_bind_reason(torch.empty(0)) != "Triton is not importable":
        assert "power of two in [16, 4096]" in fft_bind_reason(fake)
    with pytest.raises(ShapeError, match=r"\(4, 64\) and \(1, 64\)"):
        fft_bind(a, a[:1])
    with pytest.raises(InputError, match="'cufft'"):
        hrr.bind(a, a, backend="cufft")
    with pytest.raises(BackendUnavailableError, match="runs method='involution' only"):
        hrr.unbind(a, a, method="exact", backend="triton")


def test_auto_keeps_small_batches_and_cpu_tensors_on_torch_fft(monkeypatch):
    calls = []
    import torchnitro.hrr.fft_kernel as fk

    monkeypatch.setattr(fk, "fft_bind", lambda *a, **k: calls.append(1))
    a = torch.randn(backend.FFT_KERNEL_MIN_ROWS, 64)
    torch.testing.assert_close(hrr.bind(a, a), hrr.bind(a, a, backend="torch"))  # CPU: never the kernel
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
def test_kernel_on_gpu_matches_torch_fft(d):
    """Every supported d at its default launch configuration (a compiled kernel can differ from the
    interpreted one), plus rows whose norms differ by 1e6 and a zero row."""
    g = torch.Generator().manual_seed(d)
    a, b = (x.cuda() for x in hrr.random((2, 3001), d, generator=g))
    ref_b, ref_u = hrr.bind(a, b, backend="torch"), hrr.unbind(a, b, backend="torch")
    torch.testing.assert_close(hrr.bind(a, b, backend="triton"), ref_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(hrr.unbind(a, b, backend="triton"), ref_u, atol=1e-5, rtol=0)
    scale = torch.logspace(-3, 3, a.shape[0], device="cuda")[:, None]
    b_scaled = b * scale
    b_scaled[7] = 0
    out = hrr.bind(a, b_scaled, backend="triton")
    assert bool((out[7] == 0).all())
    torch.testing.assert_close(out / scale, hrr.bind(a, b_scaled, backend="torch") / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(hrr.bind(a, b), ref_b, atol=1e-5, rtol=0)  # auto: the kernel from d = 1024
    cpu = hrr.bind(a.cpu(), b.cpu())
    torch.testing.assert_close(hrr.bind(a, b).cpu(), cpu, atol=1e-5, rtol=0)  # same result across devices
