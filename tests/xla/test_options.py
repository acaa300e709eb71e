"""XlaOptions writes XLA_FLAGS / LIBTPU_INIT_ARGS, and keeps TPU compiler flags out of XLA_FLAGS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.xla.options import XlaOptions, is_tpu_only_flag  # noqa: E402


def test_env_routes_flags_and_merges_with_the_environment():
    opts = XlaOptions(host_device_count=4, cpu_optimization_level=0, latency_hiding_scheduler=True,
                      xla_flags={"xla_cpu_use_thunk_runtime": False},
                      libtpu_args={"xla_tpu_spmd_rng_bit_generator_unsafe": 1})
    env = opts.env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_hlo_as_text",
                    "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false"})
    # the option replaces the same flag from the environment; other flags stay
    assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 --xla_dump_hlo_as_text=true "
                                "--xla_backend_optimization_level=0 --xla_cpu_use_thunk_runtime=false")
    assert env["LIBTPU_INIT_ARGS"] == ("--xla_tpu_enable_latency_hiding_scheduler=true "
                                       "--xla_tpu_spmd_rng_bit_generator_unsafe=1")
    assert "xla_tpu" not in env["XLA_FLAGS"]


def test_tpu_flags_in_xla_flags_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"--xla_tpu_enable_latency_hiding_scheduler.*put them in libtpu_args"):
        XlaOptions(xla_flags={"xla_tpu_enable_latency_hiding_scheduler": True})
    with pytest.raises(ConfigError, match=r"environment has TPU compiler flag\(s\) --xla_tpu_foo.*LIBTPU_INIT_ARGS"):
        XlaOptions().env({"XLA_FLAGS": "--xla_tpu_foo=1"})
    with pytest.raises(ConfigError, match="cpu_optimization_level=5"):
        XlaOptions(cpu_optimization_level=5)
    assert is_tpu_only_flag("--xla_tpu_x=1") and not is_tpu_only_flag("xla_force_host_platform_device_count")


def test_apply_refuses_once_a_backend_has_started():
    jax.devices()  # the test session's backend is up
    with pytest.raises(ConfigError, match="already started"):
        XlaOptions(host_device_count=2).apply()


def test_applied_options_take_effect_in_a_fresh_cpu_process():
    """TPU flags land in LIBTPU_INIT_ARGS, so the CPU process starts (in XLA_FLAGS it would abort)."""
    code = ("from torchnitro.xla.options import XlaOptions; "
            "XlaOptions(host_device_count=3, latency_hiding_scheduler=True).apply(); "
            "import jax; print(jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "3"
