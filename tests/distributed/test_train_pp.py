"""``torchnitro train --pp``: the trainer on pipeline stages, through the CLI on real gloo ranks (torchrun).

One pipelined run (pp 2, 1F1B, 2 micro-batches, 2 accumulation steps) against the same run unsplit in this
process: the losses agree within fp32 rounding (the pipeline sums its micro-batches' gradients in another
order). Then the pipelined run is resumed from its step-2 checkpoint as if killed before step 4's save
finished: the resumed losses are bit-identical to the uninterrupted ones (DCP keys are the unsplit names).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from torchnitro.cli import main
from torchnitro.distributed.train import TrainConfig, _check, clip_grad_norm_
from torchnitro.errors import InputError

DATA = str(Path(__file__).resolve().parents[2] / "src" / "torchnitro" / "distributed")  # real text, no download
CONFIG = """version: 1
train: {max_bytes: 100000, seq: 32, batch: 4, grad_accum: 2, steps: 4, lr: 0.01, warmup: 2, dim: 32, n_layers: 4,
        n_heads: 2, log_every: 1, ckpt_every: 2}
parallel: {pp: 2, pp_schedule: 1f1b, microbatches: 2, timeout_s: 30}
"""


def _log(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)  # two 2-rank torchrun launches and one in-process run; a hang fails here
def test_train_pp2_matches_unsplit_and_resumes_bit_exact(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(CONFIG)
    pp, one = tmp_path / "pp", tmp_path / "one"
    assert main(["train", "--config", str(cfg), "--data", DATA, "--ckpt", str(pp)]) == 0  # pp from the YAML: 2 ranks
    assert main(["train", "--config", str(cfg), "--data", DATA, "--ckpt", str(one), "--pp", "1"]) == 0  # unsplit
    piped, unsplit = _log(pp), _log(one)
    assert [r["step"] for r in piped] == [1, 2, 3, 4] and [r["world"] for r in piped] == [2] * 4
    assert [r["world"] for r in unsplit] == [1] * 4
    for a, b in zip(piped, unsplit):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), f"step {a['step']}: pipeline vs unsplit"
    assert piped[-1]["loss"] < piped[0]["loss"]  # it learns
    assert piped[0]["tokens_per_s"] > 0 and piped[0]["mfu"] is None and piped[0]["peak_mem_bytes_rank"] > 0
    # killed after step 2's checkpoint, before step 4's was published: the resumed run starts at step 3
    shutil.rmtree(pp / "step_00000004")
    assert main(["train", "--config", str(cfg), "--data", DATA, "--ckpt", str(pp)]) == 0
    again = _log(pp)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 3, 4]
    assert [r["loss"] for r in again[4:]] == [r["loss"] for r in again[2:4]]  # bit-identical
    assert sorted(p.name for p in pp.glob("step_*")) == ["step_00000002", "step_00000004"]


@pytest.mark.timeout(240)
def test_train_pp2_times_replicas2_matches_unsplit(tmp_path, monkeypatch):
    """PP x DDP through the CLI flags on 4 ranks: 2 stages x 2 replicas, the replicas averaged after each step."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(CONFIG)
    flags = ["train", "--config", str(cfg), "--data", DATA, "--batch", "8", "--grad-accum", "1", "--steps", "3"]
    assert main([*flags, "--ckpt", str(tmp_path / "pp"), "--dp-replicate", "2"]) == 0
    assert main([*flags, "--ckpt", str(tmp_path / "one"), "--pp", "1"]) == 0
    piped, unsplit = _log(tmp_path / "pp"), _log(tmp_path / "one")
    assert [r["world"] for r in piped] == [4] * 3 and len(unsplit) == 3
    for a, b in zip(piped, unsplit):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), f"step {a['step']}: PP x DDP vs unsplit"


def test_pipeline_batch_must_split_into_micro_batches():
    with pytest.raises(InputError, match=r"6 samples per data-parallel rank, with a pipeline of microbatches=4"):
        _check(TrainConfig(batch=12), 2, 4)
    _check(TrainConfig(batch=16), 2, 4)


def test_clip_counts_a_shared_gradient_once_and_scales_it():
    """A pipeline's last stage holds a copy of the tied weight: its gradient is scaled, not counted twice."""
    a, copy = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, copy.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    norm = clip_grad_norm_([a, copy], 1.0, counted=[a])
    assert norm == pytest.approx(5.0)  # counted twice it would be 5 * sqrt(2)
    torch.testing.assert_close(copy.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.grad, copy.grad)
