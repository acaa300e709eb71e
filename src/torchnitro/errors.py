"""Every exception torchnitro raises on purpose.

The tree::

    NitroError                      base; the CLI prints its message without a traceback
    ├── ConfigError                 bad or unknown config keys, bad YAML, wrong version
    ├── InputError                  bad user input: shapes, dtypes, NaN, specs, missing files
    │   └── ShapeError              a tensor of the wrong shape or rank
    ├── RecipeError                 a recipe failed to build, or an unknown recipe name
    ├── VerificationError           a candidate's outputs differ from the reference
    ├── ArtifactError               a saved artifact is missing, truncated or tampered with
    ├── BackendUnavailableError     an explicitly requested backend cannot run here
    ├── OutOfMemoryError            a (real or injected) out-of-memory condition
    ├── BudgetError                 a memory or time budget that cannot be met
    └── ServeError                  serving-side failures
        ├── QueueFullError          the bounded queue is full (HTTP 429)
        ├── DeadlineExceededError   the request's deadline passed (HTTP 504)
        ├── DrainingError           the server is draining or not ready (HTTP 503)
        └── WorkerError             a worker died while holding the request (HTTP 500)

Messages follow one pattern: what was received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "NitroError",
    "ConfigError",
    "InputError",
    "ShapeError",
    "RecipeError",
    "VerificationError",
    "ArtifactError",
    "BackendUnavailableError",
    "OutOfMemoryError",
    "BudgetError",
    "ServeError",
    "QueueFullError",
    "DeadlineExceededError",
    "DrainingError",
    "WorkerError",
]


class NitroError(Exception):
    """Base class of every error torchnitro raises deliberately."""


class ConfigError(NitroError, ValueError):
    """A config value or file is invalid."""


class InputError(NitroError, ValueError):
    """User input (tensors, specs, paths) is invalid."""


class ShapeError(InputError):
    """A tensor has the wrong shape or rank."""


class RecipeError(NitroError):
    """A recipe is unknown or failed to build."""


class VerificationError(NitroError):
    """A candidate's outputs do not match the reference within tolerance."""


class ArtifactError(NitroError):
    """A saved artifact is missing, incomplete, or fails its checksum."""


class BackendUnavailableError(NitroError, RuntimeError):
    """An explicitly requested backend cannot run on this machine."""


class OutOfMemoryError(NitroError, MemoryError):
    """Out of memory (real, or injected by a test)."""


class BudgetError(NitroError, ValueError):
    """A memory or time budget cannot be met (e.g. smaller than the model)."""


class ServeError(NitroError):
    """Base class for serving errors; each maps to an HTTP status."""

    status_code = 500


class QueueFullError(ServeError):
    status_code = 429


class DeadlineExceededError(ServeError):
    status_code = 504


class DrainingError(ServeError):
    status_code = 503


class WorkerError(ServeError):
    status_code = 500
