"""``torchnitro.optimize``, ``torchnitro.load`` and ``OptimizedModel``."""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from torchnitro.autotune.artifact import EagerSource, load_artifact, write_artifact
from torchnitro.autotune.cache import CandidateCache, make_key, model_hash
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.inputs import (KeywordCall, ModelInfo, default_dynamic_dims, forward_params,
                                        input_signature, inputs_from_mapping, keyword_call, model_and_inputs,
                                        signature_of)
from torchnitro.autotune.pipelines import (OptimizedPipeline, is_pipeline, model_dir, pipeline_workload,
                                           rebuild_pipeline, saved_pipeline_model)
from torchnitro.autotune.recipe import EAGER, CandidateFiles, get_recipe
from torchnitro.autotune.report import Report
from torchnitro.errors import InputError

__all__ = ["OptimizedModel", "optimize", "load", "load_pipeline"]

KEYWORD_CALL = "keyword_call"  # the model ref's extra: the keywords of a keyword-only forward, in input order


class OptimizedModel:
    """The chosen variant: call it like the model. ``.report`` says how it was chosen."""

    def __init__(self, fn: Callable[..., Any], recipe: str, report: Report, signature: dict[str, Any],
                 candidate: CandidateFiles, source: EagerSource | None = None, *, keepalive: Any = None,
                 device: torch.device | None = None):
        self._fn = fn
        self.device = device  # where the variant runs (optimize's resolved device); None: as loaded, unchecked
        self._moved_warned = False
        self.recipe = recipe  # name of the chosen recipe
        self.report = report
        self.signature = signature  # {'inputs': [{name, dtype, shape(-1 = dynamic)}], 'outputs': [...]}
        self.candidate = candidate  # the recipe's files, copied into the artifact by save()
        self.source = source or EagerSource()
        self._keepalive = keepalive  # e.g. the search's TemporaryDirectory while candidate.dir lies in it

    @property
    def numeric_class(self) -> str:
        return get_recipe(self.recipe).numeric_class.value

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs:  # a tokenizer's output as keywords: om(**batch)
            inputs = self._positional(inputs, kwargs)
        back = self._elsewhere(inputs)
        with torch.inference_mode():
            if back is None:
                return self._fn(*inputs)
            out = self._fn(*tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, inputs))
            return tree_map(lambda x: x.to(back) if isinstance(x, torch.Tensor) else x, out)

    def _elsewhere(self, inputs: tuple[Any, ...]) -> torch.device | None:
        """The device of input tensors not on the one the variant runs on (None: all there). The search's
        ``device='auto'`` picks the GPU where one is visible, while a model from ``from_pretrained`` and its
        tokenizer's tensors stay on the CPU: such calls are copied to the variant's device and the outputs
        back, with one warning (the copies are outside what was timed)."""
        if self.device is None:
            return None
        dev = next((x.device for x in tree_flatten(inputs)[0]
                    if isinstance(x, torch.Tensor) and x.device.type != self.device.type), None)
        if dev is not None and not self._moved_warned:
            self._moved_warned = True
            warnings.warn(f"this variant runs on {self.device} (the device optimize chose); received inputs on {dev}: "
                          f"they are copied to {self.device} and the outputs back to {dev} on every call, outside "
                          f"what was timed. Pass tensors on {self.device}, or optimize with "
                          f"OptimizeConfig(device='{dev.type}')", stacklevel=3)
        return dev

    def _positional(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        names = self.source.arg_names or [i["name"] for i in self.signature.get("inputs", [])]
        unknown = [k for k in kwargs if k not in names[len(inputs):]]
        if unknown:
            raise InputError(f"received keyword input(s) {unknown}; expected argument names after the {len(inputs)} "
                             f"positional one(s) among {names}")
        last = max(names.index(k) for k in kwargs)
        return tuple(inputs) + tuple(kwargs.get(n) for n in names[len(inputs):last + 1])

    def install(self, model: nn.Module) -> Any:
        """Run this variant as ``model``'s forward, so ``st.encode(...)`` / ``model(**batch)`` use it; calls it
        was not verified for run the original with one warning. Returns an ``Installation`` (``.uninstall()``,
        or use it as a context manager); see ``torchnitro.autotune.install``."""
        from torchnitro.autotune.install import install

        return install(self, model)

    def save(self, directory: str | Path) -> Path:
        """Write the artifact (see ``torchnitro.autotune.artifact``); returns the directory."""
        import tempfile

        candidate, src, tmp = self.candidate, self.source, None
        if self.recipe == EAGER and not src.ref.get("spec") and src.model is not None and src.example_inputs:
            from torchnitro.autotune.install import own_forwards
            from torchnitro.autotune.recipes.eager import export_program

            tmp = tempfile.TemporaryDirectory(prefix="torchnitro-export-")
            with own_forwards(src.model):  # installed on the model it was made from: the model is what is saved
                meta, why = export_program(src.model, src.example_inputs, src.dynamic_dims,
                                           Path(tmp.name) / "model.pt2")
            if why is None:
                candidate = CandidateFiles(Path(tmp.name), ["model.pt2"], {**candidate.meta, **meta, "exported": True},
                                           standalone=True)
            else:
                warnings.warn(f"torch.export failed ({why}); the artifact needs torchnitro.load(dir, model=...) "
                              "(replace_weights=True for a fresh instance)", stacklevel=2)
        elif not candidate.standalone and not src.ref.get("spec"):
            warnings.warn(f"recipe {self.recipe!r} rebuilds from the eager model, and this model is a Python object "
                          "with no factory reference: the artifact loads with torchnitro.load(dir, model=<your model>) "
                          "only (replace_weights=True for a fresh instance), and `torchnitro serve DIR` cannot load "
                          "it. For a servable artifact, optimize a 'module:function' spec, or pick among standalone "
                          "recipes (config.recipes, e.g. ['onnxruntime', 'openvino', 'torchscript'])", stacklevel=2)
        return write_artifact(directory, candidate, src, recipe=self.recipe, numeric_class=self.numeric_class,
                              signature=self.signature, report=self.report, hardware=self.report.hardware)

    def __repr__(self) -> str:
        return f"OptimizedModel(recipe={self.recipe!r}, model={self.report.model!r})"


def _as_tuple(model: nn.Module, example_inputs: Any) -> tuple[Any, ...]:
    if example_inputs is None:
        return ()
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Mapping):
        return inputs_from_mapping(model, example_inputs)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise InputError(f"example_inputs: received {type(example_inputs).__name__}; expected a tensor, a tuple of "
                         "tensors passed positionally to the model, or a dict of them by argument name")
    return example_inputs


def _check_no_meta(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Meta tensors hold no values (``torch.device('meta')``, an empty-weights init): nothing can be run or
    compared on them, and they failed deep in the search ("Tensor.item() cannot be called on meta tensors")."""
    from torchnitro.autotune.recipes._layout import tensor_leaves

    bad = [i for i, t in enumerate(tensor_leaves(inputs)) if t.is_meta]
    if bad:
        raise InputError(f"example_inputs: received tensor(s) {bad} on device 'meta' (shapes without values); expected "
                         "real tensors on cpu or cuda, e.g. torch.randint(0, 100, (8, 128))")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise InputError(f"model: received {type(model).__name__} with {len(meta)} parameter(s)/buffer(s) on device "
                         f"'meta' (e.g. {meta[0]!r}); expected loaded weights: load them (load_state_dict(..., "
                         "assign=True) or from_pretrained without an empty-weights init) before optimizing")


def optimize(model: nn.Module | str | Any, example_inputs: Any = None, config: OptimizeConfig | None = None, *,
             info: ModelInfo | None = None) -> OptimizedModel | OptimizedPipeline:
    """Return the fastest variant of ``model`` that passes the verification gate on this machine.

    ``model`` is an ``nn.Module`` (``example_inputs``: a tensor, a tuple of positional inputs, or a
    dict / ``BatchEncoding`` of them by forward-argument name, as a tokenizer returns) or a model spec
    string (a built-in name, ``'module:function'`` or ``'hf:/path'``). An HF model that returns its
    key/value cache is optimized with ``use_cache=False`` (a report note says so). A
    ``transformers.Pipeline`` with ``example_inputs`` as it is called (a string or a list of them)
    returns an ``OptimizedPipeline`` (``torchnitro.autotune.pipelines``).
    """
    cfg = config or OptimizeConfig()
    if not isinstance(cfg, OptimizeConfig):
        raise InputError(f"config: received {type(cfg).__name__}; expected torchnitro.OptimizeConfig")
    if is_pipeline(model):
        from torchnitro.autotune.search import resolve_device

        hf_model, inputs, pipe_info = pipeline_workload(model, example_inputs)
        om = optimize(hf_model, inputs, cfg, info=pipe_info)
        return OptimizedPipeline(model, om, inputs=inputs, device=resolve_device(cfg))
    if isinstance(model, str):
        model, resolved, info = model_and_inputs(model)
        example_inputs = example_inputs if example_inputs is not None else resolved
    if not isinstance(model, nn.Module):
        raise InputError(f"model: received {type(model).__name__}; expected a torch.nn.Module, a model spec string "
                         "or a transformers text pipeline")
    from torchnitro.autotune.install import refuse_installed

    refuse_installed(model, "optimize")
    name = type(model).__name__
    kw = keyword_call(model, example_inputs) if isinstance(example_inputs, Mapping) else None
    if kw is not None:  # forward(self, *, input_ids, ...): searched by position through the adapter
        model, example_inputs = kw, tuple(example_inputs[n] for n in kw.call_names)
    inputs = _as_tuple(model, example_inputs)
    if not inputs:
        raise InputError("example_inputs: received nothing; expected the model's inputs, e.g. (torch.randint(0, 100, (8, 128)),)")
    _check_no_meta(model, inputs)
    if info is None:
        info = ModelInfo(None, name, None, default_dynamic_dims(model, inputs, cfg.padding_mask),
                         extra={KEYWORD_CALL: kw.call_names} if kw is not None else {})
    train_note = None
    if model.training:  # e.g. an HF model built from_config (from_pretrained returns it in eval mode)
        model = copy.deepcopy(model).eval()
        train_note = ("the model was in train mode: optimized and compared in eval mode (dropout off, batch-norm "
                      "running statistics), as every variant runs; your model object is left as it was")
    model, cache_note = _without_cache(model, inputs)
    cached = _from_cache(model, inputs, info, cfg)
    if cached is not None:
        return cached
    from torchnitro.autotune.search import resolve_device, search

    # new containers for the search: a model that writes its outputs into its feature dict (sentence-transformers)
    # writes into the search's copy, and the signature, the saved example and the cache key see the call as given
    out = search(model, tree_map(lambda x: x, inputs), info, cfg)
    out.report.notes.extend(n for n in (train_note, cache_note) if n)
    out.report.inputs = input_signature(inputs)  # as given: the search's copy may hold what the model wrote into it
    sig = signature_of(model, inputs, out.workload.eager_outputs, out.workload.dynamic_dims, out.workload.references)
    ref = {"spec": info.spec, "name": info.name, "extra": info.extra}
    source = EagerSource(model, ref, inputs, out.workload.dynamic_dims, [p.name for p in forward_params(model)])
    cf = out.candidate
    if cfg.cache and (cf.dir is None or not str(cf.dir).startswith(str(out.tmp.name))):
        CandidateCache(cfg.resolved_cache_dir()).put_search(_search_key(model, inputs, cfg), {
            "report": out.report.to_dict(), "recipe": out.recipe.name, **cf.to_dict(), "signature": sig, "ref": ref})
    return OptimizedModel(out.fn, out.recipe.name, out.report, sig, cf, source, keepalive=out.tmp,
                          device=resolve_device(cfg))


def _returns_cache(out: Any) -> bool:
    keys = out.keys() if hasattr(out, "keys") else []
    vals = [out[k] for k in keys] if keys else (list(out) if isinstance(out, (tuple, list)) else [out])
    return any(type(v).__name__.endswith("Cache") or (isinstance(v, tuple) and v and isinstance(v[0], tuple))
               for v in vals)


def _without_cache(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[nn.Module, str | None]:
    """An HF model that returns its key/value cache (``use_cache``: a ``DynamicCache`` or
    ``past_key_values``) is optimized as a copy with ``use_cache=False``: the cache is state for
    generation, not an output to verify, and it does not trace or export."""
    cfgs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    if not cfgs:
        return model, None
    try:
        with torch.inference_mode():
            if not _returns_cache(model(*inputs)):
                return model, None
    except Exception:  # noqa: BLE001 - the search runs the model again and reports the failure properly
        return model, None
    model = copy.deepcopy(model)
    for m in model.modules():
        if getattr(c := getattr(m, "config", None), "use_cache", None) is True:
            c.use_cache = False
    return model, ("use_cache=False for the optimization: the model's key/value cache (past_key_values) is "
                   "generation state, not compared and not returned by the optimized variant")


def _search_key(model: nn.Module, inputs: tuple[Any, ...], cfg: OptimizeConfig) -> str:
    from torchnitro.autotune.cache import CACHE_VERSION
    from torchnitro.autotune.search import resolve_device
    from torchnitro.autotune.workload import select_recipes
    from torchnitro.hardware import hardware_info

    return make_key(v=CACHE_VERSION, model=model_hash(model), inputs=input_signature(inputs), cfg=cfg.cache_key_fields(),
                    recipes=[f"{r.name}@{r.version}" for r in select_recipes(cfg)], hw=hardware_info().fingerprint,
                    device=str(resolve_device(cfg)), threads=cfg.resolved_threads())


def _from_cache(model: nn.Module, inputs: tuple[Any, ...], info: ModelInfo, cfg: OptimizeConfig) -> OptimizedModel | None:
    """A previous search with the same model, inputs, config and machine: reload its winner and
    re-check it on the held-out inputs (cheap) instead of searching again."""
    if not cfg.cache:
        return None
    t0 = time.perf_counter()
    key = _search_key(model, inputs, cfg)
    hit = CandidateCache(cfg.resolved_cache_dir()).get_search(key)
    if hit is None:
        return None
    from torchnitro.autotune.search import resolve_device
    from torchnitro.autotune.verify import collect, gate_options, judge
    from torchnitro.autotune.workload import prepare_workload

    try:
        recipe = get_recipe(hit["recipe"])
        cf = CandidateFiles.from_dict(hit)
        if cf.dir is not None and not all((cf.dir / f).is_file() for f in cf.files):
            return None
        device = resolve_device(cfg)
        eager = copy.deepcopy(model).eval().to(device)
        fn = eager if recipe.name == EAGER else cf.load(recipe, eager)  # loads from a copy: eager stays fp32
        wl = prepare_workload(eager, inputs, info, cfg, device, recheck=True)
        gate = judge(collect(fn, wl.held_out), wl.references, cfg.tolerance(recipe.numeric_class.value),
                     metric_fn=cfg.metric_fn, metric_threshold=cfg.metric_threshold, reference_raw=wl.reference_raw,
                     **gate_options(cfg, eager, wl.held_out))
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - a stale or unreadable cache entry means: search again
        return None
    if not gate.passed:
        return None
    report = Report.from_dict(hit["report"])
    report.cached = True
    report.search_s = time.perf_counter() - t0
    return OptimizedModel(fn, recipe.name, report, hit["signature"], cf,
                          EagerSource(eager, hit["ref"], inputs, info.dynamic_dims), device=device)


def _as_saved(directory: Path, model: nn.Module | None) -> nn.Module | None:
    """The user's model as the artifact was made from it: in its ``KeywordCall`` when its forward took the
    inputs by keyword only (the manifest's model extra names the keywords; the checksums are checked next)."""
    import json

    if model is None or isinstance(model, KeywordCall) or not (directory / "manifest.json").is_file():
        return model
    try:
        names = (json.loads((directory / "manifest.json").read_text()).get("model") or {}).get("extra", {}).get(
            KEYWORD_CALL)
    except (ValueError, AttributeError):
        return model  # load_artifact names what is wrong with the manifest
    return KeywordCall(model, names) if isinstance(names, list) and names else model


def load(directory: str | Path, model: nn.Module | None = None, *, trust_code: bool = False,
         allocator: bool = True, threads: int | None = None, replace_weights: bool = False) -> OptimizedModel:
    """Load a saved artifact after checking every file's SHA-256 (``ArtifactError`` on mismatch).

    ``model`` is only needed for non-standalone recipes whose artifact has no factory reference. It must hold
    the artifact's weights (``InputError`` names the first that differs: loading would overwrite them), unless
    ``replace_weights=True``: then the artifact's weights are loaded into it (a new ``MyModel()``).
    A folder saved by ``OptimizedPipeline.save`` gives its optimized model (``load_pipeline``: the pipeline).
    ``trust_code=True`` lets the artifact run code (a ``.py`` model factory, a TorchScript archive);
    without it an artifact is loaded as data only (see ``torchnitro.autotune.artifact``).
    ``allocator``: apply the glibc allocator setting the optimizer measured to help this variant (meta
    ``environment``) to this process with ``mallopt`` (glibc reads the ``MALLOC_*`` variables only at a
    process's start; ``torchnitro serve`` also sets them for its workers; ``bench.environment.apply_allocator``).
    ``threads``: build an ONNX Runtime or OpenVINO session with this many intra-op threads instead of the count the
    artifact records (``torchnitro serve --threads``); torch's own thread count is left as it is.
    """
    d = model_dir(directory)  # a saved pipeline: its model artifact
    model = _as_saved(d, model)
    manifest, fn, eager = load_artifact(d, model, trust_code=trust_code, threads=threads,
                                        replace_weights=replace_weights)
    if allocator and manifest.get("meta", {}).get("environment"):
        from torchnitro.bench.environment import apply_allocator

        apply_allocator(manifest["meta"]["environment"], environ=False)
    report_path = d / "report.json"
    import json

    report = Report.from_dict(json.loads(report_path.read_text()))
    weights = None if manifest["standalone"] else d / "weights.safetensors"  # saved again as is: exact fp32
    cf = CandidateFiles(d / "candidate", manifest.get("candidate_files", []), manifest.get("meta", {}),
                        manifest["standalone"])
    return OptimizedModel(fn, manifest["recipe"], report, manifest["signature"], cf,
                          EagerSource(eager, manifest.get("model", {}), weights=weights))


def load_pipeline(directory: str | Path, pipe: Any = None, *, device: torch.device | str | None = None,
                  trust_code: bool = False, allocator: bool = True) -> OptimizedPipeline:
    """Load an artifact saved from an ``OptimizedPipeline``: on ``pipe`` (the original pipeline) when
    given, else on a pipeline rebuilt from the saved task, tokenizer and model config (``device``:
    where it runs, default CPU). ``torchnitro.load`` on the same folder returns the optimized model."""
    hf = pipe.model if pipe is not None else saved_pipeline_model(directory)
    om = load(directory, model=copy.deepcopy(hf), trust_code=trust_code, allocator=allocator,
              replace_weights=True)  # a copy (pipe.model is left as it is), or a model rebuilt from the saved config
    return rebuild_pipeline(directory, om, pipe, hf_model=hf, device=device)
