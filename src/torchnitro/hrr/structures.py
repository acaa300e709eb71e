"""Structures built from HRR ops: role-filler records and sequences, and their measured capacity.

Record: ``r = sum_j role_j * filler_j`` with *unitary* role vectors derived from the role names
(SHA-256 of ``"<seed>:<name>"`` seeds a generator), so the same name gives the same role everywhere
without storing it, and unbinding with the involution is exact for the role: the decoded filler is
``filler_j`` plus the crosstalk of the other ``k - 1`` pairs (similarity ~ ``1/sqrt(k)``).

Sequence: ``s = sum_i P^i(x_i)`` with a fixed random permutation ``P`` (seeded); position ``i`` is read
back with ``P^-i`` and cleaned up against an ItemMemory.

Capacity: ``measure_accuracy`` encodes random structures of ``k`` items drawn from a codebook of
``n_items`` and reports the fraction decoded correctly; ``capacity`` searches the largest ``k`` whose
accuracy reaches a target. Both are Monte-Carlo estimates (seeded); see docs/hrr.md for a table.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchnitro.errors import InputError, ShapeError
from torchnitro.hrr import ops
from torchnitro.hrr.backend import check_vec
from torchnitro.hrr.fused import bind_superpose
from torchnitro.hrr.memory import ItemMemory

__all__ = ["role_vector", "role_matrix", "Record", "Sequence", "measure_accuracy", "capacity", "STRUCTURES"]

STRUCTURES = ("record", "sequence")


@functools.lru_cache(maxsize=4096)
def _role64(name: str, d: int, seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return ops.unitary(1, d, generator=g, dtype=torch.float64)[0]


def role_vector(name: str, d: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The unitary role vector of ``name`` (deterministic in ``name``, ``d`` and ``seed``), shape (d,)."""
    if not isinstance(name, str):
        raise InputError(f"role name: received {type(name).__name__} {name!r}, expected a str")
    return _role64(name, d, seed).to(dtype=dtype, device=device)


def role_matrix(names: list[str] | tuple[str, ...], d: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Role vectors of ``names`` stacked, (k, d)."""
    return torch.stack([role_vector(n, d, seed=seed, dtype=dtype, device=device) for n in names])


@functools.lru_cache(maxsize=64)
def _position_index(d: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tables of P^i and P^-i for i < length: two (length, d) int64 tensors."""
    perm = ops.permutation(d, generator=torch.Generator().manual_seed(seed))
    fwd = [torch.arange(d)]
    for _ in range(1, length):
        fwd.append(fwd[-1].index_select(0, perm))  # P^{i+1}(j) = P^i(P(j))
    table = torch.stack(fwd)
    return table, torch.argsort(table, dim=1)


@dataclass(frozen=True)
class Record:
    """A role-filler record: ``vector`` (..., d) holds ``sum_j role(name_j) * filler_j``."""

    vector: torch.Tensor  # (..., d) the encoded record (a batch of records when there are leading dims)
    roles: tuple[str, ...]  # role names, in encoding order
    seed: int = 0  # role-vector seed: records only decode with the seed they were encoded with

    @classmethod
    def encode(cls, fields: Mapping[str, torch.Tensor], *, seed: int = 0, normalized: bool = True) -> "Record":
        """Encode ``{role: filler}``; fillers are (d,) or batched (..., d) and broadcast together."""
        if not isinstance(fields, Mapping) or not fields:
            raise InputError(f"Record.encode: received {type(fields).__name__}, expected a non-empty dict role -> vector")
        names = tuple(fields)
        vecs = list(fields.values())
        for n, v in zip(names, vecs):
            if not isinstance(v, torch.Tensor):
                raise InputError(f"Record.encode: filler of {n!r} is {type(v).__name__}, expected a torch.Tensor (..., d)")
        d = vecs[0].shape[-1]
        try:
            fillers = torch.stack(torch.broadcast_tensors(*vecs), dim=-2)  # (..., k, d)
        except RuntimeError as exc:
            shapes = {n: tuple(v.shape) for n, v in zip(names, vecs)}
            raise ShapeError(f"Record.encode: filler shapes {shapes} do not broadcast; give every filler (..., d)") from exc
        roles = role_matrix(names, d, seed=seed, dtype=fillers.dtype, device=fillers.device)  # (k, d)
        return cls(bind_superpose(roles, fillers, normalized=normalized), names, seed)

    def filler(self, role: str) -> torch.Tensor:
        """The noisy filler of ``role`` (..., d): unbinding with the (unitary) role vector."""
        if role not in self.roles:
            raise InputError(f"Record: received role {role!r}, this record has roles {list(self.roles)}")
        r = role_vector(role, self.vector.shape[-1], seed=self.seed, dtype=self.vector.dtype, device=self.vector.device)
        return ops.unbind(self.vector, r)

    def decode(self, role: str, memory: ItemMemory, k: int = 1) -> tuple[Any, torch.Tensor]:
        """Clean up the filler of ``role`` against ``memory``: labels and similarities (see ItemMemory.cleanup)."""
        return memory.cleanup(self.filler(role), k=k)

    def decode_all(self, memory: ItemMemory) -> dict[str, Any]:
        """Best label for every role, in one cleanup call."""
        q = torch.stack([self.filler(r) for r in self.roles], dim=-2)  # (..., k, d)
        names, _ = memory.cleanup(q.reshape(-1, q.shape[-1]))
        k = len(self.roles)
        if self.vector.dim() == 1:
            return dict(zip(self.roles, names))
        return {r: names[j::k] for j, r in enumerate(self.roles)}


@dataclass(frozen=True)
class Sequence:
    """A sequence ``vector`` (..., d) = ``sum_i P^i(x_i)`` for positions ``0 .. length - 1``."""

    vector: torch.Tensor  # (..., d)
    length: int  # number of positions encoded
    seed: int = 0  # seed of the permutation P

    @classmethod
    def encode(cls, items: torch.Tensor, *, seed: int = 0, normalized: bool = True) -> "Sequence":
        """Encode ``items`` (..., L, d) (position along dim -2)."""
        if not isinstance(items, torch.Tensor) or items.dim() < 2 or items.shape[-2] == 0:
            got = tuple(items.shape) if isinstance(items, torch.Tensor) else type(items).__name__
            raise ShapeError(f"Sequence.encode: received {got}, expected a tensor (..., L, d) with L >= 1 items")
        check_vec("items", items)
        length, d = items.shape[-2], items.shape[-1]
        fwd, _ = _position_index(d, length, seed)
        idx = fwd.to(items.device).expand(*items.shape[:-2], length, d)
        out = items.gather(-1, idx).sum(-2)  # (..., d): P^i applied to position i, then summed
        return cls(ops.normalize(out) if normalized else out, length, seed)

    def item(self, i: int) -> torch.Tensor:
        """The noisy item at position ``i`` (..., d)."""
        if not isinstance(i, int) or not 0 <= i < self.length:
            raise InputError(f"Sequence: received position {i!r}, expected an int in [0, {self.length})")
        _, inv = _position_index(self.vector.shape[-1], self.length, self.seed)
        return self.vector.index_select(-1, inv[i].to(self.vector.device))

    def decode(self, memory: ItemMemory) -> list[Any]:
        """Best label at every position (for a batch of sequences: one list per position)."""
        d = self.vector.shape[-1]
        _, inv = _position_index(d, self.length, self.seed)
        v = self.vector.unsqueeze(-2).expand(*self.vector.shape[:-1], self.length, d)
        q = v.gather(-1, inv.to(v.device).expand_as(v))  # (..., L, d)
        names, _ = memory.cleanup(q.reshape(-1, d))
        if self.vector.dim() == 1:
            return names
        return [names[i::self.length] for i in range(self.length)]


def measure_accuracy(structure: str, n_pairs: int, *, d: int, n_items: int, trials: int = 100,
                     seed: int = 0) -> float:
    """Fraction of items decoded correctly from ``trials`` random structures of ``n_pairs`` items.

    Items are drawn (with replacement) from a codebook of ``n_items`` N(0, 1/d) vectors; records use
    ``n_pairs`` distinct roles; every item is cleaned up against the whole codebook.
    """
    if structure not in STRUCTURES:
        raise InputError(f"structure: received {structure!r}, expected one of {STRUCTURES}")
    for name, v in (("n_pairs", n_pairs), ("d", d), ("n_items", n_items), ("trials", trials)):
        if not isinstance(v, int) or v < 1:
            raise InputError(f"measure_accuracy: received {name}={v!r}, expected an int >= 1")
    g = torch.Generator().manual_seed(seed)
    book = ops.random(n_items, d, generator=g)
    mem = ItemMemory(book, device="cpu")
    pick = torch.randint(0, n_items, (trials, n_pairs), generator=g)
    fillers = book[pick]  # (trials, k, d)
    if structure == "record":
        names = [f"role{j}" for j in range(n_pairs)]
        rec = Record.encode({n: fillers[:, j] for j, n in enumerate(names)}, seed=seed)
        q = torch.stack([rec.filler(n) for n in names], dim=1)  # (trials, k, d)
    else:
        seq = Sequence.encode(fillers, seed=seed)
        _, inv = _position_index(d, n_pairs, seed)
        v = seq.vector.unsqueeze(1).expand(trials, n_pairs, d)
        q = v.gather(-1, inv.expand_as(v))
    _, idx = mem.topk(q.reshape(-1, d), k=1)
    return (idx[:, 0] == pick.reshape(-1)).double().mean().item()


def capacity(structure: str, *, d: int, n_items: int, accuracy: float = 0.99, trials: int = 100,
             seed: int = 0, max_pairs: int = 4096) -> int:
    """Largest number of items per structure decoded with at least ``accuracy`` (Monte-Carlo).

    Doubling search, then bisection; 0 when even one item misses the target.
    """
    if not 0.0 < accuracy <= 1.0:
        raise InputError(f"capacity: received accuracy={accuracy!r}, expected a fraction in (0, 1]")

    def ok(k: int) -> bool:
        return measure_accuracy(structure, k, d=d, n_items=n_items, trials=trials, seed=seed) >= accuracy

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_pairs and ok(hi):
        lo, hi = hi, hi * 2
    if hi > max_pairs:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
