"""XLA's own buffer assignment, read from its dump files, to hold the memory model against.

With ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` set before jax is imported, every
compile (host or a TPU topology through libtpu) writes, per HLO module,
``*after_optimizations-buffer-assignment.txt`` (allocations and the values placed in them, with
their sizes and memory spaces) and ``*after_optimizations-live-range.txt`` (the schedule's live
ranges and the values live at XLA's own peak). ``read_buffer_dump`` turns the two files of one
module into a ``BufferDump``:

* ``temp_by_color``: the preallocated-temp allocation per memory space. Color 0 is HBM (host
  memory on the CPU backend); on a TPU color 1 is on-chip VMEM, colors 2 and above are small
  (SMEM, sync flags);
* ``live_peak_by_color``: the bytes of temp values XLA lists as live at its peak, per memory space
  (parameters, outputs and constants are not temp and are left out);
* ``values_peak_by_color``: the peak over the whole schedule of the temp values' live bytes, per
  memory space, computed here from every value's live range (the listing above is at one time step
  chosen over all memory spaces together).

``temp_by_color[0]`` over ``values_peak_by_color[0]`` is the fragmentation of XLA's HBM heap.
None of this is ``compiled.memory_analysis()``: results/xla_tpu_buffers.md compares all three.

``read_schedule`` reads what the optimised program does around its peak, from the same module's
``*after_optimizations.txt`` (the scheduled HLO) and live-range file: the values live at XLA's peak
with the JAX operation each comes from (a ``copy-start`` named by the value it copies), and how the
gradients are synchronised: all-reduces of the backward (XLA's combiner merges them into few, late
ones) and ``while`` loops of gradient matmuls (reduce-scatter collective matmuls, "windowed
einsums"), with their schedule positions. results/xla_tpu_peak.md holds them for the 4x512 LM.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from torchnitro.errors import ConfigError

__all__ = ["BufferDump", "PeakValue", "Schedule", "read_buffer_dump", "read_schedule", "find_module_files"]

_ALLOC = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.M)
_VALUE = re.compile(r"^ value: <\d+ (\S+) @(\d+)> \(size=(\d+),offset=(\d+)\)", re.M)
_RANGE = re.compile(r"^    (\S+\{[^}]*\}):(\d+)-(\d+)$", re.M)
_PEAK = re.compile(r"^  Live ranges at (\d+) \(peak\):\n((?:    .*\n)*)", re.M)
_PEAK_ENTRY = re.compile(r"^    (\S+\{[^}]*\}): (\d+) bytes", re.M)


@dataclass(frozen=True)
class BufferDump:
    """One HLO module's buffer assignment as XLA dumped it (bytes per memory space color)."""

    module: str  # the dump's file stem, e.g. "module_0000.jit_step.cl_933746096"
    temp_by_color: dict[int, int] = field(default_factory=dict)  # preallocated-temp allocation size
    live_peak_by_color: dict[int, int] = field(default_factory=dict)  # temp values live at XLA's peak
    values_peak_by_color: dict[int, int] = field(default_factory=dict)  # peak of temp values' live bytes
    peak_step: int = -1  # the schedule position XLA names as its peak (-1: no live-range file)


def _name(v: str) -> str:
    return v if "{" in v else v + "{}"  # the live-range file names every value with its tuple index


def _merge(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Overlapping (first, last, bytes) ranges of one slot merged, keeping the largest size."""
    out: list[list[int]] = []
    for a, b, size in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1], out[-1][2] = max(out[-1][1], b), max(out[-1][2], size)
        else:
            out.append([a, b, size])
    return [(a, b, size) for a, b, size in out]


def find_module_files(dump_dir: str, module: str = "jit_step") -> tuple[str, str | None]:
    """(buffer-assignment file, live-range file or None) of the largest module whose name contains ``module``."""
    found = [p for p in glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
             if module in os.path.basename(p)]
    if not found:
        have = sorted(os.path.basename(p) for p in glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt")))
        raise ConfigError(f"no '*after_optimizations-buffer-assignment.txt' for module {module!r} in {dump_dir}; "
                          f"found {have or 'none'}. Set XLA_FLAGS='--xla_dump_to={dump_dir} --xla_dump_hlo_as_text' "
                          "before jax is imported")
    ba = max(found, key=os.path.getsize)
    lr = ba.replace("-buffer-assignment.txt", "-live-range.txt")
    return ba, lr if os.path.exists(lr) else None


def read_buffer_dump(dump_dir: str, module: str = "jit_step") -> BufferDump:
    """Parse the buffer assignment (and live ranges, when dumped) of ``module`` in ``dump_dir``."""
    ba, lr = find_module_files(dump_dir, module)
    text = open(ba).read()
    temp: dict[int, int] = {}
    color_of: dict[str, int] = {}  # temp value -> memory space
    slot_of: dict[str, tuple[int, int]] = {}  # temp value -> (allocation, offset): values that share a slot alias
    size_of: dict[str, int] = {}
    alloc_color: dict[int, int] = {}
    allocs = list(_ALLOC.finditer(text))
    for k, m in enumerate(allocs):
        if "preallocated-temp" not in m.group(2):
            continue
        c = re.search(r"color (\d+)", m.group(2))
        color = int(c.group(1)) if c else 0
        temp[color] = temp.get(color, 0) + int(m.group(1))
        alloc_color[k] = color
        body = text[m.end(): allocs[k + 1].start() if k + 1 < len(allocs) else len(text)]
        for v in _VALUE.finditer(body):
            color_of[_name(v.group(1))] = color
            slot_of[_name(v.group(1))] = (k, int(v.group(4)))
            size_of[_name(v.group(1))] = int(v.group(3))
    stem = re.sub(r"\.(cpu_)?after_optimizations.*", "", os.path.basename(ba))
    if lr is None:
        return BufferDump(stem, temp)
    lt = open(lr).read()
    live: dict[int, int] = {}
    step = -1
    pk = _PEAK.search(lt)
    if pk:
        step = int(pk.group(1))
        for e in _PEAK_ENTRY.finditer(pk.group(2)):
            if e.group(1) in color_of:
                live[color_of[e.group(1)]] = live.get(color_of[e.group(1)], 0) + int(e.group(2))
    # values in one slot whose live ranges overlap are one buffer (in-place updates, tuple elements,
    # async copies): merge them into one range of the largest size before summing
    by_slot: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r in _RANGE.finditer(lt):
        v = r.group(1)
        if v in color_of:
            by_slot.setdefault(slot_of[v], []).append((int(r.group(2)), int(r.group(3)), size_of[v]))
    events: dict[int, dict[int, int]] = {}  # color -> {position: delta}
    for slot, rs in by_slot.items():
        ev = events.setdefault(alloc_color[slot[0]], {})
        for a, b, size in _merge(rs):
            ev[a] = ev.get(a, 0) + size
            ev[b + 1] = ev.get(b + 1, 0) - size
    peaks: dict[int, int] = {}
    for color, ev in events.items():
        cur = best = 0
        for pos in sorted(ev):
            cur += ev[pos]
            best = max(best, cur)
        peaks[color] = best
    return BufferDump(stem, temp, live, peaks, step)


_INST = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*)$", re.M)
_SEQ = re.compile(r"^    (\d+):(\S+)$", re.M)


@dataclass(frozen=True)
class PeakValue:
    """One value live at XLA's peak."""

    name: str  # HLO value, e.g. "fusion.1316{0}"
    bytes: int
    first: int  # schedule positions of its live range
    last: int
    source: str  # the JAX op_name it comes from (for a copy, that of the copied value)


@dataclass(frozen=True)
class Schedule:
    """The optimised entry computation's schedule around its peak (positions index the live-range file)."""

    length: int  # schedule positions
    peak_step: int
    peak: tuple[PeakValue, ...] = ()  # values live at the peak, largest first
    grad_all_reduces: tuple[tuple[int, int], ...] = ()  # (position, bytes) of each all-reduce of a gradient
    grad_loops: tuple[int, ...] = ()  # positions of while loops computing a gradient matmul (collective matmul)
    gathers: dict[str, int] = field(default_factory=dict)  # all-gathers by element type and JAX op ("bf16 dot_general")


def _entry(hlo: str) -> dict[str, tuple[str, str, str, list[str]]]:
    """name -> (opcode, shape, op_name, operand names) for the ENTRY computation's instructions."""
    start = hlo.find("\nENTRY")
    out = {}
    for m in _INST.finditer(hlo[start if start >= 0 else 0:]):
        rest = m.group(4)
        op = re.search(r'op_name="([^"]*)"', rest)
        out[m.group(1)] = (m.group(3), m.group(2), op.group(1) if op else "",
                           re.findall(r"%([\w.-]+)", rest.split("), ")[0]))
    return out


def _source(name: str, inst: dict[str, tuple[str, str, str, list[str]]], depth: int = 4) -> str:
    """The op_name of a value, following copies and tuple elements to the value they hold."""
    while depth and name in inst:
        op, _, op_name, operands = inst[name]
        if op_name or not operands or op not in ("copy-start", "copy", "copy-done", "get-tuple-element", "bitcast"):
            return op_name
        name, depth = operands[0], depth - 1
    return inst.get(name, ("", "", "", []))[2]


def _bytes_of(shape: str) -> int:
    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
    total = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * sizes.get(dt, 4)
    return total


def read_schedule(dump_dir: str, module: str = "jit_step") -> Schedule:
    """The peak's values and the gradient synchronisation of ``module``'s optimised, scheduled program."""
    ba, lr = find_module_files(dump_dir, module)
    hlo_path = ba.replace("-buffer-assignment.txt", ".txt")
    if lr is None or not os.path.exists(hlo_path):
        raise ConfigError(f"no live-range or optimised-HLO file beside {ba}: dump with --xla_dump_hlo_as_text")
    inst, lt = _entry(open(hlo_path).read()), open(lr).read()
    pos = {m.group(2): int(m.group(1)) for m in _SEQ.finditer(lt)}
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(lt)}
    pk = _PEAK.search(lt)
    peak = []
    for e in _PEAK_ENTRY.finditer(pk.group(2) if pk else ""):
        name = e.group(1).split("{")[0]
        a, b = ranges.get(e.group(1), (-1, -1))
        peak.append(PeakValue(e.group(1), int(e.group(2)), a, b, _source(name, inst)))
    peak.sort(key=lambda v: -v.bytes)

    def grad(n: str) -> bool:
        return "transpose(" in inst[n][2]

    reduces = tuple(sorted((pos[n], _bytes_of(inst[n][1])) for n in inst
                           if inst[n][0] in ("all-reduce", "all-reduce-start", "reduce-scatter") and n in pos
                           and grad(n)))
    loops = tuple(sorted(pos[n] for n in inst if inst[n][0] == "while" and n in pos and grad(n)
                         and "dot_general" in inst[n][2]))
    gathers: dict[str, int] = {}
    for n, (op, shape, op_name, _) in inst.items():
        if op in ("all-gather", "all-gather-start"):
            key = f"{shape.lstrip('(').split('[')[0]} {op_name.rsplit('/', 1)[-1] or '?'}"
            gathers[key] = gathers.get(key, 0) + 1
    return Schedule(len(pos), int(pk.group(1)) if pk else -1, tuple(peak), reduces, loops, gathers)
