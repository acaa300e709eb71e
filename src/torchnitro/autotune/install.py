"""The optimized variant put back into the model object the user holds: ``opt.install(model)``.

A sentence-transformers user calls ``st.encode(sentences, batch_size=...)``, which tokenizes, sorts by
length, batches and pools, and calls ``st(features)`` once per batch; an HF user calls
``model(**tokenizer(texts))``. ``install`` replaces ``model.forward`` on that one object (an instance
attribute; the class is untouched) with a forward that runs the ``OptimizedModel`` where the call fits
what the variant was verified for, and the original forward otherwise:

* **What fits.** The call's tensors sit where the example's did (same arguments, same dict keys), with
  the example's dtypes and ranks, and every dim the search did not declare dynamic
  (``inputs.default_dynamic_dims``: the batch, and the sequence where the inputs carry a mask) has the
  example's size. Any other argument is at the forward's default or the example's value (an HF flag such
  as ``return_dict`` may also be at its config's value, as sentence-transformers passes it). A loaded
  artifact that kept no example inputs is checked by its signature and its saved input layout.
* **Fallback.** A call that does not fit, a model in train mode (the variant is the eval model), an HF output
  flag of the model's config changed since the install (``output_hidden_states``, ``return_dict``, ...), a model
  whose weights changed since the install (the variant holds the old ones: a parameter's version counter or storage
  moved, as an optimizer step, ``load_state_dict`` or ``.half()`` do), or a variant that raises runs the original
  forward, with one ``warnings.warn`` per kind of reason naming the shape, argument or parameter and why;
  ``Installation.calls`` counts both paths. Never a wrong answer from a shape
  the variant was not verified at, never a crash that the original would not have. A model optimized
  without its key/value cache (GPT-2, Llama: ``use_cache`` on) runs the variant for calls with
  ``use_cache=False`` (or the config's flag off) only: the original returns the cache a decoding loop reads.
* **Outputs.** What the variant returns (the model's own output class, rebuilt by the runtimes). A
  sentence-transformers model writes its outputs into the feature dict it was given, as its modules do.
  Outputs carry no autograd graph (the variant runs under ``torch.inference_mode``); outside inference
  mode they are ordinary tensors, as eager's are.
* **Undo.** ``Installation.uninstall()`` (or leaving ``with opt.install(model):``) restores the forward
  the object had.
* **Saving.** ``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` of an installed model give the plain
  model (its own forward; nothing of torchnitro is pickled): the install is a patch of this process's object,
  not part of the model. Its ``state_dict`` is unchanged by the install.

The model must hold the weights the variant was made from (compared where the ``OptimizedModel`` still
has the eager model; the very object that was optimized, against ``install_inputs.Weights`` taken then: a
fine-tuning step since is refused, the same values written again are not); an ``InputError`` names the first
parameter that differs.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import operator
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from torchnitro.autotune.failure import clean_line
from torchnitro.autotune.install_inputs import (
    LeafSpec,
    Weights,
    Path_,
    leaves,
    read_paths,
    same,
    spec_from_example,
    spec_from_signature,
    where,
)
from torchnitro.errors import InputError

__all__ = ["Installation", "install", "refuse_installed", "own_forwards"]

# HF forward flags whose None default means "as model.config says": passing the config's value is no change
# (sentence-transformers passes return_dict=True)
_CONFIG_FLAGS = ("return_dict", "output_attentions", "output_hidden_states", "use_cache")
_MISSING = object()
_CACHE_NOTE = "use_cache=False for the optimization"  # api._without_cache's report note
def _is_sentence_transformer(model: nn.Module) -> bool:
    return any(c.__module__.startswith("sentence_transformers.") for c in type(model).__mro__)


class Installation:
    """``optimized`` running as ``model.forward`` (see the module docstring). ``calls`` counts the calls that
    ran the variant (``'optimized'``) and the original (``'original'``); ``uninstall()`` undoes it; as a
    context manager, leaving the block undoes it."""

    def __init__(self, optimized: Any, model: nn.Module):
        self.optimized, self.model = optimized, model
        self.calls: collections.Counter[str] = collections.Counter()
        self._had_own = "forward" in model.__dict__  # an instance attribute to put back as it was
        self._own = model.__dict__.get("forward")
        self._original: Callable[..., Any] = model.forward
        self._sig = inspect.signature(self._original)
        self._names = [p.name for p in self._sig.parameters.values()
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # the variant's inputs by position: forward's order, or a keyword-only forward's keywords in input order
        self._order = list(optimized.source.arg_names) or self._names
        self._tensors, self._others, self._n_inputs = self._variant_inputs(optimized)
        self._tensors_in_structures = any(len(p) > 1 for p in self._tensors)
        self._writes_into_features = _is_sentence_transformer(model)
        self._warned: set[str] = set()
        self._inside = threading.local()
        # the search dropped the model's key/value cache (its report's note): a call that returns one runs the original
        self._no_cache = "use_cache" in self._sig.parameters and any(
            str(n).startswith(_CACHE_NOTE) for n in optimized.report.notes)
        # the HF config's output flags as at the install: a call that leaves one out reads the config, which the
        # user may change later (model.config.output_hidden_states = True); the variant answers as it was then
        config = getattr(model, "config", None)
        takes = set(self._sig.parameters) | ({*_CONFIG_FLAGS} if any(
            p.kind == p.VAR_KEYWORD for p in self._sig.parameters.values()) else set())
        self._flags = {f: getattr(config, f) for f in _CONFIG_FLAGS
                       if hasattr(config, f) and f in takes and not (f == "use_cache" and self._no_cache)}
        self._weights = Weights.of(model)  # its counters read on every call: tens of microseconds for BERT-base
        self.installed = False

    def _variant_inputs(self, om: Any) -> tuple[dict[Path_, LeafSpec], dict[Path_, Any], int | None]:
        src = om.source
        if src.example_inputs:
            example = tuple(src.example_inputs)
            tensors, others = spec_from_example(self._order, example, dict(src.dynamic_dims))
            if any(isinstance(x, Mapping) for x in example):  # drop the keys the model wrote into its feature dict
                read = read_paths(self.model, example, self._order)
                tensors = {p: s for p, s in tensors.items() if p in read}
            return tensors, others, len(example)
        return spec_from_signature(self._order, om.signature, om.candidate.meta.get("input_layout")), {}, None

    # -- the forward that runs in place of the original --------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._inside, "active", False):  # the variant calls this very object (eager, a fallback path)
            return self._original(*args, **kwargs)
        try:
            given = self._by_name(args, kwargs)
        except TypeError:  # forward does not bind the call: the original raises its own TypeError, no warning first
            return self._original(*args, **kwargs)
        why = self._unfit(given)
        if why is not None:
            return self._fallback(*why, args, kwargs)
        self._inside.active = True
        try:
            out = self.optimized(*self._positional(given))
        except Exception as exc:  # noqa: BLE001 - the original answers instead; the warning names the error
            error = clean_line(f"{type(exc).__name__}: {exc}", 200)
        else:
            error = None
        finally:
            self._inside.active = False
        if error is not None:
            return self._fallback("error", f"the optimized variant raised {error}", args, kwargs)
        self.calls["optimized"] += 1
        return self._as_original(out, args, kwargs)

    def _fallback(self, kind: str, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{type(self.model).__name__}: running the original forward instead of the optimized "
                          f"variant ({self.optimized.recipe}): {why}. Further calls for this kind of reason fall back "
                          "without a warning (Installation.calls counts them)", stacklevel=6)
        self.calls["original"] += 1
        return self._original(*args, **kwargs)

    def _unfit(self, given: dict[str, Any]) -> tuple[str, str] | None:
        """(kind, why) when the call (``given``: its arguments by name) is not one the variant was verified for,
        else None."""
        if self.model.training:
            return "training", ("the model is in train mode; the variant is the eval-mode model (call "
                                "model.eval(), or uninstall() to train)")
        name = self._weights.changed()
        if name is not None:
            return "weights", (f"the model's {name!r} changed since the install (an optimizer step, load_state_dict, "
                               "a cast or a move); the variant holds the weights it was made from: optimize the "
                               "model again, or uninstall()")
        use_cache = given.get("use_cache")
        if use_cache is None:  # HF: the config's flag
            use_cache = getattr(getattr(self.model, "config", None), "use_cache", None)
        if self._no_cache and use_cache:
            return "cache", ("the call returns the model's key/value cache (use_cache is on: the model's config or the "
                             "call), which the variant does not compute; call with use_cache=False, or set "
                             "model.config.use_cache = False, to run the variant")
        for flag, was in self._flags.items():
            now = getattr(self.model.config, flag, was)
            if given.get(flag) is None and not same(now, was):
                return "config", (f"model.config.{flag} is {now!r}, not {was!r} as at the install: the variant answers "
                                  "as it did then; set it back, or optimize the model again")
        found: dict[Path_, Any] = {}
        for name, value in given.items():
            leaves(value, (name,), found)
        for path, v in found.items():
            why = self._leaf_unfit(path, v)
            if why is not None:
                return why
        missing = [where(p) for p in self._tensors if p not in found]
        if missing:
            return "inputs", f"the call has no {missing}, which the variant takes"
        return None

    def _leaf_unfit(self, path: Path_, v: Any) -> tuple[str, str] | None:
        spec = self._tensors.get(path)
        if isinstance(v, Tensor):
            if spec is None and len(path) > 1 and self._n_inputs is None and not self._tensors_in_structures:
                return None  # a loaded artifact that kept neither the example nor a layout: the runtime checks it
            if spec is None:
                return "inputs", (f"input {where(path)} (shape {tuple(v.shape)}) was not among the inputs the "
                                  f"variant was optimized with ({[where(p) for p in self._tensors]}); optimize "
                                  "with the inputs the model is called with")
            if spec.dtype is not None and v.dtype != spec.dtype:
                return "dtype", f"input {where(path)} is {v.dtype}; the variant takes {spec.dtype}"
            if spec.shape is not None and (v.dim() != len(spec.shape) or any(
                    s not in (-1, int(n)) for s, n in zip(spec.shape, v.shape))):
                return "shape", (f"input {where(path)} has shape {tuple(v.shape)}; the variant was verified at "
                                 f"{list(spec.shape)} (-1: dynamic), so the others are fixed (declare them in "
                                 "OptimizeConfig.dynamic_dims to vary them)")
            return None
        if spec is not None:
            return "inputs", f"input {where(path)} is {type(v).__name__}; the variant takes a tensor there"
        if path in self._others:
            if not same(v, self._others[path]):
                return "arguments", f"{where(path)}={v!r}; the variant was optimized with {self._others[path]!r}"
            return None
        if path == ("use_cache",) and self._no_cache and v is False:
            return None  # what the variant computes
        param = self._sig.parameters.get(path[0]) if len(path) == 1 else None
        default = param.default if param is not None else inspect.Parameter.empty
        if v is None or (default is not inspect.Parameter.empty and same(v, default)):
            return None
        config = getattr(self.model, "config", None)
        if len(path) == 1 and path[0] in _CONFIG_FLAGS and same(v, getattr(config, str(path[0]), _MISSING)):
            return None  # what the HF model reads from its config when the argument is left out
        if len(path) > 1 and self._n_inputs is None:
            return None  # a non-tensor entry of a feature dict (a loaded artifact keeps no example to compare)
        return "arguments", f"{where(path)}={v!r} differs from the default the variant was optimized with"

    def _by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name (``**kwargs`` entries by their own name, ``*args`` by position)."""
        bound = self._sig.bind(*args, **kwargs)
        out: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            param = self._sig.parameters[name]
            if param.kind == param.VAR_KEYWORD:
                out.update(value)
            elif param.kind == param.VAR_POSITIONAL:
                out.update({len(self._names) + i: v for i, v in enumerate(value)})
            else:
                out[name] = value
        return out

    def _positional(self, given: dict[str, Any]) -> tuple[Any, ...]:
        """The call (``given``: its arguments by name) as the variant's positional inputs (its order; skipped ones
        at forward's default)."""
        present = [i for i, name in enumerate(self._order) if given.get(name) is not None]
        n = self._n_inputs if self._n_inputs is not None else (present[-1] + 1 if present else 0)
        out = []
        for name in self._order[:n]:
            p = self._sig.parameters.get(name)
            default = None if p is None or p.default is inspect.Parameter.empty else p.default
            out.append(given.get(name, default))
        return tuple(out)

    def _as_original(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Outside inference mode, ordinary tensors (an inference tensor refuses the in-place update the
        original's output allows). A sentence-transformers model answers in the feature dict it was given
        (its modules write into it)."""
        if not torch.is_inference_mode_enabled():
            out = tree_map(lambda t: t.clone() if isinstance(t, Tensor) and t.is_inference() else t, out)
        if self._writes_into_features and isinstance(out, Mapping):
            features = (list(args) + list(kwargs.values()))[0]
            if isinstance(features, dict) and features is not out:
                features.update(out)
                return features
        return out

    # -- install / undo ---------------------------------------------------------------------------

    def install(self) -> Installation:
        self.model.forward = _InstalledForward(self)  # instance attribute: nn.Module.__call__ finds it first
        self.installed = True
        return self

    def uninstall(self) -> None:
        """Restore the forward the model had (a no-op when already undone)."""
        if not self.installed:
            return
        if self._had_own:
            self.model.forward = self._own
        else:
            self.model.__dict__.pop("forward", None)
        self.installed = False

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "installed" if self.installed else "uninstalled"
        return (f"Installation({type(self.model).__name__}, recipe={self.optimized.recipe!r}, {state}, "
                f"{dict(self.calls)})")


class _InstalledForward:
    """``model.forward`` while installed. ``inspect.signature`` gives the original's (code that reads it, like a
    trainer dropping unused columns, sees no change); a deep copy of the model gets its class's own forward,
    so a copy that is then changed (fine-tuned, quantized) never runs this model's variant."""

    def __init__(self, installation: Installation):
        self.installation = installation
        functools.update_wrapper(self, installation._original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.installation.forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        model = self.installation.model
        twin = memo.get(id(model), model)  # the model's copy, made before its attributes are copied
        return type(twin).forward.__get__(twin)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.save(model)``, ``pickle``, a worker process) as the forward the model had before the
        install: the variant is a patch of this process's object, not part of the model, so the saved model is
        the plain model, loads where torchnitro is not installed, and runs its own forward. Built from
        builtins only: ``getattr(model, 'forward')`` runs while the model is unpickled, before its state is set,
        so it finds the class's forward."""
        inst = self.installation
        if inst._had_own:
            return operator.getitem, ((inst._own,), 0)
        return getattr, (inst.model, "forward")


def _reference_model(om: Any) -> nn.Module | None:
    """The eager model the variant was made from, out of its keyword adapter (None when the result kept none)."""
    from torchnitro.autotune.inputs import KeywordCall

    m = om.source.model
    return m.model if isinstance(m, KeywordCall) else m


def _check_weights(om: Any, model: nn.Module) -> None:
    ref = _reference_model(om)
    made_with = getattr(om.source, "made_with", None)
    changed = made_with.changed() if ref is model and made_with is not None else None
    if changed is not None:  # the object optimized, changed since (an optimizer step, load_state_dict, a cast)
        raise InputError(f"install: received {type(model).__name__} whose {changed!r} changed since the variant was "
                         "made from it (a fine-tuning step, load_state_dict, a cast); expected the weights it was "
                         "optimized with: optimize the model again")
    if ref is None or ref is model:
        return
    mine, theirs = model.state_dict(), ref.state_dict()
    if list(mine) != list(theirs):
        extra = sorted(set(mine) ^ set(theirs))[:3]
        raise InputError(f"install: received {type(model).__name__} whose parameters differ by name from the model "
                         f"the variant was made from (e.g. {extra}); expected the model given to optimize or load")
    for name, t in mine.items():
        r = theirs[name]
        if isinstance(t, Tensor) and isinstance(r, Tensor) and t.dtype == r.dtype and (
                t.shape != r.shape or not torch.equal(t.detach().cpu(), r.detach().cpu())):
            raise InputError(f"install: received {type(model).__name__} whose {name!r} differs from the model the "
                             "variant was made from; expected the same weights (optimize this model, or load the "
                             "artifact with torchnitro.load(dir, model=this_model))")


def _installed(model: nn.Module) -> list[tuple[str, Installation]]:
    """The installations running in ``model`` or a module inside it, by module name."""
    found = ((name, getattr(m.__dict__.get("forward"), "installation", None)) for name, m in model.named_modules())
    return [(name, i) for name, i in found if isinstance(i, Installation) and i.installed]


@contextlib.contextmanager
def own_forwards(model: nn.Module) -> Iterator[None]:
    """``model`` and its modules with their own forwards for the block, the installs put back after: saving an
    installed result exports the model (``torch.export`` of the installed forward fails: it reads a function's
    code), and a call meanwhile from another thread runs the original, which is correct too."""
    undone = [inst for _, inst in _installed(model)]
    for inst in undone:
        inst.uninstall()
    try:
        yield
    finally:
        for inst in undone:
            inst.install()


def refuse_installed(model: nn.Module, what: str) -> None:
    """Raise ``InputError`` when ``model`` or a module inside it runs an installed variant: the search would time
    that variant as the model's eager forward, and a loaded eager artifact would run it as the model."""
    for name, inst in _installed(model)[:1]:
        held = type(model).__name__ + (f" (its module {name!r})" if name else "")
        raise InputError(f"{what}: received {held}, which runs an installed optimized variant "
                         f"({inst.optimized.recipe}) as its forward; expected the model with its own forward. "
                         "uninstall() it first (or leave its `with opt.install(model):` block)")


def install(optimized: Any, model: nn.Module) -> Installation:
    """Run ``optimized`` (an ``OptimizedModel``) as ``model``'s forward; see the module docstring."""
    if not isinstance(model, nn.Module):
        raise InputError(f"install: received {type(model).__name__}; expected the torch.nn.Module the variant was "
                         "made from (a SentenceTransformer, an HF model, your own module)")
    current = getattr(model.__dict__.get("forward"), "installation", None)
    if isinstance(current, Installation) and current.installed:
        raise InputError(f"install: {type(model).__name__} already runs an optimized variant "
                         f"({current.optimized.recipe}); uninstall() it first")
    _check_weights(optimized, model)
    return Installation(optimized, model).install()
