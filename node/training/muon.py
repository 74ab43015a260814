"""The ranks' inner optimizers: AdamW, or Muon for the blocks' matrices with AdamW for the rest (MuLoCo).

Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", arXiv 2502.16982) replaces a weight matrix's
update by its orthogonalised Nesterov momentum (five quintic Newton-Schulz iterations in bf16, the coefficients
torch and Keller Jordan use). MuLoCo (arXiv 2505.23725) runs it as DiLoCo's inner optimizer: the
pseudo-gradients it produces compress to a few bits with error feedback at next to no loss.

The step is scaled by 0.2 * sqrt(max(rows, cols)) (Moonshot's "match AdamW's RMS"), so `run.inner_lr` means the
same for both optimizers and a run switches between them without a new learning-rate search.

Sharded parameters (FSDP2 and TP DTensors) are orthogonalised whole: each rank gathers the full momentum of a
matrix, runs Newton-Schulz on it, and keeps its own shard of the result. Every rank of the node repeats the same
matrix products (deterministic, so the shards agree); at the sizes farloco trains on a GPU that costs a few
percent of a step (the benchmark in benchmarks/node_throughput.py measures it), and a distributed Muon that
splits the matrices among the ranks is the known next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# torch.optim.Muon's quintic coefficients (Keller Jordan's), five iterations.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(matrix: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T (Newton-Schulz in bf16), in the matrix's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.T
    result: torch.Tensor = x.to(matrix.dtype)
    return result


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (a whole matrix) as `param` holds it: this rank's shard when param is a DTensor."""
    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the parameters in `muon_params`, AdamW for `adamw_params`; one `lr` and `weight_decay`.

    State per parameter: `step`, and `momentum_buffer` (Muon) or `exp_avg`/`exp_avg_sq` (AdamW), shaped and
    sharded like the parameter, so torch.distributed.checkpoint saves and reshards it as AdamW's."""

    def __init__(
        self,
        muon_params: Iterable[torch.nn.Parameter],
        adamw_params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"MuonAdamW: expected lr >= 0 and weight_decay >= 0, got {lr}, {weight_decay}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"MuonAdamW: expected momentum in [0, 1), got {momentum}")
        muon = list(muon_params)
        for param in muon:
            if param.dim() != 2:
                raise ValueError(
                    f"MuonAdamW: Muon takes 2-D matrices, got a parameter of shape {tuple(param.shape)}"
                )
        groups: list[dict[str, Any]] = [
            {"params": muon, "algorithm": "muon"},
            {"params": list(adamw_params), "algorithm": "adamw"},
        ]
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "betas": betas, "eps": eps}
        super().__init__([g for g in groups if g["params"]], defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    if group["algorithm"] == "muon":
                        state["momentum_buffer"] = torch.zeros_like(param)
                    else:
                        state["exp_avg"] = torch.zeros_like(param)
                        state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                if group["algorithm"] == "muon":
                    self._muon(param, group, state)
                else:
                    self._adamw(param, group, state)
        return loss

    @staticmethod
    def _muon(param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        grad, buffer, momentum = param.grad, state["momentum_buffer"], group["momentum"]
        assert grad is not None
        buffer.lerp_(grad, 1 - momentum)
        nesterov = grad.lerp(buffer, momentum)
        update = _like(orthogonalize(_full(nesterov)), param)
        rows, cols = param.shape[0], param.shape[1]
        scale = 0.2 * math.sqrt(max(rows, cols))
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(update, alpha=-group["lr"] * scale)

    @staticmethod
    def _adamw(param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        grad = param.grad
        assert grad is not None
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1 = 1 - beta1**step
        bias2 = 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(group["eps"])
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """The parameters Muon takes: the blocks' weight matrices (not embeddings, head or norms)."""
    return name.startswith("layers.") and param.dim() == 2


def build_inner_optimizer(
    model: torch.nn.Module,
    algorithm: str,
    *,
    lr: float,
    weight_decay: float,
    fused: bool,
    is_matrix: Callable[[str, torch.nn.Parameter], bool] = is_muon_matrix,
) -> torch.optim.Optimizer:
    """run.inner_optimizer's optimizer over `model`'s parameters (`is_matrix`: those Muon takes)."""
    if algorithm == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused
        )
    if algorithm == "muon":
        named = list(model.named_parameters())
        return MuonAdamW(
            [p for n, p in named if is_matrix(n, p)],
            [p for n, p in named if not is_matrix(n, p)],
            lr=lr,
            weight_decay=weight_decay,
        )
    raise ValueError(f"run.inner_optimizer: expected 'adamw' or 'muon', got {algorithm!r}")
