"""What a model of one's own is, for the run hash: `run.model`'s architecture as a short digest.

A shared module (config.py's `run_section` needs it, and config.py imports no room): for a Hugging Face
config.json, the digest of its content (no torch, no transformers); for an entry point package.module:factory,
the digest of the module's parameter names, shapes and dtypes and module classes, built on the meta device, and
of the factory module's source. Presets have none: their name says it all, and their run hashes stay as they
were. node/training/models.py builds the models themselves.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from farloco.node.config import ConfigError, model_kind

HF_CONFIG_FILE = "config.json"


class ModelError(ConfigError):
    """run.model cannot be built or sharded as asked; the message says what was expected and what was found."""


def hf_config_dict(run_model: str) -> dict[str, Any]:
    """The parsed config.json that `run.model` names (the file, or the folder holding it)."""
    path = Path(run_model)
    if path.is_dir():
        path = path / HF_CONFIG_FILE
    if not path.is_file():
        raise ModelError(f"run.model: expected a Hugging Face config.json at {path}, found nothing there")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"run.model: {path} is not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError(f"run.model: {path}: expected a config.json object with a 'model_type' string")
    return data


def entry_factory(run_model: str) -> Callable[[], Any]:
    module_name, _, attr = run_model.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"run.model {run_model!r}: cannot import {module_name!r} ({exc}); the module must be importable on "
            f"every node (installed, or on PYTHONPATH)"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"run.model {run_model!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def architecture(run_model: str) -> str:
    """A digest of the model's architecture for the run hash ('' for a preset: its name says it all)."""
    kind = model_kind(run_model)
    if kind == "builtin":
        return ""
    if kind == "hf":
        path = Path(run_model)
        path = path / HF_CONFIG_FILE if path.is_dir() else path
        try:
            stat = path.stat()
        except OSError:
            stat = None
        return _architecture_cached(run_model, stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)
    return _architecture_cached(run_model, 0, 0)


@lru_cache(maxsize=16)
def _architecture_cached(run_model: str, _mtime: int, _size: int) -> str:
    if model_kind(run_model) == "hf":
        config = hf_config_dict(run_model)
        canonical = json.dumps(
            {k: v for k, v in config.items() if k not in ("transformers_version", "torch_dtype", "dtype")},
            sort_keys=True,
            separators=(",", ":"),
        )
        return f"hf:{config['model_type']}:{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"
    import torch

    with torch.device("meta"):  # names and shapes only: no memory, no init
        made = entry_factory(run_model)()
    module = getattr(made, "module", made)
    if not isinstance(module, torch.nn.Module):
        raise ModelError(
            f"run.model {run_model!r}: expected the factory to return an nn.Module or a ModelSpec, "
            f"got {type(made).__name__}"
        )
    described = {
        "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in module.named_parameters()],
        "modules": [[n, f"{type(m).__module__}.{type(m).__qualname__}"] for n, m in module.named_modules()],
        "source": _source_digest(run_model),
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return f"entry:{type(module).__name__}:{digest}"


def _source_digest(run_model: str) -> str:
    module = importlib.import_module(run_model.partition(":")[0])
    try:
        return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()
    except (OSError, TypeError):
        return ""
