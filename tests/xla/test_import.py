"""torchnitro never imports jax by itself: the TPU path costs nothing to users who do not use it."""

from __future__ import annotations

import subprocess
import sys


def test_import_torchnitro_and_xla_package_leave_jax_unimported():
    code = ("import sys, torchnitro, torchnitro.xla; dir(torchnitro.xla); "
            "print('jax' in sys.modules, 'jaxlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
