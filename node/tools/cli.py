"""The `farloco` command line: run a node, steer it, inspect the swarm, prepare data, try a local demo."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from farloco.node.config import PRESETS, ConfigError, example_config, load_config

# The run directory's lock, held for the life of `farloco join` (see _lock_run_dir).
_RUN_DIR_LOCK: list[int] = []


def _lock_run_dir(run_dir: Path) -> None:
    """Claim `run_dir` for this process, or exit naming the node that holds it.

    One node per run directory: its identity key, checkpoints, hand-off and logs are its own, and a second node
    on them would take the first one's peer id and interleave their checkpoints. A POSIX record lock
    (`lockf`): the kernel drops it when the process ends however it ends (a SIGKILLed node restarts on its
    directory at once), and forked children (the DHT process) do not hold it."""
    import errno
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "node.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
            os.close(fd)
            click.echo(
                f"warning: {run_dir} cannot be locked ({exc.strerror}): nothing stops a second node on it",
                err=True,
            )
            return
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise click.ClickException(
            f"run directory {run_dir} is in use by another farloco node (pid {holder}); one node per run "
            f"directory (its identity, checkpoints and hand-off are its own): stop that node "
            f"(`farloco leave --run-dir {run_dir}`) or give this one another --run-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _RUN_DIR_LOCK.append(fd)


def _setup_logging(verbose: bool, log_format: str | None, run_dir: Path) -> None:
    from farloco.node.logs import setup_logging

    setup_logging(log_format, verbose=verbose, run_dir=run_dir)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="farloco")
def main() -> None:
    """farloco: decentralized, low-bandwidth training of neural networks (DiLoCo and friends).

    Start with `farloco demo` to watch three local peers train together, then
    `farloco config example > node.toml` and `farloco join --config node.toml --run-dir runs/a`.
    """


# ---- join / bootstrap -------------------------------------------------------------------------------------------
def _host_overrides(
    host: str | None, port: int | None, dht_port: int | None, data_port: int | None = None
) -> list[str]:
    overrides = []
    if host is not None:
        overrides.append(f'network.host="{host}"')
    if port is not None:
        overrides.append(f"network.grpc_port={port}")
    if dht_port is not None:
        overrides.append(f"network.dht_port={dht_port}")
    if data_port is not None:
        overrides.append(f"network.data_port={data_port}")
    return overrides


@main.command()
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="TOML config file."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory for this node's resolved config, logs, checkpoints and control endpoint.",
)
@click.option(
    "--initial-peer",
    "initial_peers",
    multiple=True,
    metavar="MADDR",
    help="Multiaddr of a DHT peer to join through (repeatable); adds to network.initial_peers.",
)
@click.option("--host", default=None, help="Address every listening part binds to (overrides network.host).")
@click.option("--port", type=int, default=None, help="gRPC port (overrides network.grpc_port; 0 = any).")
@click.option("--dht-port", type=int, default=None, help="DHT port (overrides network.dht_port; 0 = any).")
@click.option(
    "--data-port",
    type=int,
    default=None,
    help="TCP data-plane port for the exchange (overrides network.data_port; 0 = any).",
)
@click.option(
    "--island",
    default=None,
    metavar="NAME",
    help="The island this node belongs to: nodes on one fast fabric reduce among themselves first (overrides "
    "node.island; needs run.island_slices).",
)
@click.option(
    "--island-endpoint",
    default=None,
    metavar="HOST:PORT",
    help="The island's rendezvous (torch c10d), the same on every node of the island (overrides "
    "node.island_endpoint).",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one config value, e.g. --set run.inner_steps=50 (repeatable).",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="stderr log lines as text or JSON lines (ts, level, logger, msg, extra fields). Default: text when "
    "stderr is a terminal, json otherwise. <run-dir>/logs/daemon.jsonl always gets JSON lines.",
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    metavar="SPEC",
    help="Chaos on purpose (repeatable; adds to FARLOCO_FAULTS): ACTION[=VALUE]@PHASE[+SECONDS][:ROUNDS], e.g. "
    "crash@exchange+0.2:5 (SIGKILL 0.2 s into round 5's exchange), hang=20@train:3, drop@exchange:4, "
    "delay=5@match, corrupt@exchange:6, wrong=sign_flip_x1000@exchange. See RELIABILITY.md.",
)
def join(
    config_path: Path | None,
    run_dir: Path,
    initial_peers: tuple[str, ...],
    host: str | None,
    port: int | None,
    dht_port: int | None,
    data_port: int | None,
    island: str | None,
    island_endpoint: str | None,
    overrides: tuple[str, ...],
    verbose: bool,
    log_format: str | None,
    faults: tuple[str, ...],
) -> None:
    """Start a node and join (or found) a swarm. Prints the node's multiaddrs; runs until it leaves."""
    # A SIGTERM or Ctrl+C before the agent's own handlers exist (torch's import, the model, the DHT's start take
    # seconds on a loaded host; Slurm's time-limit leave or systemd may signal then) is a leave, not a death.
    started: dict[str, Any] = {}

    def leave_while_starting(signum: int, frame: object) -> None:
        agent = started.get("agent")
        if agent is None:
            started["leave"] = True
        else:
            agent.request_leave("graceful")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave_while_starting)
    _lock_run_dir(run_dir)
    _setup_logging(verbose, log_format, run_dir)
    if faults:  # the ranks read the plan from the environment too (slow-steps)
        os.environ["FARLOCO_FAULTS"] = ",".join(filter(None, [os.environ.get("FARLOCO_FAULTS", ""), *faults]))
    from farloco.node.faults.plan import parse_faults
    from farloco.optim import ATTACKS

    try:
        parse_faults(os.environ.get("FARLOCO_FAULTS", ""), ATTACKS)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        islands = [f"node.island={json.dumps(island)}"] if island is not None else []
        if island_endpoint is not None:
            islands.append(f"node.island_endpoint={json.dumps(island_endpoint)}")
        config = load_config(
            config_path,
            [*overrides, *_host_overrides(host, port, dht_port, data_port), *islands],
            environ=os.environ,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if initial_peers:
        network = dataclasses.replace(
            config.network, initial_peers=[*config.network.initial_peers, *initial_peers]
        )
        config = dataclasses.replace(config, network=network)
    from farloco.node.daemon.agent import Agent

    try:
        agent = Agent(config, run_dir)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    started["agent"] = agent
    if started.get("leave"):
        agent.request_leave("graceful")
    code = agent.run()
    from farloco.node.logs import console_format

    if agent.error and console_format() == "text":  # a JSON stderr already has it, as a log line
        click.echo(f"error: {agent.error}", err=True)
    sys.exit(code)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the DHT node binds to.")
@click.option("--port", type=int, default=0, show_default=True, help="DHT port (0 = any free port).")
@click.option(
    "--initial-peer", "initial_peers", multiple=True, metavar="MADDR", help="Other bootstrap nodes."
)
@click.option(
    "--maddr-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the multiaddrs to this file (one per line), for scripts.",
)
@click.option(
    "--identity",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Private key file: keeps the same peer id (and multiaddr) across restarts.",
)
@click.option(
    "--run",
    "runs",
    multiple=True,
    metavar="NAME",
    help="A run (run.name) that joins through this node: its member records are checked here as a member checks "
    "them. Signatures are checked for every run.",
)
def bootstrap(
    host: str,
    port: int,
    initial_peers: tuple[str, ...],
    maddr_file: Path | None,
    identity: Path | None,
    runs: tuple[str, ...],
) -> None:
    """Run a standalone DHT node that peers join through; prints its multiaddrs and runs until stopped.

    It stores records like any DHT node (those whose keys lie near its id): it refuses unsigned or forged
    entries of any run, and entries of the wrong schema under the members key of each --run."""
    import signal
    import threading

    from farloco.node.daemon.dhtnode import DHTStartError, make_dht, stop_dht, visible_maddrs
    from farloco.node.logs import setup_logging
    from farloco.protocol.membership import bootstrap_record_validators
    from farloco.util.addresses import bind_multiaddr

    setup_logging(None)  # text on a terminal, JSON lines otherwise (journald, docker logs, Slurm output)
    # Handlers first: a SIGTERM that lands while the DHT starts must still shut it down cleanly.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    kwargs: dict[str, Any] = {}
    if identity is not None:
        kwargs["identity_path"] = str(identity)
    dht = make_dht(
        host_maddrs=[bind_multiaddr(host, port)],
        initial_peers=list(initial_peers),
        record_validators=bootstrap_record_validators(runs),
        start=True,
        **kwargs,
    )
    try:
        maddrs = visible_maddrs(dht, stop=stop)
    except DHTStartError as exc:
        stop_dht(dht)
        if stop.is_set():
            return
        raise click.ClickException(str(exc)) from exc
    for maddr in maddrs:
        click.echo(maddr)
    sys.stdout.flush()
    if maddr_file is not None:
        tmp = maddr_file.with_suffix(".tmp")
        tmp.write_text("\n".join(maddrs) + "\n")
        tmp.replace(maddr_file)
    stop.wait()
    stop_dht(dht)


@main.command()
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write it to this file (mode 0600, refused if it exists) instead of printing it.",
)
def secret(out: Path | None) -> None:
    """Make a fresh run secret: 32 random bytes in hex. Give the same one to every node of the run
    (auth.secret_file, or the FARLOCO_RUN_SECRET environment variable); keep it out of version control."""
    import secrets as random_source

    value = random_source.token_hex(32) + "\n"
    if out is None:
        click.echo(value, nl=False)
        return
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise click.UsageError(
            f"{out} exists: a run keeps its secret (remove it first to make a new one)"
        ) from None
    except OSError as exc:
        raise click.UsageError(f"cannot create {out}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(value)
    click.echo(f'wrote a run secret to {out}; set auth.secret_file = "{out}" on every node', err=True)


@main.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory for ca.pem, ca.key and NODE.pem / NODE.key per node (refused if ca.pem is there already).",
)
@click.option("--days", type=click.FloatRange(min=1), default=3650.0, show_default=True, help="Validity.")
@click.argument("nodes", nargs=-1, required=True)
def certs(out: Path, days: float, nodes: tuple[str, ...]) -> None:
    """Make an operator's own certificates for mutual TLS: a CA and, for each NODE named, a certificate and
    key it signs. Not needed where every node holds the run secret (TLS then uses a CA derived from it); for
    a PKI of your own: give each node network.tls_cert = NODE.pem, tls_key = NODE.key, tls_ca = ca.pem and
    tls_server_name = "farloco-peer". Keep ca.key offline; the .key files are written mode 0600."""
    from farloco.node.fsutil import write_atomic
    from farloco.protocol.transport import SERVER_NAME, make_pki

    bad = [n for n in nodes if not n or "/" in n or n.startswith(".") or n == "ca"]
    if bad:
        raise click.UsageError(f"node names are file names (not 'ca', no '/', no leading '.'): got {bad}")
    if (out / "ca.pem").exists():
        raise click.UsageError(f"{out / 'ca.pem'} exists: a run keeps its CA (use another --out)")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in make_pki(list(nodes), days=days).items():
        write_atomic(out / name, data, mode=0o600 if name.endswith(".key") else 0o644)
        click.echo(str(out / name))
    click.echo(f'set tls_server_name = "{SERVER_NAME}" on every node with these certificates', err=True)


# ---- steering a running node ------------------------------------------------------------------------------------
def _client(run_dir: Path) -> Any:
    from farloco.node.daemon.control import ControlClient, ControlError

    try:
        return ControlClient(run_dir)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--now", is_flag=True, help="Leave at once, abandoning the current round.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for the exit.")
def leave(run_dir: Path, now: bool, timeout: float) -> None:
    """Make a node leave gracefully: finish or withdraw from the round, deregister, stop trainers, exit."""
    _leave(run_dir, "now" if now else "graceful", timeout)


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--timeout", type=float, default=3600.0, show_default=True, help="Seconds to wait for the exit."
)
def drain(run_dir: Path, timeout: float) -> None:
    """Finish the current round, then leave."""
    _leave(run_dir, "drain", timeout)


def _leave(run_dir: Path, mode: str, timeout: float) -> None:
    from farloco.node.daemon.control import ControlError

    client = _client(run_dir)
    try:
        client.leave(mode)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from exc
    deadline = time.monotonic() + timeout
    while client.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if client.alive():
        raise click.ClickException(f"node (pid {client.pid}) still running after {timeout:.0f}s")
    click.echo(f"node in {run_dir} left")


def _ask(run_dir: Path, what: str) -> Any:
    """GET `status` or `peers` from the node of `run_dir`; a node that does not answer is a clean CLI error."""
    from farloco.node.daemon.control import ControlError

    try:
        return getattr(_client(run_dir), what)()
    except ControlError as exc:
        raise click.ClickException(str(exc)) from exc


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--swarm", is_flag=True, help="Also the swarm as this node sees it (the `farloco peers` table)."
)
def status(run_dir: Path, as_json: bool, swarm: bool) -> None:
    """Show a node's state: round, loss, learning rate, peers, bytes, hash (with --swarm, every peer's too)."""
    from rich.console import Console
    from rich.table import Table

    data = _ask(run_dir, "status")
    members = _ask(run_dir, "peers") if swarm else None
    if as_json:
        click.echo(json.dumps(data if members is None else {**data, "peers": members}, indent=2))
        return
    table = Table(title=f"farloco node {data['peer_id'][:16]}…", show_header=False)
    for key in (
        "state",
        "round_id",
        "inner_step",
        "loss",
        "eval_loss",
        "inner_lr",
        "outer_lr",
        "num_peers",
        "group_share",
        "left_out",
        "isolated_seconds",
        "vanished_peers",
        "match_wait_seconds",
        "outer_hash",
        "bytes_sent",
        "bytes_received",
        "compression_ratio",
        "strategy",
        "codec",
        "grpc_address",
        "slot",
        "tokens_per_second",
        "trainer_restarts",
        "trainer_last_exit",
        "last_checkpoint",
        "sync",
        "leave_mode",
        "error",
    ):
        value = data.get(key)
        if key == "outer_hash" and value:
            value = value[:16]
        if key in ("isolated_seconds", "vanished_peers") and not data.get("isolated"):
            continue  # only while isolated
        if key == "group_share" and value is not None:
            value = f"{100 * value:.0f}% of recent rounds"
        if key == "left_out":
            value = ", ".join(f"{reason} {n}" for reason, n in sorted((value or {}).items())) or "never"
        if key == "sync" and value:
            done, total = value["bytes_done"] / 2**20, value["bytes_total"] / 2**20
            value = f"{done:.1f} / {total:.1f} MiB ({value['description']})"
        table.add_row(key, _fmt(value))
    Console().print(table)
    if members is not None:
        _print_peers(members)


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def peers(run_dir: Path, as_json: bool) -> None:
    """List the swarm as this node sees it."""
    members = _ask(run_dir, "peers")
    if as_json:
        click.echo(json.dumps(members, indent=2))
        return
    _print_peers(members)


def _print_peers(members: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(members)} peers")
    for column in ("peer", "state", "round", "step", "slot", "loss", "hash", "share", "heartbeat", "address"):
        table.add_column(column, no_wrap=column in ("peer", "address"))
    for m in members:
        table.add_row(
            m["peer_id"][:16] + ("*" if m.get("self") else ""),
            m["state"],
            str(m["round_id"]),
            str(m["inner_step"]),
            str(m["slot"]),
            _fmt(m["loss"]),
            (m["outer_hash"] or "-")[:12],
            "-" if m.get("share") is None else f"{100 * m['share']:.0f}%",
            f"{m['heartbeat_age']:.1f}s ago",
            m["address"],
        )
    Console().print(table)


# ---- config / data ----------------------------------------------------------------------------------------------
@main.group()
def config() -> None:
    """Config files: print a documented example or the JSON Schema, validate one, read a value.

    Every key can also be set in the environment as FARLOCO__SECTION__KEY=value (e.g. FARLOCO__RUN__INNER_STEPS=50,
    the value read as --set reads it): file < environment < --set."""


@config.command("schema")
def config_schema_command() -> None:
    """Print the config's JSON Schema (every section and key, its type, default and meaning)."""
    from farloco.node.config import config_schema

    click.echo(json.dumps(config_schema(), indent=2))


@config.command("example")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--init-from",
    "init_from",
    metavar="DIR",
    default="",
    help="Start from this model folder's weights, its config.json the architecture (run.init_from, run.model).",
)
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def config_example(preset: str, init_from: str, overrides: tuple[str, ...]) -> None:
    """Print a documented config (every key with its meaning): the preset's values, then --init-from and --set."""
    given = (
        [f"run.model={json.dumps(init_from)}", f"run.init_from={json.dumps(init_from)}"] if init_from else []
    )
    try:
        click.echo(example_config(preset, [*given, *overrides]))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


@config.command("check")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def config_check(path: Path, overrides: tuple[str, ...]) -> None:
    """Validate a config file; prints its run_hash."""
    from farloco.node.config import run_hash
    from farloco.node.daemon.agent import build_outer
    from farloco.node.training.model import num_parameters
    from farloco.node.training.models import check_init_from, meta_spec
    from farloco.node.training.parallel import check_node_layout

    try:
        cfg = load_config(path, overrides, environ=os.environ)
        check_node_layout(cfg)
        spec = meta_spec(cfg.run.model)
        build_outer(cfg, num_parameters(spec.module))
        if cfg.run.init_from:  # names and shapes from the files' headers: no weight is read
            check_init_from(spec, cfg.run.init_from)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ok: run {cfg.run.name!r}, run_hash {run_hash(cfg)}")


@config.command("get")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("key", metavar="SECTION.KEY")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def config_get(path: Path, key: str, overrides: tuple[str, ...]) -> None:
    """Print one resolved value of a config (defaults filled in), for scripts: e.g. timeouts.leave_timeout."""
    try:
        cfg = load_config(path, overrides, environ=os.environ)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    section_name, _, name = key.partition(".")
    section = getattr(cfg, section_name, None)
    if not name or section is None or not dataclasses.is_dataclass(section):
        sections = [f.name for f in dataclasses.fields(cfg)]
        raise click.ClickException(f"expected SECTION.KEY with SECTION one of {sections}, got {key!r}")
    if name not in {f.name for f in dataclasses.fields(section)}:
        keys = [f.name for f in dataclasses.fields(section)]
        raise click.ClickException(f"expected a key of [{section_name}], one of {keys}, got {name!r}")
    value = getattr(section, name)
    click.echo(value if isinstance(value, str) else json.dumps(value))


@main.group()
def data() -> None:
    """Training data: turn text into memory-mapped token shards."""


@data.command("prepare")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--tokenizer",
    default="bytes",
    show_default=True,
    help="'bytes' (offline byte-level) or the path of a Hugging Face tokenizer.json.",
)
@click.option("--val-fraction", type=float, default=0.05, show_default=True)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="The .jsonl field, or the Parquet / saved-dataset column, that holds each document's text.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Tokenizer processes [default: the cores, at most 8, for a tokenizer.json; 1 for bytes].",
)
def data_prepare(
    inputs: tuple[Path, ...],
    out_dir: Path,
    tokenizer: str,
    val_fraction: float,
    text_field: str,
    workers: int | None,
) -> None:
    """Tokenize .txt / .jsonl / .parquet files, Hugging Face datasets saved with `save_to_disk` (a split's
    folder), or directories of them, into shards for `run.dataset`. Streams: a corpus larger than memory is fine;
    nothing is fetched from a hub."""
    from farloco.node.training.data import prepare_dataset

    if workers is None:
        workers = 1 if tokenizer == "bytes" else max(1, min(8, os.cpu_count() or 1))
    try:
        info = prepare_dataset(
            list(inputs),
            out_dir,
            tokenizer,
            text_field=text_field,
            workers=workers,
            val_fraction=val_fraction,
            progress=True,
        )
    except (ValueError, ImportError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out_dir}: {info}")


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder for model.safetensors, config.json and generation_config.json.",
)
def export(run_dir: Path, out_dir: Path) -> None:
    """Write a run's newest checkpoint as a Hugging Face Llama model folder."""
    from farloco.node.tools.export import ExportError, export_run

    try:
        path = export_run(run_dir, out_dir, progress=True)
    except ExportError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"exported to {path}")


@main.command()
@click.option(
    "--run-dir",
    "run_dirs",
    type=click.Path(file_okay=False, path_type=Path),
    multiple=True,
    required=True,
    help="A node's run directory; repeat it to overlay several nodes.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the PNGs go (default: <first run dir>/report).",
)
def report(run_dirs: tuple[Path, ...], out_dir: Path | None) -> None:
    """Plot loss, bytes sent vs. data-parallel, round time and peers per round from the nodes' event logs."""
    from farloco.node.tools.report import ReportError, make_report

    try:
        paths = make_report(list(run_dirs), out_dir or run_dirs[0] / "report")
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc
    for path in paths:
        click.echo(str(path))


# ---- demo -------------------------------------------------------------------------------------------------------
@main.command()
@click.option("--peers", "num_peers", type=int, default=3, show_default=True, help="Peers to start.")
@click.option(
    "--rounds", type=int, default=None, help="Outer rounds to train (default: 6; 30 for --strategy demo)."
)
@click.option(
    "--strategy",
    default=None,
    help="Outer strategy: diloco (the default), streaming-diloco, demo, sparseloco.",
)
@click.option(
    "--codec",
    default=None,
    help="Wire codec: fp32, fp16, bf16, int8, int4, topk, dct-topk (default: int8 for diloco, the default "
    "strategy, to show what compression saves; dct-topk for --strategy demo; fp32 otherwise).",
)
@click.option("--ranks", type=int, default=1, show_default=True, help="Trainer ranks of the first peer.")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where run directories go (default: a temporary directory, removed afterwards).",
)
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Config overrides.")
def demo(
    num_peers: int,
    rounds: int | None,
    strategy: str | None,
    codec: str | None,
    ranks: int,
    work_dir: Path | None,
    overrides: tuple[str, ...],
) -> None:
    """Train the tiny model with N local peers on loopback, then print what happened."""
    from farloco.node.tools.demo import run_demo

    extra = list(overrides)
    if strategy:
        extra.append(f'run.strategy="{strategy}"')
    if (
        codec is None
        and (strategy or "diloco") == "diloco"
        and not any(o.startswith("run.codec") for o in extra)
    ):
        # What people come for: DiLoCo's pseudo-gradients in int8 send 4x fewer bytes than fp32 at no visible
        # cost in the demo's loss (error feedback keeps what int8 rounds away).
        codec = "int8"
    if codec:
        extra.append(f'run.codec="{codec}"')
    sys.exit(
        run_demo(num_peers=num_peers, rounds=rounds, overrides=extra, first_ranks=ranks, work_dir=work_dir)
    )


if __name__ == "__main__":
    main()
