"""Timing a function alone in its own process, alternated with work timed in this one or in other such processes.

A runtime with its own thread pool (ONNX Runtime, OpenVINO) keeps its threads spinning after a call
and takes the cores from whatever this process times next; a function that will be deployed alone
must be timed alone. ``ChildTimer`` starts ``python -m torchnitro.bench.isolated``, which builds the
function from a loader named ``"module:function"`` (plus JSON keyword arguments) and the inputs from
a tensor file (``torch.load(weights_only=True)``: nothing the user wrote is unpickled), calls it once
and reports ready; start-up is never timed. Then each ``timer(k)`` asks the child for one sample of
``k`` calls, timed by the child on its own clock, and returns seconds per call: ``bench.compare``
takes such a timer in place of a function, so rounds alternate this process and the child, or several
children (A B A B), while this process only waits.

Every child starts with the environment it inherits plus what ``bench.environment.timing_process_env()`` adds
(glibc's ``ALLOCATOR_SETTING``, unless the environment chooses the allocator itself; no thread setting: a variant
is timed with the OpenMP wait it is deployed with) plus the caller's ``env`` (a None value removes a variable:
``GLIBC_DEFAULTS`` starts a child with glibc's default thresholds). Each sample also reports the minor page
faults per call the child took during it (``ChildTimer.faults``): returned memory faulting in again is what
glibc's default thresholds cost.

While this process waits for the child it sleeps in ``read``; the child sleeps in ``readline`` while
this process times. Each sample goes through ``bench.quiet.Gate``: it starts only once every other process
of the timing (this one's other threads, the other children, their helpers) has gone idle, and is taken
again when foreign CPU ran beside it; ``sample(k, warm)`` makes ``warm`` untimed calls first in the same
request (``autotune.fair.Steady``).

``shared_process()`` marks code that times several things in one process: runtimes that own a
thread pool must not let it spin there (``process_is_shared()``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import select
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence, cast

import torch

from torchnitro.bench.environment import timing_process_env
from torchnitro.bench.quiet import Gate, GateConfig, name_process
from torchnitro.errors import RecipeError

__all__ = ["ChildTimer", "shared_process", "process_is_shared", "save_inputs"]

_STARTUP_S = 180.0  # interpreter + torch import + loading the artifact on a busy 2-core machine
_SHARED = [0]  # depth of nested shared_process() blocks in this process


@contextlib.contextmanager
def shared_process() -> Iterator[None]:
    """While active, this process times several variants: runtimes must keep their pools from spinning."""
    _SHARED[0] += 1
    try:
        yield
    finally:
        _SHARED[0] -= 1


def process_is_shared() -> bool:
    """True inside ``shared_process()``: other work is timed in this process beside a runtime's calls."""
    return _SHARED[0] > 0


def save_inputs(sets: Sequence[tuple[Any, ...]], path: Path) -> None:
    """Write the timing inputs for a child: tensors and plain values only, loadable with weights_only=True."""
    try:
        torch.save([list(s) for s in sets], path)
        torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything that is not tensors/plain values
        from torchnitro.errors import InputError

        path.unlink(missing_ok=True)
        raise InputError(f"the timing inputs hold objects other than tensors and plain values ({exc}); expected "
                         "tensors, numbers, strings, lists, tuples or dicts of those") from exc


class ChildTimer:
    """One function timed in its own process; ``timer(k)`` -> seconds per call over one sample of ``k`` calls."""

    times_itself = True  # bench.compare calls it with k instead of wrapping it in a sampler

    def __init__(self, loader: str, kwargs: dict[str, Any], inputs: Path, *, threads: int, device: str = "cpu",
                 gate: GateConfig | None = GateConfig(), timeout_s: float = 120.0, log: Path | None = None,
                 env: dict[str, str | None] | None = None, outputs: Path | None = None, name: str | None = None):
        """``env``: extra environment of the child (e.g. ``MALLOC_MMAP_THRESHOLD_``, read once, when it starts; None:
        remove that variable), on top of ``timing_process_env()``, which adds nothing ``env`` decides itself
        (``self.env``: what the child added to this environment, None for what it removed);
        ``gate``: when a sample may start and when it is retaken (``bench.quiet``; None: ungated samples);
        ``outputs``: a file the child writes its first call's outputs to (the tensors of the first input set,
        in ``torch.utils._pytree`` leaf order) before it reports ready, for the caller to check what it times;
        ``name``: the child's label in the gate's reports (default: the log file's stem)."""
        spec = {"loader": loader, "kwargs": kwargs, "inputs": str(inputs), "threads": threads, "device": device,
                "outputs": str(outputs) if outputs else None}
        self.spec, self.extra_env = spec, dict(env or {})
        self.gate = Gate(gate) if gate is not None else None
        self.timeout_s = timeout_s
        self.samples = 0
        self.failed: str | None = None  # why the child stopped answering, once it has
        self.faults: list[float] = []  # minor page faults per call, one entry per sample
        # a caller's own OpenMP wait or allocator setting in ``env`` replaces the default one (not merged with it)
        self.env = {**timing_process_env({**os.environ, **self.extra_env}), **self.extra_env}
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        self.log = log or inputs.with_suffix(f".{os.getpid()}.{id(self)}.log")
        self._err = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "torchnitro.bench.isolated", json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env,
                                         bufsize=0)  # unbuffered: select() sees every line
        except BaseException:  # no process (memory, process limit): nothing of this timer is left open
            self._err.close()
            self.log.unlink(missing_ok=True)
            raise
        self.name = name or self.log.stem.removeprefix("_timing_")
        name_process(self.proc.pid, self.name)
        self._stdin, self._stdout = cast(IO[bytes], self.proc.stdin), cast(IO[bytes], self.proc.stdout)  # both PIPE
        self._ready = False

    def again(self, env: dict[str, str | None], *, threads: int | None = None,
              kwargs: dict[str, Any] | None = None, name: str | None = None) -> "ChildTimer":
        """A fresh process timing the same function, with ``env`` added to this one's extra environment
        (``threads`` / ``kwargs``: other torch threads / loader arguments than this one's). Raises ``RecipeError``
        when that process cannot be started (its callers, the trials, note a failed timing process and go on)."""
        sp = self.spec
        try:
            return ChildTimer(sp["loader"], sp["kwargs"] if kwargs is None else kwargs, Path(sp["inputs"]),
                              threads=sp["threads"] if threads is None else threads, device=sp["device"],
                              gate=self.gate.cfg if self.gate else None, timeout_s=self.timeout_s,
                              env={**self.extra_env, **env}, outputs=Path(sp["outputs"]) if sp["outputs"] else None,
                              name=name or f"{self.name} (again)")
        except OSError as exc:
            raise RecipeError(f"a fresh timing process could not start ({exc})") from exc

    def wait_ready(self) -> None:
        """Block until the child has loaded the function and called it once (not timed)."""
        if not self._ready:
            self._expect(self._read(_STARTUP_S + self.timeout_s), "ready")
            self._ready = True

    def __call__(self, k: int) -> float:
        return self.sample(k)

    def sample(self, k: int, warm: int = 0) -> float:
        """Seconds per call over ``k`` timed calls, after ``warm`` untimed ones in the same request; gated
        (``bench.quiet``): taken once the other processes are idle, retaken when foreign CPU ran beside it."""
        self.wait_ready()
        if self.gate is None:
            return self._take(k, warm)
        return self.gate.sample(self.proc.pid, lambda: self._take(k, warm))

    def _take(self, k: int, warm: int) -> float:
        self._send(f"{int(k)} {int(warm)}")
        line = self._read(self.timeout_s * max(1, k + warm))
        self.samples += 1
        seconds, _, faults = self._expect(line, "sample").partition(" ")
        if faults:
            self.faults.append(float(faults))
        return float(seconds)

    def _send(self, text: str) -> None:
        try:
            self._stdin.write((text + "\n").encode())
            self._stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self._fail(f"the timing process exited: {self._tail()}", exc)

    def _read(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self._stdout], [], [], timeout_s)
        if not ready:
            self._fail(f"the timing process did not answer within {timeout_s:.0f} s (killed)")
        return self._stdout.readline().decode().strip()

    def _expect(self, line: str, what: str) -> str:
        tag, _, rest = line.partition(" ")
        if tag != what:
            detail = rest if tag == "error" else f"{line!r}; {self._tail()}"
            self._fail(f"the timing process failed while waiting for {what!r}: {detail}")
        return rest

    def _fail(self, why: str, cause: BaseException | None = None) -> None:
        self.failed = why
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()
        raise RecipeError(why) from cause

    def _tail(self) -> str:
        self._err.flush()
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return " / ".join(lines[-3:])[-400:] or f"exit code {self.proc.poll()}"

    def close(self) -> None:
        name_process(self.proc.pid, None)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._send("quit")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self._err):
            with contextlib.suppress(OSError, ValueError):
                f.close()  # type: ignore[union-attr]
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> "ChildTimer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _minor_faults() -> int:
    """Minor page faults of this process so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _load(loader: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
    mod, _, name = loader.partition(":")
    return getattr(importlib.import_module(mod), name)(**kwargs)


def _child(spec: dict[str, Any]) -> None:
    from torchnitro.bench.timing import TimingConfig, _Sampler, _use_cuda

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the protocol owns the real stdout; a stray print goes to the log

    def send(line: str) -> None:
        proto.write(line.replace("\n", " ") + "\n")

    try:
        torch.set_num_threads(spec["threads"])
        fn = _load(spec["loader"], spec["kwargs"])
        sets = torch.load(spec["inputs"], weights_only=True)
        with torch.inference_mode():
            call = lambda: [fn(*x) for x in sets]  # noqa: E731
            call()  # lazy initialisation is start-up, not timed
            if spec.get("outputs"):
                leaves = torch.utils._pytree.tree_leaves(fn(*sets[0]))
                torch.save([t.detach().cpu() for t in leaves if isinstance(t, torch.Tensor)], spec["outputs"])
            sampler = _Sampler(call, _use_cuda(TimingConfig(device=spec["device"])))
            send("ready")
            for line in sys.stdin:
                if line.strip() == "quit":
                    break
                k, _, warm = line.strip().partition(" ")
                for _ in range(int(warm or 0)):
                    call()  # untimed: this process's caches and pool take the switch from the others
                before = _minor_faults()
                seconds = sampler(int(k))
                send(f"sample {seconds:.9e} {(_minor_faults() - before) / max(1, int(k)):.1f}")
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the reason
        send(f"error {type(exc).__name__}: {exc}"[:600])


if __name__ == "__main__":  # pragma: no cover - exercised through ChildTimer
    _child(json.loads(sys.argv[1]))
