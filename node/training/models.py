"""`run.model`: which model a node trains, built the same way on every node, and how its ranks shard it.

`run.model` takes three forms:

- a preset of the built-in decoder (``tiny``, ``small``, ``125m``, ``350m``, ``1b``: farloco.node.training.model);
- the path of a Hugging Face causal-LM ``config.json`` (or of the folder holding one), of any architecture
  `transformers` knows (Llama, Qwen2, Mistral, GPT-NeoX...): built with ``AutoModelForCausalLM.from_config``,
  nothing fetched from a hub; it needs ``transformers`` (the ``hf`` extra);
- a Python entry point ``package.module:factory``: ``factory()`` returns an ``nn.Module`` or a `ModelSpec`
  that also says how to shard it. The module must be importable on every node (PYTHONPATH).

Whatever the form, the parameters are initialised here from the run seed, one generator per parameter name
(`seeded_init`), so every node starts round 0 from the same theta whatever its CPU; the canonical flat order,
the hand-off, checkpoints and the state sync only see ``named_parameters()`` and work for any model.

The run hash covers the architecture, not only the string in ``run.model``: `architecture` digests the
``config.json`` (for an HF config) or the module's parameter names, shapes and module classes plus the source
file of the factory (for an entry point), and `run_section` adds it as ``run.model_architecture``. A joiner whose
model differs is refused with that key named in the message. Presets add nothing (their hashes are unchanged).

What a factory may return (import `ModelSpec` from here)::

    def factory() -> ModelSpec:
        model = MyNet(vocab_size=256, ...)
        return ModelSpec(model, fsdp_units=["blocks.*"], tp_plan={"blocks.*.fc1": ColwiseParallel(), ...})

- ``fsdp_units``: module names (``fnmatch`` patterns, e.g. ``"blocks.*"``) or module classes that are each
  sharded on their own by FSDP2 (and checkpointed / compiled one by one); the root is always a unit.
- ``tp_plan``: a `parallelize_module` plan on the root (patterns allowed), or None if the model cannot be split
  over node.tp > 1 (then node.tp must be 1).
- ``loss``: ``loss(output, targets) -> scalar``; the default takes the logits (``output`` itself, or its
  ``.logits``) against the next-token targets with cross entropy.
- ``init``: ``init(module, seed)`` in place, if the model wants its own init (it must be deterministic across
  machines); the default is `seeded_init` with std 0.02.
- ``muon``: the parameter names Muon takes (run.inner_optimizer = muon); default: the 2-D weights inside the
  FSDP units.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farloco.node.architecture import ModelError, architecture, entry_factory, hf_config_dict
from farloco.node.config import model_kind
from farloco.node.training.model import (
    Transformer,
    build_model,
    init_each_parameter,
    lm_loss,
    model_config,
    seeded_normal_,
)


@dataclass
class ModelSpec:
    """A model and how farloco trains it (see the module docstring)."""

    module: nn.Module
    fsdp_units: Sequence[str | type[nn.Module]] = ()
    tp_plan: Mapping[str, Any] | None = None
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    init: Callable[[nn.Module, int], None] | None = None
    muon: Callable[[str, nn.Parameter], bool] | None = None
    kind: str = "entry"
    """builtin, hf or entry (set by farloco)."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """kind hf: the config.json it was built from (the export writes it back)."""

    def units(self) -> list[nn.Module]:
        """The FSDP units below the root, in module order (the root itself is sharded last, always)."""
        if self.kind == "builtin":
            assert isinstance(self.module, Transformer)
            return list(self.module.layers)
        found: list[nn.Module] = []
        for name, module in self.module.named_modules():
            if not name:
                continue
            for unit in self.fsdp_units:
                if (isinstance(unit, str) and fnmatch.fnmatchcase(name, unit)) or (
                    isinstance(unit, type) and isinstance(module, unit)
                ):
                    found.append(module)
                    break
        # A unit inside another unit is sharded with its parent's parameters excluded: keep only the outermost.
        inner = {id(sub) for unit in found for sub in unit.modules() if sub is not unit}
        return [unit for unit in found if id(unit) not in inner]

    def compute_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output = self.module(inputs)
        if self.loss is not None:
            return self.loss(output, targets)
        return lm_loss(logits_of(output), targets)

    def is_muon_matrix(self, name: str, param: nn.Parameter) -> bool:
        if self.muon is not None:
            return self.muon(name, param)
        if param.dim() != 2:
            return False
        if self.kind == "builtin":
            return name.startswith("layers.")
        return any(name.startswith(prefix) for prefix in self._unit_prefixes())

    def _unit_prefixes(self) -> list[str]:
        names = {id(module): name for name, module in self.module.named_modules()}
        return [names[id(unit)] + "." for unit in self.units()]


def as_spec(model: ModelSpec | nn.Module) -> ModelSpec:
    """A spec as it is; the built-in decoder (or any module, trained as one unit) wrapped in one."""
    if isinstance(model, ModelSpec):
        return model
    return ModelSpec(model, kind="builtin" if isinstance(model, Transformer) else "entry")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or a `transformers` output's ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ModelError(
        f"the model returned {type(output).__name__}: expected logits [batch, seq, vocab] (a tensor or an object "
        f"with .logits); give the ModelSpec a loss(output, targets) for anything else"
    )


def _hf_module(config: dict[str, Any]) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ModelError(
            "run.model names a Hugging Face config: that needs transformers (pip install 'farloco[hf]')"
        ) from exc
    # The weights farloco trains are float32 whatever dtype the file was saved in (theta is float32; the ranks
    # cast for bf16 compute themselves): a config's dtype must not build a bf16 module.
    dropped = ("model_type", "transformers_version", "dtype", "torch_dtype")
    fields = {k: v for k, v in config.items() if k not in dropped}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        module: nn.Module = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
        # Training never decodes: no key/value cache built on every forward (an export keeps the file's value).
        module.config.use_cache = False  # type: ignore[union-attr]
        return module
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"run.model: transformers cannot build a causal LM from this config: {exc}") from exc


def _spec_of(run_model: str) -> ModelSpec:
    """The uninitialised spec (construction only, no seeded init): on the meta device, this is all that the
    architecture digest and the agent's layout need."""
    kind = model_kind(run_model)
    if kind == "builtin":
        return ModelSpec(Transformer(model_config(run_model)), kind="builtin")
    if kind == "hf":
        config = hf_config_dict(run_model)
        module = _hf_module(config)
        units = tuple(getattr(module, "_no_split_modules", None) or ())
        classes = [type(m) for m in module.modules() if type(m).__name__ in units]
        return ModelSpec(
            module,
            fsdp_units=tuple(dict.fromkeys(classes)),
            tp_plan=_hf_tp_plan(module),
            kind="hf",
            hf_config=config,
        )
    made = entry_factory(run_model)()
    spec = made if isinstance(made, ModelSpec) else ModelSpec(made) if isinstance(made, nn.Module) else None
    if spec is None or not isinstance(spec.module, nn.Module):
        raise ModelError(
            f"run.model {run_model!r}: expected the factory to return an nn.Module or a ModelSpec, "
            f"got {type(made).__name__}"
        )
    spec.kind = "entry"
    return spec


def build_spec(run_model: str, seed: int, init_from: str = "") -> ModelSpec:
    """The model `run.model` names, on CPU in float32, its parameters a function of (architecture, seed) only,
    or, with `init_from` (run.init_from), exactly the weights of that folder (`load_init_from`)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ModelError(f"expected a non-negative int seed, got {seed!r}")
    if init_from:
        spec = _spec_of(run_model)  # no seeded init: every parameter is about to be overwritten
        load_init_from(spec, init_from)
        return spec
    if model_kind(run_model) == "builtin":
        return ModelSpec(build_model(model_config(run_model), seed), kind="builtin")
    spec = _spec_of(run_model)
    if spec.init is not None:
        spec.init(spec.module, seed)
    else:
        std = float(spec.hf_config.get("initializer_range", 0.02)) if spec.kind == "hf" else 0.02
        seeded_init(spec.module, seed, std)
    return spec


def check_init_from(spec: ModelSpec, folder: str) -> tuple[dict[str, Any], dict[str, str]]:
    """That `folder` holds every parameter of `spec` under its name with its shape, and nothing foreign to it
    (a preset: a farloco export of that preset, its config.json that preset's); reads only the files' headers,
    so it works on a meta-device spec (`farloco config check`). Returns the folder's tensor index and the
    parameter -> tensor name map; a ModelError names what is wrong."""
    from farloco.node.training.model import export_hf_config, hf_state_dict_names
    from farloco.node.weights import folder_config, weights_index

    index: dict[str, Any] = dict(weights_index(Path(folder)))
    module = spec.module
    if spec.kind == "builtin":
        assert isinstance(module, Transformer)
        _check_preset_config(folder, export_hf_config(module.config))
        names = hf_state_dict_names(module)
    else:
        names = {name: name for name, _ in module.named_parameters()}
        theirs = folder_config(Path(folder))
        ours = spec.hf_config.get("model_type")
        if theirs is not None and ours is not None and theirs.get("model_type") != ours:
            raise ModelError(
                f"run.init_from: {folder} holds a {theirs.get('model_type')!r} model, run.model is a {ours!r} one"
            )
    params = dict(module.named_parameters())
    missing = [names[name] for name in params if names[name] not in index]
    misshapen = [
        f"{names[name]} {list(index[names[name]].shape)} (expected {list(param.shape)})"
        for name, param in params.items()
        if names[name] in index and tuple(index[names[name]].shape) != tuple(param.shape)
    ]
    # Tied duplicates (lm_head.weight beside tied embeddings) and buffers saved with the weights are the
    # model's own names: only a name the model has nowhere is foreign.
    known = set(names.values()) | set(module.state_dict())
    if spec.kind == "builtin":
        known |= {"lm_head.weight"}
    foreign = sorted(set(index) - known)
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    if misshapen:
        problems.append(f"{len(misshapen)} of another shape: {', '.join(misshapen[:4])}")
    if foreign:
        problems.append(
            f"{len(foreign)} the model does not have: {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''}"
        )
    if problems:
        raise ModelError(
            f"run.init_from: {folder} does not hold this run.model's {len(params)} parameters: "
            + "; ".join(problems)
        )
    return index, names


def load_init_from(spec: ModelSpec, folder: str) -> None:
    """Overwrite every parameter of `spec` with the tensor of the same name in `folder` (node/weights.py finds
    and checks the files, `check_init_from` the names and shapes), as float32. A NaN/Inf value is a ModelError
    naming the tensor, before anything is overwritten."""
    from safetensors import safe_open

    index, names = check_init_from(spec, folder)
    params = dict(spec.module.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(index[names[name]].file, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for path, members in by_file.items():
        with safe_open(str(path), framework="pt") as file:
            for name in members:
                value = file.get_tensor(names[name]).to(torch.float32)
                if not torch.isfinite(value).all():
                    raise ModelError(f"run.init_from: {path.name}: {names[name]} holds NaN or Inf values")
                loaded[name] = value
    with torch.no_grad():
        for name, param in params.items():
            if param.device.type == "meta":
                raise ModelError("load_init_from: the model is on the meta device")
            param.copy_(loaded.pop(name))


def _check_preset_config(folder: str, expected: dict[str, Any]) -> None:
    from farloco.node.weights import folder_config

    found = folder_config(Path(folder))
    if found is None:
        raise ModelError(
            f"run.init_from: {folder} has no config.json; a preset run.model takes a `farloco export` of that "
            f"preset (or leave run.model unset to train the folder's own architecture)"
        )
    ignored = {"transformers_version", "torch_dtype", "dtype", "architectures", "use_cache"}
    differ = [
        f"{key} {found.get(key)!r} (the preset: {value!r})"
        for key, value in sorted(expected.items())
        if key not in ignored and found.get(key) != value
    ]
    if differ:
        raise ModelError(
            f"run.init_from: {Path(folder) / 'config.json'} is not this preset's architecture: "
            f"{'; '.join(differ[:6])}; "
            f"leave run.model unset to train the folder's own architecture"
        )


def meta_spec(run_model: str) -> ModelSpec:
    """The spec built on the meta device: names and shapes, no memory, no init (a 10B model costs nothing)."""
    with torch.device("meta"):
        return _spec_of(run_model)


def seeded_init(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init in place: every parameter of 2 or more dimensions normal(0, std) from a generator
    seeded by (seed, its name), biases 0, other 1-D parameters (norm scales) as the module constructed them.
    Sampled in float64 and rounded: the float32 CPU sampler's values depend on the CPU's vector unit."""

    def init_one(name: str, param: nn.Parameter) -> None:
        if param.dim() >= 2:
            seeded_normal_(param, seed, name, std)
        elif name.endswith("bias"):
            with torch.no_grad():
                param.zero_()

    init_each_parameter(module, init_one)


def _hf_tp_plan(module: nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan a `transformers` model declares (config.base_model_tp_plan), as torch
    ParallelStyles on the causal LM's root; None when it declares none or uses styles beyond plain column-wise
    and row-wise (the attention of HF models reshapes with -1 heads, so those two split it by heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(module, "config", None)
    declared = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(module, "base_model_prefix", "model")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not declared or any(style not in styles for style in declared.values()):
        return None
    return {f"{prefix}.{name}": styles[style]() for name, style in declared.items()}


def check_tp(spec: ModelSpec, tp: int, where: str = "node.tp") -> None:
    """A model splits over `tp` ranks only if it has a plan and every split dimension divides: a clear error."""
    if tp == 1 or spec.kind == "builtin":
        return
    if spec.tp_plan is None:
        raise ModelError(
            f"{where}={tp}: this run.model declares no tensor-parallel plan; expected node.tp = 1"
        )
    if spec.kind == "hf":
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = spec.hf_config.get(key)
            if isinstance(value, int) and value % tp:
                raise ModelError(f"{where}={tp}: the model's {key}={value} is not a multiple of it")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, module in spec.module.named_modules():
        style = next((s for pattern, s in spec.tp_plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if isinstance(module, nn.Linear) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            dim, what = (
                (module.out_features, "out_features")
                if isinstance(style, ColwiseParallel)
                else (module.in_features, "in_features")
            )
            if dim % tp:
                raise ModelError(f"{where}={tp}: {name}.{what}={dim} is not a multiple of it")


__all__ = [
    "ModelError",
    "ModelSpec",
    "architecture",
    "as_spec",
    "build_spec",
    "check_init_from",
    "check_tp",
    "load_init_from",
    "logits_of",
    "meta_spec",
    "seeded_init",
]
