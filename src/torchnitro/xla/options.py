"""Runtime and compiler options as one typed config that writes ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``.

Two environment variables carry XLA's options and they are read once, when the first backend
starts (not when jax is imported):

* ``XLA_FLAGS`` is parsed by every XLA backend in the process, CPU included, and an unknown flag
  is fatal: ``XLA_FLAGS=--xla_tpu_...`` aborts a CPU-only process with "Unknown flag in
  XLA_FLAGS" (a C++ abort, no Python exception). TPU compiler flags therefore never go there.
* ``LIBTPU_INIT_ARGS`` is read by libtpu only: the TPU compiler's flags (``--xla_tpu_*``, the
  latency-hiding scheduler, async collectives) belong here. It also applies to AOT compiles for a
  TPU topology on a CPU.

``XlaOptions.env()`` returns both strings (merged with what the environment already has, a flag
given here replacing the same flag there); ``apply()`` writes them and refuses once a backend has
started, because the new values would silently not take effect.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping

from torchnitro.errors import ConfigError

__all__ = ["XlaOptions", "TPU_ONLY_PREFIXES", "is_tpu_only_flag"]

# flag-name prefixes that only libtpu's flag parser knows; in XLA_FLAGS they abort a non-TPU process
TPU_ONLY_PREFIXES = ("xla_tpu_", "xla_jf_", "xla_sc_", "xla_mosaic_", "megascale_", "tpu_")


def is_tpu_only_flag(name: str) -> bool:
    """True for a flag (with or without leading dashes / ``=value``) that only the TPU compiler accepts."""
    return name.lstrip("-").split("=", 1)[0].startswith(TPU_ONLY_PREFIXES)


def _fmt(value: bool | int | float | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse(flags: str) -> dict[str, str]:
    """``"--a=1 --b"`` -> {"a": "1", "b": "true"} (insertion order kept)."""
    out: dict[str, str] = {}
    for tok in flags.split():
        name, _, value = tok.lstrip("-").partition("=")
        out[name] = value or "true"
    return out


def _join(flags: Mapping[str, str]) -> str:
    return " ".join(f"--{k}={v}" for k, v in flags.items())


@dataclass(frozen=True)
class XlaOptions:
    """XLA runtime/compiler options; None leaves a flag to XLA's default."""

    host_device_count: int | None = None  # split the host CPU into N XLA devices (meshes without accelerators)
    cpu_optimization_level: int | None = None  # 0-3: LLVM opt level of the CPU backend (0 compiles ~40% faster)
    dump_to: str | None = None  # directory for HLO / buffer-assignment dumps of every compile
    latency_hiding_scheduler: bool | None = None  # TPU: overlap collectives with compute (libtpu)
    async_collectives: bool | None = None  # TPU: async all-gather / reduce-scatter / all-reduce (libtpu)
    xla_flags: dict[str, bool | int | float | str] = field(default_factory=dict)  # more XLA_FLAGS, no dashes
    libtpu_args: dict[str, bool | int | float | str] = field(default_factory=dict)  # more LIBTPU_INIT_ARGS

    def __post_init__(self) -> None:
        if self.host_device_count is not None and self.host_device_count < 1:
            raise ConfigError(f"host_device_count={self.host_device_count}; expected a device count >= 1")
        if self.cpu_optimization_level is not None and self.cpu_optimization_level not in (0, 1, 2, 3):
            raise ConfigError(f"cpu_optimization_level={self.cpu_optimization_level}; expected 0, 1, 2 or 3")
        tpu_in_xla = [k for k in self.xla_flags if is_tpu_only_flag(k)]
        if tpu_in_xla:
            raise ConfigError(
                f"xla_flags has TPU compiler flag(s) {', '.join('--' + k.lstrip('-') for k in tpu_in_xla)}: XLA_FLAGS "
                "is parsed by every backend and an unknown flag aborts a CPU-only process ('Unknown flag in "
                "XLA_FLAGS'); put them in libtpu_args (LIBTPU_INIT_ARGS), which only libtpu reads")

    def _xla(self) -> dict[str, str]:
        f: dict[str, str] = {}
        if self.host_device_count is not None:
            f["xla_force_host_platform_device_count"] = str(self.host_device_count)
        if self.cpu_optimization_level is not None:
            f["xla_backend_optimization_level"] = str(self.cpu_optimization_level)
        if self.dump_to is not None:
            f["xla_dump_to"] = self.dump_to
        f.update({k.lstrip("-"): _fmt(v) for k, v in self.xla_flags.items()})
        return f

    def _libtpu(self) -> dict[str, str]:
        f: dict[str, str] = {}
        if self.latency_hiding_scheduler is not None:
            f["xla_tpu_enable_latency_hiding_scheduler"] = _fmt(self.latency_hiding_scheduler)
        if self.async_collectives is not None:
            for op in ("all_gather", "reduce_scatter", "all_reduce"):
                f[f"xla_tpu_enable_async_{op}"] = _fmt(self.async_collectives)
        f.update({k.lstrip("-"): _fmt(v) for k, v in self.libtpu_args.items()})
        return f

    def env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """``{"XLA_FLAGS": ..., "LIBTPU_INIT_ARGS": ...}`` merged over ``environ`` (default: os.environ).

        A TPU-only flag already in the environment's XLA_FLAGS is refused too: that process would abort.
        """
        environ = os.environ if environ is None else environ
        xla = _parse(environ.get("XLA_FLAGS", ""))
        bad = [k for k in xla if is_tpu_only_flag(k)]
        if bad:
            raise ConfigError(f"XLA_FLAGS in the environment has TPU compiler flag(s) "
                              f"{', '.join('--' + k for k in bad)}; a CPU-only process aborts on them. Move them to "
                              "LIBTPU_INIT_ARGS (or XlaOptions.libtpu_args)")
        xla.update(self._xla())
        tpu = _parse(environ.get("LIBTPU_INIT_ARGS", ""))
        tpu.update(self._libtpu())
        return {"XLA_FLAGS": _join(xla), "LIBTPU_INIT_ARGS": _join(tpu)}

    def apply(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Write the two variables into ``environ`` (default os.environ) before any XLA backend starts."""
        if environ is None:
            xb = sys.modules.get("jax._src.xla_bridge")
            if xb is not None and xb.backends_are_initialized():
                raise ConfigError("XlaOptions.apply: a JAX backend has already started and read XLA_FLAGS; apply the "
                                  "options before the first jax computation (or in a fresh process)")
            environ = os.environ
        new = self.env(environ)
        for k, v in new.items():
            if v:
                environ[k] = v
        return new
