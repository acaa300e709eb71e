"""Memory planning without a TPU: compile the sharded step and read XLA's buffer assignment.

``plan_memory`` lowers the real train step with ShapeDtypeStructs (nothing is allocated) and
compiles it for the host devices or, through ``libtpu``, for a TPU topology on this CPU; the
executable's ``memory_analysis()`` gives per-device argument, output, alias and temp bytes, i.e.
XLA's own plan of the device memory. ``torchnitro.xla.estimate`` is the analytic counterpart
(TPU-tiled arguments, residuals saved per remat policy, loss-head buffers, FSDP gathers), so the two
can be compared; ``find_batch_size`` searches the largest batch whose compiled peak fits a budget.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import optax
from jax.sharding import Mesh

from torchnitro.errors import BudgetError, ConfigError
from torchnitro.xla.dump import read_buffer_dump
from torchnitro.xla.estimate import MemoryEstimate, estimate_memory
from torchnitro.xla.lm import batch_spec, lm_train_step
from torchnitro.xla.mesh import TPU_HBM_GIB, MeshConfig, make_mesh, parse_target
from torchnitro.xla.model import LMConfig, param_spec
from torchnitro.xla.train import TrainStep

__all__ = ["CompiledMemory", "MemoryPlan", "plan_memory", "plan_lm_cell", "find_batch_size", "find_lm_batch_size",
           "hbm_per_device"]

GIB = 1024**3


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes from ``compiled.memory_analysis()``."""

    argument: int  # inputs: parameter, optimizer-state and batch shards
    output: int  # results (new parameters and state, loss)
    alias: int  # outputs written into donated inputs (counted in both argument and output)
    temp: int  # scratch: gradients, saved activations, collectives' buffers (see _tpu_temp for v5e)
    code: int  # generated code
    hbm_temp: int | None = None  # XLA's HBM temp allocation from its buffer dump (TPU targets; None on host)

    @property
    def peak(self) -> int:
        """Live bytes at the step's peak as XLA plans them: inputs + fresh outputs + scratch."""
        return self.argument + self.output - self.alias + self.temp


@dataclass(frozen=True)
class MemoryPlan:
    """One configuration, compiled and estimated."""

    target: str  # "host" or a TPU target such as "v5p:2x2x2"
    mesh: dict[str, int]  # axis -> size
    rules: str  # sharding rule set
    remat: str  # remat policy (or "per-layer")
    batch_size: int  # global batch
    seq_len: int  # tokens per sequence
    compiled: CompiledMemory  # what XLA planned
    estimate: MemoryEstimate  # what the analytic model says
    hbm: int | None  # device memory per device for a TPU target, None on host
    flops: float | None  # per-device FLOPs of one step from the compiled cost analysis

    @property
    def fits(self) -> bool | None:
        return None if self.hbm is None else self.compiled.peak <= self.hbm

    @property
    def estimate_error(self) -> float:
        """Relative error of the analytic peak against the compiled peak."""
        return self.estimate.peak / self.compiled.peak - 1.0


def hbm_per_device(target: str, devices: Sequence[Any]) -> int:
    """HBM bytes per JAX device of a TPU slice (a chip's HBM split over its cores when they are separate)."""
    t = parse_target(target)
    chips = math.prod(int(p) for p in t.topology.split("x"))
    return int(TPU_HBM_GIB[t.generation] * GIB * chips / len(devices))


def _mesh(mesh: str | MeshConfig, target: str) -> Mesh:
    return make_mesh(mesh, target=None if target == "host" else target)


def _lm_step(cfg: LMConfig, batch_size: int, seq_len: int, mesh: str | MeshConfig, rules: str,
             remat: str | Sequence[str], target: str, opt: optax.GradientTransformation) -> TrainStep:
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    m = _mesh(mesh, target)
    dp = m.shape.get("data", 1) * m.shape.get("fsdp", 1)
    if batch_size % dp:
        raise ConfigError(f"batch_size={batch_size} does not divide over the {dp} data-parallel devices of mesh "
                          f"{dict(m.shape)}; use a multiple of {dp}")
    return lm_train_step(cfg, opt, m, rules, batch_size, seq_len, remat=remat)


def _hbm(target: str, step: TrainStep) -> int | None:
    return None if target == "host" else hbm_per_device(target, list(step.mesh.devices.flat))


def _hbm_temp_allocation(dump_dir: str) -> int | None:
    try:
        return read_buffer_dump(dump_dir).temp_by_color.get(0, 0)
    except (ConfigError, OSError):  # no dump written (another libtpu, other flags): memory_analysis alone
        return None


def _tpu_temp(reported: int, hbm_temp: int | None, target: str) -> int:
    """memory_analysis temp, or XLA's HBM temp allocation where libtpu reports 0 for a program that has one.

    libtpu 0.0.42.1 reports temp 0 for v5e programs whose dumped buffer assignment holds megabytes of HBM
    temp (docs/xla.md, "What memory_analysis temp is on a TPU"); a planner that took the 0 would call
    every such program a fit.
    """
    if reported == 0 and hbm_temp:
        warnings.warn(f"{target}: compiled.memory_analysis() reports temp 0 but XLA's buffer assignment has "
                      f"{hbm_temp / 2**20:.1f} MiB of HBM temp; using the buffer assignment's number",
                      stacklevel=3)
        return hbm_temp
    return reported


def plan_memory(cfg: LMConfig, batch_size: int, seq_len: int, *, mesh: str | MeshConfig = "1x-1x1",
                rules: str = "fsdp", remat: str | Sequence[str] = "none", target: str = "host",
                optimizer: optax.GradientTransformation | None = None, dump_dir: str | None = None) -> MemoryPlan:
    """Compile the LM's sharded train step for ``target`` (no execution) and report its memory per device.

    ``dump_dir`` keeps XLA's dump of the compile there (``torchnitro.xla.dump.read_buffer_dump`` reads it).
    """
    opt = optimizer or optax.adamw(1e-3)
    step = _lm_step(cfg, batch_size, seq_len, mesh, rules, remat, target, opt)
    params = param_spec(cfg)
    lowered = step.lower(params, jax.eval_shape(opt.init, params), batch_spec(batch_size, seq_len))
    hbm_temp = None
    if target == "host" and dump_dir is None:
        compiled = lowered.compile()
    else:  # XLA's own HBM temp allocation from its buffer dump, beside memory_analysis (see _tpu_temp)
        with tempfile.TemporaryDirectory(prefix="torchnitro-xla-dump-") as tmp:
            d = dump_dir or tmp
            compiled = lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True})
            hbm_temp = _hbm_temp_allocation(d) if target != "host" else None
    ma = compiled.memory_analysis()
    cm = CompiledMemory(ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                        _tpu_temp(ma.temp_size_in_bytes, hbm_temp, target), ma.generated_code_size_in_bytes,
                        hbm_temp)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax returned one dict per program
    return MemoryPlan(target=target, mesh=dict(step.mesh.shape), rules=rules,
                      remat=remat if isinstance(remat, str) else "per-layer", batch_size=batch_size, seq_len=seq_len,
                      compiled=cm, estimate=estimate_memory(cfg, step, batch_size, seq_len, remat),
                      hbm=_hbm(target, step), flops=(cost or {}).get("flops"))


def plan_lm_cell(cfg: LMConfig, batch_size: int, seq_len: int, *, mesh: str | MeshConfig = "1x-1x1",
                 rules: str = "fsdp", remat: str = "none", target: str = "host",
                 compile: bool = True) -> dict[str, Any]:
    """One row of ``torchnitro xla plan``: compiled bytes (when ``compile``) and the estimate, per device."""
    if not compile:
        step = _lm_step(cfg, batch_size, seq_len, mesh, rules, remat, target, optax.adamw(1e-3))
        est = estimate_memory(cfg, step, batch_size, seq_len, remat)
        hbm = _hbm(target, step)
        return dict(remat=remat, batch=batch_size, est_argument=est.argument, est_temp=est.temp,
                    est_peak=est.peak, hbm=hbm, fits=None if hbm is None else est.peak <= hbm)
    p = plan_memory(cfg, batch_size, seq_len, mesh=mesh, rules=rules, remat=remat, target=target)
    c, e = p.compiled, p.estimate
    return dict(remat=remat, batch=batch_size, argument=c.argument, temp=c.temp, peak=c.peak,
                est_argument=e.argument, est_temp=e.temp, est_peak=e.peak, error=p.estimate_error, hbm=p.hbm,
                fits=p.fits, flops=p.flops)


def find_batch_size(peak_bytes: Callable[[int], int], budget: int, *, multiple: int = 1,
                    max_batch: int = 1 << 16) -> int:
    """Largest batch (a multiple of ``multiple``) with ``peak_bytes(batch) <= budget``, by doubling then bisection.

    ``peak_bytes`` is usually ``lambda b: plan_memory(cfg, b, ...).compiled.peak`` (one compile per
    probe) with ``budget = hbm_fraction * plan.hbm``; a fake function makes the search testable.
    """
    if budget <= 0 or multiple < 1:
        raise ConfigError(f"find_batch_size: budget={budget} bytes, multiple={multiple}; expected both positive")
    first = peak_bytes(multiple)
    if first > budget:
        raise BudgetError(f"even batch {multiple} needs {first / GIB:.2f} GiB per device, over the budget of "
                          f"{budget / GIB:.2f} GiB; shard more (fsdp/tensor), remat, or use a bigger target")
    lo, hi = 1, 2  # in units of `multiple`: lo fits; hi is the first candidate not yet known to fit
    while hi * multiple <= max_batch and peak_bytes(hi * multiple) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch // multiple + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_bytes(mid * multiple) <= budget:
            lo = mid
        else:
            hi = mid
    return lo * multiple


def find_lm_batch_size(cfg: LMConfig, seq_len: int, target: str, *, mesh: str | MeshConfig = "1x-1x1",
                       rules: str = "fsdp", remat: str | Sequence[str] = "none", hbm_fraction: float = 0.9,
                       plan: Callable[..., MemoryPlan] = plan_memory) -> int:
    """Largest global batch whose compiled peak fits ``hbm_fraction`` of the TPU ``target``'s HBM per device.

    Every probe is an AOT compile for the target (seconds each); ``plan`` is injectable for tests.
    """
    if target == "host":
        raise ConfigError("find_lm_batch_size needs a TPU target such as 'v5e:2x2' (host devices have no HBM "
                          "budget); call find_batch_size with your own budget instead")
    if not 0 < hbm_fraction <= 1:
        raise ConfigError(f"hbm_fraction={hbm_fraction}; expected a fraction in (0, 1]")
    m = _mesh(mesh, target)
    dp = m.shape.get("data", 1) * m.shape.get("fsdp", 1)
    budget = int(hbm_fraction * hbm_per_device(target, list(m.devices.flat)))

    def peak(b: int) -> int:
        return plan(cfg, b, seq_len, mesh=mesh, rules=rules, remat=remat, target=target).compiled.peak

    return find_batch_size(peak, budget, multiple=dp)
