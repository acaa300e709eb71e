"""On-disk cache of search results, so a re-run is fast.

Two levels, both under ``$TORCHNITRO_CACHE_DIR`` (default ``~/.cache/torchnitro``):

* ``candidates/<key>/``: one evaluated candidate (its record and its artifact files). The key hashes
  the model (weights and structure), the input signature, the recipe, the verification sizes and
  tolerance, thread count, device, and the hardware fingerprint (which covers library versions).
* ``searches/<key>.json``: a whole search (the report and which candidate won), keyed by the same
  model/input/hardware hash plus the config fields that change the answer.

Entries are written to a temporary folder and renamed, so a killed run never leaves half an entry.
Failed candidates are not cached (a timeout may be load on the machine, not the recipe).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CACHE_VERSION", "model_hash", "make_key", "function_id", "CandidateCache"]

CACHE_VERSION = "3"  # bump when the meaning of cached entries changes (2: per-row cosine gate; 3: a masked
# token model's sequence dim is dynamic, so a cached winner exported at the example's length is not reused)


def model_hash(model: nn.Module) -> str:
    """SHA-256 over the module structure and every parameter/buffer's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(type(model).__module__.encode() + b"." + type(model).__qualname__.encode())
    h.update(repr(model).encode())
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}={t!r}".encode())
            continue
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())
    return h.hexdigest()


def function_id(fn: Any) -> str | None:
    """Identity of a user function for cache keys: name plus a hash of its bytecode and constants,
    so two different lambdas do not share cached verdicts."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    body = repr((code.co_code, code.co_consts, code.co_names)) if code is not None else repr(fn)
    return f"{getattr(fn, '__qualname__', type(fn).__name__)}:{hashlib.sha256(body.encode()).hexdigest()[:12]}"


def make_key(**parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class CandidateCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _cand(self, key: str) -> Path:
        return self.root / "candidates" / key

    def get_candidate(self, key: str) -> tuple[dict[str, Any], Path] | None:
        d = self._cand(key)
        try:
            rec = json.loads((d / "entry.json").read_text())
        except (OSError, ValueError):
            return None
        if not all((d / f).is_file() for f in rec.get("files", [])):
            return None
        return rec, d

    def put_candidate(self, key: str, entry: dict[str, Any], src_dir: Path, files: list[str]) -> Path | None:
        """Copy ``files`` from ``src_dir`` into the cache with ``entry``; returns the entry folder."""
        final = self._cand(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
            for f in files:
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src_dir / f, tmp / f)
            (tmp / "entry.json").write_text(json.dumps({**entry, "files": files}, default=str))
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            return final
        except OSError:  # a read-only or full disk must not fail the search
            return None

    def get_search(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / "searches" / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def put_search(self, key: str, data: dict[str, Any]) -> None:
        d = self.root / "searches"
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, default=str)
            os.replace(tmp, d / f"{key}.json")
        except OSError:
            pass
