from __future__ import annotations

import pytest

from torchnitro.cli import main
from torchnitro.errors import InputError
from torchnitro.memory.cli import parse_bytes


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("version: 1\n"
                 "model: {dim: 32, n_layers: 1, n_heads: 2, vocab_size: 64, max_seq_len: 32}\n"
                 "memory: {batch: 2, seq: 16, dtype: bf16, checkpointing: blocks, budget: 2MiB, max_val: 64}\n")
    return p


def test_plan_prints_terms(cfg, capsys):
    assert main(["memory", "plan", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "activations/layer" in out and "peak" in out and "blocks" in out


def test_find_batch_prints_answer(cfg, capsys):
    assert main(["memory", "find-batch", "--config", str(cfg), "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "batch size:" in out and "trials" in out


def test_bad_config_is_a_clean_error(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("version: 1\nmemory: {batchsize: 3}\n")
    assert main(["memory", "plan", "--config", str(p)]) == 2
    assert "batchsize" in capsys.readouterr().err
    assert main(["memory", "plan", "--checkpointing", "sometimes"]) == 2


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(100) == 100
    with pytest.raises(InputError, match="512MiB"):
        parse_bytes("lots")
