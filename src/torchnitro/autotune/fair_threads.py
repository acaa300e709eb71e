"""The thread-count knob: is the chosen variant faster with fewer intra-op threads than the search used?

The final comparison times every variant with the search's thread count (``OptimizeConfig.threads``; default:
the usable cores). Small models often lose to their own synchronisation at every operator (OpenMP barriers,
ONNX Runtime's and OpenVINO's thread pools), so after the comparison the chosen variant is started again in fresh
processes with fewer threads (half the cores, and one), interleaved with its process at the full count
(``tune_threads``). A count is taken only when it is faster by ``MIN_THREAD_GAIN`` beyond the noise of the paired
ratio; the artifact then records it (``meta_with_threads``: ``meta["torch_threads"]`` for torch's own threads,
and the runtime's own setting where it keeps one: ONNX Runtime's ``meta["threads"]``, OpenVINO's
``INFERENCE_NUM_THREADS``), ``torchnitro.load`` builds ONNX Runtime and OpenVINO sessions with it, and
``torchnitro serve`` gives each worker that many torch threads unless ``--threads`` or the config file's
``serve.threads`` says otherwise (``recorded_threads``; at most the usable cores // workers). ``torchnitro.load``
does not change torch's thread count in your process: read
``OptimizedModel.candidate.meta["torch_threads"]`` and call ``torch.set_num_threads`` yourself if you want it.

The speedups in the report stay those of the comparison (same thread count on both sides); the trial's note
gives the p50 at each count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchnitro.autotune.fair import Steady
from torchnitro.autotune.thread_meta import meta_with_threads
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.ratio import paired_ratio
from torchnitro.bench.timing import TimingConfig, compare

__all__ = ["ThreadTrial", "tune_threads", "start_fewer", "thread_options", "meta_with_threads", "recorded_threads",
           "runtime_of", "MIN_THREAD_GAIN"]

MIN_THREAD_GAIN = 1.03  # fewer threads are recorded when this much faster and beyond the noise


def thread_options(threads: int) -> list[int]:
    """Fewer thread counts worth a trial for a variant timed with ``threads``: half of them and one."""
    return sorted({max(1, threads // 2), 1} - {threads}, reverse=True) if threads > 1 else []


def _kwargs_with_threads(kwargs: dict[str, Any], threads: int) -> dict[str, Any]:
    """The timing process's loader arguments with the variant's meta set to ``threads`` (``fair.load_variant``
    and ``fair.load_standalone`` both take the artifact's meta)."""
    out = dict(kwargs)
    if isinstance(out.get("meta"), dict):
        out["meta"] = meta_with_threads(out["meta"], threads)
    return out


@dataclass
class ThreadTrial:
    """The chosen variant's p50 at the search's thread count and at fewer, each in its own fresh process."""

    threads: int  # what the comparison used
    chosen: int  # what the artifact records (``threads`` unless fewer won)
    p50_ms: dict[int, float] = field(default_factory=dict)
    ratio: float = 1.0  # p50 at ``threads`` / p50 at ``chosen``
    noise: float = 0.0
    runtime: str | None = None  # the runtime whose own thread setting the meta holds (``runtime_of``), if any

    def text(self) -> str:
        times = ", ".join(f"{k} thread{'s' if k > 1 else ''} {ms:.3f} ms" for k, ms in sorted(self.p50_ms.items(),
                                                                                              reverse=True))
        if self.chosen == self.threads:
            verdict = (f"kept {self.threads} (fewer must be >= {MIN_THREAD_GAIN:.2f}x faster beyond the noise)")
        else:
            load = f"torchnitro.load builds its {self.runtime} session with it, " if self.runtime else ""
            verdict = (f"{self.chosen} recorded in the artifact ({self.ratio:.2f}x ±{self.noise:.2f} against "
                       f"{self.threads}; {load}torchnitro serve's workers run that many torch threads)")
        return f"thread count: the chosen variant alone in fresh processes, {times}; {verdict}"


def runtime_of(meta: dict[str, Any]) -> str | None:
    """The runtime whose own thread count an artifact's meta holds (``meta_with_threads`` rewrites it), or None:
    torch's threads only, which ``torchnitro.load`` leaves as the caller set them."""
    ov = meta.get("ov_config")
    if isinstance(ov, dict) and "INFERENCE_NUM_THREADS" in ov:
        return "OpenVINO"
    return "ONNX Runtime" if "threads" in meta else None


def start_fewer(timer: ChildTimer, k: int) -> ChildTimer:
    """A fresh process of ``timer``'s variant with ``k`` threads (torch's and the runtime's own, in its meta);
    returns at once. Raises ``RecipeError`` when it cannot start."""
    return timer.again({}, threads=k, kwargs=_kwargs_with_threads(timer.spec["kwargs"], k),
                       name=f"{timer.name} ({k} thread{'s' if k > 1 else ''})")


def tune_threads(timer: ChildTimer, tc: TimingConfig, options: list[int] | None = None,
                 started: dict[int, ChildTimer] | None = None) -> ThreadTrial | None:
    """Time ``timer``'s variant against fresh processes of it with fewer threads (``thread_options``), all
    interleaved; None when there is no smaller count to try. ``started``: count -> its process, already started by
    the caller (``start_fewer``, beside the other trials' start-ups); closed here like those started here. Raises
    ``RecipeError`` when a process fails."""
    threads = int(timer.spec["threads"])
    options = thread_options(threads) if options is None else [k for k in options if k != threads]
    others: dict[int, ChildTimer] = {k: o for k, o in (started or {}).items() if k in options}
    for k, o in (started or {}).items():
        if k not in others:
            o.close()  # not a count tried here: nothing of it is left running
    if not options:
        return None
    try:
        for k in options:
            if k not in others:
                others[k] = start_fewer(timer, k)
        for o in others.values():
            o.wait_ready()
        res = compare({threads: Steady(timer), **{k: Steady(o) for k, o in others.items()}}, tc)
    finally:
        for o in others.values():
            o.close()
    p50 = {k: t.median * 1e3 for k, t in res.items()}
    best = min(options, key=lambda k: res[k].median)
    est = paired_ratio(res[threads], res[best])
    meta = timer.spec["kwargs"].get("meta")
    runtime = runtime_of(meta) if isinstance(meta, dict) else None
    chosen = best if est.ratio >= MIN_THREAD_GAIN and est.beats_noise else threads
    return ThreadTrial(threads, chosen, p50, est.ratio, est.noise, runtime)


def recorded_threads(source: str | Path | dict[str, Any]) -> int | None:
    """The torch thread count an artifact records (``meta["torch_threads"]``), or None. ``source``: the artifact's
    directory (its manifest read and verified here) or its meta (``fair.recorded_meta``)."""
    from torchnitro.autotune.fair import recorded_meta

    got = recorded_meta(source).get("torch_threads")
    return got if isinstance(got, int) and not isinstance(got, bool) and got >= 1 else None
