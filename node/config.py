"""The typed configuration tree of a farloco node: TOML file -> `--set` overrides -> frozen dataclasses.

The `[run]` section describes the training run and must be identical on every peer of a swarm: it is hashed into
`run_hash`, and a peer whose hash differs is refused with the list of differing keys. Every other section is
local to the node (where it listens, how many trainer ranks it runs, its timeouts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

SCALAR = str | int | float | bool


class ConfigError(ValueError):
    """A config file, key or value that cannot be used; the message names the key, the value and what was expected."""


OUTER_UPDATES = ("sync", "delayed", "eager")
LATE_WORK = ("merge", "discard")
SPARSE_CODECS = ("topk", "dct-topk")
INNER_OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("auto", "fp32", "bf16")
LOGGERS = ("tensorboard", "wandb")


@dataclass(frozen=True)
class RunConfig:
    """What the swarm trains and how. Identical on every peer (hashed into `run_hash`)."""

    name: str = "farloco-demo"
    """Run name; namespaces the DHT keys, so two runs can share one DHT."""
    model: str = "tiny"
    """The model: a size preset of the built-in Llama-style decoder (tiny, small, 125m, 350m, 1b), the path of a
    Hugging Face causal-LM config.json (any transformers architecture; needs the hf extra), or an entry point
    package.module:factory returning an nn.Module or a farloco ModelSpec (node/training/models.py). Any form
    is initialised from run.seed identically on every node (or loaded from run.init_from); the run hash covers
    its architecture, not the path."""
    init_from: str = ""
    """Start from pretrained weights: a local model folder, Hugging Face (config.json with model.safetensors, or
    model.safetensors.index.json and its shards) or a `farloco export`; theta at round 0 is exactly its weights
    (in float32). run.model, when not set, is this folder's config.json; a preset takes a farloco export of that
    preset. The run hash covers the weights' digest, not the path (node/weights.py). '' starts from run.seed."""
    dataset: str = "builtin"
    """'builtin' (the bundled corpus, no download) or the path of a directory made by `farloco data prepare`."""
    strategy: str = "diloco"
    """Outer strategy: diloco, streaming-diloco (one of num_fragments fragments per round, exchanged while the
    ranks run tau more inner steps), demo (one plain SGD step per round: needs inner_steps = 1; inner_lr,
    warmup_steps and inner_weight_decay are unused) or sparseloco."""
    codec: str = "fp32"
    """Codec of the outer update on the wire: fp32, fp16, bf16, int8, int4, topk, dct-topk."""
    strategy_options: dict[str, SCALAR] = field(default_factory=dict)
    """Extra hyper-parameters passed to the strategy (e.g. {beta = 0.95} for sparseloco; diloco: lr, momentum,
    error_feedback and feedback_bf16, the error-feedback residual kept in bfloat16, default true; streaming-diloco:
    those, num_fragments, alpha and tau, the overlapped inner steps, 0 <= tau < inner_steps, default 1)."""
    codec_options: dict[str, SCALAR] = field(default_factory=dict)
    """Extra options passed to the codec (e.g. {block_size = 256} for int8)."""
    inner_steps: int = 20
    """H: inner optimizer steps between two outer synchronisations."""
    inner_optimizer: str = "adamw"
    """The ranks' inner optimizer: 'adamw' (betas 0.9, 0.95) or 'muon' (MuLoCo, arXiv 2505.23725: Muon with
    Nesterov momentum 0.95 for the blocks' weight matrices, its step scaled to AdamW's RMS so inner_lr means the
    same, and AdamW for embeddings, head and norms). Unused by demo, whose ranks take one plain SGD step."""
    inner_lr: float = 3e-3
    """Peak learning rate of the inner optimizer."""
    inner_weight_decay: float = 0.1
    """Decoupled weight decay of the inner optimizer."""
    warmup_steps: int = 20
    """Linear warm-up of the inner learning rate, in inner steps."""
    lr_schedule: str = "constant"
    """The inner rate after the warm-up (node/schedule.py): 'constant' (inner_lr), 'cosine' or 'linear'
    (from inner_lr down to inner_lr x min_lr_ratio at the total), 'wsd' (warmup-stable-decay: inner_lr until the
    last wsd_decay_fraction of the total, then linear down). Its position is the swarm's inner step (round id x
    inner_steps + the step in the round), so joiners and resumed nodes apply the rate the swarm is at."""
    min_lr_ratio: float = 0.0
    """The decaying schedules end at inner_lr x this (0..1)."""
    total_inner_steps: int = 0
    """The schedule's length in inner steps (0: max_rounds x inner_steps; a decaying schedule needs one)."""
    wsd_decay_fraction: float = 0.1
    """lr_schedule = 'wsd': the last fraction of the total over which the rate decays (0 < f <= 1)."""
    outer_lr_schedule: str = "constant"
    """The outer rate by round (node/schedule.py): 'constant' (the strategy's lr: outer_lr, or strategy_options
    lr), 'cosine' or 'linear' from it down to it x min_lr_ratio at the total's last round (total_inner_steps /
    inner_steps, or max_rounds). A function of the round id, so every member applies the same rate."""
    grad_clip: float = 1.0
    """Clip the inner gradient norm to this value (0 disables)."""
    batch_size: int = 8
    """Sequences per inner step per node (split across the node's trainer ranks)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    outer_lr: float = 0.7
    """Outer learning rate (DiLoCo paper default 0.7)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (DiLoCo paper default 0.9)."""
    seed: int = 0
    """Seed of the initial parameters (all peers start from the same theta_0) and the data order."""
    data_slots: int = 8
    """The training data is cut into this many disjoint slices; a node trains on the slice of its slot."""
    outer_update: str = "sync"
    """When a round's mean reaches the ranks (diloco, sparseloco). 'sync': the ranks wait for the exchange and
    start the next round from its result. 'delayed': they start the next round at once from theta_outer, which
    takes each round's mean one round late, so the exchange runs while they train (Kale et al. 2025).
    'eager': as delayed, and each node previews its own fresh update in the weights its ranks start from.
    A mean applied one round late is a stale step: with diloco's outer momentum 0.9 it oscillates; lower
    outer_momentum (0-0.5) for delayed and eager (BENCHMARKS.md, "Overlapped outer updates")."""
    late_work: str = "merge"
    """What a node late for a round (its group formed without it) does with the inner steps it trained for it.
    'merge': keep their pseudo-gradient and add it, weighted by its steps, to its contribution to the next round
    (one round stale at most; node/daemon/latework.py). 'discard': drop them. Only the synchronous loop merges
    (the overlapped ones apply every mean a round late already; streaming-diloco keeps them in the weights)."""
    aggregator: str = "mean"
    """How a round's contributions are combined: 'mean' (weighted by samples, the default) or a robust rule that
    bounds what a minority of Byzantine members (valid but wrong updates) can do: 'trimmed_mean' (per
    coordinate, drops the largest and smallest quarter), 'median' (per coordinate), 'norm_clip' (each member's
    chunk clipped to the median chunk norm) or 'centered_clip' (CenteredClip, hivemind's BTARD rule). Applied per
    chunk by its owner (farloco.optim.aggregate); the norm-based two need a dense codec. Every member must agree."""
    min_peers: int = 1
    """Commit rule: a round commits only if at least this many peers contributed, else it is aborted."""
    island_slices: int = 0
    """Islands (node.island): the outer update is cut into this many equal slices, and the k nodes of an island
    each carry k-th of them across the slow network (2..4096, at least the largest island; 8 or 16 suit most
    layouts). 0: this run has no islands, and a node that names one is refused. Every node agrees (the
    exchange cuts its chunks at the slice boundaries)."""
    max_rounds: int = 0
    """Stop after this many outer rounds (0: train until told to leave)."""
    exchange_group_size: int = 0
    """Bounded groups for the exchange. 0 (default): every member of a round exchanges with every other (the
    flat all-to-all: N - 1 peers each, the fewest bytes). G >= 2: a round of more than G members goes through
    rows of at most G members and the columns across them, a column of more than G in rows and columns itself
    (protocol/exchange/grouped.py): each member talks to about 2(G - 1) others per level (log_G N - 1 levels)
    and sends about 3V bytes instead of 2V for a V-byte update; its mean is alike on every
    member, within one more coding of the codec than the flat one. A member lost inside a round is dropped by its
    row and column, which go on (a lost carrier's slice is then its other rows' mean) while the group has at most
    G^2 members; above, the round falls back to the flat exchange among all (which drops it). Dense codecs, no
    robust aggregator, no islands, every member dialable (else flat). For swarms of several dozen nodes and more;
    8-32 suit most (G^2 at least the swarm's size keeps a loss inside the rows). Every node agrees."""

    def __post_init__(self) -> None:
        _positive(self, "inner_steps", "batch_size", "seq_len", "data_slots", "min_peers")
        if self.exchange_group_size == 1 or not 0 <= self.exchange_group_size <= 4096:
            raise ConfigError(
                f"run.exchange_group_size: expected 0 (flat) or 2..4096, got {self.exchange_group_size!r}"
            )
        if self.island_slices == 1 or not 0 <= self.island_slices <= 4096:
            raise ConfigError(
                f"run.island_slices: expected 0 (no islands) or 2..4096, got {self.island_slices!r}"
            )
        _non_negative(
            self, "inner_lr", "inner_weight_decay", "warmup_steps", "grad_clip", "outer_lr", "max_rounds"
        )
        from farloco.node.schedule import LR_SCHEDULES, OUTER_LR_SCHEDULES, total_inner_steps

        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"run.lr_schedule: expected one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.outer_lr_schedule not in OUTER_LR_SCHEDULES:
            raise ConfigError(
                f"run.outer_lr_schedule: expected one of {OUTER_LR_SCHEDULES}, got {self.outer_lr_schedule!r}"
            )
        if self.outer_lr_schedule != "constant" and total_inner_steps(self) < self.inner_steps:
            raise ConfigError(
                f"run.outer_lr_schedule = {self.outer_lr_schedule!r} decays over a total: set "
                "run.total_inner_steps (at least one round's inner_steps), or run.max_rounds"
            )
        if isinstance(self.min_lr_ratio, bool) or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"run.min_lr_ratio: expected 0..1, got {self.min_lr_ratio!r}")
        if isinstance(self.wsd_decay_fraction, bool) or not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise ConfigError(f"run.wsd_decay_fraction: expected 0 < f <= 1, got {self.wsd_decay_fraction!r}")
        _non_negative(self, "total_inner_steps")
        if self.lr_schedule != "constant":
            total = total_inner_steps(self)
            if total == 0:
                raise ConfigError(
                    f"run.lr_schedule = {self.lr_schedule!r} decays over a total: set run.total_inner_steps, "
                    "or run.max_rounds (the total is then max_rounds x inner_steps)"
                )
            if total <= self.warmup_steps:
                raise ConfigError(
                    f"run.lr_schedule = {self.lr_schedule!r}: the total ({total} inner steps) must exceed "
                    f"run.warmup_steps ({self.warmup_steps})"
                )
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(
                f"run.inner_optimizer: expected one of {INNER_OPTIMIZERS}, got {self.inner_optimizer!r}"
            )
        if self.aggregator not in AGGREGATOR_NAMES:
            raise ConfigError(
                f"run.aggregator: expected one of {list(AGGREGATOR_NAMES)}, got {self.aggregator!r}"
            )
        if self.outer_update not in OUTER_UPDATES:
            raise ConfigError(f"run.outer_update: expected one of {OUTER_UPDATES}, got {self.outer_update!r}")
        if self.late_work not in LATE_WORK:
            raise ConfigError(f"run.late_work: expected one of {LATE_WORK}, got {self.late_work!r}")
        if self.outer_update != "sync" and self.strategy not in ("diloco", "sparseloco"):
            raise ConfigError(
                f"run.outer_update={self.outer_update!r}: expected strategy diloco or sparseloco (streaming-diloco "
                f"overlaps with strategy_options.tau), got strategy {self.strategy!r}"
            )
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"run.outer_momentum: expected a number in [0, 1), got {self.outer_momentum!r}")
        model_kind(self.model)
        if not self.name or any(c in self.name for c in "/ \t\n"):
            raise ConfigError(f"run.name: expected a non-empty name without '/' or spaces, got {self.name!r}")


@dataclass(frozen=True)
class NodeConfig:
    """How this node trains locally."""

    num_ranks: int = 1
    """Trainer ranks on this node (one per GPU; on CPU each takes `threads_per_rank` cores)."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available). The backend follows: NCCL on cuda, gloo on cpu."""
    threads_per_rank: int = 1
    """torch intra-op threads per trainer rank on CPU."""
    agent_threads: int = 0
    """Threads for the agent's passes over the model's vectors each round (theta's digest, int8's encode and
    decode, the contribution, the outer step), each thread on its own contiguous range (torch's intra-op
    threads cannot split a sha256 or the codec's C kernels); on cpu also the agent's torch threads. 0: the cores
    the ranks leave: the cores less num_ranks x threads_per_rank, or less one per rank on cuda; at least 1."""
    max_restarts: int = 3
    """How many times the elastic launcher restarts crashed trainer ranks before the node gives up."""
    eval_batches: int = 4
    """Held-out batches evaluated on theta_outer after every round (0 disables)."""
    tp: int = 1
    """Tensor-parallel degree inside the node: the ranks form a 2-D mesh (num_ranks/tp data-parallel shards x tp),
    attention and MLP split Megatron-style (q/k/v and w1/w3 column-wise, wo and w2 row-wise) with sequence
    parallelism for the blocks' norms, FSDP2 over the data-parallel dimension. Must divide num_ranks, and the
    model's n_heads, n_kv_heads and ffn_dim, and run.seq_len. A node-local choice: nodes of one swarm may
    differ."""
    precision: str = "auto"
    """Compute precision of the ranks: 'fp32', 'bf16' (FSDP2 MixedPrecisionPolicy: bf16 parameters in forward and
    backward, fp32 gradient reduction, fp32 master weights, which the hand-off reads) or 'auto' (bf16 on cuda,
    fp32 on cpu)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them (less memory, about
    a third more compute)."""
    micro_batches: int = 1
    """Gradient accumulation: each inner step runs the rank's batch in this many micro-batches (must divide the
    per-rank batch, run.batch_size / (num_ranks / tp))."""
    compile: bool = False
    """torch.compile each transformer block (the first steps compile; step-time metrics leave them out)."""
    loggers: list[str] = field(default_factory=list)
    """Experiment trackers that also get the per-round figures of logs/agent.jsonl: "tensorboard" (under
    <run-dir>/logs/tensorboard; pip install 'farloco[tensorboard]') and/or "wandb" (one wandb run per node, in
    group = run.name, named node.name, with an id stable across the node's restarts, so a restarted node
    resumes its own run; project = run.name unless WANDB_PROJECT says otherwise; its own environment applies,
    e.g. WANDB_MODE=offline; pip install 'farloco[wandb]')."""
    log_every_steps: int = 0
    """Per-inner-step figures: every this many inner steps (of the swarm's count), the ranks' mean training loss,
    tokens/s and MFU over those steps reach logs/agent.jsonl (a 'steps' event) and the experiment loggers
    (step/loss, step/tokens_per_second, step/mfu at x = the inner step). 0: per round only. Intervals shorter
    than the agent's 0.2 s look at the ranks are sampled, not all logged."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one rank's device at node.precision, for MFU (0: the known GPUs' datasheet figure,
    H100, H200, A100, B200; none on CPU or another GPU, and then no MFU)."""
    name: str = ""
    """This node's name in the experiment trackers (default: the first 16 characters of its peer id, which its
    identity.key keeps across restarts)."""
    data_slot: int = -1
    """The data slot (run.data_slots) this node asks for when it has no checkpoint of the run to resume; kept
    while no other live member holds it, as a resumed node keeps its checkpoint's. -1: the lowest free one.
    For a deployment that wants node i on slice i, and for runs that must train the same bits every time."""
    partial_contributions: bool = True
    """A straggler's way out (run.outer_update = sync, with the members' links on): when every other member
    of the round is ready and waits for this node, its ranks end their inner steps after the one they are in
    and the node joins the round with what it trained, weighted in the mean by its share of the round's steps
    (steps run / inner_steps). Off: the others wait for all of its steps (up to timeouts.match_timeout)."""
    partial_min_fraction: float = 0.25
    """The smallest share of the round's inner steps a partial contribution carries: a node further behind
    keeps training, and the others wait for it (up to timeouts.match_timeout) or leave it out of the round."""
    island: str = ""
    """The island this node belongs to: nodes that share a fast fabric (a Slurm allocation, a rack, a placement
    group) and name the same island reduce their updates among themselves over torch.distributed (gloo) first,
    then each carries its slice of the island's mean across the slow network (node/daemon/island.py). Empty: no
    island (an island of one is exactly that). Needs run.island_slices and island_endpoint."""
    island_endpoint: str = ""
    """host:port of the island's rendezvous (torch's c10d elastic rendezvous: the node whose address this is
    hosts its store; under Slurm the first node of the island's allocation, under Kubernetes pod 0 of the
    island's StatefulSet). Every node of the island names the same one."""
    island_size: int = 0
    """The most nodes the island holds (its rendezvous completes at once when all are in). 0: run.island_slices."""
    island_backend: str = "gloo"
    """The island's collectives: 'gloo' (host memory, any node) or 'nccl' (GPU nodes: the island's reduce-scatter
    and all-gathers go through 64 MiB staging buffers on the node's first GPU; not yet measured on GPUs)."""

    def __post_init__(self) -> None:
        _positive(self, "num_ranks", "threads_per_rank", "tp", "micro_batches")
        if not 0.0 < self.partial_min_fraction <= 1.0:
            raise ConfigError(
                f"node.partial_min_fraction: expected a number in (0, 1], got {self.partial_min_fraction!r}"
            )
        _non_negative(self, "max_restarts", "eval_batches", "island_size", "agent_threads")
        if not isinstance(self.data_slot, int) or isinstance(self.data_slot, bool) or self.data_slot < -1:
            raise ConfigError(f"node.data_slot: expected -1 (any) or a slot >= 0, got {self.data_slot!r}")
        if self.island_backend not in ("gloo", "nccl"):
            raise ConfigError(f"node.island_backend: expected 'gloo' or 'nccl', got {self.island_backend!r}")
        if self.island_backend == "nccl" and self.device == "cpu":
            raise ConfigError("node.island_backend='nccl': expected a GPU node, got node.device='cpu'")
        if self.island and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.island):
            raise ConfigError(
                f"node.island: expected 1-64 letters, digits, '_', '.' or '-', got {self.island!r}"
            )
        if self.island and not re.fullmatch(r"\[?[A-Za-z0-9_.:-]+\]?:[0-9]{1,5}", self.island_endpoint):
            raise ConfigError(
                f"node.island_endpoint: expected host:port of the island's rendezvous (node.island="
                f"{self.island!r}), got {self.island_endpoint!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"node.device: expected one of 'auto', 'cpu', 'cuda', got {self.device!r}")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown or len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"node.loggers: expected distinct names of {LOGGERS}, got {self.loggers!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"node.precision: expected one of {PRECISIONS}, got {self.precision!r}")
        _non_negative(self, "log_every_steps", "peak_tflops")
        if self.num_ranks % self.tp:
            raise ConfigError(
                f"node.tp={self.tp}: expected a divisor of node.num_ranks={self.num_ranks} (the ranks form a "
                f"{self.num_ranks}/tp x tp mesh)"
            )


@dataclass(frozen=True)
class NetworkConfig:
    """Where this node listens and whom it contacts first."""

    host: str = "127.0.0.1"
    """Address every listening part binds to (gRPC, DHT). Use 0.0.0.0 or a LAN address for real swarms."""
    announce_host: str = ""
    """Address or DNS name other peers should dial (default: `host`, or, where `host` is 0.0.0.0 / ::, an address
    of this node's that is not loopback); set it behind port forwarding or in containers."""
    grpc_port: int = 0
    """gRPC port (0: any free port)."""
    dht_port: int = 0
    """hivemind DHT port (0: any free port)."""
    data_plane: str = "tcp"
    """How the exchange's bulk streams and the round's small messages travel: "tcp" (a TCP listener beside gRPC,
    same authentication, checks and encryption, ~2x less CPU per byte than Python gRPC; the small messages on a
    kept-open link per peer) or "grpc"."""
    data_port: int = 0
    """Port of the TCP data plane (0: any free port; peers learn it over gRPC)."""
    streams_per_peer: int = 1
    """Streams (TCP connections) this node opens to each other member for its share of an exchange, 1..16: the
    chunks of a part travel side by side, each stream with its own TCP window. One stream carries at most its
    window per round trip (4-8 MiB by default: 320-640 Mbit/s at 100 ms); on links with more bandwidth x delay,
    e.g. 1 Gbit/s x 100 ms (12.5 MB in flight), use 2-4. Each node picks its own; dense codecs only."""
    codec_threads: int = 0
    """Threads for the exchange's codec work on chunks (encoding, decoding, an owner's sums), 0..64; 0 (default)
    does it on the agent's event loop. Each thread codes a chunk of its own (the int8 kernels release the GIL),
    for a many-core host whose exchange at 1B parameters is bound by one core's codec work; on a node with one
    core to spare it only adds a hand-off per chunk (measured 0.6-1.06x on 2 cores, BENCHMARKS.md)."""
    socket_buffer_bytes: int = 0
    """Socket buffers of the data plane's connections: 0 (default) keeps the kernel's receive autotuning and sets
    the send buffer to the kernel's ceiling (2 x net.core.wmem_max) where autotuning would stop lower; N > 0
    sets both to N bytes (capped by net.core.wmem_max/rmem_max: a warning names the sysctl); -1 leaves both to
    the kernel."""
    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of DHT peers to join through (e.g. from `farloco bootstrap`)."""
    dht_niceness: int = 0
    """How much lower than the agent the DHT child and its libp2p daemon are scheduled (`nice`), 0..19; 0
    (default) schedules them like the agent. The DHT is the round's fallback (its messages ride the links), so
    with many agents on few busy cores a freeze waits less for DHT work at 10 (8 peers on 2 cores: p50 15-16 ms
    against 24), but the DHT falls behind when the cores are saturated (16 peers: p99 1.0 s against 0.18 s), and
    beside CPU training ranks its heartbeats would too (BENCHMARKS.md, "Links")."""
    control_host: str = "127.0.0.1"
    """Address of the local control/metrics HTTP endpoint (keep it on loopback)."""
    control_port: int = 0
    """Port of the control/metrics endpoint (0: any free port; it is written to the run directory)."""
    reachability: str = "public"
    """Whether other nodes can open connections to this node: "public" (default; its DHT, gRPC and data ports
    are reachable at `announce_host` or `host`) or "private": behind NAT or a firewall that lets nothing in (a
    home router, a cloud VPC's NAT gateway, an HPC compute node). A private node opens every connection itself and
    is a full member: it trains and contributes to every round, sending its share to the members that own the
    parts and taking the means back on the connections it opened; it owns no part, never leads a round's
    matchmaking, never serves state, and its DHT node runs in client mode. Needs a dense codec and at least one
    public member in the swarm."""
    encryption: str = "auto"
    """Encryption of every connection between nodes (gRPC calls, exchange streams, state sync): TLS 1.3 with a
    certificate both ways. "auto" (default): on when `host` is not a loopback address, off on 127.0.0.1 / ::1
    (the demo, the tests); "tls": always; "off": never (beyond loopback only with auth.insecure_no_secret).
    The certificates are tls_cert/tls_key/tls_ca when given, else made at start from a CA derived from the run
    secret, so every holder of the secret trusts every other and nobody else (docs/security.md)."""
    tls_cert: str = ""
    """PEM certificate (chain) this node presents for mutual TLS (`farloco certs` makes a CA and one per node).
    Set tls_cert, tls_key and tls_ca together, or none of them (then the run secret's CA, see `encryption`)."""
    tls_key: str = ""
    """PEM private key of `tls_cert` (unencrypted)."""
    tls_ca: str = ""
    """PEM certificate(s) of the CA that signs every peer's certificate; peers presenting any other are refused."""
    tls_server_name: str = ""
    """Name checked in a peer's server certificate instead of the address dialled (e.g. one DNS name the CA puts
    in every peer's certificate). Empty: the dialled host must be in the certificate's subjectAltName."""

    def __post_init__(self) -> None:
        for key in ("grpc_port", "dht_port", "control_port", "data_port"):
            value = getattr(self, key)
            if not 0 <= value <= 65535:
                raise ConfigError(f"network.{key}: expected a port in 0..65535, got {value!r}")
        if not 1 <= self.streams_per_peer <= 16:
            raise ConfigError(f"network.streams_per_peer: expected 1..16, got {self.streams_per_peer!r}")
        if not 0 <= self.codec_threads <= 64:
            raise ConfigError(f"network.codec_threads: expected 0..64, got {self.codec_threads!r}")
        if not 0 <= self.dht_niceness <= 19:
            raise ConfigError(f"network.dht_niceness: expected 0..19, got {self.dht_niceness!r}")
        if self.socket_buffer_bytes < -1:
            raise ConfigError(
                f"network.socket_buffer_bytes: expected -1, 0 or a size in bytes, got {self.socket_buffer_bytes!r}"
            )
        if self.data_plane not in ("tcp", "grpc"):
            raise ConfigError(f"network.data_plane: expected 'tcp' or 'grpc', got {self.data_plane!r}")
        if self.reachability not in ("public", "private"):
            raise ConfigError(
                f"network.reachability: expected 'public' or 'private', got {self.reachability!r}"
            )
        if self.encryption not in ENCRYPTION_MODES:
            raise ConfigError(
                f"network.encryption: expected one of {', '.join(ENCRYPTION_MODES)}, got {self.encryption!r}"
            )
        if self.encryption == "off" and self.tls_cert:
            raise ConfigError("network.encryption = 'off' contradicts network.tls_cert: drop one of them")
        _check_tls(self)


TLS_KEYS = ("tls_cert", "tls_key", "tls_ca")
ENCRYPTION_MODES = ("auto", "tls", "off")


def _check_tls(network: NetworkConfig) -> None:
    """All three TLS paths or none; each an existing file that parses as what it should be; key matches cert."""
    given = [key for key in TLS_KEYS if getattr(network, key)]
    if not given:
        if network.tls_server_name:
            raise ConfigError(
                "network.tls_server_name: only meaningful with tls_cert, tls_key and tls_ca set"
            )
        return
    if len(given) != len(TLS_KEYS):
        missing = [f"network.{key}" for key in TLS_KEYS if key not in given]
        raise ConfigError(
            f"mutual TLS needs network.tls_cert, tls_key and tls_ca together: got {given}, missing {missing}"
        )
    # Imported here: only nodes that use TLS pay for it (cryptography comes with hivemind).
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    data = {}
    for key in TLS_KEYS:
        path = Path(getattr(network, key))
        try:
            data[key] = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"network.{key}: expected a readable PEM file, got {str(path)!r}: {exc}"
            ) from exc
    try:
        certs = x509.load_pem_x509_certificates(data["tls_cert"])
        x509.load_pem_x509_certificates(data["tls_ca"])
    except ValueError as exc:
        raise ConfigError(
            f"network.tls_cert / tls_ca: expected PEM certificates in {network.tls_cert!r} and "
            f"{network.tls_ca!r}: {exc}"
        ) from exc
    try:
        private_key = serialization.load_pem_private_key(data["tls_key"], password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"network.tls_key: expected an unencrypted PEM private key in {network.tls_key!r}: {exc}"
        ) from exc
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if private_key.public_key().public_bytes(der, raw) != certs[0].public_key().public_bytes(der, raw):
        raise ConfigError(
            f"network.tls_key: the key in {network.tls_key!r} does not belong to the first certificate of "
            f"{network.tls_cert!r}"
        )


def load_tls(network: NetworkConfig) -> Any:
    """The `farloco.protocol.transport.TlsConfig` of `network` (checked at config load), or None without TLS."""
    if not network.tls_cert:
        return None
    from farloco.protocol.transport import TlsConfig

    return TlsConfig(
        root_certificates=Path(network.tls_ca).read_bytes(),
        certificate_chain=Path(network.tls_cert).read_bytes(),
        private_key=Path(network.tls_key).read_bytes(),
        server_name=network.tls_server_name or None,
    )


def transport_tls(config: Config, secret: bytes, run_id: str, name: str) -> Any:
    """The TLS material every connection of this node uses (`farloco.protocol.transport.TlsConfig`), or None
    for plaintext: the operator's certificates when configured, else, where `network.encryption` asks for TLS
    (by default: beyond loopback), a certificate of the CA derived from the run secret, issued now for a fresh
    key named `name`. ConfigError for plaintext beyond loopback without auth.insecure_no_secret."""
    network = config.network
    if network.tls_cert:
        return load_tls(network)
    loopback = is_loopback(network.host)
    if network.encryption == "off" or (network.encryption == "auto" and loopback):
        if not loopback and not config.auth.insecure_no_secret:
            raise ConfigError(
                f"network.encryption = 'off' with network.host = {network.host!r}: every update and mean would "
                f"cross the network in clear text. Leave it 'auto' (TLS beyond loopback), or, on a closed test "
                f"network, set auth.insecure_no_secret = true"
            )
        return None
    from farloco.protocol.transport import run_credentials

    return run_credentials(secret, run_id, name)


@dataclass(frozen=True)
class TimeoutConfig:
    """Time limits of the round protocol, in seconds."""

    heartbeat_interval: float = 0.0
    """How often the member record is refreshed on the DHT (straight to the members key's replicas, which a full
    store finds again once per `member_ttl`). 0: `member_ttl / 4`, four chances to refresh before the record
    expires, whatever the ttl. The member table is read every `member_ttl / 4` (at most once a heartbeat): a read
    carries every member's record. The round itself never waits for either (its records travel over the
    members' links); what a faster beat buys is a fresher status view (inner step, loss), at a DHT store per
    beat on each of the key's replicas."""
    member_ttl: float = 8.0
    """A member whose record is older than this is considered gone."""
    match_timeout: float = 30.0
    """How long the round leader waits for live members still training the round before freezing the group
    without them (dead members drop out sooner, when their record expires after `member_ttl`)."""
    match_timeout_min: float = 2.0
    """Lower bound of the adaptive straggler wait: each round the leader waits for live members not ready yet
    about twice the 90th percentile of recent rounds' ready spreads, within [match_timeout_min, match_timeout]
    (protocol/matchmaking/rules.py `StragglerWait`); a member dropped for being late raises the wait at once. A round
    never waits less than `leader_timeout` (what keeps the leader election in agreement)."""
    leader_timeout: float = 5.0
    """How long followers wait for a group beyond `match_timeout` before the next peer leads."""
    exchange_timeout: float = 60.0
    """Deadline of one outer exchange."""
    sync_timeout: float = 300.0
    """Deadline of a state download when joining."""
    dht_retry: float = 60.0
    """How long a DHT store the node needs (its member record when joining, its data-slot claim, a round's
    ready or group record, its departure) is retried with back-off before the node gives up on it. Each failed
    try is logged with what it waits for; only a refusal that outlasts this ends the node, with a message naming
    the DHT key. Heartbeats are not retried: the next beat is their retry."""
    isolation_timeout: float = 120.0
    """How long a node whose peers vanished without leaving (a crash or a network partition: it cannot tell)
    waits for its swarm, committing no round and dialling the initial peers, before the policy decides: with
    `run.min_peers` > 1 it exits with an error, with `min_peers` = 1 it goes on alone (protocol/isolation.py)."""
    leave_timeout: float = 30.0
    """Upper bound on leaving (`farloco leave`, `leave --now`, SIGTERM, Ctrl+C), from any state: a round in
    flight is finished only if it ends within about half of this, then the departure is stored, the ranks are
    stopped and the node exits, each step bounded."""

    def __post_init__(self) -> None:
        _positive(self, *[f.name for f in dataclasses.fields(self) if f.name != "heartbeat_interval"])
        _non_negative(self, "heartbeat_interval")
        if self.heartbeat_interval >= self.member_ttl:
            raise ConfigError(
                f"timeouts.heartbeat_interval must be shorter than timeouts.member_ttl ({self.member_ttl}), or a "
                f"live member's record expires between beats: got {self.heartbeat_interval}"
            )
        if self.match_timeout_min > self.match_timeout:
            raise ConfigError(
                f"timeouts.match_timeout_min must be <= timeouts.match_timeout: expected at most "
                f"{self.match_timeout}, got {self.match_timeout_min}"
            )

    @property
    def heartbeat(self) -> float:
        """Seconds between two stores of the member record: `heartbeat_interval`, or `member_ttl / 4` for 0."""
        return self.heartbeat_interval or self.member_ttl / 4


@dataclass(frozen=True)
class AuthConfig:
    """How peers prove they belong to the run."""

    secret_file: str = ""
    """File holding the run secret (HMAC key of every RPC and DHT record; at least 16 bytes, e.g. 32 random bytes
    in hex from `farloco secret`), the same on every node. Empty: the FARLOCO_RUN_SECRET environment variable.
    Neither: a node listening on loopback only uses a secret derived from the run hash (it keeps other runs
    out, not attackers); a node listening on any other address refuses to start, unless
    `insecure_no_secret` says so."""
    insecure_no_secret: bool = False
    """Let a node that listens beyond loopback run without a secret (the one derived from the public run hash):
    anyone who can read a config of the run can then join it and push updates. For closed test networks only."""


# farloco.optim.AGGREGATORS (this module stays torch-free; a test keeps the two equal)
AGGREGATOR_NAMES = ("mean", "trimmed_mean", "median", "norm_clip", "centered_clip")
MIN_SECRET_BYTES = 16
SECRET_ENV = "FARLOCO_RUN_SECRET"


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a listener on this machine (a name other than localhost: no)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def run_secret(config: Config, run_hash_hex: str, environ: Mapping[str, str] | None = None) -> bytes:
    """The run secret this node uses (see AuthConfig): from auth.secret_file, else FARLOCO_RUN_SECRET, else
    derived from the run hash where that is allowed. ConfigError saying what to do where it is not."""
    environ = os.environ if environ is None else environ
    path = config.auth.secret_file
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"auth.secret_file: cannot read {path!r}: {exc.strerror or exc}") from None
        where = f"auth.secret_file {path!r}"
    elif environ.get(SECRET_ENV):
        secret, where = environ[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        host = config.network.host
        if not is_loopback(host) and not config.auth.insecure_no_secret:
            raise ConfigError(
                f"network.host = {host!r} listens beyond this machine, but the run has no secret: anyone who can "
                f"read a config of the run could join it and push updates. Make one and give it to every node: "
                f'`farloco secret --out run-secret` then auth.secret_file = "run-secret" (or the '
                f"{SECRET_ENV} environment variable); or listen on 127.0.0.1; or, on a closed test network, "
                f"set auth.insecure_no_secret = true"
            )
        return hashlib.sha256(b"farloco-run-secret:" + run_hash_hex.encode()).digest()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where}: expected a secret of at least {MIN_SECRET_BYTES} bytes (e.g. `farloco secret`), got "
            f"{len(secret)}"
        )
    return secret


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of the outer state."""

    every_rounds: int = 5
    """Write a checkpoint every this many committed rounds, and at run.max_rounds (0 disables both)."""
    keep: int = 3
    """Keep this many most recent checkpoints."""

    def __post_init__(self) -> None:
        _non_negative(self, "every_rounds")
        _positive(self, "keep")


@dataclass(frozen=True)
class Config:
    """The whole configuration of one node."""

    run: RunConfig = field(default_factory=RunConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        node, run = self.node, self.run
        dp = node.num_ranks // node.tp
        per_rank = run.batch_size // dp
        if per_rank < 1:
            raise ConfigError(
                f"run.batch_size={run.batch_size}: expected at least one sequence per data-parallel rank "
                f"(node.num_ranks={node.num_ranks} / node.tp={node.tp} = {dp})"
            )
        if per_rank % node.micro_batches:
            raise ConfigError(
                f"node.micro_batches={node.micro_batches}: expected a divisor of the per-rank batch "
                f"run.batch_size / (num_ranks / tp) = {run.batch_size} / {dp} = {per_rank}"
            )
        if node.island:
            if not run.island_slices:
                raise ConfigError(
                    f"node.island={node.island!r}: this run has no islands (run.island_slices = 0); set "
                    "run.island_slices (e.g. 16) on every node of the run"
                )
            if run.codec in SPARSE_CODECS:
                raise ConfigError(
                    f"node.island={node.island!r}: expected a dense codec (fp32, fp16, bf16, int8, int4), got "
                    f"run.codec={run.codec!r} (sparse payloads travel whole, not in slices)"
                )
            if node.island_size > run.island_slices:
                raise ConfigError(
                    f"node.island_size={node.island_size}: expected at most run.island_slices="
                    f"{run.island_slices} (each node of an island carries at least one slice)"
                )
        if node.data_slot >= run.data_slots:
            raise ConfigError(
                f"node.data_slot={node.data_slot}: expected -1 (any) or a slot below run.data_slots="
                f"{run.data_slots}"
            )
        if run.seq_len % node.tp:
            raise ConfigError(
                f"node.tp={node.tp}: expected a divisor of run.seq_len={run.seq_len} (sequence parallelism "
                f"splits each sequence over the tp ranks)"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _positive(obj: object, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value <= 0:
            raise ConfigError(f"{_section_of(obj)}.{key}: expected a positive number, got {value!r}")


def _non_negative(obj: object, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value < 0:
            raise ConfigError(f"{_section_of(obj)}.{key}: expected a number >= 0, got {value!r}")


def _section_of(obj: object) -> str:
    return next((name for name, cls in SECTIONS.items() if isinstance(obj, cls)), type(obj).__name__)


SECTIONS: dict[str, type[Any]] = {
    "run": RunConfig,
    "node": NodeConfig,
    "network": NetworkConfig,
    "timeouts": TimeoutConfig,
    "auth": AuthConfig,
    "checkpoint": CheckpointConfig,
}

T = TypeVar("T")


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check (and gently convert: int -> float) one value against its field's annotation."""
    origin = typing.get_origin(annotation)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        for key, item in value.items():
            if isinstance(item, (dict, list)) or item is None:
                raise ConfigError(f"{path}.{key}: expected a number, string or boolean, got {item!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        return value
    raise ConfigError(f"{path}: unsupported annotation {annotation!r}")


def _build_section(name: str, cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]}: expected one of {sorted(known)}")
    kwargs = {key: _coerce(f"{name}.{key}", value, hints[key]) for key, value in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - dataclass signature mismatch is a programming error
        raise ConfigError(f"[{name}]: {exc}") from exc


def _literal(raw: str) -> Any:
    """A value given as text (--set, the environment): a TOML literal, else the text itself as a string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `section.key=value`; the value is read as a TOML literal, falling back to a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. run.inner_steps=50")
    return parts[0], parts[1], _literal(raw)


ENV_PREFIX = "FARLOCO__"
"""`FARLOCO__SECTION__KEY=value` sets section.key (names in any case; the value read as --set reads it)."""


def environment_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, str, Any]]:
    """(variable, section, key, value) for each FARLOCO__SECTION__KEY variable of `environ`, by name. A
    variable of that prefix naming no section.key of the config is a ConfigError naming it."""
    found = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(
                f"environment variable {name}: expected {ENV_PREFIX}SECTION__KEY, e.g. {ENV_PREFIX}RUN__INNER_STEPS"
            )
        section, key = parts
        if section not in SECTIONS:
            raise ConfigError(
                f"environment variable {name}: unknown section {section!r}, expected one of {sorted(SECTIONS)}"
            )
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        if key not in known:
            raise ConfigError(
                f"environment variable {name}: unknown key {section}.{key}: expected one of {sorted(known)}"
            )
        found.append((name, section, key, _literal(environ[name])))
    return found


def build_config(
    data: dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Validate a parsed TOML document, apply the FARLOCO__SECTION__KEY variables of `environ` (when given),
    then the `section.key=value` overrides, and build the frozen tree: file < environment < --set."""
    merged: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]: expected one of {sorted(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}]: expected a table, got {values!r}")
        merged[section] = dict(values)
    for _name, section, key, value in environment_overrides(environ or {}):
        merged.setdefault(section, {})[key] = value
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(
                f"--set {text!r}: unknown section {section!r}, expected one of {sorted(SECTIONS)}"
            )
        merged.setdefault(section, {})[key] = value
    run = merged.get("run", {})
    if run.get("init_from") and "model" not in run:  # the architecture is the weights' own config.json
        run["model"] = run["init_from"]
    return Config(**{name: _build_section(name, cls, merged.get(name, {})) for name, cls in SECTIONS.items()})


def load_config(
    path: Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load a TOML file (or the defaults when `path` is None) and apply the environment's FARLOCO__SECTION__KEY
    variables (when `environ` is given: the CLI passes os.environ) and the overrides, in that order."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    return build_config(data, overrides, environ)


def run_section(config: Config | RunConfig) -> dict[str, SCALAR]:
    """The [run] section as a flat dict (nested option tables become `strategy_options.beta` etc.)."""
    run = config.run if isinstance(config, Config) else config
    flat: dict[str, SCALAR] = {}
    for key, value in dataclasses.asdict(run).items():
        if isinstance(value, dict):
            for sub, item in sorted(value.items()):
                flat[f"{key}.{sub}"] = item
        else:
            flat[key] = value
    # A model that is not a preset: its architecture (a digest of its config.json, or of its module's
    # structure and source), so nodes that name the same file or factory but build different models differ.
    kind = model_kind(run.model)
    if kind != "builtin":
        from farloco.node.architecture import architecture  # imports torch only for an entry point

        flat["model_architecture"] = architecture(run.model)
    # Paths differ from machine to machine: what they hold is what must agree (the architecture digest above,
    # the weights' digest here). No init_from: the key is left out, and a run's hash is what it was without it.
    if kind == "hf":
        flat["model"] = "hf-config"
    del flat["init_from"]
    if run.init_from:
        from farloco.node.weights import weights_digest

        flat["init_from"] = weights_digest(run.init_from)
    return flat


# The built-in decoder's presets (node/training/model.py MODEL_PRESETS; tests/unit/test_usermodel.py checks they
# agree): named here so that reading a config never imports torch.
MODEL_PRESET_NAMES = ("tiny", "small", "125m", "350m", "1b")


def model_kind(run_model: str) -> str:
    """run.model's form: 'builtin' (a preset), 'hf' (the path of a Hugging Face config.json or of its folder)
    or 'entry' (package.module:factory). ConfigError for anything else."""
    if run_model in MODEL_PRESET_NAMES:
        return "builtin"
    if run_model.endswith(".json") or "/" in run_model or Path(run_model).is_dir():
        return "hf"
    module, colon, attr = run_model.partition(":")
    if colon and module and attr.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return "entry"
    raise ConfigError(
        f"run.model: expected a preset ({', '.join(MODEL_PRESET_NAMES)}), the path of a Hugging Face "
        f"config.json, or an entry point package.module:factory; got {run_model!r}"
    )


def run_hash(config: Config | RunConfig) -> str:
    """sha256 over the canonical JSON of the [run] section: equal on every peer of one run."""
    canonical = json.dumps(run_section(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def diff_run(mine: dict[str, SCALAR], theirs: dict[str, SCALAR]) -> list[str]:
    """Human-readable list of [run] keys whose values differ: 'run.inner_steps: 20 here, 50 there'."""
    keys = sorted(set(mine) | set(theirs))
    missing = "<unset>"
    return [
        f"run.{key}: {mine.get(key, missing)!r} here, {theirs.get(key, missing)!r} there"
        for key in keys
        if mine.get(key, missing) != theirs.get(key, missing)
    ]


def to_toml(config: Config) -> str:
    """Render a config as TOML (written next to the checkpoints as the resolved config)."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot render {value!r} as TOML")


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # ~1M parameters, rounds of a few seconds on one CPU core: try farloco on a laptop.
    "tiny": {"run": {"model": "tiny", "inner_steps": 20, "batch_size": 8, "seq_len": 128}},
    # A ~10M model for a workstation or a small GPU.
    "small": {
        "run": {"model": "small", "inner_steps": 100, "batch_size": 16, "seq_len": 256, "inner_lr": 1e-3}
    },
    # A real run: 1B parameters, H=500 as in the DiLoCo paper, int8 outer updates, one node per 8-GPU host.
    "1b": {
        "run": {
            "model": "1b",
            "inner_steps": 500,
            "batch_size": 256,
            "seq_len": 2048,
            "inner_lr": 4e-4,
            "warmup_steps": 1000,
            "codec": "int8",
            "min_peers": 2,
        },
        "node": {"num_ranks": 8, "device": "cuda"},
        "network": {"host": "0.0.0.0"},
        "timeouts": {"match_timeout": 60.0, "leader_timeout": 30.0, "exchange_timeout": 1800.0},
    },
}


def example_config(preset: str = "tiny", overrides: list[str] | tuple[str, ...] = ()) -> str:
    """A documented TOML config: every field with its docstring as a comment, values from the preset, then
    `overrides` (section.key=value, as --set takes them)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    config = build_config(PRESETS[preset], overrides)
    docs = _field_docs()
    lines = [f"# farloco config, preset {preset!r}. Override any key with --set section.key=value.", ""]
    for section, values in config.to_dict().items():
        cls = SECTIONS[section]
        lines.append(f"# {(cls.__doc__ or '').strip()}")
        lines.append(f"[{section}]")
        for key, value in values.items():
            for doc_line in docs.get((cls.__name__, key), "").splitlines():
                lines.append(f"# {doc_line.strip()}")
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _field_docs() -> dict[tuple[str, str], str]:
    """Field docstrings (the string literal under each field) read from this module's source."""
    import ast
    import inspect
    import itertools
    import sys

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for current, following in itertools.pairwise(body):
            if (
                isinstance(current, ast.AnnAssign)
                and isinstance(current.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[(node.name, current.target.id)] = following.value.value
    return docs


def _schema_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation in simple:
        return {"type": simple[annotation]}
    if origin is list:
        (item,) = typing.get_args(annotation)
        return {"type": "array", "items": _schema_type(item)}
    if origin is dict:
        return {"type": "object", "additionalProperties": {"type": ["number", "string", "boolean"]}}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_type(arg) for arg in typing.get_args(annotation)]}
    if annotation is type(None):
        return {"type": "null"}
    raise ConfigError(f"no JSON Schema type for {annotation!r}")


def config_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the config file: every section and key with its type, default and
    meaning. What it cannot say (ranges, one key against another) the loader checks."""
    docs = _field_docs()
    defaults = Config()
    properties: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        keys: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            entry = _schema_type(hints[f.name])
            entry["default"] = getattr(getattr(defaults, name), f.name)
            doc = docs.get((cls.__name__, f.name))
            if doc:
                entry["description"] = " ".join(doc.split())
            keys[f.name] = entry
        properties[name] = {
            "type": "object",
            "description": " ".join((cls.__doc__ or "").split()),
            "properties": keys,
            "additionalProperties": False,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "farloco node config",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
