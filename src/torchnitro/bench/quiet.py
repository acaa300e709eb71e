"""Taking a timed sample only while the other processes of a timing are idle, and knowing that it was so.

A comparison that alternates several processes (``bench.isolated.ChildTimer``) times one of them while
the others wait; a runtime pool that keeps spinning after its own sample (ONNX Runtime, OpenVINO, libgomp),
a compile-worker pool or a refresh thread of the waiting process then takes cores from the sample. A
fixed settle pause guesses how long that lasts; the gate measures it instead:

1. before each sample, the CPU time of every *other* process of the timing (the waiting process's threads
   other than the one that waits, every descendant of it other than the timed process) is polled: the sum
   of the first field of ``/proc/<pid>/task/*/schedstat`` (nanoseconds on the CPU; ``/proc/<pid>/stat``
   counts 10 ms ticks). The sample starts once their run time grows by less than ``idle_share`` of a
   ``window_s`` window and none of their threads is runnable, or after ``cap_s`` (the sample is then marked);
2. around the sample the same counters are read again, and the machine's busy time from ``/proc/stat``
   (10 ms ticks, so only a gross excess beyond its resolution counts per sample): "foreign CPU" is what
   our other processes and the rest of the machine ran during the sample's wall time; the timed process's
   run-queue delay (second field of schedstat, ns) shows foreign work a short sample's ticks cannot;
3. a sample with foreign CPU above ``foreign_share`` of its wall time is discarded and taken again, at
   most ``retakes`` times; the last one is kept and counted as taken under foreign load. Load that outlasts
   two samples in a row is not a burst: a sibling busy through two capped waits costs one window per sample
   from then on (until it goes idle in time), the rest of the machine busy through every retake of two
   samples is not retaken into any more (until a sample comes clean); both are counted. Our own siblings'
   spin is still waited out and retaken while the rest of the machine is busy.

Our own processes cannot be quieted at the source without changing what is timed: a torch-based child's
libgomp team spins ~3 ms after each sample (its deployed default), an ONNX Runtime or OpenVINO child's pool
less; the gate waits those out (the spin of each timed process during its own sample is part of its time).

``recording()`` collects every gated sample of this process while it is active (the final comparison and
the benchmarks report the counts: samples retaken, taken under foreign load, how long the gate waited, and
which other process burnt CPU during others' samples). ``ignore(pid)`` leaves a process out of "ours"
(a deliberate competitor in a benchmark); the machine-wide reading still sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

__all__ = ["GateConfig", "Reading", "GateStats", "Gate", "recording", "ignore", "process_cpu_ns", "runnable_threads",
           "name_process", "descendants"]

_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)  # /proc/stat's unit
_IGNORED: set[int] = set()  # pids left out of "ours" (``ignore``)
_NAMES: dict[int, str] = {}  # pid -> label for the report (``name_process``)
_COLLECTORS: list["GateStats"] = []  # active ``recording()`` blocks


@dataclass(frozen=True)
class GateConfig:
    """When a sample may start and when it is taken again."""

    window_s: float = 0.005  # the idle check's window: the others' run time is compared over this long
    idle_share: float = 0.02  # ... and must grow by less than this share of it (2%: 0.1 ms in 5 ms)
    cap_s: float = 2.0  # wait at most this long for the others; then the sample is taken and marked (0: no wait,
    # readings only)
    foreign_share: float = 0.05  # a sample with more foreign CPU than this share of its wall time is retaken
    retakes: int = 3  # at most this many retakes of one sample; the last one is kept (counted)
    machine: bool = True  # also retake on the rest of the machine: its CPU beyond /proc/stat's resolution, or the
    # timed process waiting for a CPU (run-queue delay) for more than foreign_share of the sample


@dataclass
class Reading:
    """One sample's window: wall time and the CPU time that ran beside the timed process."""

    wall_s: float
    ours: dict[str, float]  # label -> CPU seconds each other process of ours ran during the window
    machine_s: float | None  # the rest of the machine's busy CPU seconds (None: /proc/stat unreadable)
    delay_s: float  # how long the timed process's threads waited for a CPU (run-queue delay)
    waited_s: float = 0.0  # how long the gate waited for the others before the sample
    capped: bool = False  # the others never went idle within cap_s
    polls: int = 0  # idle-check windows before the sample (1: the others were idle at once)
    timed: str = ""  # the timed process's label

    @property
    def ours_s(self) -> float:
        return sum(self.ours.values())

    def ours_share(self) -> float:
        return self.ours_s / self.wall_s if self.wall_s > 0 else 0.0

    def machine_share(self) -> float:
        return (self.machine_s or 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def foreign(self, cfg: GateConfig) -> str | None:
        """Why this sample counts as taken under foreign load, or None."""
        if self.ours_share() > cfg.foreign_share:
            return "ours"
        if not cfg.machine:
            return None
        slack = 2 * _TICK_S  # two /proc/stat readings, each truncated to a tick
        if self.machine_s is not None and self.machine_s - slack > cfg.foreign_share * self.wall_s:
            return "machine"
        # /proc/stat cannot see a few ms of foreign work in a short sample; the timed process's own run-queue
        # delay (ns) can: its threads waited for a CPU that something else held
        if self.delay_s > cfg.foreign_share * self.wall_s:
            return "run-queue delay"
        return None


@dataclass
class GateStats:
    """Counts over gated samples (one ``Gate``, or everything inside a ``recording()``)."""

    samples: int = 0  # samples kept
    retaken: int = 0  # samples discarded for foreign CPU and taken again
    retaken_for: dict[str, int] = field(default_factory=dict)  # "ours" / "machine" -> retakes
    kept_foreign: int = 0  # kept with foreign CPU above the share (retakes used up)
    capped: int = 0  # taken after the gate's cap without the others idle
    waited_s: float = 0.0  # total time the gate waited for the others
    readings: list[Reading] = field(default_factory=list, repr=False)  # kept samples' windows
    burnt: dict[str, float] = field(default_factory=dict)  # label -> CPU s during others' samples (retaken too)

    def add(self, r: Reading, *, kept: bool, why: str | None) -> None:
        for label, s in r.ours.items():
            self.burnt[label] = self.burnt.get(label, 0.0) + s
        self.waited_s += r.waited_s
        if not kept:
            self.retaken += 1
            self.retaken_for[why or "?"] = self.retaken_for.get(why or "?", 0) + 1
            return
        self.samples += 1
        self.readings.append(r)
        self.capped += int(r.capped)
        self.kept_foreign += int(why is not None)

    def text(self) -> str:
        """One line for a report's timing note."""
        if not self.samples:
            return "timing gate: no gated samples"
        rs = self.readings
        ours = [r.ours_share() for r in rs]
        mach = [r.machine_share() for r in rs if r.machine_s is not None]
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.retaken_for.items()))
        top = sorted(self.burnt.items(), key=lambda kv: -kv[1])[:3]
        out = (f"timing gate: {self.samples} samples, {self.retaken} retaken for foreign CPU above the share"
               + (f" ({why})" if why else "") + f", {self.kept_foreign} kept under foreign load after the retakes, "
               f"{self.capped} taken after the idle wait's cap; waited {self.waited_s:.2f} s in all; foreign CPU "
               f"in kept samples: ours median {statistics.median(ours):.1%} (max {max(ours):.1%})")
        if mach:
            out += f", rest of the machine median {statistics.median(mach):.0%} (10 ms ticks)"
        delay = [r.delay_s / r.wall_s for r in rs if r.wall_s > 0]
        if delay:
            out += f"; the timed process's run-queue delay median {statistics.median(delay):.1%} of the sample"
        if top:
            out += "; our other processes' CPU during others' samples: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in top)
        return out


@contextlib.contextmanager
def recording() -> Iterator[GateStats]:
    """Collect every gated sample taken in this process while the block runs."""
    stats = GateStats()
    _COLLECTORS.append(stats)
    try:
        yield stats
    finally:
        _COLLECTORS.remove(stats)


@contextlib.contextmanager
def ignore(pid: int) -> Iterator[None]:
    """Leave process ``pid`` (and its descendants) out of "ours" while the block runs: a deliberate competitor."""
    _IGNORED.add(pid)
    try:
        yield
    finally:
        _IGNORED.discard(pid)


def name_process(pid: int, label: str | None) -> None:
    """The label a timing process carries in the reports (None: forget it)."""
    if label is None:
        _NAMES.pop(pid, None)
    else:
        _NAMES[pid] = label


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the task or process exited in between
        return None


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _task_ns(pid: int, tid: str, field_index: int) -> int:
    text = _read(f"/proc/{pid}/task/{tid}/schedstat")
    if text is not None:
        return int(text.split()[field_index])
    return 0


def process_cpu_ns(pid: int, *, skip_tid: int | None = None, field_index: int = 0) -> int:
    """Nanoseconds all threads of ``pid`` (but ``skip_tid``) ran on a CPU (``field_index`` 1: waited for one).

    Threads that exited take their time with them: a difference of two readings is clamped at 0 by callers."""
    skip = str(skip_tid) if skip_tid is not None else None
    return sum(_task_ns(pid, t, field_index) for t in _tasks(pid) if t != skip)


def runnable_threads(pid: int, *, skip_tid: int | None = None) -> int:
    """How many threads of ``pid`` (but ``skip_tid``) are running or waiting for a CPU (state R)."""
    skip = str(skip_tid) if skip_tid is not None else None
    n = 0
    for t in _tasks(pid):
        text = _read(f"/proc/{pid}/task/{t}/stat") if t != skip else None
        n += bool(text) and text.rpartition(")")[2].split()[0] == "R"  # type: ignore[union-attr]
    return n


def descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of every live descendant of ``root`` (from ``/proc/*/stat``)."""
    kids: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for p in pids:
        text = _read(f"/proc/{p}/stat")
        if text is None:
            continue
        ppid = int(text.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(p)
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for k in kids.get(parent, []):
            if k not in out:
                out[k] = parent
                todo.append(k)
    return out


def _machine_busy_s() -> float | None:
    text = _read("/proc/stat")
    if text is None or not text.startswith("cpu "):
        return None
    v = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    busy = v[0] + v[1] + v[2] + (sum(v[5:8]) if len(v) >= 8 else 0)  # user nice system irq softirq steal
    return busy * _TICK_S


def _label(pid: int) -> str:
    if pid in _NAMES:
        return _NAMES[pid]
    comm = (_read(f"/proc/{pid}/comm") or "?").strip()
    return f"{comm}[{pid}]"


class _Others:
    """The processes and threads a sample of ``timed`` must not share the machine with, and their counters."""

    def __init__(self, timed: int):
        me, self.tid = os.getpid(), threading.get_native_id()
        self.timed = timed
        tree = descendants(me)
        skip = set()
        for p in _IGNORED:
            skip.add(p)
            skip.update(q for q in tree if _under(q, p, tree))
        self.pids = [p for p in tree if p != timed and p not in skip]
        self.here = timed != me  # this process's other threads count as others when a child is timed
        self.labels = {p: (f"{_NAMES[timed]}'s subprocess {_label(p)}" if timed in _NAMES and _under(p, timed, tree)
                           else _label(p)) for p in self.pids}

    def cpu(self) -> dict[str, int]:
        """label -> ns on a CPU so far."""
        out: dict[str, int] = {}
        for p in self.pids:  # two processes may carry one label: their times add up
            out[self.labels[p]] = out.get(self.labels[p], 0) + process_cpu_ns(p)
        if self.here:
            out["this process's other threads"] = process_cpu_ns(os.getpid(), skip_tid=self.tid)
        return out

    def runnable(self) -> int:
        """Threads of the others that are running or waiting for a CPU."""
        n = sum(runnable_threads(p) for p in self.pids)
        return n + (runnable_threads(os.getpid(), skip_tid=self.tid) if self.here else 0)

    def wait_idle(self, cfg: GateConfig) -> tuple[float, bool, int]:
        """Poll until the others' run time grows by less than ``idle_share`` of ``window_s`` and none of their
        threads is runnable (on a loaded machine a spinning thread can sit a whole window in the run queue);
        (waited s, capped, windows polled)."""
        if cfg.cap_s <= 0:
            return 0.0, False, 0
        t0 = time.perf_counter()
        last, polls = sum(self.cpu().values()), 0
        while True:
            time.sleep(cfg.window_s)
            now, polls = sum(self.cpu().values()), polls + 1
            waited = time.perf_counter() - t0
            if now - last < cfg.idle_share * cfg.window_s * 1e9 and not self.runnable():
                return waited, False, polls
            if waited >= cfg.cap_s:
                return waited, True, polls
            last = now


def _under(pid: int, ancestor: int, tree: dict[int, int]) -> bool:
    while pid in tree:
        if pid == ancestor:
            return True
        pid = tree[pid]
    return pid == ancestor


class Gate:
    """Gated samples of one timed process (``timed_pid``; this process's pid for work timed here)."""

    def __init__(self, cfg: GateConfig | None = None):
        self.cfg = cfg or GateConfig()
        self.stats = GateStats()
        self._machine_streak = 0  # samples in a row kept with the rest of the machine busy after their retakes
        self._capped_streak = 0  # samples in a row taken after the idle wait's cap

    def sample(self, timed_pid: int, take: Callable[[], float]) -> float:
        """Wait for the others to idle, run ``take()`` (one sample, its seconds per call), read what ran beside it;
        retake a sample with foreign CPU above the share (bounded). Returns the kept sample's value."""
        cfg = self.cfg
        attempt = 0
        while True:
            others = _Others(timed_pid)
            # a sibling busy throughout (two samples in a row after the cap) costs one window per sample from
            # then on, until one goes idle in time; the rest of the machine busy throughout (two samples in a row
            # kept under its load after every retake) is not retaken into any more: each would only multiply
            # the run time; such samples are still counted
            short = self._capped_streak >= 2
            waited, capped, polls = others.wait_idle(dataclasses.replace(cfg, cap_s=min(cfg.cap_s, cfg.window_s))
                                                     if short else cfg)
            value, reading = self._window(others, take)
            reading.waited_s, reading.capped, reading.polls = waited, capped, polls
            reading.timed = _NAMES.get(timed_pid, "this process" if timed_pid == os.getpid() else str(timed_pid))
            why = reading.foreign(cfg)
            machine_busy = why not in (None, "ours") and self._machine_streak >= 2
            kept = why is None or attempt >= cfg.retakes or machine_busy
            for stats in [self.stats, *_COLLECTORS]:
                stats.add(reading, kept=kept, why=why)
            if kept:
                self._machine_streak = self._machine_streak + 1 if why not in (None, "ours") else 0
                self._capped_streak = self._capped_streak + 1 if capped else 0
                return value
            attempt += 1

    @staticmethod
    def _window(others: _Others, take: Callable[[], float]) -> tuple[float, Reading]:
        me = os.getpid()
        timed, ours0 = others.timed, others.cpu()
        own0, delay0 = process_cpu_ns(timed), process_cpu_ns(timed, field_index=1)
        mine0, busy0 = (process_cpu_ns(me) if timed != me else 0), _machine_busy_s()
        t0 = time.perf_counter_ns()
        value = take()
        wall = (time.perf_counter_ns() - t0) / 1e9
        busy1, ours1 = _machine_busy_s(), others.cpu()
        own = max(0, process_cpu_ns(timed) - own0) / 1e9
        delay = max(0, process_cpu_ns(timed, field_index=1) - delay0) / 1e9
        mine = max(0, process_cpu_ns(me) - mine0) / 1e9 if timed != me else 0.0  # includes the waiting thread
        ours = {k: max(0, ours1.get(k, 0) - v) / 1e9 for k, v in ours0.items()}
        here = ours.get("this process's other threads", 0.0)
        rest = sum(v for k, v in ours.items() if k != "this process's other threads")
        machine = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own - rest - max(mine, here))
        return value, Reading(wall, ours, machine, delay)
