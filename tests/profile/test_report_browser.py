"""report.html rendered by headless Chromium: it loads offline, every section and the three plots are there."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest
import torch
from torch import nn

from torchnitro.profile import ProfileConfig, profile
from torchnitro.profile.report import SECTIONS

_BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(_BROWSER is None, reason="no Chromium/Chrome installed (apt-get install chromium)")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def _chromium(args: list[str], home) -> subprocess.CompletedProcess:
    profile_dir = home / "chromium-profile"
    return subprocess.run([_BROWSER, *_FLAGS, f"--user-data-dir={profile_dir}", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HOME": str(home)})


def test_report_renders_in_headless_chromium(tmp_path):
    torch.manual_seed(0)
    p = profile(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128)), torch.randn(8, 64),
                ProfileConfig(warmup=1, steps=2, peak_flops=1e10, monitor=False), train=True)
    report = p.save(tmp_path / "prof")
    dom = _chromium(["--dump-dom", report.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for sec in SECTIONS:
        assert f'id="{sec}"' in dom.stdout
    assert dom.stdout.count("<img") == 3 and "matmul" in dom.stdout
    assert "Trace analysis</h2>" in dom.stdout and "outermost ops on 1 thread" in dom.stdout
    shot = tmp_path / "report.png"
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,1800", report.as_uri()], tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1200, 1800)
    if os.environ.get("TORCHNITRO_KEEP_SCREENSHOT"):  # for a person to look at the rendering
        shutil.copyfile(shot, os.environ["TORCHNITRO_KEEP_SCREENSHOT"])
