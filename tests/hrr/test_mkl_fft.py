"""hrr.mkl_fft: bind/unbind through cached MKL descriptors in row blocks, against the torch.fft path."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import backend, mkl_fft
from torchnitro.hrr import ops as h

pytestmark = pytest.mark.skipif(not mkl_fft.mkl_available(),
                                reason=f"no MKL DFTI here: {mkl_fft._library()[1]}")

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def _pair(shape_a, shape_b, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape_a, generator=g, dtype=dtype), torch.randn(shape_b, generator=g, dtype=dtype)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Both product paths: NumPy's at one thread, torch's at more."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _reference(a, b, conj_b):
    return h.unbind(a, b, backend="torch") if conj_b else h.bind(a, b, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("conj_b", [False, True])
@pytest.mark.parametrize("shape_a,shape_b", [
    ((8, 512), (8, 512)),            # ordinary
    ((5, 123), (5, 123)),            # odd d keeps its length
    ((2, 3, 1001), (2, 3, 1001)),    # several leading dims
    ((1,), (1,)),                    # d = 1
    ((9, 100), (100,)),              # one key against a batch
    ((100,), (9, 100)),              # ... on either side (unbind conjugates the batch side)
    ((1, 1, 99), (5, 99)),           # a single vector with more leading dims broadcasts out
])
def test_matches_torch_fft(shape_a, shape_b, dtype, conj_b, threads):
    a, b = _pair(shape_a, shape_b, dtype)
    got = mkl_fft.mkl_bind(a, b, conj_b=conj_b)
    want = _reference(a, b, conj_b)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("n,block_rows", [(7, 2), (13, 4), (16, 4), (3, 8)])
@pytest.mark.parametrize("conj_b", [False, True])
def test_several_blocks_give_the_same_result(n, block_rows, conj_b, threads):
    d = 64
    a, b = _pair((n, d), (n, d), torch.float64, seed=n)
    got = mkl_fft.mkl_bind(a, b, conj_b=conj_b, block_bytes=block_rows * d * 8)
    torch.testing.assert_close(got, _reference(a, b, conj_b), **TOL[torch.float64])


@pytest.mark.parametrize("n,rows", [(7, 2), (100, 64), (64, 64), (1, 8), (129, 64)])
def test_blocks_are_balanced_and_cover_the_batch(n, rows):
    blocks = list(mkl_fft._blocks(n, rows))
    assert [s for s, _ in blocks] == [sum(c for _, c in blocks[:i]) for i in range(len(blocks))]
    counts = [c for _, c in blocks]
    assert sum(counts) == n and max(counts) <= rows and max(counts) - min(counts) <= 1
    assert len(blocks) == -(-n // rows)


def test_block_rows_rule():
    assert mkl_fft.block_rows(4096, torch.float32) == 16  # 256 KiB / 16 KiB rows
    assert mkl_fft.block_rows(4096, torch.float64) == 8
    assert mkl_fft.block_rows(512, torch.float32, threads=2) == 256
    assert mkl_fft.block_rows(1 << 20, torch.float32) == 1  # a row larger than the block still runs
    assert mkl_fft.block_rows(1000, torch.float32, block_bytes=40_000) == 8  # rounded down to a power of 2


def test_noncontiguous_inputs_and_empty_batch():
    a, b = _pair((64, 6), (64, 6), torch.float32)
    at, bt = a.t(), b.t()  # (6, 64), strided
    torch.testing.assert_close(mkl_fft.mkl_bind(at, bt), h.bind(at, bt, backend="torch"), **TOL[torch.float32])
    empty = torch.empty(0, 16)
    assert mkl_fft.mkl_bind(empty, empty).shape == (0, 16)
    assert h.bind(empty, empty, backend="torch").shape == (0, 16)  # torch.fft itself rejects it


def test_descriptor_cache_is_bounded_and_reused(monkeypatch):
    monkeypatch.setattr(mkl_fft, "_CACHE_SIZE", 4)
    mkl_fft._cache.plans.clear()
    a, b = _pair((3, 32), (3, 32), torch.float32)
    mkl_fft.mkl_bind(a, b)
    first = dict(mkl_fft._cache.plans)
    mkl_fft.mkl_bind(a, b)
    assert dict(mkl_fft._cache.plans) == first  # same shape: the committed descriptors are reused
    for d in range(10, 20):
        x, y = _pair((2, d), (2, d), torch.float32)
        torch.testing.assert_close(mkl_fft.mkl_bind(x, y), h.bind(x, y, backend="torch"), **TOL[torch.float32])
    assert len(mkl_fft._cache.plans) <= 4
    evicted = first.popitem()[1]
    assert not evicted.handle  # freed when evicted


def test_thread_count_is_part_of_the_key():
    a, b = _pair((40, 256), (40, 256), torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mkl_fft.mkl_bind(a, b)
        torch.set_num_threads(2)
        two = mkl_fft.mkl_bind(a, b)
    finally:
        torch.set_num_threads(before)
    keys = {k[3] for k in mkl_fft._cache.plans if k[0] == 256}
    assert {1, 2} <= keys
    torch.testing.assert_close(one, two, **TOL[torch.float32])


def test_concurrent_callers_get_their_own_results():
    pairs = [_pair((33, 128), (33, 128), torch.float32, seed=s) for s in range(4)]
    want = [h.bind(a, b, backend="torch") for a, b in pairs]
    got, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(20):
                got[i] = mkl_fft.mkl_bind(*pairs[i])
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **TOL[torch.float32])


def test_bad_inputs_name_what_was_received():
    a = torch.randn(4, 8)
    with pytest.raises(ShapeError, match=r"shapes \(4, 8\) and \(3, 8\)"):
        mkl_fft.mkl_bind(a, torch.randn(3, 8))
    with pytest.raises(BackendUnavailableError, match="float16"):
        mkl_fft.mkl_bind(a.half(), a.half())
    with pytest.raises(InputError, match="block_bytes=0"):
        mkl_fft.mkl_bind(a, a, block_bytes=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 64), (3, 2, 63), (17,), (0, 8)])
def test_rfft_irfft_match_torch_fft(shape, dtype):
    x = _pair(shape, shape, dtype)[0]
    spec = mkl_fft.rfft(x)
    d = shape[-1]
    assert spec.shape == (*shape[:-1], d // 2 + 1)
    if x.numel():  # torch.fft itself rejects an empty batch
        torch.testing.assert_close(spec, torch.fft.rfft(x), **TOL[dtype])
    back = torch.empty(shape, dtype=dtype)
    assert mkl_fft.irfft(spec, d, out=back) is back
    torch.testing.assert_close(back, x, **TOL[dtype])
    if x.numel():
        torch.testing.assert_close(mkl_fft.irfft(spec.conj(), d), torch.fft.irfft(spec.conj(), n=d), **TOL[dtype])
        torch.testing.assert_close(mkl_fft.rfft(x.t() if x.dim() == 2 else x), torch.fft.rfft(x.t() if x.dim() == 2 else x),
                                   **TOL[dtype])


def test_rfft_irfft_reject_what_they_cannot_take():
    with pytest.raises(InputError, match="float16"):
        mkl_fft.rfft(torch.randn(2, 8).half())
    with pytest.raises(InputError, match=r"\(\.\.\., 5\)"):
        mkl_fft.irfft(torch.randn(2, 4, dtype=torch.complex64), 8)
    with pytest.raises(ShapeError, match="out is"):
        mkl_fft.irfft(torch.randn(2, 5, dtype=torch.complex64), 8, out=torch.empty(2, 7))


# --- through hrr.bind / hrr.unbind --------------------------------------------------------------


def test_auto_takes_the_mkl_path_on_cpu(monkeypatch):
    calls = []
    real = mkl_fft.mkl_bind
    monkeypatch.setattr(mkl_fft, "mkl_bind", lambda x, y, conj_b: calls.append(conj_b) or real(x, y, conj_b=conj_b))
    a, b = _pair((6, 64), (6, 64), torch.float32)
    torch.testing.assert_close(h.bind(a, b), h.bind(a, b, backend="torch"), **TOL[torch.float32])
    torch.testing.assert_close(h.unbind(a, b), h.unbind(a, b, backend="torch"), **TOL[torch.float32])
    h.unbind(a, b, "exact")  # not the involution: torch.fft
    h.bind(a, torch.randn(2, 1, 64))  # a general broadcast: torch.fft
    assert calls == [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [64, 63])
def test_other_transforms_take_kept_descriptors_and_agree(monkeypatch, dtype, d):
    a, b = _pair((5, d), (5, d), dtype, seed=d)
    wide = torch.randn(3, 1, d, dtype=dtype)  # broadcasts both ways with b: not the blocked bind
    ops = {
        "project": lambda: h.project(a),
        "exact_inverse": lambda: h.exact_inverse(a),
        "unbind exact": lambda: h.unbind(a, b, "exact"),
        "unbind projected": lambda: h.unbind(a, b, "projected"),
        "bind broadcast": lambda: h.bind(wide, b),
        "unbind broadcast": lambda: h.unbind(wide, b),
    }
    calls = []
    real = mkl_fft.rfft
    monkeypatch.setattr(mkl_fft, "rfft", lambda x: calls.append(tuple(x.shape)) or real(x))
    kept = {k: f() for k, f in ops.items()}
    assert len(calls) == 10  # one transform per operand of each op: none went to torch.fft
    monkeypatch.setattr(mkl_fft, "mkl_available", lambda: False)
    for k, f in ops.items():
        torch.testing.assert_close(kept[k], f(), **TOL[dtype], msg=k)


def test_autograd_keeps_the_torch_path():
    a, b = (x.requires_grad_() for x in _pair((2, 7), (2, 7), torch.float64))
    assert torch.autograd.gradcheck(h.bind, (a, b), fast_mode=True)
    with pytest.raises(BackendUnavailableError, match="requires grad"):
        h.bind(a, b, backend="mkl")
    with pytest.raises(BackendUnavailableError, match="involution"):
        h.unbind(a.detach(), b.detach(), "exact", backend="mkl")


def test_a_failing_mkl_call_falls_back_once_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise BackendUnavailableError("MKL DFTI call failed with status 1: injected")

    monkeypatch.setattr(mkl_fft, "mkl_bind", broken)
    monkeypatch.setattr(backend.HEALTH, "mkl", None)
    a, b = _pair((3, 16), (3, 16), torch.float32)
    with pytest.warns(UserWarning, match="injected"):
        got = h.bind(a, b)
    torch.testing.assert_close(got, h.bind(a, b, backend="torch"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: auto now skips MKL
        h.unbind(a, b)
    with pytest.raises(BackendUnavailableError, match="injected"):
        h.bind(a, b, backend="mkl")  # asked for explicitly: raised, not hidden


def test_without_mkl_auto_uses_torch_and_explicit_raises(monkeypatch):
    monkeypatch.setattr(mkl_fft, "_library", lambda: (None, "this torch build has no MKL"))
    a, b = _pair((3, 16), (3, 16), torch.float32)
    torch.testing.assert_close(h.bind(a, b), h.bind(a, b, backend="torch"))
    with pytest.raises(BackendUnavailableError, match="no MKL"):
        h.bind(a, b, backend="mkl")


# --- benchmarks/hrr_mkl_blocks.py runs end to end (tiny sizes, short timings) --------------------


def test_block_benchmark_script_writes_its_tables(tmp_path, monkeypatch):
    import json
    import sys

    from _bench import load_benchmark

    from torchnitro.bench import timing

    tool = load_benchmark("hrr_mkl_blocks")
    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path))
    monkeypatch.setattr(tool, "TimingConfig", lambda **kw: timing.TimingConfig(**kw).quick())
    before = torch.get_num_threads()
    try:
        for extra in ([], ["--unbind"], ["--parts"]):
            monkeypatch.setattr(sys, "argv", ["hrr_mkl_blocks.py", "--dims", "16", "--batches", "5",
                                              "--blocks-kib", "1", "0", "--name", "t", *extra])
            assert tool.main() == 0
            rows = json.loads((tmp_path / "t.json").read_text())["rows"]
            if extra == ["--parts"]:
                assert [r["steps"] for r in rows] == ["two forward transforms", "+ product", "+ inverse (whole bind)"]
            else:
                assert {r["variant"] for r in rows} >= {"torch.fft", "mkl 1 KiB", "mkl one block"}
                assert all(r["max_abs_err"] < 1e-4 for r in rows)
    finally:
        torch.set_num_threads(before)
