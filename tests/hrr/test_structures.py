"""Records and sequences: round trips, batching, errors, and measured capacity.

Capacity checks are seeded Monte-Carlo runs (100 structures each). Measured at d = 256 with a
100-item codebook: records and sequences hold ~10 items at >= 99% accuracy and fall to ~50% at 4x
that; the asserted bounds leave a wide margin around those numbers.
"""

from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError, ShapeError
from torchnitro.hrr import ops as h
from torchnitro.hrr.memory import ItemMemory
from torchnitro.hrr.structures import Record, Sequence, capacity, measure_accuracy, role_vector


@pytest.fixture(scope="module")
def memory():
    book = h.random(200, 512, generator=torch.Generator().manual_seed(0))
    return ItemMemory(book, [f"w{i}" for i in range(200)], device="cpu")


def test_role_vectors_are_deterministic_unitary_and_distinct():
    a, b = role_vector("color", 64), role_vector("color", 64)
    assert torch.equal(a, b)
    assert not torch.allclose(role_vector("color", 64, seed=1), a)
    torch.testing.assert_close(torch.fft.rfft(a.double()).abs(), torch.ones(33, dtype=torch.float64), atol=1e-6, rtol=0)
    assert abs(h.cosine(a, role_vector("shape", 64)).item()) < 0.5


def test_record_roundtrip(memory):
    red, square = memory["w3"], memory["w17"]
    rec = Record.encode({"color": red, "shape": square})
    assert rec.roles == ("color", "shape") and rec.vector.shape == (512,)
    assert rec.decode("color", memory)[0] == "w3"
    assert rec.decode("shape", memory)[0] == "w17"
    assert rec.decode_all(memory) == {"color": "w3", "shape": "w17"}
    torch.testing.assert_close(rec.vector.norm(), torch.tensor(1.0))
    labels, sims = rec.decode("color", memory, k=2)
    assert labels[0] == "w3" and sims[0] > sims[1]


def test_batched_records_and_sequences(memory):
    book = memory.vectors
    colors, shapes = book[:6], book[6:12]  # 6 records at once
    rec = Record.encode({"color": colors, "shape": shapes, "size": book[20]})  # broadcast one filler
    assert rec.vector.shape == (6, 512)
    out = rec.decode_all(memory)
    assert out["color"] == [f"w{i}" for i in range(6)] and out["size"] == ["w20"] * 6
    seqs = Sequence.encode(book[:12].reshape(3, 4, 512))  # 3 sequences of 4
    decoded = seqs.decode(memory)
    assert decoded == [[f"w{4 * b + i}" for b in range(3)] for i in range(4)]


def test_sequence_roundtrip_and_position_order(memory):
    items = memory.vectors[[5, 9, 5, 40, 2]]  # repeats are fine
    seq = Sequence.encode(items)
    assert seq.decode(memory) == ["w5", "w9", "w5", "w40", "w2"]
    assert memory.cleanup(seq.item(3))[0] == "w40"
    rev = Sequence.encode(items.flip(0))
    assert h.cosine(seq.vector, rev.vector).abs() < 0.6  # order matters


def test_wrong_seed_does_not_decode(memory):
    rec = Record.encode({"a": memory["w1"], "b": memory["w2"]}, seed=0)
    wrong = Record(rec.vector, rec.roles, seed=1)
    assert wrong.decode("a", memory)[1] < 0.3 < rec.decode("a", memory)[1]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: Record.encode({}), "non-empty dict"),
        (lambda m: Record.encode({"a": [1.0]}), "filler of 'a' is list"),
        (lambda m: Record.encode({"a": torch.zeros(2, 8), "b": torch.zeros(3, 8)}), "do not broadcast"),
        (lambda m: Record.encode({"a": m["w1"]}).filler("b"), "roles \\['a'\\]"),
        (lambda m: Sequence.encode(torch.zeros(8)), r"\(8,\)"),
        (lambda m: Sequence.encode(m.vectors[:3]).item(3), r"\[0, 3\)"),
        (lambda m: measure_accuracy("tree", 2, d=8, n_items=4), "'tree'"),
        (lambda m: capacity("record", d=8, n_items=4, accuracy=1.5), "1.5"),
    ],
)
def test_bad_input(memory, call, match):
    with pytest.raises((InputError, ShapeError), match=match):
        call(memory)


@pytest.mark.parametrize("structure", ["record", "sequence"])
def test_capacity_d256(structure):
    assert measure_accuracy(structure, 6, d=256, n_items=100, trials=100) >= 0.99
    assert measure_accuracy(structure, 40, d=256, n_items=100, trials=100) < 0.7
    cap = capacity(structure, d=256, n_items=100, trials=100)
    assert 6 <= cap <= 16, cap


def test_capacity_grows_with_dimension():
    small = capacity("sequence", d=128, n_items=100, trials=100)
    large = capacity("sequence", d=512, n_items=100, trials=100)
    assert large >= 2.5 * small, (small, large)
