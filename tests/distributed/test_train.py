"""The training loop: deterministic data, and a resumed run whose losses equal an uninterrupted one's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchnitro.distributed import ParallelConfig, shutdown
from torchnitro.distributed.train import ByteCorpus, TrainConfig, lr_at, train
from torchnitro.errors import InputError

DATA = str(Path(__file__).resolve().parents[2] / "src" / "torchnitro" / "distributed")  # real text, no download


def _cfg(**kw) -> TrainConfig:
    base = dict(data=DATA, max_bytes=100_000, seq=32, batch=4, grad_accum=2, steps=4, lr=1e-2, warmup=2,
                dim=32, n_layers=2, n_heads=2, log_every=1, ckpt_every=2, keep=2)
    return TrainConfig(**{**base, **kw})


@pytest.fixture
def one_rank(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    yield ParallelConfig()
    shutdown()


def test_resume_continues_the_same_loss_trajectory(tmp_path, one_rank):
    full = train(_cfg(ckpt=str(tmp_path / "a")), one_rank)
    first = []

    def crash_at_3(record):
        first.append(record)
        if record["step"] == 3:  # after step 2's checkpoint, before step 4's: step 3 is lost
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_cfg(ckpt=str(tmp_path / "b")), one_rank, on_log=crash_at_3)
    resumed = train(_cfg(ckpt=str(tmp_path / "b")), one_rank)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]  # started from step 2, not from scratch
    losses = [r["loss"] for r in full]
    assert [r["loss"] for r in first] == losses[:3]
    assert [r["loss"] for r in resumed] == losses[2:]  # bit-identical: data order, model, AdamW state, schedule
    assert losses[-1] < losses[0]  # it learns
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 3, 4]  # step 3 ran twice: before the crash and after
    assert log[0]["mfu"] is None and log[0]["tokens_per_s"] > 0  # no peak given: MFU not made up
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_00000002", "step_00000004"]
    # each attempt's first record carries its start-up stamps in order (the resume benchmark's phases)
    for rec in (log[0], log[3]):
        st = rec["startup"]
        assert st["imported"] <= st["initialized"] <= st["loaded"] <= st["logged"]
    assert "startup" not in log[1] and "startup" not in log[4]


def test_byte_corpus_and_schedule():
    c = ByteCorpus(DATA, seq=16, max_bytes=1000)
    assert len(c) == 999 // 16 and c[0].shape == (17,) and c[0].max() < 256
    assert torch.equal(c[1][0], c[0][16])  # windows overlap by the one target byte
    cfg = _cfg(steps=100, warmup=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1) and lr_at(55, cfg) == pytest.approx(0.55)


def test_bad_data_and_batch(tmp_path, one_rank):
    with pytest.raises(InputError, match=r"0 text files \(0 bytes\)"):
        ByteCorpus(str(tmp_path), seq=16, max_bytes=1000)
    with pytest.raises(InputError, match=r"batch=3 \(global\) with 2 data-parallel ranks"):
        from torchnitro.distributed.train import _check
        _check(_cfg(batch=3), 2)


def test_train_cli_configs_merge_yaml_and_flags(tmp_path):
    from torchnitro.distributed.cli import train_configs
    from torchnitro.errors import ConfigError

    f = tmp_path / "train.yaml"
    f.write_text("version: 1\ntrain: {steps: 200, seq: 64}\nparallel: {dp_shard: 2, tp: 2}\n")
    tcfg, pcfg, nproc = train_configs(str(f), {"steps": 10, "tp": None, "data": None})
    assert (tcfg.steps, tcfg.seq, pcfg.dp_shard, pcfg.tp, nproc) == (10, 64, 2, 2, 4)  # flag wins; nproc = product
    f.write_text("version: 1\ntrainer: {steps: 2}\n")
    with pytest.raises(ConfigError, match=r"unknown top-level key\(s\) \['trainer'\]"):
        train_configs(str(f), {})


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    from torchnitro.distributed.train import clip_grad_norm_

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert clip_grad_norm_(a, 0.5) == pytest.approx(want.item(), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
