"""Temp memory of the LM train step by a liveness walk over its jaxpr at one device's shapes.

The per-device program of the SPMD step is traced directly: the loss and its gradient with the
batch split over the data-like axes, heads / MLP hidden / vocab split over the tensor axis and the
weights as FSDP gathers them (whole along the fsdp-split dimension). Its jaxpr, with every call,
``jax.checkpoint`` and custom-derivative body inlined, is a schedule: the forward, then the
backward in reverse with the rematerialised forward of each block just before its backward. The
walk takes that order as XLA's and asks, at every equation, which buffers are live.

Which values get a buffer follows what XLA's fusion passes do:

* outputs of matmuls, reductions, gathers/scatters, Pallas kernels and other non-elementwise ops
  are *materialised*; elementwise ops, broadcasts, reshapes, slices and concatenations fuse into
  their consumers and never get a buffer of their own. A fused value read at equation ``j``
  keeps every materialised value it is computed from live until ``j`` (XLA recomputes the
  elementwise chain inside the consumer instead of storing it; this is why ``none`` costs about
  what ``dots_saveable`` does on a TPU);
* a fused join of two or more buffers that three or more equations read (the residual stream
  ``x + f(x)``: the next norm's reduction, its scaling and the next add) is stored once;
* FSDP: a weight split over ``fsdp`` is all-gathered before its first forward use and freed after
  its last, and gathered again for the backward (each pass has its own all-gather; keeping the
  forward's copy instead put every layer's weights in the peak, up to 64% over the compile); on a
  TPU a weight only matmuls read is gathered in bf16 (the f32 product runs in one bf16 pass and XLA
  casts the shard before gathering), and a table whose shards hold whole rows is looked up on the
  shards (an all-to-all), not gathered for the lookup; when
  its gradient is synchronised is ``simulate``'s ``grad_sync``: XLA's all-reduce combiner merges the
  gradients' all-reduces into one at the end of the backward, so each FSDP gradient waits whole
  ("combined", what 38 of the 42 v5p compiles of results/xla_tpu_peak.md do), or the gradient
  matmuls become reduce-scatter collective matmuls that the TPU scheduler runs after the whole
  activation-gradient chain, their operands waiting ("deferred", the other 4: the 4x512 LM under
  FSDP at batch 32); unsplit gradients wait whole. The optimizer update is elementwise into
  donated buffers: no temp.
* buffer sizes are TPU-tiled (``tpu_array_bytes``) on a TPU target; ``pack`` then places the
  buffers as XLA's heap assignment does (largest first, best fit).

Not modelled: which of the two gradient syncs XLA picks (its TPU cost model for collective
matmuls is not public), XLA's scheduler reordering the walk otherwise (and the holes its order leaves in the heap),
memory-space assignment moving buffers to on-chip VMEM, bf16 operand copies XLA keeps across the
forward and backward, collective buffers other than the gathered weights, and fixed scratch
(results/xla_tpu_buffers.md compares the walk with XLA's own buffer assignment).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

__all__ = ["FUSIBLE", "GRAD_SYNC", "INLINED", "Liveness", "pack", "simulate", "tpu_array_bytes"]

# primitives XLA fuses into their consumers (loop fusion): no buffer of their own
FUSIBLE = frozenset("""
    abs add add_any and broadcast_in_dim ceil clamp concatenate convert_element_type copy copy_p cos div eq exp exp2
    expand_dims expm1 floor ge gt imag integer_pow iota is_finite le log log1p logistic lt max min mul ne neg
    not or pad pow real reduce_precision rem reshape rev round rsqrt select_n sign sin slice sqrt square
    squeeze stop_gradient sub tan tanh transpose xor erf erf_inv cbrt nextafter shift_left
    shift_right_logical shift_right_arithmetic population_count clz
""".split())
# call-like primitives whose body is inlined into the walk (a Pallas call or a loop stays one opaque op)
INLINED = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
                     "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})
DOTS = frozenset({"dot_general", "conv_general_dilated"})
GRAD_SYNC = ("scatter", "combined", "deferred")  # when sharded gradients are synchronised (see simulate)


@dataclass
class _Value:
    shape: tuple[int, ...]
    itemsize: int
    roots: frozenset[int]  # the materialised values (ids) this value is read from
    op: str  # producing primitive ("arg" for inputs)


@dataclass(frozen=True)
class _Eqn:
    prim: str
    ins: tuple[int, ...]  # value ids (literals dropped)
    outs: tuple[int, ...]


@dataclass
class Liveness:
    """Result of the walk: peak live temp bytes and what was live at the peak, by kind."""

    peak: int  # bytes: the most that is live at once
    heap: int = 0  # bytes: the size of the buffers packed as XLA's heap packs them (>= peak: fragmentation)
    at_peak: dict[str, int] = field(default_factory=dict)  # kind -> bytes live at the peak
    peak_index: int = 0  # equation index of the peak
    n_eqns: int = 0
    live: list[tuple[str, tuple[int, ...], int, int, int, int]] = field(default_factory=list)  # at the peak:
    # (kind/op, shape, itemsize, bytes, first equation, last equation)


def _sub_jaxpr(e: Any) -> Any:
    for k in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = e.params.get(k)
        if j is not None:
            return j
    return None


class _Flat:
    """The jaxpr as one flat list of equations over integer value ids."""

    def __init__(self) -> None:
        self.values: dict[int, _Value] = {}
        self.eqns: list[_Eqn] = []

    def new(self, aval: Any, op: str) -> int:
        i = len(self.values)
        shape = tuple(getattr(aval, "shape", ()))
        dt = getattr(aval, "dtype", None)
        self.values[i] = _Value(shape, dt.itemsize if dt is not None and hasattr(dt, "itemsize") else 4,
                                frozenset(), op)
        return i

    def walk(self, jaxpr: Any, env: dict[Any, int]) -> None:
        for e in jaxpr.eqns:
            name = e.primitive.name
            sub = _sub_jaxpr(e) if name in INLINED else None
            ins = [env.get(v) for v in e.invars if not isinstance(v, jcore.Literal)]
            if sub is not None:
                inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
                inner_env: dict[Any, int] = {}
                outer = [v for v in e.invars]
                for iv, ov in zip(inner.invars[len(inner.invars) - len(outer):], outer):
                    if not isinstance(ov, jcore.Literal) and ov in env:
                        inner_env[iv] = env[ov]
                for cv in inner.constvars:
                    inner_env[cv] = self.new(cv.aval, "const")
                self.walk(inner, inner_env)
                for ov, iv in zip(e.outvars, inner.outvars):
                    if not isinstance(iv, jcore.Literal) and iv in inner_env:
                        env[ov] = inner_env[iv]
                    else:
                        env[ov] = self.new(ov.aval, "const")
                continue
            outs = tuple(self.new(v.aval, name) for v in e.outvars)
            for v, i in zip(e.outvars, outs):
                env[v] = i
            self.eqns.append(_Eqn(name, tuple(i for i in ins if i is not None), outs))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tpu_array_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of an array in TPU HBM: two minor dims in (8, 128) tiles (cheapest pair), rank 1 in 128s."""
    if len(shape) == 0:
        return itemsize
    if len(shape) == 1:
        return _round_up(shape[0], 128) * itemsize
    best = None
    for minor, second in itertools.permutations(range(len(shape)), 2):
        rest = math.prod(s for i, s in enumerate(shape) if i not in (minor, second))
        b = rest * _round_up(shape[minor], 128) * _round_up(shape[second], 8) * itemsize
        best = b if best is None else min(best, b)
    return int(best)


def _bytes(shape: tuple[int, ...], itemsize: int, tpu: bool) -> int:
    return tpu_array_bytes(shape, itemsize) if tpu else math.prod(shape) * itemsize


def _roots(f: _Flat, fusible_extra: frozenset[str]) -> None:
    """Fill in, for every value, the materialised values it is read from (itself when it gets a buffer)."""
    vals = f.values
    readers: dict[int, int] = {}
    for e in f.eqns:
        for i in set(e.ins):
            readers[i] = readers.get(i, 0) + 1
    for i, v in vals.items():  # inputs root themselves; constants (RoPE tables, masks) are not counted
        v.roots = frozenset({i}) if v.op == "arg" else frozenset()
    for e in f.eqns:
        fused = e.prim in FUSIBLE or e.prim in fusible_extra
        roots = frozenset().union(*(vals[i].roots for i in e.ins)) if fused else frozenset()
        for o in e.outs:
            # a fused join of two or more buffers that three or more equations read (the residual stream
            # x + f(x): the next norm's reduction, its scaling and the next add) is stored once, not
            # recomputed by every reader with all its inputs kept live
            keep = not fused or (len(roots) >= 2 and readers.get(o, 0) >= 3)
            vals[o].roots = frozenset({o}) if keep else roots


def pack(buffers: Sequence[tuple[int, int, int]]) -> int:
    """Heap size when (bytes, first, last) buffers are placed largest first at the best-fitting free offset.

    XLA's buffer assignment (GlobalDecreasingSizeBestFitHeap, spatial order) places each buffer, in
    decreasing size, into the smallest gap left by the already-placed buffers whose live ranges
    overlap its own, or on top of the heap; the allocation it reports as temp is the heap's top,
    which exceeds the peak of live bytes by the gaps no later buffer fits.
    """
    placed: list[tuple[int, int, int, int]] = []  # (offset, bytes, first, last)
    top = 0
    for size, a, b in sorted(buffers, key=lambda t: (-t[0], -(t[2] - t[1]))):
        if size <= 0:
            continue
        busy = sorted((o, o + s) for o, s, pa, pb in placed if pa <= b and a <= pb)
        best, best_gap, cur = None, None, 0
        for lo, hi in busy:
            if lo - cur >= size and (best_gap is None or lo - cur < best_gap):
                best, best_gap = cur, lo - cur
            cur = max(cur, hi)
        offset = best if best is not None else cur
        placed.append((offset, size, a, b))
        top = max(top, offset + size)
    return top


def _synced_outputs(closed: Any, env: dict[Any, int],
                    outputs: Callable[[int, tuple[int, ...]], tuple[str, int]] | None) -> dict[int, tuple[str, int]]:
    """Flat output index -> (kind, shard bytes) for the outputs ``outputs`` says are synchronised as shards."""
    out: dict[int, tuple[str, int]] = {}
    for m, ov in enumerate(closed.jaxpr.outvars):
        if outputs is None or isinstance(ov, jcore.Literal) or ov not in env:
            continue
        k, b = outputs(m, tuple(ov.aval.shape))
        if b:
            out[m] = (k, b)
    return out


def _deferred_dots(f: _Flat, out_ids: Sequence[int]) -> dict[int, None]:
    """Equations (in order) of the matmuls whose outputs are the materialised values of these outputs."""
    made = {o: k for k, e in enumerate(f.eqns) for o in e.outs}
    found = {made[r]: None for i in out_ids for r in f.values[i].roots
             if r in made and f.eqns[made[r]].prim in DOTS}
    return dict(sorted(found.items()))


_LAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type"})


def _gathered_itemsize(f: _Flat, i: int, tpu: bool, local_rows: frozenset[int]) -> int:
    """Bytes per element of a gathered f32 input: 2 on a TPU when only matmuls read it (through layout ops).

    A TPU multiplies f32 at default precision in one bf16 pass, and XLA casts the shard before the
    all-gather: every weight all-gather in the compiles of results/xla_tpu_peak.md is bf16.
    """
    item = f.values[i].itemsize
    if not tpu or item != 4:
        return item
    frontier, ends = [i], []
    while frontier:
        v = frontier.pop()
        for e in f.eqns:
            if v in e.ins and not (e.prim == "gather" and i in local_rows):  # a lookup on the shards (simulate)
                if e.prim in _LAYOUT:
                    frontier.extend(e.outs)
                else:
                    ends.append(e.prim)
    return 2 if ends and all(p in DOTS for p in ends) else item


def simulate(fn: Callable, args: tuple, kinds: Callable[[int, tuple[int, ...]], str], tpu: bool,
             outputs: Callable[[int, tuple[int, ...]], tuple[str, int]] | None = None,
             fusible_extra: frozenset[str] = frozenset(), grad_sync: str = "scatter",
             row_local: frozenset[int] = frozenset()) -> Liveness:
    """Walk ``jax.make_jaxpr(fn)(*args)`` and return the peak of live temp bytes.

    ``kinds(i, shape)`` names flat input ``i``: "arg" for an argument (not temp) or another kind
    for a buffer gathered just before its uses, once for the uses up to the first output's
    equation (the forward) and once for those after it (the backward). ``outputs(i, shape)`` gives
    (kind, bytes) of what waits until the end of the step once flat output ``i`` is complete (a
    gradient shard), or ("", 0) for the output itself to wait. ``fusible_extra`` names primitives
    to treat as fused in this program (e.g. a gather the partitioner turns into a masked select).

    ``grad_sync`` says when the outputs that ``outputs`` names with bytes (sharded gradients) are
    synchronised (results/xla_tpu_peak.md shows each in XLA's schedule):

    * "scatter": each is reduce-scattered as soon as it is complete; only the shard waits;
    * "combined": XLA's all-reduce combiner merges them into one all-reduce at the end of the
      backward, so each waits whole from its completion to the end;
    * "deferred": the matmuls that produce them become reduce-scatter collective matmuls that the
      TPU scheduler runs after the activation-gradient chain: those matmuls leave their place, and
      each of their operands waits, stored at its own size and dtype, from where it is computed to
      the end (the shard itself is small and waits after).

    ``row_local`` names flat inputs (gathered tables) whose shards hold whole rows: a ``gather``
    (embedding lookup) reads the shards and exchanges the rows (an all-to-all, as the partitioner
    compiles it), so only their other readers need the gathered table.
    """
    if grad_sync not in GRAD_SYNC:
        raise ValueError(f"grad_sync={grad_sync!r} is not one of {GRAD_SYNC}")
    closed = jax.make_jaxpr(fn)(*args)
    f = _Flat()
    env: dict[Any, int] = {}
    in_kind: dict[int, str] = {}
    local_rows: set[int] = set()
    for n, v in enumerate(closed.jaxpr.invars):
        env[v] = f.new(v.aval, "arg")
        in_kind[env[v]] = kinds(n, tuple(v.aval.shape))
        if n in row_local:
            local_rows.add(env[v])
    for v in closed.jaxpr.constvars:
        env[v] = f.new(v.aval, "const")
    f.walk(closed.jaxpr, env)
    vals = f.values
    _roots(f, fusible_extra)
    n = len(f.eqns)
    first_out = env.get(closed.jaxpr.outvars[0]) if not isinstance(closed.jaxpr.outvars[0], jcore.Literal) else None
    bound = next((k for k, e in enumerate(f.eqns) if first_out in e.outs), n)  # forward | backward
    synced = _synced_outputs(closed, env, outputs)  # flat output -> (kind, shard bytes)
    moved = _deferred_dots(f, [env[closed.jaxpr.outvars[m]] for m in synced]) if grad_sync == "deferred" else {}
    ranges: dict[int, list[list[int]]] = {}  # buffer -> [first, last] equation of each live range
    kind: dict[int, str] = {}
    for idx, e in enumerate(f.eqns):
        if idx in moved:  # runs at the end: its reads and its (full-size) output are not here
            continue
        for o in e.outs:
            if o in vals[o].roots:
                ranges[o] = [[idx, idx]]
                kind[o] = "dots" if e.prim in DOTS else "pallas" if e.prim == "pallas_call" else "other"
        for i in e.ins:
            for r in vals[i].roots:
                if in_kind.get(r) == "arg" or vals[r].op == "const":
                    continue
                if e.prim == "gather" and r in local_rows:  # rows are looked up on the shards (then an all-to-all)
                    continue
                if r not in ranges:  # a gathered input: made just before its first use
                    ranges[r], kind[r] = [[idx, idx]], in_kind.get(r, "other")
                elif r in in_kind and ranges[r][-1][1] <= bound < idx:  # gathered again for the backward
                    ranges[r].append([idx, idx])
                ranges[r][-1][1] = idx
    extra: list[tuple[int, int, str]] = []  # (from, bytes, kind) live until the end
    made = {o: k for k, e in enumerate(f.eqns) for o in e.outs}
    done: set[int] = set()
    for idx in moved:  # a deferred matmul's operands wait, each stored once, from where it is computed
        for i in f.eqns[idx].ins:
            if in_kind.get(i) == "arg" or not vals[i].roots or i in done:  # an input, or built from constants
                continue
            done.add(i)
            if vals[i].roots == frozenset({i}) and i in ranges:  # a buffer already: it lives on
                ranges[i][-1][1] = n - 1
                kind[i] = "deferred"
            else:
                extra.append((made.get(i, 0), _bytes(vals[i].shape, vals[i].itemsize, tpu), "deferred"))
    for m, ov in enumerate(closed.jaxpr.outvars):
        if isinstance(ov, jcore.Literal) or ov not in env:
            continue
        k, b = synced.get(m, ("", 0))
        roots = vals[env[ov]].roots
        if b and grad_sync == "deferred":
            extra.append((n - 1, b, k))
        elif b and grad_sync == "scatter":
            extra.append((max((ranges[r][-1][1] for r in roots if r in ranges), default=0), b, k))
        else:  # the output itself waits whole (for "combined": the full gradient until the all-reduce)
            for r in roots:
                if r in ranges:
                    ranges[r][-1][1] = n - 1
                    kind[r] = "grads" if m else kind[r]
    size = {r: _bytes(vals[r].shape, _gathered_itemsize(f, r, tpu, local_rows) if in_kind.get(r, "arg") != "arg"
                      else vals[r].itemsize, tpu) for r in ranges}
    delta = [0] * (n + 1)
    for r, rs in ranges.items():
        for a, b in rs:
            delta[a] += size[r]
            delta[b + 1] -= size[r]
    for a, b, _ in extra:
        delta[a] += b
    cur, peak, at = 0, 0, 0
    for idx in range(n):
        cur += delta[idx]
        if cur > peak:
            peak, at = cur, idx
    by_kind: dict[str, int] = {}
    live = []
    for r, rs in ranges.items():
        for a, b in rs:
            if a <= at <= b:
                by_kind[kind[r]] = by_kind.get(kind[r], 0) + size[r]
                live.append((f"{kind[r]}/{vals[r].op}", vals[r].shape, vals[r].itemsize, size[r], a, b))
    for a, b, k in extra:
        if a <= at:
            by_kind[k] = by_kind.get(k, 0) + b
    bufs = [(size[r], a, b) for r, rs in ranges.items() for a, b in rs] + [(b, a, n - 1) for a, b, _ in extra]
    return Liveness(peak=peak, heap=pack(bufs), at_peak=by_kind, peak_index=at, n_eqns=n, live=sorted(live, key=lambda t: -t[3]))
