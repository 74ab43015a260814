"""The built-in model: a Llama-style decoder-only transformer, its presets, init, loss and HF export names.

This file owns the architecture every farloco node trains when it does not bring its own model:
RMSNorm, rotary position embeddings (the "rotate_half" layout Hugging Face Llama uses, so q/k weights export
without a permutation), grouped-query attention through ``F.scaled_dot_product_attention``, a SwiGLU MLP,
tied or untied embeddings, no biases. It is meant to be read top to bottom, like nanoGPT.

Two properties matter to the rest of farloco:
- ``build_model(config, seed)`` gives bit-identical parameters for the same seed on every machine, because every
  node of a swarm must start round 0 from the same theta.
- Each ``TransformerBlock`` is a self-contained module with no cross-block state, so FSDP2 ``fully_shard`` can
  be applied per block and then to the root (checked by ``tests/unit/test_model.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`Transformer`. Part of the swarm-wide ``[run]`` config: every peer must agree on it."""

    vocab_size: int
    """Number of token ids; logits have this last dimension."""
    dim: int
    """Width of the residual stream (HF ``hidden_size``)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; ``dim`` must be a multiple of it (head_dim = dim / n_heads)."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``. Equal to n_heads is MHA."""
    ffn_dim: int
    """Hidden width of the SwiGLU MLP (HF ``intermediate_size``)."""
    max_seq_len: int
    """Longest sequence the rotary tables are precomputed for; longer inputs are refused."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    tie_embeddings: bool = True
    """If true the output projection reuses the token embedding matrix (there is no separate ``output``)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is always a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive float, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings: expected a bool, got {self.tie_embeddings!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig: dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig: head_dim=dim/n_heads={self.head_dim} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


# Sizes in the comments are from num_parameters(build_model(...)) and are checked by tests/unit/test_model.py.
MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~1.02M parameters, byte vocab: the tests' and the demo's model; several steps/s on one CPU core.
    "tiny": ModelConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=512
    ),
    # ~9.5M parameters, byte vocab: a CPU-trainable model that still learns something visible.
    "small": ModelConfig(
        vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=1024
    ),
    # ~128M parameters with a 32k tokenizer.
    "125m": ModelConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3072, max_seq_len=2048
    ),
    # ~360M parameters with a 32k tokenizer.
    "350m": ModelConfig(
        vocab_size=32000, dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, ffn_dim=3584, max_seq_len=2048
    ),
    # ~1.04B parameters with a 32k tokenizer (Llama-3.2-1B's shape with a smaller vocab).
    "1b": ModelConfig(
        vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048
    ),
}


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    """The preset ``preset`` with some fields replaced, e.g. ``model_config("tiny", max_seq_len=128)``."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(MODEL_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; expected some of {sorted(fields)}")
    return dataclasses.replace(MODEL_PRESETS[preset], **overrides)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 so bf16 activations do not lose the normalisation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables [max_seq_len, head_dim] in the rotate_half layout (frequencies repeated twice).

    Computed in float64 and rounded once, so every machine gets the same float32 tables.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by position; cos/sin are [T, head_dim]."""
    # Cast the tables, not x: under mixed precision x is bf16 and must stay so for SDPA.
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention; q/k/v/o are separate Linears so the HF export is 1:1."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp query and n_kv_heads/tp kv heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # enable_gqa repeats each kv head for n_heads/n_kv_heads consecutive query heads (repeat_interleave),
        # which is the grouping HF Llama's repeat_kv uses.
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        projected: Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
        return projected


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x); w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). The unit FSDP2 shards."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        out: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Transformer(nn.Module):
    """Decoder-only language model: tokens [B, T] int64 -> logits [B, T, vocab_size] float32."""

    config: ModelConfig
    output: nn.Linear | None
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # Tied: no output module at all, the logits use tok_embeddings.weight directly. That keeps a single
        # name for the matrix in named_parameters() *and* state_dict() (a second alias would make
        # safetensors refuse the checkpoint and the canonical flat order ambiguous).
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        # Not persistent: derived from the config, so they stay out of checkpoints and the wire payload.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Activation checkpointing per block (node.activation_checkpointing): a flag rather than a wrapper
        # module, so parameter names stay those of the canonical order.
        self.checkpoint_blocks = False

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(
                f"Transformer.forward: expected integer tokens of shape [batch, seq_len], "
                f"got dtype={tokens.dtype} shape={list(tokens.shape)}"
            )
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"Transformer.forward: seq_len={seq_len} exceeds max_seq_len={self.config.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.checkpoint_blocks and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        h = self.norm(h)
        logits = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
        return logits.float()


def _parameter_seed(seed: int, name: str) -> int:
    # One generator per parameter, keyed by its name: a parameter's init does not depend on creation order
    # or on which other parameters exist, so the same name always gets the same values.
    digest = hashlib.sha256(f"farloco-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal_(param: nn.Parameter, seed: int, name: str, std: float) -> None:
    """`param` <- normal(0, std) from a generator seeded by (seed, name): the same values on every machine."""
    generator = torch.Generator(device="cpu").manual_seed(_parameter_seed(seed, name))
    # Sample in float64: torch's float32 CPU normal has an AVX2-vectorised path whose values differ from the
    # default one (checked with ATEN_CPU_CAPABILITY), so float32 sampling would depend on the CPU. The float64
    # path is the same on every CPU; rounding to float32 happens in copy_.
    with torch.no_grad():  # grad mode is per thread; a pool's threads start with it on
        param.copy_(torch.empty(param.shape, dtype=torch.float64).normal_(0.0, std, generator=generator))


def init_each_parameter(module: nn.Module, init_one: Callable[[str, nn.Parameter], None]) -> None:
    """`init_one(name, param)` for every parameter, in parallel: each parameter has its own generator, so the
    results do not depend on the order; the sampling is single-threaded and dominates a big model's build."""
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        for future in [pool.submit(init_one, name, param) for name, param in module.named_parameters()]:
            future.result()


def init_weights(model: Transformer, seed: int) -> None:
    """GPT-2-style init in place: normal(0, 0.02), residual projections (wo, w2) scaled by 1/sqrt(2*n_layers),
    norm weights 1. Deterministic across machines (see build_model)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)

    def init_one(name: str, param: nn.Parameter) -> None:
        if name.endswith("norm.weight"):
            with torch.no_grad():
                param.fill_(1.0)
            return
        std = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0.02
        seeded_normal_(param, seed, name, std)

    init_each_parameter(model, init_one)


def build_model(config: ModelConfig, seed: int) -> Transformer:
    """A fresh float32 model on CPU whose parameters depend only on (config, seed): bit-identical everywhere."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"build_model: expected a non-negative int seed, got {seed!r}")
    model = Transformer(config)
    init_weights(model, seed)
    return model


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy. ``targets[b, t]`` is the token that follows ``inputs[b, t]`` (the
    samplers in farloco.node.training.data already shift), so logits [B, T, V] and targets [B, T] line up."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_loss: expected logits [B, T, V] and targets [B, T], "
            f"got logits {list(logits.shape)} and targets {list(targets.shape)}"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).long())


def num_parameters(model: nn.Module) -> int:
    """Number of unique parameter values (a tied matrix counts once)."""
    # named_parameters() already skips a tensor registered twice; dedupe by identity too in case a caller
    # aliased one parameter under two modules some other way.
    unique = {id(p): p for _, p in model.named_parameters()}
    return sum(p.numel() for p in unique.values())


def export_hf_config(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``LlamaConfig`` dict (config.json) describing the same model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": float(config.rope_theta),
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


# Our names inside a block -> HF Llama names inside model.layers.N.
_HF_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_state_dict_names(model: Transformer) -> dict[str, str]:
    """Our parameter name -> HF Llama parameter name, for every parameter of ``model``.

    Weights need no permutation: our RoPE is the rotate_half form HF applies to q_proj/k_proj outputs. When
    embeddings are tied there is no ``lm_head.weight``; HF re-ties it from ``tie_word_embeddings``.
    """
    mapping: dict[str, str] = {}
    for name, _ in model.named_parameters():
        if name in _HF_TOP_NAMES:
            mapping[name] = _HF_TOP_NAMES[name]
            continue
        prefix, _, rest = name.partition(".")
        index, _, inner = rest.partition(".")
        if prefix != "layers" or not index.isdigit() or inner not in _HF_BLOCK_NAMES:
            raise ValueError(f"hf_state_dict_names: no HF Llama name for parameter {name!r}")
        mapping[name] = f"model.layers.{index}.{_HF_BLOCK_NAMES[inner]}"
    return mapping
