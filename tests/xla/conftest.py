"""JAX tests run on 8 host CPU devices; the flag must be in the environment before jax is imported.

jax is imported only by tests under tests/xla/ (never by torchnitro itself), so setting the flags
here, when pytest collects this directory, is early enough. Each test module starts with
``pytest.importorskip("jax", ...)`` so that without the [xla] extra the directory skips with a reason.
"""

from __future__ import annotations

import os

import pytest

# 8 host devices for the meshes; LLVM opt level 0 cuts CPU compile time ~40% (the tests are compile-bound,
# the tiny steps run in microseconds) and leaves HLO, buffer assignment and memory analysis unchanged
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# with libtpu installed jax would otherwise probe for a TPU on every start; AOT topologies still work
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes /tmp/libtpu_lockfile per process; AOT compiles touch no TPU, so parallel test runs may share it
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@pytest.fixture(autouse=True)
def _eight_host_devices():
    import jax

    if jax.device_count() < 8:  # jax was imported before this conftest ran: the flag came too late
        pytest.skip(f"need 8 host devices, jax sees {jax.device_count()}: XLA_FLAGS must be set before jax is "
                    "imported")
    yield
