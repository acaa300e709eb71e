"""The built-in model table: optional extras are named statically, found at use, and fail with their own error."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from torchnitro.errors import InputError
from torchnitro.nn import zoo


def test_every_extra_names_a_factory_in_its_module():
    for name, target in zoo.EXTRAS.items():
        mod_name, _, factory = target.partition(":")
        assert callable(getattr(importlib.import_module(mod_name), factory)), (name, target)
    assert set(zoo.EXTRAS) <= set(zoo.list_builtins())


def test_a_broken_extra_shows_its_import_error_not_an_unknown_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchnitro.hf", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match="torchnitro.hf"):
        zoo.get_builtin("minilm")
    with pytest.raises(InputError, match="unknown built-in model 'nope'.*minilm"):
        zoo.get_builtin("nope")


def test_listing_and_importing_change_nothing():
    code = ("import os, sys\nfrom torchnitro.nn.zoo import list_builtins\nnames = list_builtins()\n"
            "before = 'torchnitro.hf' in sys.modules\nimport torchnitro.hf\n"
            "print(before, 'minilm' in names, os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TRANSFORMERS_OFFLINE'))")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "None", "None"], out.stderr
