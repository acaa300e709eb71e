"""Artifact directories: what ``OptimizedModel.save`` writes and ``torchnitro.load`` reads.

Layout::

    opt/
      manifest.json        recipe, numeric class, signature, model reference, SHA-256 of every file
      report.json          the search report (also report.md)
      candidate/...        the recipe's files (model.ts, model.onnx, ...)
      weights.safetensors  only when the recipe is not standalone: eager weights, rebuilt from the
                           model reference (builtin name, 'module:function' or 'hf:/path')

``load_artifact`` checks the manifest's own hash and every file's SHA-256 before loading anything:
a missing, truncated or edited file raises ``ArtifactError`` and nothing is unpickled. (The hashes
catch corruption and accidental edits; they are not a signature against a deliberate attacker.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from torch import nn

from torchnitro.errors import ArtifactError

__all__ = ["FORMAT", "FORMAT_VERSION", "sha256_file", "write_artifact", "read_manifest", "load_artifact"]

FORMAT = "torchnitro-artifact"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest_hash(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_artifact(directory: str | Path, *, recipe: str, numeric_class: str, standalone: bool, meta: dict[str, Any],
                   files_dir: Path | None, files: list[str], model: nn.Module | None, model_ref: dict[str, Any],
                   signature: dict[str, Any], report: Any, hardware: str) -> Path:
    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        if not (out / "manifest.json").is_file():
            raise ArtifactError(f"save: {str(out)!r} exists and is not an artifact directory; expected an empty or "
                                "new folder (or an old artifact to overwrite). Pick another path.")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    for f in files:
        dst = out / "candidate" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(files_dir) / f, dst)  # type: ignore[arg-type]
        written.append(f"candidate/{f}")
    if not standalone:
        if model is None:
            raise ArtifactError(f"save: recipe {recipe!r} needs the eager weights but no model is attached")
        from safetensors.torch import save_model

        save_model(model.cpu() if next(model.parameters(), None) is not None else model, str(out / "weights.safetensors"))
        written.append("weights.safetensors")
    (out / "report.json").write_text(report.to_json())
    (out / "report.md").write_text(report.to_markdown())
    written += ["report.json", "report.md"]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "torchnitro_version": _version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "recipe": recipe,
        "numeric_class": numeric_class, "standalone": standalone, "meta": meta,
        "candidate_files": files, "model": model_ref, "signature": signature, "hardware": hardware,
        "files": {f: sha256_file(out / f) for f in written},
    }
    manifest["manifest_sha256"] = _manifest_hash(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return out


def _version() -> str:
    from torchnitro import __version__

    return __version__


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest after checking it and every file it lists; raises ArtifactError otherwise."""
    d = Path(directory)
    if not d.is_dir():
        raise ArtifactError(f"load: {str(d)!r} is not a directory; expected a folder written by OptimizedModel.save "
                            "or 'torchnitro optimize --out'")
    mpath = d / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"load: {str(d)!r} has no manifest.json; expected an artifact directory "
                            "(re-run torchnitro optimize --out DIR)") from None
    except ValueError as exc:
        raise ArtifactError(f"load: {str(mpath)!r} is not valid JSON ({exc}); the artifact is damaged, re-create it") from exc
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"load: {str(mpath)!r} has format {manifest.get('format')!r} version "
                            f"{manifest.get('format_version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    if manifest.get("manifest_sha256") != _manifest_hash(manifest):
        raise ArtifactError(f"load: {str(mpath)!r} was edited after it was written (its hash does not match); "
                            "re-create the artifact instead of editing it")
    bad = []
    for rel, digest in manifest.get("files", {}).items():
        p = d / rel
        if not p.is_file():
            bad.append(f"{rel} is missing")
        elif sha256_file(p) != digest:
            bad.append(f"{rel} has SHA-256 {sha256_file(p)[:12]}..., manifest says {digest[:12]}...")
    if bad:
        raise ArtifactError(f"load: artifact {str(d)!r} failed its checksum: {'; '.join(bad)}. Expected the files "
                            "exactly as saved; the artifact was tampered with or damaged, re-create it.")
    return manifest


def load_artifact(directory: str | Path, model: nn.Module | None = None) -> tuple[dict[str, Any], Any, nn.Module | None]:
    """Verify, then rebuild: returns (manifest, callable, eager model or None)."""
    from torchnitro.autotune.recipe import get_recipe
    from torchnitro.errors import RecipeError

    d = Path(directory)
    manifest = read_manifest(d)
    try:
        recipe = get_recipe(manifest["recipe"])
    except RecipeError as exc:
        raise ArtifactError(f"load: the artifact was made by recipe {manifest['recipe']!r}, which this installation "
                            f"does not have ({exc}); install the package that provides it") from exc
    eager = None
    if not manifest["standalone"]:
        ref = manifest.get("model") or {}
        if model is None:
            if not ref.get("spec"):
                raise ArtifactError(
                    f"load: recipe {manifest['recipe']!r} rebuilds from the eager model, and this artifact was made from "
                    "a Python object with no factory reference; pass it: torchnitro.load(dir, model=MyModel())")
            from torchnitro.autotune.inputs import rebuild_model

            model = rebuild_model(ref["spec"], ref.get("extra"))
        from safetensors.torch import load_model

        try:
            load_model(model, str(d / "weights.safetensors"), strict=True)
        except Exception as exc:  # noqa: BLE001 - a mismatched model gets one clear message
            raise ArtifactError(f"load: the saved weights do not fit the model {type(model).__name__} ({exc}); "
                                "pass the same architecture the artifact was made from") from exc
        eager = model.eval()
    try:
        fn = recipe.load(d / "candidate", manifest.get("meta", {}), eager)
    except Exception as exc:  # noqa: BLE001 - e.g. a runtime missing on this machine: one clear message
        raise ArtifactError(f"load: recipe {manifest['recipe']!r} could not rebuild the artifact in {str(d)!r}: "
                            f"{type(exc).__name__}: {exc}. Expected the libraries it was saved with "
                            f"(see 'hardware' in manifest.json); install them or re-run torchnitro optimize here") from exc
    return manifest, fn, eager
