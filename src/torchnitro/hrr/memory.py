"""ItemMemory: a codebook of labelled vectors and batched cleanup (nearest items by cosine).

The codebook is one (N, d) matrix of unit rows plus the (N,) row norms, so cosine similarity of a
query batch against every item is one matrix product. Items are processed in chunks of
``chunk_size`` rows: each chunk's (Q, chunk) score block is reduced to its top-k and merged into a
running top-k, so memory stays O(Q * chunk) however large N is, and a codebook that does not fit in
accelerator memory (or, with ``load(..., mmap=True)``, in RAM) is streamed through.

Ranking uses dot products with unit items; dividing by the query norm (a positive per-row constant)
does not change the order, so it is applied only to the k winners.

Editing is cheap: rows live in a buffer with spare capacity that doubles when full, so ``add`` copies
only the new rows (amortised O(added)); ``remove`` fills each hole with one of the last rows, so it
moves O(removed) rows (item order is not kept; ``remove(..., keep_order=True)`` keeps it and moves
every row after the first hole instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from torchnitro.errors import InputError, ShapeError
from torchnitro.hrr.backend import to_device, topk_chunked
from torchnitro.hrr.dispatch import Dispatcher
from torchnitro.hrr.store import load_store, save_store

__all__ = ["ItemMemory"]

_FORMAT = "torchnitro.hrr.ItemMemory"


def _check_chunk(chunk_size: int | None) -> int | None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise InputError(f"chunk_size: received {chunk_size!r}, expected a positive int or None (automatic)")
    return chunk_size


class ItemMemory:
    """Labelled codebook with batched top-k cleanup.

    ``codebook`` is (N, d); ``labels`` (default ``"0" .. "N-1"``) must be unique strings.
    ``device``: "auto" (small query batches on the CPU, large on the GPU, from the cleanup threshold
    ``hrr.calibrate(d, op="cleanup", n_items=len(memory))``, measured once per codebook-size bucket),
    "cpu", or "cuda". ``dispatcher`` overrides ``device`` (tests inject faults).
    """

    def __init__(
        self,
        codebook: torch.Tensor,
        labels: Sequence[str] | None = None,
        *,
        device: str = "auto",
        chunk_size: int | None = None,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        cb = self._check_vectors(codebook, "codebook")
        if cb.dtype not in (torch.float32, torch.float64):
            cb = cb.float()
        labels = [str(i) for i in range(cb.shape[0])] if labels is None else list(labels)
        self._check_labels(labels, cb.shape[0])
        self.chunk_size = _check_chunk(chunk_size)
        self.dispatcher = dispatcher or Dispatcher(device, d=cb.shape[1], op="cleanup", n_items=cb.shape[0])
        norms = torch.linalg.vector_norm(cb, dim=1)
        self._set_rows((cb / norms.clamp_min(1e-30).unsqueeze(1)).cpu(), norms.cpu(), owned=True)  # (N, d), (N,)
        self._labels = labels
        self._index = {lab: i for i, lab in enumerate(labels)}
        self._resident: dict[torch.device, torch.Tensor] = {}

    def _set_rows(self, unit: torch.Tensor, norms: torch.Tensor, *, owned: bool) -> None:
        """Adopt (N, d) unit rows and (N,) norms as the buffers; ``owned=False`` (e.g. memory-mapped
        from a store) means the first edit copies them instead of writing into them."""
        self._ubuf, self._nbuf, self._n, self._owned = unit, norms, unit.shape[0], owned

    @property
    def _unit(self) -> torch.Tensor:
        return self._ubuf[: self._n]  # (N, d) contiguous view of the first N rows

    @property
    def _norms(self) -> torch.Tensor:
        return self._nbuf[: self._n]

    @property
    def capacity(self) -> int:
        """Rows the buffer holds before the next ``add`` has to grow it."""
        return self._ubuf.shape[0]

    def _reserve(self, rows: int, *, spare: bool = True) -> None:
        """Own buffers with room for ``rows`` rows: double when full, shrink when under a quarter used.

        ``spare=False`` sizes a copy of a borrowed (memory-mapped) buffer to ``rows`` exactly, so the
        first ``remove`` on a large mapped store does not allocate twice its size.
        """
        cap = self.capacity
        if self._owned and rows <= cap and (cap <= 64 or rows >= cap // 4):
            return
        cap = max(rows, 2 * cap) if self._owned and rows > cap else max(16, 2 * rows if spare else rows)
        ubuf = torch.empty((cap, self.d), dtype=self.dtype)
        nbuf = torch.empty((cap,), dtype=self._nbuf.dtype)
        n = min(self._n, cap)
        ubuf[:n] = self._ubuf[:n]
        nbuf[:n] = self._nbuf[:n]
        self._ubuf, self._nbuf, self._owned = ubuf, nbuf, True

    # ----------------------------------------------------------------------------- inspection
    def __len__(self) -> int:
        return self._unit.shape[0]

    def __contains__(self, label: object) -> bool:
        return label in self._index

    def __getitem__(self, label: str) -> torch.Tensor:
        return self.vectors[self._position(label)]

    @property
    def d(self) -> int:
        return self._unit.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._unit.dtype

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def vectors(self) -> torch.Tensor:
        """The codebook as given (unit rows times their norms), (N, d)."""
        return self._unit * self._norms.unsqueeze(1)

    # ----------------------------------------------------------------------------- validation
    @staticmethod
    def _check_vectors(x: Any, name: str, d: int | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{name}: received {type(x).__name__}, expected a torch.Tensor of shape (N, d)")
        if x.dim() != 2 or x.shape[1] == 0:
            raise ShapeError(f"{name}: received shape {tuple(x.shape)}, expected (N, d) with d >= 1")
        if d is not None and x.shape[1] != d:
            raise ShapeError(f"{name}: received vectors of dimension {x.shape[1]}, this memory holds d={d}")
        if not x.is_floating_point():
            raise InputError(f"{name}: received dtype {x.dtype}, expected a floating dtype; convert with .float()")
        return x

    def _check_labels(self, labels: list[str], n: int) -> None:
        if len(labels) != n:
            raise InputError(f"labels: received {len(labels)} labels for {n} vectors; give one label per row")
        bad = [lab for lab in labels if not isinstance(lab, str)]
        if bad:
            raise InputError(f"labels: received non-string label(s) {bad[:3]!r}; labels must be str")
        if len(set(labels)) != len(labels):
            seen: set[str] = set()
            dups = sorted({lab for lab in labels if lab in seen or seen.add(lab)})
            raise InputError(f"labels: duplicate label(s) {dups[:5]!r}; labels must be unique")

    def _position(self, label: str) -> int:
        try:
            return self._index[label]
        except KeyError:
            raise InputError(f"label {label!r} is not in this memory ({len(self)} items); add() it first") from None

    # ----------------------------------------------------------------------------- editing
    def add(self, labels: Sequence[str], vectors: torch.Tensor) -> None:
        """Append items; labels must be new. Amortised O(added): only the new rows are copied."""
        v = self._check_vectors(vectors, "vectors", self.d)
        labels = list(labels)
        self._check_labels(labels, v.shape[0])
        clash = [lab for lab in labels if lab in self._index]
        if clash:
            raise InputError(f"add: label(s) {clash[:5]!r} already exist; remove() them first or use new labels")
        v = v.detach().to(device="cpu", dtype=self.dtype)
        norms = torch.linalg.vector_norm(v, dim=1)
        n, m = self._n, v.shape[0]
        self._reserve(n + m)
        torch.div(v, norms.clamp_min(1e-30).unsqueeze(1), out=self._ubuf[n:n + m])
        self._nbuf[n:n + m] = norms
        self._n = n + m
        for lab in labels:
            self._index[lab] = len(self._labels)
            self._labels.append(lab)
        self._edited()

    def remove(self, labels: Sequence[str], *, keep_order: bool = False) -> None:
        """Delete items by label (all labels are checked before anything is removed).

        Each hole is filled with one of the last rows, so this moves O(removed) rows and the order of
        the remaining items changes; ``keep_order=True`` shifts every later row down instead (O(N)).
        """
        drop = sorted({self._position(lab) for lab in labels})
        if not drop:
            return
        self._reserve(self._n, spare=False)  # a borrowed (memory-mapped) buffer is copied before it is written
        n_new = self._n - len(drop)
        if keep_order:
            keep = torch.tensor(sorted(set(range(drop[0], self._n)) - set(drop)), dtype=torch.long)
            src, dst = keep, torch.arange(drop[0], drop[0] + len(keep))
        else:
            dropped = set(drop)
            holes = [i for i in drop if i < n_new]  # holes below the new end get the surviving tail rows
            movers = [i for i in range(n_new, self._n) if i not in dropped]
            src, dst = torch.tensor(movers, dtype=torch.long), torch.tensor(holes, dtype=torch.long)
        for lab in (self._labels[i] for i in drop):
            del self._index[lab]
        if len(src):
            self._ubuf[dst] = self._ubuf[src]
            self._nbuf[dst] = self._nbuf[src]
            for s_, d_ in zip(src.tolist(), dst.tolist()):
                self._labels[d_] = self._labels[s_]
                self._index[self._labels[d_]] = d_
        del self._labels[n_new:]
        self._n = n_new
        self._reserve(n_new)  # give memory back once under a quarter of the buffer is used
        self._edited()

    def _edited(self) -> None:
        self._resident.clear()
        self.dispatcher.n_items = self._n  # a cleanup dispatcher follows the codebook size

    # ----------------------------------------------------------------------------- queries
    def _codebook_on(self, device: torch.device) -> torch.Tensor:
        """The unit matrix on ``device``: resident if it fits comfortably, else streamed by chunks."""
        if device.type != "cuda":
            return self._unit
        if device not in self._resident:
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = self._unit.numel() * self._unit.element_size()
            if nbytes > free // 2:  # too big to keep there: stream chunks from pinned host memory
                host = torch.device("cpu")
                if host not in self._resident:
                    self._resident[host] = self._unit.pin_memory()
                return self._resident[host]
            self._resident[device] = to_device(self._unit, device)
        return self._resident[device]

    def _prepare_queries(self, queries: Any) -> tuple[torch.Tensor, bool]:
        if not isinstance(queries, torch.Tensor):
            raise InputError(f"queries: received {type(queries).__name__}, expected a tensor of shape (d,) or (Q, d)")
        single = queries.dim() == 1
        q = queries.unsqueeze(0) if single else queries
        self._check_vectors(q, "queries", self.d)
        return q.to(self.dtype), single

    def topk(self, queries: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine similarities and indices of the ``k`` nearest items: ((Q, k), (Q, k)) on the CPU."""
        if not isinstance(k, int) or k < 1:
            raise InputError(f"k: received {k!r}, expected an int >= 1")
        if len(self) == 0:
            raise InputError("cleanup: this memory is empty; add() items first")
        q, _ = self._prepare_queries(queries)
        k = min(k, len(self))
        chunk = self.chunk_size

        def run(qq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cb = self._codebook_on(qq.device)
            v, i = topk_chunked(qq, cb, k, chunk)
            return v / torch.linalg.vector_norm(qq, dim=1, keepdim=True).clamp_min(1e-30), i

        return self.dispatcher.run(run, q, batch=q.shape[0])

    def cleanup(self, queries: torch.Tensor, k: int = 1) -> tuple[Any, torch.Tensor]:
        """Labels and cosine similarities of the nearest items.

        Query (d,) and k=1: ``(label, sim)``; (Q, d) and k=1: ``(list of Q labels, (Q,) sims)``;
        k > 1 adds a trailing k: ``list[list[str]]`` and (Q, k) (or (k,) for one query).
        """
        sims, idx = self.topk(queries, k)
        names = [[self._labels[j] for j in row] for row in idx.tolist()]
        single = queries.dim() == 1
        if k == 1:
            names_out: Any = [r[0] for r in names]
            sims = sims[:, 0]
        else:
            names_out = names
        return (names_out[0], sims[0]) if single else (names_out, sims)

    def similarities(self, queries: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of each query with every item, (Q, N) (or (N,) for one query)."""
        q, single = self._prepare_queries(queries)
        qn = q / torch.linalg.vector_norm(q, dim=1, keepdim=True).clamp_min(1e-30)
        out = self.dispatcher.run(lambda qq: qq @ self._codebook_on(qq.device).to(qq.device).T, qn, batch=q.shape[0])
        return out[0] if single else out

    # ----------------------------------------------------------------------------- persistence
    def save(self, directory: str | Path) -> Path:
        """Write the memory as safetensors + labels + a SHA-256 manifest."""
        meta = {"n": len(self), "d": self.d, "dtype": str(self.dtype).removeprefix("torch.")}
        return save_store(directory, {"unit": self._unit, "norms": self._norms}, self._labels, format=_FORMAT, meta=meta)

    @classmethod
    def load(cls, directory: str | Path, *, device: str = "auto", mmap: bool = False,
             chunk_size: int | None = None) -> "ItemMemory":
        """Load a saved memory after verifying every checksum. ``mmap`` maps the codebook instead of reading it."""
        tensors, labels, _ = load_store(directory, format=_FORMAT, mmap=mmap)
        mem = cls.__new__(cls)
        mem.chunk_size = _check_chunk(chunk_size)
        mem._set_rows(tensors["unit"], tensors["norms"], owned=False)
        mem.dispatcher = Dispatcher(device, d=mem._unit.shape[1], op="cleanup", n_items=mem._unit.shape[0])
        mem._check_labels(list(labels), mem._unit.shape[0])
        mem._labels = list(labels)
        mem._index = {lab: i for i, lab in enumerate(mem._labels)}
        mem._resident = {}
        return mem
