"""Store: safetensors + SHA-256 manifest; tampering, truncation and missing files load nothing."""

from __future__ import annotations

import json

import pytest
import torch

from torchnitro.errors import ArtifactError
from torchnitro.hrr import ops as h
from torchnitro.hrr.memory import ItemMemory
from torchnitro.checksum import sha256_file


@pytest.fixture
def saved(tmp_path):
    book = h.random(40, 32, generator=torch.Generator().manual_seed(0)) * 2
    mem = ItemMemory(book, [f"w{i}" for i in range(40)], device="cpu")
    path = mem.save(tmp_path / "mem")
    return mem, path


@pytest.mark.parametrize("mmap", [False, True])
def test_roundtrip(saved, mmap):
    mem, path = saved
    back = ItemMemory.load(path, device="cpu", mmap=mmap)
    assert back.labels == mem.labels and back.d == 32
    torch.testing.assert_close(back.vectors, mem.vectors)
    q = mem.vectors[:5] + 0.1
    assert back.cleanup(q)[0] == mem.cleanup(q)[0]
    back.add(["new"], torch.ones(1, 32))  # editing a mapped memory copies, never writes the file
    assert "new" in back and sha256_file(path / "tensors.safetensors") == json.loads(
        (path / "manifest.json").read_text())["files"]["tensors.safetensors"]["sha256"]


def test_manifest_lists_sha256_of_every_file(saved):
    _, path = saved
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"tensors.safetensors", "labels.json"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(path / name)
        assert entry["bytes"] == (path / name).stat().st_size


def _flip_byte(p, offset=-5):
    data = bytearray(p.read_bytes())
    data[offset] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: _flip_byte(p / "tensors.safetensors"), "SHA-256"),
        (lambda p: _flip_byte(p / "labels.json", 3), "SHA-256"),
        (lambda p: (p / "tensors.safetensors").write_bytes((p / "tensors.safetensors").read_bytes()[:-10]), "truncated"),
        (lambda p: (p / "labels.json").unlink(), "missing"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{"), "not valid JSON"),
    ],
)
def test_damaged_store_raises_and_loads_nothing(saved, damage, match):
    _, path = saved
    damage(path)
    with pytest.raises(ArtifactError, match=match):
        ItemMemory.load(path, device="cpu")


def test_not_a_store(tmp_path):
    with pytest.raises(ArtifactError, match="not a directory"):
        ItemMemory.load(tmp_path / "nothing")
