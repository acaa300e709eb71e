"""ItemMemory: cleanup against a brute-force reference, chunking, editing, device fallback."""

from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError, OutOfMemoryError, ShapeError
from torchnitro.hrr import ops as h
from torchnitro.hrr.dispatch import Dispatcher
from torchnitro.hrr.backend import topk_chunked
from torchnitro.hrr.memory import ItemMemory


def _book(n: int = 300, d: int = 64, seed: int = 0) -> torch.Tensor:
    return h.random(n, d, generator=torch.Generator().manual_seed(seed)) * 3.0  # non-unit norms


def _reference(q: torch.Tensor, book: torch.Tensor, k: int):
    sims = torch.nn.functional.cosine_similarity(q.double().unsqueeze(1), book.double().unsqueeze(0), dim=-1)
    return sims.topk(k, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [None, 7, 64, 1000])
def test_topk_matches_brute_force(dtype, chunk):
    book = _book().to(dtype)
    q = h.random(13, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    mem = ItemMemory(book, device="cpu", chunk_size=chunk)
    sims, idx = mem.topk(q, k=5)
    ref_v, ref_i = _reference(q, book, 5)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(sims.double(), ref_v, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)


def test_topk_chunked_odd_sizes_and_k_larger_than_chunk():
    book = h.normalize(_book(101, 33))
    q = h.random(5, 33, generator=torch.Generator().manual_seed(2))
    v, i = topk_chunked(q, book, k=10, chunk_size=3)
    rv, ri = (q @ book.T).topk(10, dim=1)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv)


def test_cleanup_recovers_noisy_items_with_labels():
    book = _book(500, 256)
    labels = [f"item{i}" for i in range(500)]
    mem = ItemMemory(book, labels, device="cpu")
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, 500, (40,), generator=g)
    noisy = book[pick] + 2.0 * h.random(40, 256, generator=g) * 3.0  # cos ~ 0.45 to the item
    names, sims = mem.cleanup(noisy)
    assert names == [labels[i] for i in pick.tolist()]
    assert sims.shape == (40,)
    torch.testing.assert_close(sims, h.cosine(noisy, book[pick]), atol=1e-5, rtol=0)
    name, sim = mem.cleanup(book[7])
    assert name == "item7" and abs(sim.item() - 1.0) < 1e-5
    names3, sims3 = mem.cleanup(noisy[:2], k=3)
    assert len(names3) == 2 and len(names3[0]) == 3 and sims3.shape == (2, 3)
    assert (sims3[:, 0] >= sims3[:, 1]).all()


def test_similarities_full_matrix():
    book = _book(50, 16)
    q = h.random(4, 16, generator=torch.Generator().manual_seed(4))
    mem = ItemMemory(book, device="cpu")
    ref = torch.nn.functional.cosine_similarity(q.unsqueeze(1), book.unsqueeze(0), dim=-1)
    torch.testing.assert_close(mem.similarities(q), ref, atol=1e-6, rtol=0)
    assert mem.similarities(q[0]).shape == (50,)


def test_add_remove_and_lookup():
    book = _book(10, 16)
    mem = ItemMemory(book, [f"x{i}" for i in range(10)], device="cpu")
    extra = _book(3, 16, seed=9)
    mem.add(["a", "b", "c"], extra)
    assert len(mem) == 13 and "b" in mem
    torch.testing.assert_close(mem["b"], extra[1])
    assert mem.cleanup(extra[2])[0] == "c"
    mem.remove(["x0", "b"])
    assert len(mem) == 11 and "b" not in mem and sorted(mem.labels) == sorted([f"x{i}" for i in range(1, 10)] + ["a", "c"])
    assert mem.cleanup(extra[2])[0] == "c" and mem.cleanup(book[5])[0] == "x5"
    with pytest.raises(InputError, match="already exist"):
        mem.add(["c"], extra[:1])
    with pytest.raises(InputError, match="'nope' is not in this memory"):
        mem.remove(["x1", "nope"])
    assert "x1" in mem  # nothing removed when one label is unknown
    with pytest.raises(ShapeError, match="dimension 8"):
        mem.add(["z"], torch.zeros(1, 8))


def _check_against_rebuilt(mem: ItemMemory, items: dict[str, torch.Tensor]) -> None:
    """The edited memory answers like one built from scratch from the same items."""
    assert len(mem) == len(items) and set(mem.labels) == set(items)
    for lab, vec in items.items():
        torch.testing.assert_close(mem[lab], vec, atol=1e-6, rtol=1e-6)
    labs = sorted(items)
    fresh = ItemMemory(torch.stack([items[lab] for lab in labs]), labs, device="cpu")
    q = h.random(9, 32, generator=torch.Generator().manual_seed(11))
    got, want = mem.cleanup(q, k=3), fresh.cleanup(q, k=3)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("keep_order", [False, True])
def test_random_add_remove_sequence_matches_rebuilt_memory(keep_order):
    g = torch.Generator().manual_seed(12)
    book = _book(20, 32)
    items = {f"i{j}": book[j] for j in range(20)}
    mem = ItemMemory(book, list(items), device="cpu")
    fresh_id = 20
    for step in range(40):
        if step % 3 == 2 and len(items) > 5:
            pick = torch.randperm(len(items), generator=g)[: int(torch.randint(1, 5, (1,), generator=g))]
            gone = [sorted(items)[i] for i in pick.tolist()]
            before = [lab for lab in mem.labels if lab not in gone]
            mem.remove(gone, keep_order=keep_order)
            for lab in gone:
                del items[lab]
            if keep_order:
                assert mem.labels == before
        else:
            m = int(torch.randint(1, 7, (1,), generator=g))
            new = h.random(m, 32, generator=g) * 2.0
            labs = [f"i{fresh_id + j}" for j in range(m)]
            fresh_id += m
            mem.add(labs, new)
            items.update(zip(labs, new))
        assert mem.vectors.shape == (len(items), 32)
    _check_against_rebuilt(mem, items)


def test_add_grows_capacity_geometrically():
    mem = ItemMemory(_book(4, 32), device="cpu")
    g = torch.Generator().manual_seed(13)
    buffers = set()
    for j in range(600):
        mem.add([f"n{j}"], h.random(1, 32, generator=g))
        buffers.add(mem._ubuf.data_ptr())
        assert mem.capacity >= len(mem)
    assert len(mem) == 604 and len(buffers) <= 8  # 16, 32, ..., 1024: a handful of copies, not 600
    assert mem.capacity < 2 * 604 + 16


def test_remove_moves_only_as_many_rows_as_removed():
    book = _book(1000, 32)
    mem = ItemMemory(book, [f"r{i}" for i in range(1000)], device="cpu")
    mem.add(["extra"], book[:1])  # now an owned buffer with spare capacity
    before = mem._ubuf.clone()
    mem.remove(["r3", "r500"])
    changed = (mem._ubuf[: len(mem)] != before[: len(mem)]).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 500]  # the two holes, filled from the tail; no other row was written
    assert mem.labels[3] in ("extra", "r999") and mem.labels[500] in ("extra", "r999")
    torch.testing.assert_close(mem["r999"], book[999])
    torch.testing.assert_close(mem["extra"], book[0])
    mem.remove([f"r{i}" for i in range(1000) if i not in (3, 500)])
    assert len(mem) == 1 and mem.capacity <= 64  # memory given back when mostly empty


def test_edits_of_a_memory_mapped_store_leave_the_files_intact(tmp_path):
    book = _book(50, 32)
    labs = [f"m{i}" for i in range(50)]
    ItemMemory(book, labs, device="cpu").save(tmp_path / "s")
    mem = ItemMemory.load(tmp_path / "s", device="cpu", mmap=True)
    mem.remove(["m0", "m7"])
    assert mem.capacity <= 50  # the mapped rows were copied once, without doubling
    mem.add(["new"], book[:1] * 5)
    again = ItemMemory.load(tmp_path / "s", device="cpu")  # checksums still verify: files untouched
    assert again.labels == labs
    torch.testing.assert_close(again.vectors, book, atol=1e-6, rtol=1e-6)
    items = {lab: book[i] for i, lab in enumerate(labs) if lab not in ("m0", "m7")} | {"new": book[0] * 5}
    _check_against_rebuilt(mem, items)


def test_cleanup_memory_uses_its_own_calibration():
    mem = ItemMemory(_book(3000, 32), device="auto")
    assert mem.dispatcher.op == "cleanup" and mem.dispatcher.n_items == 3000
    mem.remove(["0", "1"])
    assert mem.dispatcher.n_items == 2998


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ItemMemory(torch.zeros(3)), r"\(3,\)"),
        (lambda: ItemMemory(torch.zeros(2, 4), ["a", "a"]), "duplicate"),
        (lambda: ItemMemory(torch.zeros(2, 4), ["a"]), "1 labels for 2 vectors"),
        (lambda: ItemMemory(torch.zeros(2, 4, dtype=torch.int64)), "int64"),
        (lambda: ItemMemory(torch.ones(2, 4), device="tpu"), "tpu"),
        (lambda: ItemMemory(torch.ones(2, 4), chunk_size=0), "chunk_size: received 0"),
        (lambda: ItemMemory(torch.ones(2, 4), device="cpu").cleanup(torch.ones(5)), "dimension 5"),
        (lambda: ItemMemory(torch.ones(2, 4), device="cpu").cleanup(torch.ones(4), k=0), "k: received 0"),
    ],
)
def test_bad_input(make, match):
    with pytest.raises((InputError, ShapeError), match=match):
        make()


def test_device_failure_falls_back_to_cpu_with_one_warning():
    calls = []

    def fault(device):
        calls.append(device)
        raise OutOfMemoryError("injected: accelerator out of memory")

    # the CPU stands in for the accelerator; batches >= 4 "go to the GPU" and hit the fault
    disp = Dispatcher("auto", accelerator="cpu", threshold=4, fault=fault)
    book = _book()
    mem = ItemMemory(book, device="cpu", dispatcher=disp)
    ref = ItemMemory(book, device="cpu")
    q = h.random(8, 64, generator=torch.Generator().manual_seed(5))
    with pytest.warns(RuntimeWarning, match="injected"):
        got = mem.topk(q, k=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure does not warn again
        again = mem.topk(q, k=3)
    want = ref.topk(q, k=3)
    assert torch.equal(got[1], want[1]) and torch.equal(again[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    assert disp.fallbacks == 2 and len(calls) == 2
    mem.topk(q[:2], k=3)  # below the threshold: stays on the CPU, no fault
    assert len(calls) == 2


def test_non_device_errors_propagate():
    def fault(device):
        raise ValueError("a bug, not a device failure")

    disp = Dispatcher("auto", accelerator="cpu", threshold=1, fault=fault)
    with pytest.raises(ValueError, match="a bug"):
        disp.run(lambda x: x, torch.ones(2, 2))


@pytest.mark.gpu
def test_gpu_cleanup_matches_cpu_and_streams_large_codebooks():
    book = _book(5000, 128)
    q = h.random(300, 128, generator=torch.Generator().manual_seed(6))
    cpu = ItemMemory(book, device="cpu").topk(q, 4)
    gpu_mem = ItemMemory(book, device="cuda", chunk_size=999)
    gpu = gpu_mem.topk(q, 4)
    assert gpu[0].device.type == "cpu"
    assert torch.equal(gpu[1], cpu[1])
    torch.testing.assert_close(gpu[0], cpu[0], atol=1e-5, rtol=0)
    v, i = topk_chunked(h.normalize(q).cuda(), h.normalize(book).pin_memory(), 4, chunk_size=1000)
    assert torch.equal(i.cpu(), cpu[1])
