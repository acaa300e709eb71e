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

An artifact is data, because anyone can edit a manifest and recompute its unkeyed hash. Unless the
caller passes ``trust_code=True`` (CLI: ``--trust-code``), loading refuses

* a model reference that is not a built-in name, a local Hugging Face folder or a ``module:function``
  in a module installed here (a ``.py`` path, or a module found inside the artifact, is refused);
* a TorchScript (or any pickle-bearing) archive among the files: ``torch.jit.load`` runs the program
  it holds. A ``torch.export`` program loads with one warning: its graph runs only registered ops,
  but it is still a program from whoever made the file;
* manifest keys that are absolute or contain ``..``, any symbolic link, and any file the manifest
  does not list.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from torch import nn

from torchnitro.autotune.recipe import EAGER, CandidateFiles, get_recipe
from torchnitro.checksum import sha256_file
from torchnitro.errors import ArtifactError, InputError, RecipeError

__all__ = ["FORMAT", "FORMAT_VERSION", "EagerSource", "write_artifact", "read_manifest", "load_artifact",
           "check_model_spec"]

FORMAT = "torchnitro-artifact"
FORMAT_VERSION = 1
_OPT_IN = ("If you trust whoever made this artifact, load it with trust_code=True (CLI: --trust-code), "
           "as with Hugging Face's trust_remote_code.")


def _manifest_hash(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class EagerSource:
    """The eager model a variant was made from: what a non-standalone artifact stores of it."""

    model: nn.Module | None = None  # the eager fp32 model (its weights go into a non-standalone artifact)
    ref: dict[str, Any] = field(default_factory=dict)  # {'spec', 'name', 'extra'}: how load() rebuilds it
    example_inputs: tuple[Any, ...] = ()  # for torch.export when saving eager without a factory
    dynamic_dims: dict[int, list[int]] = field(default_factory=dict)  # input index -> dims that vary
    arg_names: list[str] = field(default_factory=list)  # forward arguments by position, for keyword calls
    # a loaded artifact's weights.safetensors, copied as is on save: ``model`` may have been converted by
    # its recipe's load (bf16, int8 smoothing), the file holds the fp32 weights
    weights: Path | None = None
    # ``model``'s parameters as the variant was made (``install_inputs.Weights``): ``install`` on this same object
    # refuses it once it has changed (fine-tuned since), which comparing it with itself cannot tell
    made_with: Any = None

    def __post_init__(self) -> None:
        if self.model is not None and self.made_with is None:
            from torchnitro.autotune.install_inputs import Weights

            self.made_with = Weights.of(self.model)


def write_artifact(directory: str | Path, candidate: CandidateFiles, source: EagerSource, *, recipe: str,
                   numeric_class: str, signature: dict[str, Any], report: Any, hardware: str) -> Path:
    out = Path(directory)
    inputs = [Path(candidate.dir) / f for f in candidate.files] + ([source.weights] if source.weights else [])
    if any(p.resolve().is_relative_to(out.resolve()) for p in inputs):
        raise ArtifactError(f"save: {str(out)!r} holds the files of the model being saved (it was loaded from "
                            "there); expected another folder. Save to a new path, then replace the old one.")
    if out.exists() and any(out.iterdir()):
        if not (out / "manifest.json").is_file():
            raise ArtifactError(f"save: {str(out)!r} exists and is not an artifact directory; expected an empty or "
                                "new folder (or an old artifact to overwrite). Pick another path.")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    for f in candidate.files:
        dst = out / "candidate" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(candidate.dir) / f, dst)  # type: ignore[arg-type]
        written.append(f"candidate/{f}")
    if not candidate.standalone:
        _write_weights(source, out / "weights.safetensors", recipe)
        written.append("weights.safetensors")
    (out / "report.json").write_text(report.to_json())
    (out / "report.md").write_text(report.to_markdown())
    written += ["report.json", "report.md"]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "torchnitro_version": _version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "recipe": recipe,
        "numeric_class": numeric_class, "standalone": candidate.standalone, "meta": candidate.meta,
        "candidate_files": candidate.files, "model": _model_ref(candidate, source), "signature": signature,
        "hardware": hardware,
        "files": {f: sha256_file(out / f) for f in written},
    }
    manifest["manifest_sha256"] = _manifest_hash(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return out


def _weights_sha256(model: nn.Module) -> str:
    """SHA-256 of the model's weights alone: each state-dict tensor's dtype, shape and bytes, in order (not names,
    class or module path, which an adapter or the script that loads may change)."""
    import torch

    h = hashlib.sha256()
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor) and not t.is_meta:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model_ref(candidate: CandidateFiles, source: EagerSource) -> dict[str, Any]:
    """The manifest's model reference; a standalone program holds its own weights, so their hash goes with it
    (``load(dir, model=m)`` checks ``m`` against it, as it checks a non-standalone artifact's weight file)."""
    if not candidate.standalone or source.model is None:
        return source.ref
    return {**source.ref, "weights_sha256": _weights_sha256(source.model)}


def _write_weights(source: EagerSource, path: Path, recipe: str) -> None:
    if source.weights is not None:
        shutil.copy2(source.weights, path)
        return
    model = source.model
    if model is None:
        raise ArtifactError(f"save: recipe {recipe!r} needs the eager weights but no model is attached")
    from safetensors.torch import save_model

    save_model(model.cpu() if next(model.parameters(), None) is not None else model, str(path))


def _version() -> str:
    from torchnitro.version import __version__

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
    _check_layout(d, manifest)
    bad = []
    for rel, digest in manifest["files"].items():
        p = d / rel
        if not p.is_file():
            bad.append(f"{rel} is missing")
        elif sha256_file(p) != digest:
            bad.append(f"{rel} has SHA-256 {sha256_file(p)[:12]}..., manifest says {digest[:12]}...")
    if bad:
        raise ArtifactError(f"load: artifact {str(d)!r} failed its checksum: {'; '.join(bad)}. Expected the files "
                            "exactly as saved; the artifact was tampered with or damaged, re-create it.")
    return manifest


def _plain_key(rel: Any) -> bool:
    """A manifest key names a file below the folder: relative, forward slashes, no '.', '..' or empty parts."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return not PurePosixPath(rel).is_absolute() and all(p not in ("", ".", "..") for p in parts) \
        and not (len(parts[0]) > 1 and parts[0][1] == ":")  # a Windows drive


def _check_layout(d: Path, manifest: dict[str, Any]) -> None:
    """The folder holds exactly the files the manifest lists, as regular files, and no links."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"load: manifest.json of {str(d)!r} has 'files' of type {type(files).__name__}; "
                            "expected a mapping of relative paths to SHA-256; re-create the artifact")
    root = d.resolve()
    bad = [f"{rel!r} is not a plain relative path inside the artifact" for rel in files if not _plain_key(rel)]
    bad += [f"{rel!r} resolves outside the artifact" for rel in files
            if _plain_key(rel) and not (root / rel).resolve().is_relative_to(root)]
    bad += [f"candidate file {f!r} is not among the listed files" for f in manifest.get("candidate_files", [])
            if f"candidate/{f}" not in files]
    listed = set(files) | {"manifest.json"}
    for top, dirs, names in os.walk(root):  # does not follow links: a linked folder is reported, not entered
        for n in sorted(dirs + names):
            p = Path(top) / n
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                bad.append(f"{rel} is a symbolic link")
            elif n in names and not p.is_file():
                bad.append(f"{rel} is not a regular file")
            elif n in names and rel not in listed:
                bad.append(f"{rel} is not listed in manifest.json")
    if bad:
        raise ArtifactError(f"load: artifact {str(d)!r} is not plain data: {'; '.join(bad)}. Expected only the "
                            "regular files manifest.json lists, inside the folder; remove the others or re-create "
                            "the artifact with torchnitro optimize --out")


def check_model_spec(spec: str, directory: Path) -> None:
    """Refuse a manifest model reference that would run code the artifact carries (see module docstring).

    Built-in names and ``hf:`` folders are data. ``module:function`` must name a module installed
    here, found without the artifact on the path; it is imported here so the rebuild uses this copy.
    """
    if ":" not in spec or spec.startswith("hf:"):
        return
    mod_name, _, fn_name = spec.rpartition(":")
    where = f"manifest.json of {str(directory)!r} names the model factory {spec!r}"
    if not all(p.isidentifier() for p in mod_name.split(".")) or not fn_name.isidentifier():
        raise ArtifactError(f"load: {where}, which is not an installed 'module:function' (a file path?); an "
                            f"artifact is data and torchnitro runs no code it points at. Pass the model: torchnitro.load(dir, "
                            f"model=MyModel()). {_OPT_IN}")
    try:
        found = importlib.util.find_spec(mod_name.split(".")[0])  # locates the top package, runs nothing
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ArtifactError(f"load: {where}, but module {mod_name!r} is not installed here; install the package "
                            "that provides it, or pass the model: torchnitro.load(dir, model=MyModel())")
    root = directory.resolve()

    def inside(place: str | None) -> bool:
        return bool(place) and Path(place).resolve().is_relative_to(root)  # type: ignore[arg-type]

    if not any(inside(p) for p in [found.origin, *(found.submodule_search_locations or [])]):
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001 - an installed module that fails to import: one clear message
            raise ArtifactError(f"load: {where}; importing {mod_name!r} failed ({type(exc).__name__}: {exc}); "
                                "fix that installation, or pass the model: torchnitro.load(dir, model=...)") from exc
        if not inside(getattr(module, "__file__", None)):
            return
    raise ArtifactError(f"load: {where}, a module inside the artifact directory; an artifact is data and "
                        f"torchnitro runs no code it carries. {_OPT_IN}")


def _program_kind(path: Path) -> str | None:
    """'torchscript' for archives torch.jit.load would run (code/ or pickles), 'export' for torch.export."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if any(n.endswith(".pkl") or "/code/" in f"/{n}" for n in names):
        return "torchscript"
    if any(n.rpartition("/")[2] == "archive_format" for n in names):
        return "export"
    return None


def _check_programs(d: Path, manifest: dict[str, Any]) -> None:
    """Refuse TorchScript, warn on torch.export programs, judged by each file's content, not its name."""
    kinds = {rel: _program_kind(d / rel) for rel in manifest["files"] if rel.startswith("candidate/")}
    scripts = sorted(rel for rel, k in kinds.items() if k == "torchscript")
    if scripts:
        raise ArtifactError(f"load: {', '.join(scripts)} in {str(d)!r} is a TorchScript (pickle-bearing) archive; "
                            "torch.jit.load runs the program it holds, so torchnitro does not load it from an "
                            f"artifact by default (expected plain data: ONNX, safetensors). {_OPT_IN}")
    exported = sorted(rel for rel, k in kinds.items() if k == "export")
    if exported:
        warnings.warn(f"{', '.join(exported)} in {str(d)!r} is a torch.export program: torch.export.load runs its "
                      "graph (registered ops only). Load artifacts only from sources you trust; pass "
                      "trust_code=True (CLI: --trust-code) to acknowledge and silence this", UserWarning, stacklevel=4)


def _check_same_weights(model: nn.Module, path: Path) -> None:
    """Refuse to overwrite ``model``'s weights with different ones from ``path``: the user's model object would
    change under them (a fine-tuned model reverted, another checkpoint replaced). Names the first that differs;
    names and shapes that do not fit are left to ``load_model``, which names them."""
    import torch
    from safetensors import safe_open

    from torchnitro.autotune.inputs import KeywordCall

    mine = model.state_dict()
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            t = mine.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            saved = f.get_tensor(name)
            if t.shape == saved.shape and not torch.equal(t.detach().cpu().to(saved.dtype), saved):
                kind = type(model.model if isinstance(model, KeywordCall) else model).__name__
                raise InputError(
                    f"load: received {kind} whose {name!r} differs from the weights saved in the artifact; loading "
                    f"would overwrite your model's weights with them. Expected the model the artifact was made from; "
                    f"to fill a new {kind}() with the artifact's weights, pass replace_weights=True")


def _check_program_weights(model: nn.Module, manifest: dict[str, Any]) -> None:
    """A standalone artifact loaded with ``model=m`` (to install it on ``m``): its program answers with the weights
    it was made from, so ``m`` must hold those (an artifact saved before the hash was recorded is not checked)."""
    want = (manifest.get("model") or {}).get("weights_sha256")
    if want and _weights_sha256(model) != want:
        raise InputError(f"load: received {type(model).__name__} whose weights differ from the ones the artifact was "
                         f"made from (its {manifest['recipe']} program holds those, and an install on this model would "
                         "answer with them); expected the model the artifact was made from. Optimize this model again, "
                         "or load without model= to run the artifact as saved")


def _for_recipe(recipe: str, eager: nn.Module | None, users: bool) -> nn.Module | None:
    """The model a recipe rebuilds from. The user's (``users``: given as ``load(dir, model=m)``) goes to any recipe
    but eager as a private copy, as in the search (``CandidateFiles.load``): a recipe may convert what it is given
    (bf16 casts it, the int8 and fused-kernel recipes swap its modules), and the user goes on using ``m`` (its
    own forward after ``uninstall()``). Eager runs the model itself; a model rebuilt here is converted in place."""
    return copy.deepcopy(eager) if users and eager is not None and recipe != EAGER else eager


def load_artifact(directory: str | Path, model: nn.Module | None = None, *, trust_code: bool = False,
                  threads: int | None = None, replace_weights: bool = False
                  ) -> tuple[dict[str, Any], Any, nn.Module | None]:
    """Verify, then rebuild: returns (manifest, callable, eager model or None).

    ``model``: the eager model a recipe that is not standalone rebuilds from. Its weights must be the artifact's
    (``InputError`` names the first that differs) unless ``replace_weights=True``, which loads the artifact's
    weights into it (a new instance of the architecture); a model running an installed variant is refused. Given
    for a standalone artifact (to install it on the model), its weights must hash as the saved program's did.
    ``trust_code``: run code the artifact names or holds (a ``.py`` model factory, TorchScript);
    only for artifacts from a source you trust. ``threads``: the intra-op thread count of a runtime session the
    recipe builds (ONNX Runtime, OpenVINO), instead of the one the artifact records
    (``thread_meta.meta_with_threads``).
    """
    d = Path(directory)
    manifest = read_manifest(d)
    users = model is not None
    if model is not None:
        from torchnitro.autotune.install import refuse_installed

        refuse_installed(model, "load")
        if manifest["standalone"] and not replace_weights:
            _check_program_weights(model, manifest)
    if not trust_code:
        _check_programs(d, manifest)
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
                    "a Python object with no factory reference; pass it: torchnitro.load(dir, model=my_model), or "
                    "a new instance to fill with the artifact's weights: torchnitro.load(dir, model=MyModel(), "
                    "replace_weights=True)")
            from torchnitro.autotune.inputs import rebuild_model

            if not trust_code:
                check_model_spec(str(ref["spec"]), d)
            model = rebuild_model(ref["spec"], ref.get("extra"))
        elif not replace_weights:
            _check_same_weights(model, d / "weights.safetensors")
        from safetensors.torch import load_model

        try:
            load_model(model, str(d / "weights.safetensors"), strict=True)
        except Exception as exc:  # noqa: BLE001 - a mismatched model gets one clear message
            raise ArtifactError(f"load: the saved weights do not fit the model {type(model).__name__} ({exc}); "
                                "pass the same architecture the artifact was made from") from exc
        eager = model.eval()
    try:
        meta = manifest.get("meta", {})
        if threads is not None:
            from torchnitro.autotune.thread_meta import meta_with_threads

            meta = meta_with_threads(meta, threads)
        fn = recipe.load(d / "candidate", meta, _for_recipe(recipe.name, eager, users))
    except Exception as exc:  # noqa: BLE001 - e.g. a runtime missing on this machine: one clear message
        raise ArtifactError(f"load: recipe {manifest['recipe']!r} could not rebuild the artifact in {str(d)!r}: "
                            f"{type(exc).__name__}: {exc}. Expected the libraries it was saved with "
                            f"(see 'hardware' in manifest.json); install them or re-run torchnitro optimize here") from exc
    return manifest, fn, eager
