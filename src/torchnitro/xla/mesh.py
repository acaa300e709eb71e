"""Device meshes for the TPU path: a shape string and axis names -> ``jax.sharding.Mesh``.

The mesh is built either over the devices this process sees (TPU, GPU, or host CPU devices made
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``) or over the devices of a TPU
*topology description* (``target="v5p:2x2x2"``), which needs the ``libtpu`` wheel but no TPU: it
lets ``jax.jit(...).lower(...).compile()`` produce a real TPU executable on this CPU, for memory
planning (see ``torchnitro.xla.memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from torchnitro.errors import BackendUnavailableError, ConfigError

__all__ = ["KNOWN_AXES", "TPU_HBM_GIB", "MeshConfig", "TpuTarget", "make_mesh", "parse_target", "target_devices"]

# mesh axes the sharding rules know about (torchnitro.xla.rules); data and fsdp both split the batch,
# fsdp also splits the parameters, tensor splits heads / MLP hidden / vocab (Megatron-style)
KNOWN_AXES = ("data", "fsdp", "tensor")

# HBM per chip in GiB, from Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e Trillium)
TPU_HBM_GIB: dict[str, float] = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}


@dataclass(frozen=True)
class MeshConfig:
    """A logical device mesh: one size per named axis; at most one size may be -1 (inferred)."""

    shape: tuple[int, ...] = (1, -1, 1)  # size per axis; -1: whatever makes the product the device count
    axes: tuple[str, ...] = KNOWN_AXES  # axis names, in mesh order (outermost first)

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ConfigError(f"mesh shape {self.shape} has {len(self.shape)} sizes but axes {self.axes} has "
                              f"{len(self.axes)} names; give one size per axis")
        unknown = [a for a in self.axes if a not in KNOWN_AXES]
        if unknown:
            raise ConfigError(f"unknown mesh axis {unknown[0]!r} in {self.axes}; known axes: {', '.join(KNOWN_AXES)}")
        if len(set(self.axes)) != len(self.axes):
            raise ConfigError(f"mesh axes {self.axes} repeat a name; each axis appears once")
        bad = [s for s in self.shape if s != -1 and s < 1]
        if bad or self.shape.count(-1) > 1:
            raise ConfigError(f"mesh shape {self.shape}: sizes must be >= 1, with at most one -1 (inferred)")

    @classmethod
    def parse(cls, spec: str, axes: Sequence[str] = KNOWN_AXES) -> MeshConfig:
        """``"2x2x2"`` or ``"-1x2"`` -> MeshConfig; the number of sizes must match ``axes``."""
        try:
            shape = tuple(int(s) for s in spec.lower().split("x"))
        except ValueError:
            raise ConfigError(f"mesh shape {spec!r} is not sizes joined by 'x' (expected e.g. '2x2x2' or '-1x2x1')"
                              ) from None
        return cls(shape, tuple(axes))

    def resolve(self, n_devices: int) -> tuple[int, ...]:
        """The concrete shape for ``n_devices``, with the -1 filled in; errors when sizes disagree."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if n_devices % known:
                raise ConfigError(f"mesh {self.shape} over {self.axes}: the fixed sizes multiply to {known}, which "
                                  f"does not divide the {n_devices} devices; pick sizes whose product divides "
                                  f"{n_devices}")
            return tuple(n_devices // known if s == -1 else s for s in self.shape)
        if known != n_devices:
            raise ConfigError(f"mesh {self.shape} over {self.axes} needs {known} devices but {n_devices} are "
                              f"available; make the product {n_devices} or use -1 for one axis")
        return self.shape


@dataclass(frozen=True)
class TpuTarget:
    """A TPU generation and slice topology, e.g. ``v5p:2x2x2`` (chips along each torus dimension)."""

    generation: str  # "v4", "v5e", "v5p", "v6e"
    topology: str  # chips per dimension, "2x2" or "2x2x2"

    @property
    def name(self) -> str:
        return f"{self.generation}:{self.topology}"


def parse_target(target: str) -> TpuTarget:
    """``"v5p:2x2x2"`` -> TpuTarget; unknown generations and malformed topologies raise ConfigError."""
    gen, sep, topo = target.partition(":")
    if not sep or gen not in TPU_HBM_GIB:
        raise ConfigError(f"TPU target {target!r}: expected '<generation>:<topology>' with generation one of "
                          f"{', '.join(TPU_HBM_GIB)} (e.g. 'v5p:2x2x2')")
    if not topo or not all(p.isdigit() and int(p) > 0 for p in topo.split("x")):
        raise ConfigError(f"TPU target {target!r}: topology {topo!r} is not chip counts joined by 'x' (e.g. '2x2')")
    return TpuTarget(gen, topo)


def target_devices(target: str) -> list[Any]:
    """The devices of a TPU topology description (no TPU needed, but the ``libtpu`` wheel is)."""
    t = parse_target(target)
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=t.name)
    except Exception as exc:  # libtpu missing, too old for this generation, or locked by another process
        fix = ("another process holds libtpu's lockfile: set ALLOW_MULTIPLE_LIBTPU_LOAD=1 before jax starts "
               "(AOT compiles use no TPU)" if "lockfile" in str(exc) else
               "install the matching libtpu wheel (pip install 'torchnitro[xla]')")
        raise BackendUnavailableError(f"cannot describe TPU topology {t.name!r} here ({type(exc).__name__}: {exc}); "
                                      f"{fix}") from exc
    return list(topo.devices)


def make_mesh(shape: str | MeshConfig, axes: Sequence[str] = KNOWN_AXES, *, target: str | None = None,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` of the given shape over local devices, explicit ``devices``, or a TPU ``target`` topology."""
    cfg = shape if isinstance(shape, MeshConfig) else MeshConfig.parse(shape, axes)
    if target is not None and devices is not None:
        raise ConfigError("make_mesh: pass either target= (a TPU topology) or devices=, not both")
    devs = target_devices(target) if target is not None else list(devices if devices is not None else jax.devices())
    dims = cfg.resolve(len(devs))
    if devs[0].platform == "tpu" and len({tuple(d.coords) for d in devs if hasattr(d, "coords")}) == len(devs):
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(dims, devs)  # follows the torus so neighbours share links
    else:  # host devices, or a TPU described per core (v4 without megacore: two devices share a chip's coords)
        grid = np.asarray(devs, dtype=object).reshape(dims)
    return Mesh(grid, cfg.axes)
