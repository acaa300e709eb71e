"""DCP checkpoints: saved by FSDP on 2 ranks, loaded on 1 and on 3 ranks bit-exact (resharding); atomic
publication, keep-last-N, and a half-written checkpoint never taken as the latest."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.distributed.workers import ckpt as ckpt_worker
from torchnitro.distributed.checkpoint import latest_step, list_steps, load, step_dir
from torchnitro.errors import ArtifactError


def _equal(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), f"{path}: tensors differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ckpt = root / "ckpt"
    run_ranks("ckpt.py", 2, "save", str(ckpt), str(root))
    return root, ckpt


def test_keep_last_n_and_no_temporaries(saved):
    _, ckpt = saved
    assert list_steps(ckpt) == [2, 3]  # keep=2 pruned step 1; step 3 was the async save
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("world", [1, 3])
def test_load_on_another_world_size_is_bit_exact(saved, world, monkeypatch):
    root, ckpt = saved
    if world == 1:  # one rank needs no launcher: load in this process (saves a process start)
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k, raising=False)
        ckpt_worker.main("load", ckpt, root)
    else:
        run_ranks("ckpt.py", world, "load", str(ckpt), str(root))
    got = torch.load(root / f"loaded_{world}.pt", weights_only=True)
    want = torch.load(root / "saved.pt", weights_only=True)
    assert got["step"] == 3 and got["step_tensor"] == 3
    _equal(got["params"], want["params"], "params")
    _equal(got["optim"], want["optim"], "optim")


def test_half_written_checkpoint_is_never_latest(tmp_path):
    good = step_dir(tmp_path, 5)
    good.mkdir()
    (good / ".metadata").write_bytes(b"x")
    (good / "__0_0.distcp").write_bytes(b"x")
    killed = tmp_path / ".tmp-step_00000007"  # what a save killed before its rename leaves
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"partial")
    no_meta = step_dir(tmp_path, 9)  # a step directory without metadata (copied by hand, truncated)
    no_meta.mkdir()
    (no_meta / "__0_0.distcp").write_bytes(b"x")
    assert latest_step(tmp_path) == 5
    assert list_steps(tmp_path / "missing") == [] and latest_step(tmp_path / "missing") is None


def test_load_of_a_missing_step_names_the_steps_there(tmp_path):
    assert load({}, tmp_path) is None  # nothing saved yet: a fresh start
    d = step_dir(tmp_path, 4)
    d.mkdir()
    (d / ".metadata").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"received step=2.*finished steps: \[4\]"):
        load({}, tmp_path, step=2)


def test_incompatible_model_is_one_clear_error(tmp_path):
    from torchnitro.distributed.checkpoint import ModelState, save
    from torchnitro.nn.models import TransformerLM

    save({"train": ModelState(TransformerLM(vocab_size=64, dim=32, n_layers=1, n_heads=2))}, tmp_path, step=1)
    other = TransformerLM(vocab_size=64, dim=48, n_layers=1, n_heads=2)
    with pytest.raises(ArtifactError, match=r"step_00000001 does not fit the state.*different model"):
        load({"train": ModelState(other)}, tmp_path)


def test_single_process_save_publishes_and_prunes_stale_temporaries(tmp_path):
    from torchnitro.distributed.checkpoint import save

    stale = tmp_path / ".tmp-step_00000001"  # a save of step 1 killed half-way
    stale.mkdir(parents=True)
    for step in (2, 3, 4):
        save({"x": torch.full((3,), float(step))}, tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    state = {"x": torch.zeros(3)}
    assert load(state, tmp_path) == 4 and torch.equal(state["x"], torch.full((3,), 4.0))
    assert load(state, tmp_path, step=3) == 3 and torch.equal(state["x"], torch.full((3,), 3.0))


def test_async_save_survives_a_new_process_group(tmp_path, monkeypatch):
    """The background-save group belongs to one default group; after shutdown + init a fresh one is made."""
    from torchnitro.distributed import ParallelConfig, init, shutdown
    from torchnitro.distributed.checkpoint import save

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    try:
        for step in (1, 2):
            init(ParallelConfig())
            save({"x": torch.full((2,), float(step))}, tmp_path, step=step, async_=True).wait()
            shutdown()
        state = {"x": torch.zeros(2)}
        assert load(state, tmp_path) == 2 and torch.equal(state["x"], torch.full((2,), 2.0))
    finally:
        shutdown()
