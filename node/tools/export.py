"""`farloco export`: turn a run directory's newest checkpoint into a Hugging Face Llama-style model folder (for a
model of one's own, `export_spec`: the module's own names, and its config.json when run.model is an HF config).

Owns the conversion from farloco's outer state (one flat float32 theta in canonical order, see
`farloco.node.handoff`) to what a Llama loader reads: `model.safetensors` with HF parameter names,
`config.json` (a LlamaConfig dict) and `generation_config.json`. Tied embeddings are written once, as
`model.embed_tokens.weight`, with `tie_word_embeddings = true`; `lm_head.weight` exists only for untied models.

Each file is written to a temporary name, fsynced and renamed into place, `config.json` last: a loader that finds
a `config.json` finds the complete model next to it, and an interrupted export never leaves a half-written file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from safetensors.torch import save_file

from farloco.node.checkpoint import (
    CheckpointError,
    checkpoints_dir,
    latest_checkpoint,
    load_checkpoint,
)
from farloco.node.config import ConfigError, load_config, model_kind, run_hash
from farloco.node.fsutil import atomic_path, fsync_dir, write_atomic
from farloco.node.handoff import layout_of, unflatten
from farloco.node.training.data import MANIFEST_NAME, TOKENIZER_NAME
from farloco.node.training.model import (
    ModelConfig,
    Transformer,
    export_hf_config,
    hf_state_dict_names,
    model_config,
)
from farloco.node.training.models import ModelSpec, architecture, meta_spec
from farloco.node.training.tokenizer import HFTokenizer, hf_tokenizer_name, load_tokenizer

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ENTRY_FILE = "farloco_model.json"


class ExportError(RuntimeError):
    """A run directory cannot be exported; the message says what was expected and what was found."""


def export_run(run_dir: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Export the newest loadable checkpoint of `run_dir` as a Llama-style model folder `out_dir`; returns it."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    console = Console(stderr=True, quiet=not progress)
    steps = _Steps(console, 3)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ExportError(f"{run_dir}: expected a run directory with config.toml (written by `farloco join`)")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise ExportError(f"{config_path}: {exc}") from exc
    with steps.step("finding the newest loadable checkpoint"):
        checkpoint = latest_checkpoint(checkpoints_dir(run_dir))
    if checkpoint is None:
        raise ExportError(f"{run_dir}: no loadable checkpoint under {checkpoints_dir(run_dir)}")
    with steps.step(f"loading {checkpoint.name} (verifying its hash)"):
        try:
            meta, tensors = load_checkpoint(checkpoint)
        except CheckpointError as exc:  # e.g. removed or corrupted between the two calls
            raise ExportError(str(exc)) from exc
    expected_hash = run_hash(config)
    if meta["run_hash"] != expected_hash:
        raise ExportError(
            f"{checkpoint}: expected a checkpoint of run_hash {expected_hash} ({config_path}), "
            f"found run_hash {meta['run_hash']}"
        )
    source = {
        "farloco.run_name": config.run.name,
        "farloco.run_hash": meta["run_hash"],
        "farloco.round_id": meta["round_id"],
        "farloco.outer_hash": meta["outer_hash"],
        "farloco.inner_step": meta["inner_step"],
    }
    with steps.step(f"writing {out_dir}"):
        if model_kind(config.run.model) == "builtin":
            model = model_config(config.run.model)
            export_theta(model, tensors["theta"], out_dir, metadata=source)
            max_length = model.max_seq_len
        else:
            source["farloco.model"] = config.run.model
            source["farloco.model_architecture"] = architecture(config.run.model)
            spec = meta_spec(config.run.model)
            export_spec(spec, tensors["theta"], out_dir, metadata=source)
            max_length = int(spec.hf_config.get("max_position_embeddings", config.run.seq_len))
        tokenizer_note = export_tokenizer(config.run.dataset, max_length, out_dir)
    console.print(
        f"exported round {meta['round_id']} of run {config.run.name!r} to {out_dir} ({tokenizer_note})"
    )
    return out_dir


def export_tokenizer(dataset: str, max_length: int, out_dir: Path) -> str:
    """Ship the run's tokenizer with the model: the `tokenizer.json` that `farloco data prepare` copied next to
    the shards (checked against the hash in the dataset's manifest) and a `tokenizer_config.json` naming its
    end-of-text token, so `AutoTokenizer.from_pretrained(out_dir)` loads it. Says what it did, or why nothing."""
    if dataset == "builtin":
        return "no tokenizer: the builtin corpus is byte-level, token id = byte value"
    source = Path(dataset) / TOKENIZER_NAME
    manifest_path = Path(dataset) / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"no tokenizer: the run's dataset {dataset} is not on this machine"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if not str(manifest.get("tokenizer", "")).startswith("hf:"):
        return "no tokenizer: the dataset is byte-level, token id = byte value"
    if not source.is_file():
        raise ExportError(
            f"{dataset}: the manifest names tokenizer {manifest['tokenizer']}, but {source} is missing"
        )
    content = source.read_bytes()
    if hf_tokenizer_name(content) != manifest["tokenizer"]:
        raise ExportError(
            f"{source}: expected the tokenizer {manifest['tokenizer']} the shards were made with, "
            f"found {hf_tokenizer_name(content)}"
        )
    tokenizer = load_tokenizer(str(source))
    assert isinstance(tokenizer, HFTokenizer)
    write_atomic(out_dir / TOKENIZER_NAME, content, durable=True)
    _write_json(
        out_dir / TOKENIZER_CONFIG_FILE,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.eos_token,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        },
    )
    fsync_dir(out_dir)
    return f"with its tokenizer, eos {tokenizer.eos_token!r}"


def export_theta(
    config: ModelConfig, theta: torch.Tensor, out_dir: Path, *, metadata: dict[str, str] | None = None
) -> Path:
    """Write the model folder for `theta` (flat float32, canonical order of a `Transformer(config)`)."""
    out_dir = Path(out_dir)
    # The layout and the names depend only on the shapes: build on the meta device, so exporting a 1B model
    # allocates no second copy of its weights and runs no initialisation.
    with torch.device("meta"):
        skeleton = Transformer(config)
    layout = layout_of(skeleton)
    expected = layout[-1].offset + layout[-1].numel if layout else 0
    if theta.dtype != torch.float32 or theta.dim() != 1 or theta.numel() != expected:
        raise ExportError(
            f"expected theta float32[{expected}] for model {config}, got {theta.dtype}{list(theta.shape)}"
        )
    hf_names = hf_state_dict_names(skeleton)
    hf_config = export_hf_config(config)
    has_lm_head = "lm_head.weight" in hf_names.values()
    if has_lm_head == bool(hf_config["tie_word_embeddings"]):
        raise ExportError(
            f"tie_word_embeddings={hf_config['tie_word_embeddings']} but lm_head.weight "
            f"{'present' if has_lm_head else 'absent'} in the HF names"
        )
    # Clone each parameter: safetensors refuses tensors that share one storage (views of theta).
    state = {hf_names[name]: view.clone() for name, view in unflatten(theta.detach().cpu(), layout).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    # "format": "pt" is what HF loaders check before reading a safetensors file.
    header = {"format": "pt", **(metadata or {})}
    with atomic_path(out_dir / MODEL_FILE, durable=True) as tmp:
        save_file(state, str(tmp), metadata=header)
    generation = {"_from_model_config": True, "max_length": config.max_seq_len}
    _write_json(out_dir / GENERATION_CONFIG_FILE, generation)
    _write_json(out_dir / CONFIG_FILE, hf_config)
    fsync_dir(out_dir)
    return out_dir


def export_spec(
    spec: ModelSpec, theta: torch.Tensor, out_dir: Path, *, metadata: dict[str, str] | None = None
) -> Path:
    """Write a model of one's own (run.model an HF config or an entry point; `spec` built on the meta device):
    `model.safetensors` under the module's own parameter names (tied parameters once, under their first name).
    For an HF config also its `config.json` (with `architectures` set) and `generation_config.json`, so
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads it; for an entry point `farloco_model.json`, naming
    the factory whose module's `load_state_dict(..., strict=False)` takes the file."""
    out_dir = Path(out_dir)
    layout = layout_of(spec.module)
    expected = layout[-1].offset + layout[-1].numel if layout else 0
    if theta.dtype != torch.float32 or theta.dim() != 1 or theta.numel() != expected:
        raise ExportError(
            f"expected theta float32[{expected}] for {type(spec.module).__name__}, "
            f"got {theta.dtype}{list(theta.shape)}"
        )
    state = {name: view.clone() for name, view in unflatten(theta.detach().cpu(), layout).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / MODEL_FILE, durable=True) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", **(metadata or {})})
    if spec.kind == "hf":
        hf_config = {
            **spec.hf_config,
            "architectures": [type(spec.module).__name__],
            "torch_dtype": "float32",
        }
        _write_json(out_dir / GENERATION_CONFIG_FILE, {"_from_model_config": True})
        _write_json(out_dir / CONFIG_FILE, hf_config)
    else:
        _write_json(
            out_dir / ENTRY_FILE, {k.removeprefix("farloco."): v for k, v in (metadata or {}).items()}
        )
    fsync_dir(out_dir)
    return out_dir


class _Steps:
    """A bar over the export's steps (each one a single long call: hashing or writing gigabytes) with a spinner
    and the elapsed time on a terminal; elsewhere one "done: <step> (<seconds>)" line per step."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        columns = (
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(
            *columns, console=self.console, transient=True, disable=not self.console.is_terminal
        ) as bar:
            task = bar.add_task(text, total=self.total, completed=self.done)
            started = bar.get_time()
            yield
            self.done += 1
            bar.update(task, completed=self.done)
        self.console.print(f"done: {text} ({bar.get_time() - started:.1f} s)")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", durable=True)
