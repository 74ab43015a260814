"""The benchmark scripts of benchmarks/ loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from helpers import ROOT

BENCHMARKS = ROOT / "benchmarks"


def load_script(script: Path, name: str) -> ModuleType:
    """A benchmark script of benchmarks/ as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module
