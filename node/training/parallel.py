"""How one node's ranks split the model, and where each rank's shard sits in the canonical flat vector.

`parallelize` applies, in torchtitan's order: tensor parallelism on the `tp` dimension of a 2-D DeviceMesh
(dp_shard x tp; tp ranks are consecutive, so they share the fastest links), activation checkpointing, per-block
`torch.compile`, then FSDP2 (`fully_shard`) over the dp_shard dimension with an optional bf16
`MixedPrecisionPolicy`. With tp = 1 the mesh is the 1-D mesh of plain FSDP2; a single rank computing in float32
trains the plain module (`shards`).

The tensor-parallel plan is Megatron's, written with `parallelize_module`: q/k/v and the MLP's w1/w3 column-wise,
wo and w2 row-wise, so each block does one reduction per sub-layer; the blocks' norms are sequence-parallel (the
residual stream between sub-layers stays split along the sequence over the tp ranks, and the row-wise layers
reduce-scatter into it instead of all-reducing). The embedding, the final norm and the output head are not split
over tp (FSDP still shards them over dp): the tied head would need a vocab-parallel loss, which is a later step.

`ShardView` maps a rank's local shard of one parameter, whatever its placements (FSDP's `Shard(0)`, TP's
`Shard(0)`/`Shard(1)`, FSDP over TP's `_StridedShard`, `Replicate`), onto the hand-off's flat vector in the
canonical order, so the agent sees one vector whatever the node's layout: nodes with different `tp` and
`num_ranks` train in one swarm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from farloco.node.config import Config, ConfigError, model_kind
from farloco.node.handoff import ParamSlot
from farloco.node.training.model import ModelConfig, Transformer, model_config
from farloco.node.training.models import ModelSpec, as_spec, check_tp, meta_spec


@dataclass(frozen=True)
class NodeMesh:
    """The node's ranks as a (dp_shard x tp) mesh, and this rank's place in it."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp: int


def check_tensor_parallel(model: ModelConfig, tp: int, where: str = "node.tp") -> None:
    """The built-in model splits over `tp` ranks only if its heads and widths do: a clear error otherwise."""
    if tp == 1:
        return
    for name, value in (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("ffn_dim", model.ffn_dim),
    ):
        if value % tp:
            raise ConfigError(
                f"{where}={tp}: the model's {name}={value} is not a multiple of it (tensor parallelism gives each "
                f"of the {tp} ranks {name}/tp); expected a tp dividing n_heads={model.n_heads}, "
                f"n_kv_heads={model.n_kv_heads} and ffn_dim={model.ffn_dim}"
            )


def check_node_layout(config: Config) -> None:
    """Config-load checks that need the model's shape (config.py knows no model): tp against heads and widths
    (for a model of its own, against its tensor-parallel plan, built on the meta device)."""
    if model_kind(config.run.model) != "builtin":
        if config.node.tp > 1:
            check_tp(meta_spec(config.run.model), config.node.tp)
        return
    try:
        model = model_config(config.run.model)
    except ValueError as exc:
        raise ConfigError(f"run.model: {exc}") from exc
    check_tensor_parallel(model, config.node.tp)


def ranks_use_cuda(config: Config) -> bool:
    """node.device resolved: whether the ranks train on CUDA ('auto': where a GPU is there)."""
    return config.node.device == "cuda" or (config.node.device == "auto" and torch.cuda.is_available())


def compute_dtype(config: Config, device: torch.device) -> torch.dtype:
    """node.precision resolved: 'auto' is bf16 on cuda and fp32 on cpu."""
    precision = config.node.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else torch.float32


def node_mesh(device: torch.device, world_size: int, rank: int, tp: int) -> NodeMesh:
    if world_size % tp:
        raise ConfigError(f"node.tp={tp}: expected a divisor of the {world_size} ranks launched")
    dp = world_size // tp
    if tp == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
        return NodeMesh(mesh, mesh, None, rank, world_size, 0, 1)
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return NodeMesh(mesh, mesh["dp"], mesh["tp"], rank // tp, dp, rank % tp, tp)


def tensor_parallel_plan() -> dict[str, Any]:
    """One block's plan: column-wise then row-wise per sub-layer, sequence-parallel norms around them."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather_sequence() -> PrepareModuleInput:
        # The sub-layer needs the whole sequence: all-gather the norm's sequence-split output (cos/sin pass).
        return PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        )

    return {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split every block over `tp_mesh`; the residual stream between blocks is split along the sequence."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    check_tensor_parallel(model.config, tp_mesh.size(), where="tp")
    plan = tensor_parallel_plan()
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(
        model,
        tp_mesh,
        {
            # The embedding runs whole on every tp rank; its output is cut along the sequence (no traffic).
            "tok_embeddings": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            ),
            # The final norm and the head see the whole sequence again.
            "norm": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        },
    )


def parallelize(
    model_or_spec: ModelSpec | torch.nn.Module, config: Config, device: torch.device, mesh: NodeMesh
) -> None:
    """TP, activation checkpointing, compile and FSDP2 (with mixed precision), in that order, in place, on the
    spec's model and its units (the built-in decoder's blocks, or the units a model of one's own names).

    Parameter names do not change (activation checkpointing is a flag of the built-in model and a wrapped forward
    elsewhere, compile replaces each unit's forward in place), so the canonical order and the checkpoints' keys
    are those of the plain model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    spec = as_spec(model_or_spec)
    model = spec.module
    units = spec.units()
    if mesh.tp_mesh is not None:
        if isinstance(model, Transformer):
            apply_tensor_parallel(model, mesh.tp_mesh)
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            check_tp(spec, mesh.tp)
            assert spec.tp_plan is not None
            parallelize_module(model, mesh.tp_mesh, dict(spec.tp_plan))
    if isinstance(model, Transformer):
        model.checkpoint_blocks = config.node.activation_checkpointing
    elif config.node.activation_checkpointing:
        for unit in units:
            unit.forward = _checkpointed(unit.forward)
    if config.node.compile:
        for unit in units:
            # The unit's forward, not its __call__: FSDP2's hooks (all-gather, reshard) stay eager around the
            # compiled body, as torchtitan has them, and the names stay canonical (no `_orig_mod.` wrapper).
            unit.forward = torch.compile(unit.forward)
    dtype = compute_dtype(config, device)
    if not shards(mesh, dtype):
        return
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mesh=mesh.dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh.dp_mesh, mp_policy=policy)


def shards(mesh: NodeMesh, dtype: torch.dtype) -> bool:
    """Whether `parallelize` wraps the model in FSDP2: not for one rank without tp computing in float32, where
    FSDP2 would shard nothing and cast nothing and only copy each unit's weights into its all-gather buffers and
    its gradients through a reduce-scatter of one, every step (time and a transient copy of the model's units).
    That rank trains the plain module: the same arithmetic, with its weights where HostStaging can share them
    with the agent."""
    return not (mesh.dp_size == 1 and mesh.tp_mesh is None and dtype == torch.float32)


def _checkpointed(forward: Any) -> Any:
    """`forward` recomputed in the backward pass (while training) instead of keeping its activations."""
    import functools

    import torch.utils.checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients' global norm to `max_norm`; the norm is over the whole model, whichever meshes its
    DTensors live on (with tp > 1 the blocks are 2-D and the embedding 1-D, which torch's own clip refuses)."""
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(param)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)  # type: ignore[misc]
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().square())
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    for group in by_mesh.values():  # one mesh per call: torch's foreach multiply refuses a mix
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class ShardView:
    """Where one rank's local shard of a parameter lives in the canonical flat vector.

    The local shard of a 2-D parameter is a set of rows (a range, or under FSDP over TP an interleaved set) and a
    range of columns of the whole matrix; of a 1-D parameter a range. Worked out once, from the placements by
    torch's own `distribute_tensor` on an index tensor, so any layout torch produces maps right."""

    def __init__(self, param: torch.nn.Parameter, slot: ParamSlot) -> None:
        self.param = param
        self.slot = slot
        self.local = param.to_local() if isinstance(param, DTensor) else param.data
        self.numel = self.local.numel()
        if len(slot.shape) > 2:
            raise ValueError(f"{slot.name}: parameters of {len(slot.shape)} dimensions are not supported")
        two_d = len(slot.shape) == 2
        cols = slot.shape[1] if two_d else slot.numel
        self.matrix_shape = (slot.shape[0], cols) if two_d else (1, slot.numel)
        self.rows: slice | torch.Tensor = slice(0, 0)
        self.cols = slice(0, 0)
        if not self.numel:
            return  # an empty shard (more ranks than rows): nothing to move
        if isinstance(param, DTensor):
            index_dtype = torch.int32 if slot.numel < 2**31 else torch.int64
            index = torch.arange(slot.numel, dtype=index_dtype, device=self.local.device).view(param.shape)
            local_index = distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None)
            positions = local_index.to_local().long().cpu()
            del index, local_index
        else:
            positions = torch.arange(slot.numel)
        width = self.local.shape[-1] if two_d else self.numel
        positions = positions.reshape(-1, width)
        rows = positions[:, 0] // cols
        col0 = int(positions[0, 0] % cols)
        expected = (rows * cols + col0).unsqueeze(1) + torch.arange(width).unsqueeze(0)
        if not torch.equal(expected, positions):
            raise RuntimeError(
                f"{slot.name}: placements {getattr(param, 'placements', None)} give a local shard that is not a "
                f"set of rows x a range of columns; farloco cannot map it onto the flat vector"
            )
        self.cols = slice(col0, col0 + width)
        if torch.equal(rows, rows[0] + torch.arange(rows.numel())):
            self.rows = slice(int(rows[0]), int(rows[0]) + rows.numel())
        else:
            self.rows = rows

    def flat_range(self) -> tuple[int, int] | None:
        """[begin, end) of this shard in the flat vector where it is one run of it in the shard's own order (a
        1-D shard, whole rows, or part of one row), else None (column-split rows, interleaved rows)."""
        if not self.numel or not isinstance(self.rows, slice):
            return None
        cols = self.matrix_shape[1]
        if self.rows.stop - self.rows.start > 1 and (self.cols.start, self.cols.stop) != (0, cols):
            return None
        begin = self.slot.offset + self.rows.start * cols + self.cols.start
        return begin, begin + self.numel

    def _matrix(self, flat: torch.Tensor) -> torch.Tensor:
        begin = self.slot.offset
        return flat[begin : begin + self.slot.numel].view(self.matrix_shape)

    def host_piece(self, flat: torch.Tensor) -> torch.Tensor:
        """This shard's values in `flat` (a host tensor), shaped as the local shard."""
        matrix = self._matrix(flat)
        if isinstance(self.rows, slice):
            piece = matrix[self.rows, self.cols]
        else:
            piece = matrix[:, self.cols].index_select(0, self.rows)
        return piece.reshape(self.local.shape)

    def load(self, flat: torch.Tensor) -> None:
        if self.numel:
            with torch.no_grad():
                self.local.copy_(self.host_piece(flat))

    def store_from(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` (this shard, on the host) into its place in `flat`."""
        if not self.numel:
            return
        matrix = self._matrix(flat)
        values = values.reshape(-1, self.cols.stop - self.cols.start)
        if isinstance(self.rows, slice):
            matrix[self.rows, self.cols].copy_(values)
        else:
            matrix[:, self.cols].index_copy_(0, self.rows, values)

    def store(self, flat: torch.Tensor) -> None:
        self.store_from(flat, self.local.detach())
