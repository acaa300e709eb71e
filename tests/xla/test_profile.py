"""The profiler hook: a jax.profiler trace of the sharded step is written, step times and MFU are reported."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import optax  # noqa: E402

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.xla.lm import lm_train_step, random_batch  # noqa: E402
from torchnitro.xla.mesh import make_mesh  # noqa: E402
from torchnitro.xla.model import LMConfig, init_params  # noqa: E402
from torchnitro.xla.profile import StepProfile, profile_step  # noqa: E402

CFG = LMConfig(vocab_size=128, dim=64, n_layers=1, n_heads=2, max_seq_len=16)


def _step():
    step = lm_train_step(CFG, optax.adamw(1e-3), make_mesh("1x8x1"), "fsdp", 8, 16)
    params, opt = step.init(init_params(CFG))
    return step, params, opt, step.place_batch(random_batch(CFG, 8, 16))


def test_profile_step_writes_a_trace_and_reports_times_and_mfu(tmp_path):
    step, params, opt, batch = _step()
    prof, params, opt = profile_step(step, params, opt, batch, steps=2, trace_dir=str(tmp_path), peak_flops=1e12)
    assert len(prof.step_s) == 2 and all(t > 0 for t in prof.step_s)
    assert any(f.endswith(".xplane.pb") for f in prof.trace_files), prof.trace_files
    assert prof.flops and prof.flops > 0
    assert prof.mfu == pytest.approx(prof.flops / (prof.median_s * 1e12))
    # the updated state is handed back: the step can go on with it
    _, _, loss = step(params, opt, batch)
    assert bool(jax.numpy.isfinite(loss))


def test_profile_step_without_trace_or_peak_has_no_mfu_and_rejects_bad_counts():
    step, params, opt, batch = _step()
    prof, params, opt = profile_step(step, params, opt, batch, steps=1, warmup=0)
    assert prof.trace_dir is None and prof.trace_files == [] and prof.mfu is None
    with pytest.raises(ConfigError, match="steps=0"):
        profile_step(step, params, opt, batch, steps=0)
    assert StepProfile([1.0, 3.0, 2.0], 4.0, 2.0, None).mfu == pytest.approx(1.0)
