"""The timing gate (``bench.quiet``): a sample starts only while the other timing processes are idle, a sample
with foreign CPU beside it is retaken, and the CPU reading of a process's threads is right.

Competitors are real busy processes and threads; the assertions are on order and counts, and on CPU time a
process is known to have burnt (read back at least in most part), never on how long anything took."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from torchnitro.autotune import fair
from torchnitro.bench import quiet
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.timing import TimingConfig, compare

# a long window: a busy process on a loaded 2-core machine still gets far more than 2% of it
_SLOW = quiet.GateConfig(window_s=0.1, idle_share=0.02, cap_s=120.0, foreign_share=0.05, retakes=3, machine=False)

_BURN_UNTIL = """
import os, sys, time
target = float(sys.argv[1])
while time.process_time() < target:
    pass
print("burnt", flush=True)
sys.stdin.readline()
"""

_BURN_ON_COMMAND = """
import sys, time
for line in sys.stdin:
    t0 = time.process_time()
    while time.process_time() - t0 < float(line):
        pass
    print("done", flush=True)
"""

_BUSY_UNTIL_FILE = """
import os, sys
print("busy", flush=True)
while not os.path.exists(sys.argv[1]):
    pass
sys.stdin.readline()
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


@contextmanager
def _busy_sibling(flag: Path) -> Iterator[subprocess.Popen]:
    """A child of this process that burns CPU until ``flag`` exists; yields once it runs, ends it on exit."""
    busy = _spawn(_BUSY_UNTIL_FILE, str(flag))
    try:
        assert busy.stdout.readline().strip() == "busy"
        yield busy
    finally:
        _end(busy)


def test_cpu_reading_of_a_process_sums_its_threads_and_reads_what_it_burnt():
    proc = _spawn(_BURN_UNTIL, "0.3")
    try:
        assert proc.stdout.readline().strip() == "burnt"
        assert quiet.process_cpu_ns(proc.pid) >= 0.25e9  # most of the 0.3 s it burnt on a CPU
    finally:
        _end(proc)
    stop = threading.Event()
    burnt: list[float] = []

    def burn() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        burnt.append(time.thread_time() - t0)
        stop.wait()

    th = threading.Thread(target=burn)
    me, tid = os.getpid(), threading.get_native_id()
    before_others = quiet.process_cpu_ns(me, skip_tid=tid)
    th.start()
    while not burnt:
        time.sleep(0.01)
    others = quiet.process_cpu_ns(me, skip_tid=tid) - before_others
    stop.set()
    th.join()
    assert others >= 0.15e9  # the other thread's 0.2 s, read without this (waiting) thread


def test_descendants_lists_children_and_grandchildren():
    code = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], " \
           "stdin=subprocess.PIPE); print(p.pid, flush=True); sys.stdin.read()"
    proc = _spawn(code)
    try:
        grandchild = int(proc.stdout.readline())
        tree = quiet.descendants(os.getpid())
        assert tree.get(proc.pid) == os.getpid() and tree.get(grandchild) == proc.pid
    finally:
        _end(proc)


def test_gate_waits_while_a_sibling_burns_cpu_and_samples_once_it_stops(tmp_path):
    flag = tmp_path / "stop"
    events: list[str] = []
    with _busy_sibling(flag):

        def release() -> None:
            time.sleep(0.5)  # the gate polls meanwhile; it must not sample before this
            events.append("released")
            flag.touch()

        th = threading.Thread(target=release)
        gate = quiet.Gate(_SLOW)
        th.start()
        value = gate.sample(os.getpid(), lambda: events.append("sample") or 1e-3)
        th.join()
    assert events == ["released", "sample"] and value == 1e-3
    assert gate.stats.samples == 1 and gate.stats.capped == 0 and gate.stats.waited_s > 0


def test_gate_takes_the_sample_after_its_cap_and_marks_it(tmp_path):
    with _busy_sibling(tmp_path / "never") as busy:
        gate = quiet.Gate(quiet.GateConfig(window_s=0.05, cap_s=0.2, machine=False, retakes=0))
        assert gate.sample(os.getpid(), lambda: 2e-3) == 2e-3
        with quiet.ignore(busy.pid):  # a deliberate competitor is not ours: no wait
            gate.sample(os.getpid(), lambda: 2e-3)
    assert gate.stats.samples == 2 and gate.stats.capped == 1


def test_a_sample_with_foreign_cpu_beside_it_is_retaken_and_counted():
    helper = _spawn(_BURN_ON_COMMAND)
    values = iter([5e-3, 1e-3])
    attempts: list[float] = []

    def take() -> float:
        if not attempts:  # a sibling of this timing burns 0.2 s of CPU during the first attempt only
            helper.stdin.write("0.2\n")
            helper.stdin.flush()
            assert helper.stdout.readline().strip() == "done"
        attempts.append(1.0)
        return next(values)

    try:
        with quiet.recording() as rec:
            gate = quiet.Gate(_SLOW)
            assert gate.sample(os.getpid(), take) == 1e-3  # the retaken sample's value, not the disturbed one
    finally:
        _end(helper)
    assert len(attempts) == 2
    for stats in (gate.stats, rec):
        assert stats.samples == 1 and stats.retaken == 1 and stats.retaken_for == {"ours": 1}
        assert stats.kept_foreign == 0
    assert sum(rec.burnt.values()) >= 0.15  # the helper's 0.2 s, charged to it
    assert "1 retaken" in rec.text()


def test_retakes_are_bounded_and_the_last_sample_is_kept_marked():
    helper = _spawn(_BURN_ON_COMMAND)

    def take() -> float:
        helper.stdin.write("0.05\n")
        helper.stdin.flush()
        helper.stdout.readline()
        return 1e-3

    try:
        gate = quiet.Gate(quiet.GateConfig(window_s=0.05, cap_s=30.0, retakes=2, machine=False))
        gate.sample(os.getpid(), take)
    finally:
        _end(helper)
    assert gate.stats.samples == 1 and gate.stats.retaken == 2 and gate.stats.kept_foreign == 1


def test_a_sibling_busy_throughout_costs_two_capped_samples_then_one_window_each(tmp_path):
    polls: list[int] = []
    with _busy_sibling(tmp_path / "never"):
        gate = quiet.Gate(quiet.GateConfig(window_s=0.02, cap_s=0.2, retakes=0, machine=False))
        for _ in range(5):
            gate.sample(os.getpid(), lambda: 1e-3)
            polls.append(gate.stats.readings[-1].polls)
    assert gate.stats.samples == 5 and gate.stats.capped == 5
    assert min(polls[:2]) > 1 and polls[2:] == [1, 1, 1]  # after two capped samples: one window each


def spinning_loader(spin_s: float) -> Callable[..., Any]:
    """A ChildTimer loader (run in the child): each call leaves a thread burning ``spin_s`` of CPU after it
    returns, as a runtime pool spins after its call."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        def spin() -> None:
            t0 = time.thread_time()
            while time.thread_time() - t0 < spin_s:
                pass

        threading.Thread(target=spin, daemon=True).start()
        return x * 2

    return fn


def quiet_loader() -> Callable[..., Any]:
    return lambda x: x + 1


def test_child_samples_wait_for_a_sibling_child_that_spins_after_its_own(tmp_path):
    save_inputs([(torch.ones(4),)], tmp_path / "in.pt")
    cfg = quiet.GateConfig(window_s=0.02, idle_share=0.02, cap_s=60.0, retakes=3, machine=False)
    spinner = ChildTimer("test_isolated_gate:spinning_loader", {"spin_s": 0.1}, tmp_path / "in.pt", threads=1,
                         gate=cfg, name="spinner")
    calm = ChildTimer("test_isolated_gate:quiet_loader", {}, tmp_path / "in.pt", threads=1, gate=cfg, name="calm")
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=4, min_time_s=0.0, max_time_s=60.0, min_sample_s=1e-4)
    with spinner, calm, quiet.recording() as rec:
        spinner.wait_ready()
        calm.wait_ready()
        compare({"spinner": fair.Steady(spinner), "calm": fair.Steady(calm)}, tc)
    assert calm.gate.stats.samples >= 5 and calm.gate.stats.kept_foreign == 0
    # the calm child's samples right after one of the spinner's waited for the spinner's 0.1 s of CPU to end
    # (more than one 20 ms window), and none of them has the spinner's CPU beside it
    assert sum(r.polls > 1 for r in calm.gate.stats.readings) >= 2
    assert not any(r.capped for r in calm.gate.stats.readings)
    assert all(r.ours.get("spinner", 0.0) <= 0.05 * r.wall_s for r in calm.gate.stats.readings)
    assert rec.samples == calm.gate.stats.samples + spinner.gate.stats.samples
    assert spinner.samples == spinner.gate.stats.samples + spinner.gate.stats.retaken  # one request per attempt


def test_steady_gates_work_timed_in_this_process_against_the_children(tmp_path):
    flag = tmp_path / "stop"
    events: list[str] = []
    with _busy_sibling(flag):
        threading.Timer(0.5, lambda: (events.append("released"), flag.touch())).start()
        here = fair.Steady(lambda: events.append("call"), gate=_SLOW)
        here(2)
    assert events == ["released", "call", "call", "call"]  # one untimed call, then the sample's two
    assert here.gate.stats.samples == 1


def test_gate_stats_text_names_counts_and_the_burner():
    stats = quiet.GateStats()
    clean = quiet.Reading(0.01, {"eager": 0.0}, 0.0, 0.0)
    dirty = quiet.Reading(0.01, {"onnxruntime": 0.004}, 0.0, 0.0)
    stats.add(dirty, kept=False, why="ours")
    stats.add(clean, kept=True, why=None)
    assert stats.samples == 1 and stats.retaken == 1
    text = stats.text()
    assert "1 samples, 1 retaken" in text and "onnxruntime 4.0 ms" in text
    assert quiet.GateStats().text() == "timing gate: no gated samples"


def test_reading_foreign_share_against_ours_and_the_machine():
    cfg = quiet.GateConfig(foreign_share=0.05)
    assert quiet.Reading(1.0, {"x": 0.04}, 0.0, 0.0).foreign(cfg) is None
    assert quiet.Reading(1.0, {"x": 0.06}, 0.0, 0.0).foreign(cfg) == "ours"
    assert quiet.Reading(1.0, {}, 0.5, 0.0).foreign(cfg) == "machine"
    assert quiet.Reading(1.0, {}, 0.5, 0.0).foreign(quiet.GateConfig(machine=False)) is None
    assert quiet.Reading(0.005, {}, 0.01, 0.0).foreign(cfg) is None  # within /proc/stat's two-tick resolution
    assert quiet.Reading(0.005, {}, 0.0, 0.001).foreign(cfg) == "run-queue delay"  # 20% of the sample waited
    assert quiet.Reading(0.005, {}, 0.0, 0.0002).foreign(cfg) is None


def test_reading_a_process_that_is_gone_is_zero():
    proc = _spawn("pass")
    proc.wait()
    assert quiet.process_cpu_ns(proc.pid) == 0
    assert Path("/proc/self/task").exists()


def test_runnable_threads_sees_a_busy_process_and_not_a_blocked_one(tmp_path):
    with _busy_sibling(tmp_path / "never") as busy:
        blocked = _spawn("import sys; print('up', flush=True); sys.stdin.readline()")
        try:
            assert blocked.stdout.readline().strip() == "up"
            assert quiet.runnable_threads(busy.pid) >= 1  # running or waiting for a CPU: state R either way
            deadline = time.monotonic() + 30  # the blocked one settles into its read
            while quiet.runnable_threads(blocked.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert quiet.runnable_threads(blocked.pid) == 0
        finally:
            _end(blocked)


def test_a_busy_machine_stops_retakes_but_never_the_wait_for_our_siblings(tmp_path, monkeypatch):
    clock = iter(range(0, 10**6, 100))  # every reading of the machine: 100 s more busy time (always loaded)
    monkeypatch.setattr(quiet, "_machine_busy_s", lambda: float(next(clock)))
    gate = quiet.Gate(quiet.GateConfig(window_s=0.05, cap_s=120.0, retakes=1, machine=True))
    for _ in range(2):  # retaken once each, kept under the machine's load
        gate.sample(os.getpid(), lambda: 1e-3)
    assert gate.stats.retaken == 2 and gate.stats.kept_foreign == 2
    flag = tmp_path / "stop"
    events: list[str] = []
    with _busy_sibling(flag):
        threading.Timer(0.5, lambda: (events.append("released"), flag.touch())).start()
        gate.sample(os.getpid(), lambda: events.append("sample") or 1e-3)
    assert events == ["released", "sample"]  # still waited for the busy sibling
    assert gate.stats.retaken == 2 and gate.stats.kept_foreign == 3  # but not retaken into the machine's load
