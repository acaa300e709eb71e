"""Hugging Face ``transformers.Pipeline`` objects as ``optimize`` takes them.

``optimize(pipe, "some text")`` tokenizes the example with the pipeline's own ``preprocess`` (its
tokenizer and tokenizer settings), pads the rows into one batch, optimizes ``pipe.model`` on that
batch (held-out inputs: other sentences through the same preprocessing), and returns an
``OptimizedPipeline``: a shallow copy of the pipeline whose ``model`` is a ``PipelineModel`` that
calls the optimized variant and answers in the HF model's own output class, so the pipeline's
``postprocess`` reads ``logits`` / ``last_hidden_state`` as before. The user's pipeline is not changed.

Supported: PyTorch text pipelines whose model is called with the tokenizer's tensors
(``SUPPORTED``). ``OptimizedPipeline.save(dir)`` writes the artifact to ``dir/model/`` and, beside it,
``dir/pipeline/`` (the tokenizer and model config via ``save_pretrained``, and ``pipeline.json``);
``torchnitro.load(dir)`` returns the optimized model, ``torchnitro.autotune.api.load_pipeline(dir)``
a pipeline again.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchnitro.autotune.inputs import ModelInfo, inputs_from_mapping
from torchnitro.checksum import sha256_file
from torchnitro.errors import ArtifactError, InputError

__all__ = ["SUPPORTED", "MODEL_DIR", "PIPELINE_DIR", "model_dir", "is_pipeline", "pipeline_workload", "PipelineModel",
           "OptimizedPipeline", "saved_pipeline_model", "rebuild_pipeline"]

# pipeline classes whose model takes the tokenizer's tensors as keywords and whose postprocess reads the
# model's ModelOutput (logits / last_hidden_state)
SUPPORTED = ("TextClassificationPipeline", "FeatureExtractionPipeline", "FillMaskPipeline",
             "TokenClassificationPipeline")
MODEL_DIR = "model"  # a saved pipeline's artifact folder (torchnitro.load reads it)
PIPELINE_DIR = "pipeline"  # a saved pipeline's tokenizer, model config and pipeline.json
_WORDS = ("the a model runs fast on this machine while every user waits for reply from server batch of sentences "
          "goes through layers attention heads look at each token and pooled vector describes meaning search "
          "people write questions about cooking travel weather sports music history science code").split()


def is_pipeline(obj: Any) -> bool:
    """True for an instance of ``transformers.Pipeline`` (found by class, without importing transformers)."""
    return any(c.__name__ == "Pipeline" and c.__module__.startswith("transformers.") for c in type(obj).__mro__)


def _check(pipe: Any) -> None:
    name = type(pipe).__name__
    framework = getattr(pipe, "framework", "pt")  # transformers 4.x: 'pt' or 'tf'; 5.x is PyTorch only
    if framework != "pt" or not isinstance(getattr(pipe, "model", None), nn.Module):
        raise InputError(f"pipeline: received a {name} on framework {framework!r} with model "
                         f"{type(getattr(pipe, 'model', None)).__name__}; expected a PyTorch pipeline "
                         "(pipeline(..., framework='pt') or a torch model)")
    if not any(c.__name__ in SUPPORTED for c in type(pipe).__mro__) or getattr(pipe, "tokenizer", None) is None:
        raise InputError(f"pipeline: received a {name} (task {getattr(pipe, 'task', '?')!r}); expected one of the "
                         f"text pipelines {list(SUPPORTED)} with a tokenizer. Optimize pipe.model with its own "
                         "tensor inputs instead")


def _texts(example: Any) -> list[str]:
    if isinstance(example, str):
        return [example]
    if isinstance(example, (list, tuple)) and example and all(isinstance(t, str) for t in example):
        return list(example)
    got = f"an empty {type(example).__name__}" if isinstance(example, (list, tuple)) and not example else \
        type(example).__name__ if not isinstance(example, (list, tuple)) else \
        f"a {type(example).__name__} holding {sorted({type(t).__name__ for t in example})}"
    raise InputError(f"example_inputs for a pipeline: received {got}; expected what the pipeline is called with: "
                     "a string, a non-empty list of strings, or the tokenizer's output (a dict of tensors)")


def _keys(pipe: Any) -> list[str]:
    """The tokenizer outputs the model takes (``special_tokens_mask``, offsets, ... are the pipeline's own)."""
    from torchnitro.autotune.inputs import forward_params

    names = {p.name for p in forward_params(pipe.model)}
    return [k for k in getattr(pipe.tokenizer, "model_input_names", ["input_ids", "attention_mask"]) if k in names]


def _rows(pipe: Any, texts: list[str], keys: list[str]) -> list[dict[str, list[int]]]:
    """One dict of token lists (``keys``) per model call the pipeline would make (a text may give several chunks)."""
    rows: list[dict[str, list[int]]] = []
    for text in texts:
        try:
            out = pipe.preprocess(text, **pipe._preprocess_params)
            items = [out] if isinstance(out, Mapping) else list(out)  # ChunkPipeline: a generator of chunks
        except Exception as exc:
            raise InputError(f"example_inputs: {type(pipe).__name__}.preprocess raised {type(exc).__name__}: {exc} "
                             f"on {text!r:.80}; expected text this pipeline accepts") from exc
        for item in items:
            batch = torch.as_tensor(item[keys[0]])
            for b in range(batch.shape[0] if batch.dim() == 2 else 1):  # (n, T) or (T,)
                rows.append({k: torch.as_tensor(item[k]).reshape(-1, batch.shape[-1])[b].tolist() for k in keys})
    return rows


def _pad(pipe: Any, rows: list[dict[str, list[int]]], length: int | None = None) -> dict[str, Tensor]:
    """Rows -> one right- or left-padded batch (the tokenizer's side), to ``length`` or the longest row."""
    tok = pipe.tokenizer
    lens = {len(r[next(iter(r))]) for r in rows}
    if tok.pad_token_id is None and (len(lens) > 1 or (length is not None and lens != {length})):
        raise InputError(f"example_inputs: {len(rows)} texts of {sorted(lens)} tokens need padding, and the pipeline's "
                         f"tokenizer {type(tok).__name__} has no pad token; expected one text, texts of one length, "
                         "or a tokenizer with pad_token set")
    if length is None:
        enc = tok.pad(rows, padding="longest", return_tensors="pt")
    else:  # held-out rows of exactly `length` tokens: long rows keep their last (special) token
        rows = [{k: v[:length - 1] + v[-1:] if len(v) > length else v for k, v in r.items()} for r in rows]
        enc = tok.pad(rows, padding="max_length", max_length=length, return_tensors="pt")
    return {k: enc[k].long() for k in rows[0]}  # (B, T) each


def _held_out_texts(pipe: Any, batch: int, seed: int) -> list[str]:
    """Sentences the user did not give; a fill-mask pipeline gets its mask token in each."""
    rng = random.Random(seed)
    mask = getattr(pipe.tokenizer, "mask_token", None) if any(
        c.__name__ == "FillMaskPipeline" for c in type(pipe).__mro__) else None
    out = []
    for _ in range(batch):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 40))]
        if mask:
            words[rng.randrange(len(words))] = mask
        out.append(" ".join(words))
    return out


def pipeline_workload(pipe: Any, example: Any) -> tuple[nn.Module, tuple[Any, ...], ModelInfo]:
    """``(pipe.model, positional inputs, info)`` for the optimizer: ``example`` (a string, a list of
    strings, or a tokenizer's dict) tokenized like the pipeline does and padded into one batch;
    ``info.make_inputs`` makes held-out batches from other sentences the same way."""
    _check(pipe)
    model, keys = pipe.model, _keys(pipe)
    if isinstance(example, Mapping):
        if not example:
            raise InputError("example_inputs for a pipeline: received an empty dict; expected a string, a list of "
                             "strings, or the tokenizer's output")
        batch = dict(example)
        keys = list(batch) if set(batch) <= set(keys) else []  # held-out batches carry the same keys, else random_like
    else:
        batch = _pad(pipe, _rows(pipe, _texts(example), keys))
    inputs = inputs_from_mapping(model, batch)
    if not any(isinstance(t, Tensor) for t in inputs):
        kinds = sorted({type(v).__name__ for v in batch.values()})
        raise InputError(f"example_inputs for a pipeline: received a dict of {kinds}; expected tensors (the "
                         "tokenizer's output with return_tensors='pt')")
    dyn = {i: [0, 1] for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.dim() == 2}  # (B, T): both vary

    def make_inputs(b: int, s: int, seed: int) -> tuple[Any, ...]:
        return inputs_from_mapping(model, _pad(pipe, _rows(pipe, _held_out_texts(pipe, b, seed), keys), max(2, s)))

    info = ModelInfo(None, f"{type(pipe).__name__}({type(model).__name__})", make_inputs if keys else None, dyn,
                     extra={"pipeline": type(pipe).__name__, "task": str(getattr(pipe, "task", ""))})
    return model, inputs, info


class PipelineModel:
    """Stands in for ``pipe.model``: called with the tokenizer's tensors as keywords (as every
    supported pipeline calls its model), it runs the optimized variant on its device and returns the
    HF model's output class (a tuple, tensor or plain dict from a runtime is rebuilt by the keys the
    model returned). Other attributes (``config``, ``device``, ``dtype``, ...) are the HF model's."""

    def __init__(self, optimized: Any, hf_model: nn.Module, output_class: type, output_keys: list[str],
                 device: torch.device | str | None = None):
        self.optimized = optimized  # the OptimizedModel
        self.hf_model = hf_model  # read for config and other attributes; never called
        self.output_class = output_class
        self.output_keys = list(output_keys)
        self.run_device = torch.device(device) if device is not None else None

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        if name in ("optimized", "hf_model", "output_class", "output_keys", "run_device"):
            raise AttributeError(name)
        return getattr(self.hf_model, name)

    def forward(self, **inputs: Any) -> Any:
        inputs.pop("use_cache", None)  # optimized with use_cache=False (a classifier's pipeline passes it)
        if self.run_device is not None:
            inputs = {k: v.to(self.run_device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        return self._as_output(self.optimized(**inputs))

    __call__ = forward

    def _as_output(self, out: Any) -> Any:
        if isinstance(out, self.output_class):
            return out
        if isinstance(out, Mapping):
            return self.output_class(**dict(out))
        values = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(values) > len(self.output_keys):
            raise InputError(f"the optimized model returned {len(values)} outputs; expected at most "
                             f"{len(self.output_keys)} ({self.output_keys}) as {self.output_class.__name__}")
        return self.output_class(**dict(zip(self.output_keys, values)))


def _probe_output(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[type, list[str]]:
    """The HF model's output class and keys on the example (what ``PipelineModel`` answers in)."""
    from torchnitro.autotune.inputs import forward_params

    names = [p.name for p in forward_params(model)]
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    kw = {n: v.to(dev) if isinstance(v, Tensor) else v for n, v in zip(names, inputs) if v is not None}
    if "use_cache" in names:
        kw["use_cache"] = False
    with torch.inference_mode():
        out = model(**kw)
    if not isinstance(out, Mapping):
        raise InputError(f"pipeline model {type(model).__name__} returned {type(out).__name__}; expected an HF "
                         "ModelOutput (return_dict=True), which the pipeline's postprocess reads by name")
    return type(out), list(out.keys())


class OptimizedPipeline:
    """A pipeline whose model is the optimized variant: call it like the pipeline.

    ``pipeline``: the copy that runs (the user's pipeline is untouched); ``optimized``: the
    ``OptimizedModel``; ``report`` / ``recipe``: its report and chosen recipe."""

    def __init__(self, pipe: Any, optimized: Any, *, output: tuple[type, list[str]] | None = None,
                 inputs: tuple[Any, ...] | None = None, device: torch.device | str | None = None):
        out_cls, keys = output if output is not None else _probe_output(pipe.model, inputs or ())
        self.optimized = optimized
        self.pipeline = copy.copy(pipe)  # shallow: tokenizer and settings shared, model swapped
        self.pipeline.model = PipelineModel(optimized, pipe.model, out_cls, keys, device)

    @property
    def report(self) -> Any:
        return self.optimized.report

    @property
    def recipe(self) -> str:
        return self.optimized.recipe

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipeline(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # tokenizer, task, ... of the running copy
        if name in ("optimized", "pipeline"):
            raise AttributeError(name)
        return getattr(self.pipeline, name)

    def save(self, directory: str | Path) -> Path:
        """``directory/MODEL_DIR``: the artifact (``OptimizedModel.save``); ``directory/PIPELINE_DIR``:
        the tokenizer and model config (``save_pretrained``) and ``pipeline.json`` (task, classes, output
        keys, each file's SHA-256). Returns ``directory``."""
        out = Path(directory)
        if out.exists() and any(out.iterdir()) and not (out / PIPELINE_DIR / "pipeline.json").is_file():
            raise ArtifactError(f"save: {str(out)!r} exists and is not a saved pipeline; expected an empty or new "
                                "folder (or an old pipeline save to overwrite). Pick another path.")
        self.optimized.save(out / MODEL_DIR)
        d = out / PIPELINE_DIR
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        pm: PipelineModel = self.pipeline.model
        self.pipeline.tokenizer.save_pretrained(str(d))
        pm.hf_model.config.save_pretrained(str(d))
        files = {f.name: sha256_file(f) for f in sorted(d.iterdir()) if f.is_file()}
        meta = {"version": 1, "task": str(getattr(self.pipeline, "task", "")),
                "pipeline_class": type(self.pipeline).__name__, "model_class": type(pm.hf_model).__name__,
                "output_class": f"{pm.output_class.__module__}:{pm.output_class.__qualname__}",
                "output_keys": pm.output_keys, "files": files}
        (d / "pipeline.json").write_text(json.dumps(meta, indent=2))
        return out

    def __repr__(self) -> str:
        return f"OptimizedPipeline({type(self.pipeline).__name__}, recipe={self.recipe!r})"


def model_dir(directory: str | Path) -> Path:
    """The artifact folder inside a saved pipeline (``directory`` itself when it is not one)."""
    d = Path(directory)
    return d / MODEL_DIR if (d / PIPELINE_DIR / "pipeline.json").is_file() else d


def _meta(directory: str | Path) -> dict[str, Any]:
    """``pipeline.json`` after checking the files it lists against their SHA-256."""
    d = Path(directory) / PIPELINE_DIR
    if not (d / "pipeline.json").is_file():
        raise ArtifactError(f"load_pipeline: {str(d / 'pipeline.json')!r} does not exist; expected a folder saved "
                            "by OptimizedPipeline.save. Load a model artifact with torchnitro.load")
    meta = json.loads((d / "pipeline.json").read_text())
    bad = [f for f, digest in meta.get("files", {}).items() if not (d / f).is_file() or sha256_file(d / f) != digest]
    extra = [f.name for f in d.iterdir() if f.name not in meta.get("files", {}) and f.name != "pipeline.json"]
    if bad or extra:
        raise ArtifactError(f"load_pipeline: {str(d)!r} has files changed or missing {bad} and unlisted {extra}; "
                            "expected the files pipeline.json lists, unchanged. Save the pipeline again")
    return meta


def saved_pipeline_model(directory: str | Path) -> nn.Module:
    """The HF model class named in ``pipeline.json`` built from the saved config (random weights: the
    artifact's own weights are loaded into it when its recipe needs the eager model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the saved config and tokenizer only
    import transformers

    meta = _meta(directory)
    cls = getattr(transformers, meta["model_class"], None)
    if cls is None:
        raise InputError(f"load_pipeline: the artifact names model class {meta['model_class']!r}, which transformers "
                         f"{transformers.__version__} does not have; pass the pipeline: load_pipeline(dir, pipe)")
    config = transformers.AutoConfig.from_pretrained(str(Path(directory) / PIPELINE_DIR), local_files_only=True)
    return cls(config).float().eval()


def rebuild_pipeline(directory: str | Path, optimized: Any, pipe: Any = None, hf_model: nn.Module | None = None,
                     device: torch.device | str | None = None) -> OptimizedPipeline:
    """An ``OptimizedPipeline`` around a loaded ``optimized`` model: on ``pipe`` when given, else on a
    pipeline built from the saved task, tokenizer and ``hf_model`` (``saved_pipeline_model``) on
    ``device`` (default CPU); inputs are moved to ``device`` before the optimized model runs."""
    meta = _meta(directory)
    if pipe is None:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(Path(directory) / PIPELINE_DIR), local_files_only=True)
        pipe = transformers.pipeline(meta["task"], model=hf_model, tokenizer=tok, device=device or "cpu")
    _check(pipe)
    mod, _, qual = meta["output_class"].partition(":")
    if not mod.startswith("transformers."):  # only the library's own output classes are imported by name
        raise InputError(f"load_pipeline: pipeline.json names output class {meta['output_class']!r}; expected a "
                         "transformers output class (transformers.modeling_outputs:...)")
    out_cls: Any = importlib.import_module(mod)
    for part in qual.split("."):
        out_cls = getattr(out_cls, part)
    return OptimizedPipeline(pipe, optimized, output=(out_cls, meta["output_keys"]), device=device)
