"""The process settings a CPU timing depends on, recorded beside every result.

The C allocator's history moves eager latency (issue 14: MobileNetV3 138 ms with glibc's defaults,
66.5 ms with ``MALLOC_MMAP_THRESHOLD_=268435456``), and thread variables decide how many cores each
runtime takes; a number means little without the settings it was measured under.

**Every timing process runs under ``ALLOCATOR_SETTING``** (``timing_process_env``) unless the environment
already chooses the allocator's thresholds (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or their
``GLIBC_TUNABLES``, a malloc replacement such as jemalloc in ``LD_PRELOAD``, a non-glibc C library: then it
inherits that; other ``MALLOC_*`` variables such as ``MALLOC_ARENA_MAX`` combine with the setting, and another
preloaded library, e.g. Intel's OpenMP, does not count). Why: with glibc's default thresholds a fresh process of torch's
eager returns some of each call's freed activations to the kernel and faults them in again on the next call,
and how many depends on which of torch's threads freed what first, so it differs from process to process
(``python benchmarks/eager_spread.py``: results/eager_spread.md gives each built-in's eager p50 and page faults per
call in fresh processes with and without the setting). That draw, 10-20% wide for the built-in encoder here, was
larger than the 5% the comparison's checks allow, so no comparison of one fresh process with another could agree;
under the setting the processes agree and the number is the model's, not the draw's. What glibc's
defaults cost a variant is measured separately (``autotune.fair.tune_allocator``: the chosen variant and
eager each in a fresh process with glibc's defaults beside their processes under the setting, with the page
faults per call), reported, and the setting goes into the artifact unless the defaults were faster.

The setting is also a knob for deployment: ``torchnitro.load`` / ``serve`` apply what an artifact records.
glibc reads ``MALLOC_*`` variables once, when a process starts;
``apply_allocator`` therefore does two things in a running process: it sets the same thresholds
with ``mallopt()`` (glibc's call for changing them at run time; allocations from then on follow
them) and puts the variables into ``os.environ``, so every process started from here on (serve's
worker processes) reads them at its start (``torchnitro.load`` does only the first: it changes no
environment; ``torchnitro serve`` does both). To have them from a process's very first allocation,
start it with them set: ``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912 torchnitro serve DIR``.

Every timing process (``bench.isolated.ChildTimer``: the optimizer's final comparison and the benchmarks'
"alone" side) starts with the OpenMP wait setting it will be deployed with: ``THREAD_SETTING`` adds nothing,
so that is libgomp's default (a waiting thread spins ~300000 times, about 3 ms, before it sleeps) or the
user's own ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``. A bounded spin (``GOMP_SPINCOUNT=10000``) was tried
for every timing process and measured wrong: on a quiet machine it made a small model's eager slower than
the default (``mlp`` 7.6 vs 3.3 ms p50; git show bcfd875^:results/timing_fairness.md, "OpenMP wait settings"), so
speedups read high. What the default spin does to a sample when anything else runs is handled by the timing gate
instead (``bench.quiet``: a sample starts only while the other timing processes are idle and is retaken
when foreign CPU ran beside it). Both settings are part of every recorded environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path
from typing import Mapping

import torch

__all__ = ["timing_environment", "describe_environment", "ALLOCATOR_SETTING", "allocator_untunable",
           "apply_allocator", "THREAD_SETTING", "timing_process_env", "GLIBC_DEFAULTS"]

# glibc's mmap threshold 256 MiB and trim threshold 512 MiB: freed blocks stay in the heap for the next call
# instead of going back to the kernel and faulting in again (encoder eager in a fresh process: the allocator
# table of benchmarks/timing_fairness.py and results/eager_spread.md; the first run, commit a00afff, had 1.32x with
# both, 1.00x with the mmap threshold alone)
ALLOCATOR_SETTING: dict[str, str] = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "536870912"}
# glibc environment variable -> mallopt() parameter (malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2,
# M_MMAP_THRESHOLD -3, M_MMAP_MAX -4, M_ARENA_MAX -8)
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
            "MALLOC_MMAP_MAX_": -4, "MALLOC_ARENA_MAX": -8}
# an extra environment for ``bench.isolated.ChildTimer`` that starts a timing process with glibc's default
# thresholds (None: the variable is removed from the child's environment)
GLIBC_DEFAULTS: dict[str, None] = {k: None for k in ALLOCATOR_SETTING}

# what every timing process adds to its environment: nothing, so it runs with the OpenMP wait it is deployed
# with (see the module docstring; the bounded spin it replaced: git show bcfd875^:results/timing_fairness.md)
THREAD_SETTING: dict[str, str] = {}
_THREAD_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's own choice of either wins over THREAD_SETTING

_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ORT_", "OV_", "GLIBC_TUNABLES")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# a preloaded library whose file name holds one of these replaces malloc (libjemalloc, libtcmalloc, libmimalloc,
# libtbbmalloc_proxy, libsnmalloc, librpmalloc, libhoard, scudo); others (libiomp5, a profiler) leave glibc's
_PRELOADED_ALLOCATOR_WORDS = ("malloc", "hoard", "scudo")
# glibc's tunable for each variable (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...: the same knob, another spelling)
_TUNABLES = {"MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold", "MALLOC_TOP_PAD_": "glibc.malloc.top_pad",
             "MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold", "MALLOC_MMAP_MAX_": "glibc.malloc.mmap_max",
             "MALLOC_ARENA_MAX": "glibc.malloc.arena_max"}


def _loaded_allocators() -> list[str]:
    """Non-default allocators mapped into this process (LD_PRELOAD or linked), from /proc/self/maps."""
    maps = Path("/proc/self/maps")
    text = maps.read_text(errors="replace") if maps.exists() else os.environ.get("LD_PRELOAD", "")
    return sorted({a for a in _ALLOCATORS if a in text})


def _preloaded_allocators(value: str | None) -> list[str]:
    """The libraries of an ``LD_PRELOAD`` value that replace malloc, by file name (``_PRELOADED_ALLOCATOR_WORDS``)."""
    libs = (value or "").replace(":", " ").split()
    return [lib for lib in libs if any(w in Path(lib).name.lower() for w in _PRELOADED_ALLOCATOR_WORDS)]


# the glibc tunables that set what ALLOCATOR_SETTING sets (a tunable wins over the MALLOC_* variable)
_THRESHOLD_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def _malloc_tunables(value: str | None) -> list[str]:
    """The entries of a ``GLIBC_TUNABLES`` value (``name=value`` separated by ``:``) that set one of
    ``ALLOCATOR_SETTING``'s thresholds (other ``glibc.malloc.*`` tunables, e.g. arena_max, combine with it)."""
    return [t for t in (value or "").split(":") if t.partition("=")[0] in _THRESHOLD_TUNABLES]


def timing_process_env(environ: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """What every timing process adds to the environment it inherits (``environ``, default ``os.environ``; a
    None value: a variable the caller removes): ``THREAD_SETTING``, or nothing when ``environ`` already sets
    OpenMP's wait policy or libgomp's spin count; and ``ALLOCATOR_SETTING`` unless ``environ`` already chooses
    the allocator's thresholds (``allocator_untunable``: ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``,
    their ``GLIBC_TUNABLES``, a malloc replacement in ``LD_PRELOAD``, another C library)."""
    environ = os.environ if environ is None else environ
    present = {k: v for k, v in environ.items() if v is not None}
    out = {} if any(k in present for k in _THREAD_VARS) else dict(THREAD_SETTING)
    if allocator_untunable(present) is None and not any(k in environ for k in ALLOCATOR_SETTING):
        out.update(ALLOCATOR_SETTING)  # a threshold key removed by the caller (None) also means "leave glibc's"
    return out


def timing_environment() -> dict[str, str]:
    """Allocator, allocator/thread environment variables and torch's thread counts of this process, and
    (``timing_processes``) what the timing processes started from it add."""
    libc, ver = platform.libc_ver()
    default = f"{libc} {ver} malloc".strip() if libc else "system malloc"
    env = {"allocator": ", ".join(_loaded_allocators()) or default}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(_PREFIXES)})
    if os.environ.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    env["torch_threads"] = str(torch.get_num_threads())
    env["torch_interop_threads"] = str(torch.get_num_interop_threads())
    env["timing_processes"] = " ".join(f"{k}={v}" for k, v in timing_process_env().items()) or "inherited"
    return env


def describe_environment(env: dict[str, str] | None = None) -> str:
    """One line for a report: ``allocator glibc 2.36 malloc (default thresholds), torch threads 2, ...``."""
    env = dict(env if env is not None else timing_environment())
    alloc = env.pop("allocator")
    if not any(k.startswith("MALLOC_") for k in env) and not _malloc_tunables(env.get("GLIBC_TUNABLES")) \
            and "malloc" in alloc:
        alloc += " (default thresholds)"
    threads = f"torch threads {env.pop('torch_threads')} (inter-op {env.pop('torch_interop_threads')})"
    children = env.pop("timing_processes", None)
    added = dict(kv.split("=", 1) for kv in children.split()) if children and children != "inherited" else {}
    own = any(k in env for k in _THREAD_VARS)
    extra = []
    if children is not None:
        mall = {k: v for k, v in added.items() if k.startswith("MALLOC_")}
        if mall:
            extra.append("timing processes started with " + " ".join(f"{k}={v}" for k, v in mall.items())
                         + " (glibc's thresholds fixed: no page faults from returned memory, the same in every "
                           "process)")
        else:
            extra.append("timing processes inherit this allocator setting")
        thr = {k: v for k, v in added.items() if not k.startswith("MALLOC_")}
        extra.append("timing processes started with " + " ".join(f"{k}={v}" for k, v in thr.items()) if thr
                     else "timing processes inherit this OpenMP wait setting" if own
                     else "timing processes run libgomp's default OpenMP wait (nothing added)")
    return ", ".join([f"allocator {alloc}", threads] + [f"{k}={v}" for k, v in env.items()] + extra)


def allocator_untunable(environ: Mapping[str, str] | None = None) -> str | None:
    """Why the glibc allocator setting cannot be tried in processes started with ``environ`` (default
    ``os.environ``, which processes started from here inherit), or None."""
    environ = os.environ if environ is None else environ
    if platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc (the MALLOC_* thresholds are glibc's)"
    other = _loaded_allocators()
    preloaded = _preloaded_allocators(environ.get("LD_PRELOAD"))
    if other or preloaded:
        return f"another allocator is in use ({', '.join(other) or 'LD_PRELOAD ' + ':'.join(preloaded)})"
    # only the thresholds the setting sets: MALLOC_ARENA_MAX (set by some container images) and the like combine
    # with it, and dropping the setting for them would bring back the 10-20% spread between fresh processes
    preset = sorted(k for k in environ if k in ALLOCATOR_SETTING) + _malloc_tunables(environ.get("GLIBC_TUNABLES"))
    if preset:
        return f"{', '.join(preset)} already set in this environment (every process started from here inherits it)"
    return None


def _mallopt(param: int, value: int) -> bool:
    path = ctypes.util.find_library("c")
    if platform.libc_ver()[0] != "glibc" or path is None:
        return False
    return bool(ctypes.CDLL(path).mallopt(ctypes.c_int(param), ctypes.c_int(value)))


def apply_allocator(setting: Mapping[str, str], *, environ: bool = True) -> dict[str, str]:
    """Put a recorded allocator setting into effect in this process (``mallopt``) and, with ``environ``, in
    every process started from it (``os.environ``; see the module docstring). Returns the variables applied
    with ``mallopt`` here; a variable already set in the environment is left as the user set it."""
    bad = {k: v for k, v in setting.items() if k not in _MALLOPT or not str(v).isdigit() or int(v) >= 2**31}
    if bad:
        from torchnitro.errors import InputError

        raise InputError(f"allocator setting: received {bad}; expected variables among {sorted(_MALLOPT)} with "
                         "non-negative integer values below 2**31 (bytes or counts, as glibc reads them)")
    applied = {}
    tunables = {t.partition("=")[0] for t in _malloc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    for key, value in setting.items():
        if key in os.environ or _TUNABLES[key] in tunables:  # the user's own choice wins (either spelling)
            continue
        if environ:
            os.environ[key] = str(value)
        if _mallopt(_MALLOPT[key], int(value)):
            applied[key] = str(value)
    return applied
