"""Model FLOPs per token and a device's peak FLOP/s: what MFU (model FLOPs utilisation) is made of.

MFU = model FLOPs per token x tokens/s / peak FLOP/s. Model FLOPs per token as PaLM (Chowdhery et al. 2022,
appendix B) counts them: 6 x the parameters of every matrix multiply (forward and backward; the output head
counts even when tied to the embedding, whose lookup is free) plus 12 x layers x width x sequence length for
attention's scores and values. For the built-in decoder the count comes from its config; for any other model
from its modules (2-D+ weights outside nn.Embedding, the head, and attention's term when the model's config says
its layers and width).

The peak is the device's dense rate at the precision the ranks train in: node.peak_tflops when set, else a
table of the GPUs whose figures are public (NVIDIA's datasheets, dense, no sparsity), else unknown (0), and a
node then reports no MFU. On CPU there is no datasheet peak; set node.peak_tflops to compare against one.
"""

from __future__ import annotations

import torch
from torch import nn

from farloco.node.training.model import ModelConfig, Transformer

# Dense TFLOP/s (bf16; "fp32" = TF32 tensor cores, what fp32 matmuls use with TF32 allowed).
GPU_PEAK_TFLOPS = {
    "H100": {"bf16": 989.4, "fp32": 494.7},
    "H200": {"bf16": 989.4, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "B200": {"bf16": 2250.0, "fp32": 1100.0},
}


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """The built-in decoder's model FLOPs per trained token (see the module docstring)."""
    kv = model.n_kv_heads * model.head_dim
    block = 2 * model.dim * model.dim + 2 * model.dim * kv + 3 * model.dim * model.ffn_dim
    matmul_params = model.n_layers * block + model.dim * model.vocab_size
    return 6.0 * matmul_params + 12.0 * model.n_layers * model.dim * seq_len


def module_flops_per_token(module: nn.Module, seq_len: int) -> float:
    """Model FLOPs per trained token of any model (the built-in decoder by its config); works on the meta
    device."""
    if isinstance(module, Transformer):
        return flops_per_token(module.config, seq_len)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    matmul = sum(p.numel() for p in module.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    head = getattr(module, "get_output_embeddings", None)
    output = head() if callable(head) else None
    if isinstance(output, nn.Module) and id(getattr(output, "weight", None)) in embeddings:
        matmul += output.weight.numel()  # type: ignore[operator]  # a tied head multiplies by the embedding
    config = getattr(module, "config", None)
    layers, width = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    attention = 12.0 * layers * width * seq_len if isinstance(layers, int) and isinstance(width, int) else 0.0
    return 6.0 * matmul + attention


def device_peak_flops(device: torch.device, precision: str, peak_tflops: float = 0.0) -> float:
    """The device's dense peak FLOP/s at `precision` ('bf16' or 'fp32'); 0 when unknown."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in name:
            return peaks["bf16" if precision == "bf16" else "fp32"] * 1e12
    return 0.0
