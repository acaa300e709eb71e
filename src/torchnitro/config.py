"""Typed configs and their versioned YAML form.

Every config in torchnitro is a dataclass. On disk it is YAML with a ``version`` field and one
section per config::

    version: 1
    optimize:            # OptimizeConfig fields
      budget_s: 300
    batching:            # BatchingConfig fields
      max_batch_size: 32

``load_section`` turns one section into a dataclass and rejects unknown keys by name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from torchnitro.errors import ConfigError, InputError

__all__ = ["CONFIG_VERSION", "from_dict", "to_dict", "load_yaml", "save_yaml", "load_section"]

CONFIG_VERSION = 1

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolvable forward refs
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Best-effort coercion of YAML scalars/lists into the annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or value is None:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"config field {name!r}: received {value!r}, expected {tp}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config field {name!r}: received {value!r}, expected a list")
        inner = args[0] if args else Any
        items = [_coerce(name, v, inner) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config field {name!r}: received {value!r}, expected a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return from_dict(tp, value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config field {name!r}: received {value!r}, expected true or false")
    if tp in (int, float, str):
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, tp) and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"config field {name!r}: received {value!r} ({type(value).__name__}), "
            f"expected {tp.__name__}"
        )
    if isinstance(tp, type) and issubclass(tp, __import__("enum").Enum):
        try:
            return tp(value)
        except ValueError:
            known = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"config field {name!r}: received {value!r}, expected one of {known}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys raise ConfigError naming them."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: received {type(data).__name__}, expected a mapping")
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown}; known keys are {sorted(names)}. "
            "Fix the spelling or remove them."
        )
    kwargs = {k: _coerce(k, v, hints.get(k, Any)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass -> plain dict of YAML-safe values (enums to values, tuples to lists)."""

    def plain(v: Any) -> Any:
        import enum

        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        if callable(v):
            return getattr(v, "__qualname__", repr(v))
        return v

    return plain(obj)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a versioned config file; checks the file exists, parses, and has a known version."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"config file {str(p)!r} does not exist; expected a YAML file path")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: received a {type(data).__name__}, expected a mapping")
    version = data.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise ConfigError(
            f"config file {str(p)!r} has version {version!r}; this torchnitro reads version {CONFIG_VERSION}"
        )
    return data


def load_section(path: str | Path, section: str, cls: type[T]) -> T:
    """Load one section of a versioned YAML config into dataclass ``cls``."""
    data = load_yaml(path)
    unknown = sorted(set(data) - {"version", "optimize", "batching", "serve", "memory", "precision", "hrr", "model"})
    if unknown:
        raise ConfigError(f"config file {str(path)!r}: unknown top-level key(s) {unknown}")
    return from_dict(cls, data.get(section) or {}, where=f"{path}:{section}")


def save_yaml(path: str | Path, **sections: Any) -> None:
    """Write dataclass sections to a versioned YAML file."""
    out: dict[str, Any] = {"version": CONFIG_VERSION}
    out.update({k: to_dict(v) for k, v in sections.items()})
    Path(path).write_text(yaml.safe_dump(out, sort_keys=False))
