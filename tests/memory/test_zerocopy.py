from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchnitro.errors import InputError
from torchnitro.memory.zerocopy import load_into_, load_weights, prepare_inference_, resident_bytes


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("w") / "big.safetensors"
    save_file({"w": torch.ones(50_000_000), "b": torch.arange(10, dtype=torch.bfloat16)}, str(p))  # ~200 MB
    gc.collect()
    return p


def test_mmap_adds_no_resident_memory_until_touched(big_file):
    gc.collect()
    before = resident_bytes()
    state = load_weights(big_file, mmap=True)
    after_map = resident_bytes()
    assert after_map - before < 16 * 2**20  # ~0: nothing paged in yet (200 MB of data)
    assert state["w"].shape == (50_000_000,) and state["b"].dtype == torch.bfloat16
    half = state["w"][:25_000_000].sum().item()  # touch half the pages
    after_touch = resident_bytes()
    assert half == 25_000_000.0
    assert after_touch - after_map > 80 * 2**20  # now ~100 MB is resident


def test_values_match_and_file_is_never_written(big_file):
    state = load_weights(big_file)
    ref = load_file(str(big_file))
    assert torch.equal(state["b"], ref["b"])
    state["b"][0] = 42  # copy-on-write mapping: the file stays as it was
    assert load_file(str(big_file))["b"][0].item() == 0


def test_torch_load_mmap_and_load_into(tmp_path):
    m = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    torch.save(m.state_dict(), tmp_path / "m.pt")
    save_file(m.state_dict(), str(tmp_path / "m.safetensors"))
    for name in ("m.pt", "m.safetensors"):
        m2 = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        load_into_(m2, tmp_path / name)
        x = torch.randn(3, 8)
        torch.testing.assert_close(m2(x), m(x), rtol=0, atol=0)


def test_bad_files(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"definitely not safetensors")
    with pytest.raises(InputError, match="not a safetensors file"):
        load_weights(bad)
    garbage = tmp_path / "x.bin"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(InputError, match="weights_only"):
        load_weights(garbage)
    with pytest.raises(InputError, match="does not exist"):
        load_weights(tmp_path / "missing.safetensors")
    trunc = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(100)}, str(trunc))
    trunc.write_bytes(trunc.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated"):
        load_weights(trunc)
    m = nn.Linear(3, 3)
    save_file({"other": torch.ones(2)}, str(tmp_path / "o.safetensors"))
    with pytest.raises(InputError, match="does not match"):
        load_into_(m, tmp_path / "o.safetensors")


def test_prepare_inference_in_place():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    ref = m(x).detach()
    out = prepare_inference_(m)
    assert out is m and not m.training and m[1].inplace
    assert all(not p.requires_grad for p in m.parameters())
    with torch.inference_mode():
        torch.testing.assert_close(m(x), ref, rtol=0, atol=0)
    with pytest.raises(InputError, match="floating"):
        prepare_inference_(m, torch.int8)
