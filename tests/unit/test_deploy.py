"""deploy/: every `farloco …` command line names a real command and real options, every YAML parses, every
example config validates, and the stop paths (systemd, Kubernetes, Slurm) leave gracefully within their limits.

The Docker images, the cluster and the scheduler are not available here; what can be checked without them is:
the command lines against the click CLI, the files the Dockerfiles copy, kustomize's build (when kubectl is
installed), `systemd-analyze verify` (when systemd is), `bash -n`, and the bootstrap identity script against a
real `farloco bootstrap` on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from helpers import ROOT

from farloco.node.config import Config, build_config, load_config
from farloco.node.tools.cli import main as cli_main

DEPLOY = ROOT / "deploy"
# CLI commands no deploy file runs: `farloco data prepare` makes a node's dataset before it is deployed (the
# config that needs one says so: deploy/configs/1b-gpu.toml). Every other command is run somewhere in deploy/.
NOT_RUN_BY_DEPLOY_FILES = {"data"}


# ---- finding the command lines ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommandLine:
    where: str
    argv: tuple[str, ...]  # the words after `farloco`


# `farloco` as a program (a bare word, a path ending in /farloco, or an image farloco:<tag>) followed by a word.
_PROGRAM = re.compile(
    r"(?:^|(?<=[\s\"'`(;&|=]))(?:[\w./-]*/)?farloco(?::[\w.-]+)?\s+(?=[a-z][\w-]*(?:[\s\"'`;]|$))"
)


def _words(text: str) -> tuple[str, ...]:
    """Shell words of one command: quotes, backslashes and $(...) respected; stops at ; | & ) or a comment."""
    words: list[str] = []
    current: list[str] = []
    quote: str | None = None
    depth = 0
    i = 0
    while i < len(text):
        ch = text[i]
        if quote is None and depth == 0:
            if ch.isspace():
                if current:
                    words.append("".join(current))
                    current = []
                i += 1
                continue
            if ch in ";|&)" or (ch == "#" and not current):
                break
        if ch == "\\" and quote != "'" and i + 1 < len(text):
            current.append(text[i + 1])
            i += 2
            continue
        if quote is None and ch in "'\"`":
            quote = ch
        elif ch == quote:
            quote = None
        elif quote != "'" and text.startswith("$(", i):
            depth += 1
            current.append("$(")
            i += 2
            continue
        elif depth and quote != "'" and ch == ")":
            depth -= 1
            current.append(ch)
        else:
            current.append(ch)
        i += 1
    if current:
        words.append("".join(current))
    return tuple(words)


def _scan_text(text: str, where: str) -> list[CommandLine]:
    """Command lines in a script or unit. In comments, only `backticked` code and indented example lines."""
    found = []
    logical = text.replace("\\\n", " ")  # backslash continuations make one command line
    for number, line in enumerate(logical.splitlines(), start=1):
        stripped = line.lstrip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            body = stripped[1:]
            pieces = [body] if body.startswith("  ") else re.findall(r"`([^`]+)`", body)
        else:
            pieces = [line]
        for piece in pieces:
            for match in _PROGRAM.finditer(piece):
                found.append(CommandLine(f"{where}:{number}", _words(piece[match.end() :])))
    return found


def _scan_markdown(text: str, where: str) -> list[CommandLine]:
    """Only code: fenced blocks and `inline` spans (prose may say 'farloco is …')."""
    found = []
    fences = list(re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M))
    for fence in fences:
        first_line = text.count("\n", 0, fence.start(1))
        for hit in _scan_text(fence.group(1), where):
            number = first_line + int(hit.where.rsplit(":", 1)[1])
            found.append(CommandLine(f"{where}:{number}", hit.argv))
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for span in re.finditer(r"`([^`]+)`", prose):
        number = prose.count("\n", 0, span.start()) + 1
        for hit in _scan_text(" ".join(span.group(1).split()), where):
            found.append(CommandLine(f"{where}:{number}", hit.argv))
    return found


def _image_entrypoint() -> list[str]:
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("ENTRYPOINT")]
    entrypoint: list[str] = json.loads(line.removeprefix("ENTRYPOINT"))
    return entrypoint


def _argv_after_farloco(words: list[Any]) -> tuple[str, ...] | None:
    for index, word in enumerate(words):
        if isinstance(word, str) and Path(word).name == "farloco":
            return tuple(str(w) for w in words[index + 1 :])
    return None


def _scan_yaml(document: Any, where: str) -> list[CommandLine]:
    """Command lists (compose entrypoint+command, Kubernetes command+args, exec probes) and every string."""
    found: list[CommandLine] = []
    if isinstance(document, dict):
        program = document.get("entrypoint", document.get("command"))
        arguments = document.get("args") if "args" in document else document.get("command")
        if program is document.get("command"):
            program = None
        if isinstance(arguments, list) and program is None and ("image" in document or "args" in document):
            # No entrypoint/command of its own: the image's ENTRYPOINT (`tini -- farloco`) runs the arguments.
            argv = _argv_after_farloco([*_image_entrypoint(), *arguments])
            if argv is not None:
                found.append(CommandLine(where, argv))
        for key, value in document.items():
            found += _scan_yaml(value, f"{where}.{key}")
    elif isinstance(document, list):
        argv = _argv_after_farloco(document)
        if argv is not None and argv and not argv[0].startswith("-"):
            found.append(CommandLine(where, argv))
        for index, value in enumerate(document):
            found += _scan_yaml(value, f"{where}[{index}]")
    elif isinstance(document, str):
        found += _scan_text(document, where)
    return found


def _deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.name != ".gitignore")


def _yaml_files() -> list[Path]:
    return [p for p in _deploy_files() if p.suffix in (".yaml", ".yml")]


def all_command_lines() -> list[CommandLine]:
    found: list[CommandLine] = []
    for path in _deploy_files():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        if path.suffix == ".md":
            found += _scan_markdown(text, where)
        elif path.suffix in (".yaml", ".yml"):
            for index, document in enumerate(yaml.safe_load_all(text)):
                found += _scan_yaml(document, f"{where}#{index}")
        elif path.suffix != ".toml" and not path.name.endswith(".dockerignore"):
            found += _scan_text(text, where)
    return found


COMMAND_LINES = all_command_lines()


# ---- checking them against the click CLI ----------------------------------------------------------------------------
def _resolve(argv: tuple[str, ...]) -> tuple[list[str], click.Command | None, tuple[str, ...]]:
    """(command path, the click command or None if missing, the remaining words)."""
    command: click.Command = cli_main
    path: list[str] = []
    words = list(argv)
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        name = words.pop(0)
        path.append(name)
        sub = command.commands.get(name)
        if sub is None:
            return path, None, tuple(words)
        command = sub
    return path, command, tuple(words)


def _options_of(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


@pytest.mark.parametrize(
    "line", COMMAND_LINES, ids=[f"{c.where} {' '.join(c.argv[:1])}" for c in COMMAND_LINES]
)
def test_command_line_exists_in_the_cli(line: CommandLine) -> None:
    path, command, rest = _resolve(line.argv)
    if command is None:
        pytest.fail(f"{line.where}: `farloco {' '.join(path)}` is not a command of the CLI")
    if isinstance(command, click.Group):
        pytest.fail(
            f"{line.where}: `farloco {' '.join(path)}` needs a subcommand, one of {sorted(command.commands)}"
        )
    known = _options_of(command)
    for word in rest:
        if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
            option = word.split("=", 1)[0]
            assert option in known, (
                f"{line.where}: `farloco {' '.join(path)}` has no option {option}; it has {sorted(known)}"
            )


def test_the_scanner_finds_the_command_lines_that_matter() -> None:
    """Guards the test above: a scanner that found nothing would pass everything."""
    by_file: dict[str, set[str]] = {}
    for line in COMMAND_LINES:
        by_file.setdefault(line.where.split(":")[0].split("#")[0].split(".services")[0], set()).add(
            line.argv[0]
        )
    assert {"join", "leave"} <= by_file["deploy/systemd/farloco.service"]
    assert {"bootstrap"} <= by_file["deploy/systemd/farloco-bootstrap.service"]
    assert {"join", "bootstrap", "status"} <= by_file["deploy/compose.yaml"]
    assert {"join", "bootstrap", "leave"} <= by_file["deploy/k8s/statefulset.yaml"] | by_file[
        "deploy/k8s/bootstrap.yaml"
    ]
    assert {"join", "bootstrap", "config"} <= by_file["deploy/slurm/farloco.sbatch"]
    assert {"join", "leave", "drain", "status", "peers", "report", "export"} <= by_file["deploy/OPERATORS.md"]


def test_every_command_of_the_cli_is_run_by_a_deploy_file() -> None:
    """The other direction: a command the CLI has but no deploy file (nor OPERATORS.md) shows an operator is a
    command an operator never learns about; the exempt ones must still be commands of the CLI."""
    commands = set(cli_main.commands)  # type: ignore[attr-defined]
    assert commands >= NOT_RUN_BY_DEPLOY_FILES, (
        f"not commands of the CLI: {NOT_RUN_BY_DEPLOY_FILES - commands}"
    )
    run = {line.argv[0] for line in COMMAND_LINES}
    assert not run & NOT_RUN_BY_DEPLOY_FILES, (
        f"run by a deploy file after all: {run & NOT_RUN_BY_DEPLOY_FILES}"
    )
    unshown = sorted(commands - NOT_RUN_BY_DEPLOY_FILES - run)
    assert not unshown, f"CLI commands no deploy file runs: {unshown}"


# ---- files parse, configs validate --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents and all(isinstance(d, dict) for d in documents)


@pytest.mark.parametrize("path", sorted((DEPLOY / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_config_validates(path: Path) -> None:
    config = load_config(path)
    assert config.run.name


def test_there_are_cpu_and_gpu_example_configs() -> None:
    devices = {load_config(p).node.device for p in (DEPLOY / "configs").glob("*.toml")}
    assert {"cpu", "cuda"} <= devices


def _k8s_documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d and "kind" in d]
    return documents


def _k8s(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in _k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _k8s_node_config() -> Config:
    return build_config(tomllib.loads(_k8s("ConfigMap", "farloco-node")["data"]["node.toml"]))


def _option_value(argv: list[str] | tuple[str, ...], option: str) -> str:
    return argv[list(argv).index(option) + 1]


def _graceful_leave_bound(config: Config) -> float:
    """The longest a graceful leave can take: the exchange in flight, plus stopping the trainer ranks."""
    t = config.timeouts
    return t.match_timeout + t.leader_timeout + t.exchange_timeout + 60.0


# ---- systemd ------------------------------------------------------------------------------------------------------
def _unit(path: Path) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current[key.strip()] = value.strip()
    return sections


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)\s*(s|sec|min|m|h)?", value)
    assert match, f"unexpected time span {value!r}"
    return float(match.group(1)) * {None: 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[match.group(2)]


def test_systemd_node_unit_leaves_gracefully() -> None:
    service = _unit(DEPLOY / "systemd" / "farloco.service")["Service"]
    start, stop = service["ExecStart"].split(), service["ExecStop"].split()
    assert start[0].endswith("/farloco") and start[1] == "join"
    assert stop[0].endswith("/farloco") and stop[1] == "leave"
    assert _option_value(start, "--run-dir") == _option_value(stop, "--run-dir")
    leave_timeout = float(_option_value(stop, "--timeout"))
    assert leave_timeout >= _graceful_leave_bound(load_config(DEPLOY / "configs" / "1b-gpu.toml"))
    assert _seconds(service["TimeoutStopSec"]) > leave_timeout
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"


def test_systemd_bootstrap_unit_keeps_its_identity() -> None:
    service = _unit(DEPLOY / "systemd" / "farloco-bootstrap.service")["Service"]
    start = service["ExecStart"].split()
    assert start[1] == "bootstrap"
    assert _option_value(start, "--identity").startswith("/var/lib/farloco-bootstrap/")
    assert service["StateDirectory"] == "farloco-bootstrap"
    assert service["Restart"] == "on-failure"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    farloco = Path(sys.executable).with_name("farloco")
    for unit in (DEPLOY / "systemd").glob("*.service"):
        # verify insists that ExecStart's binary exists: point it at this environment's farloco.
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/farloco/bin/farloco", str(farloco)))
    result = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# ---- Kubernetes ---------------------------------------------------------------------------------------------------
def test_k8s_statefulset() -> None:
    statefulset = _k8s("StatefulSet", "farloco")
    spec = statefulset["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    config = _k8s_node_config()

    assert spec["serviceName"] == "farloco"
    assert _k8s("Service", "farloco")["spec"]["clusterIP"] == "None"  # headless
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert _option_value(container["args"], "--run-dir").startswith("/data/")

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["farloco", "leave"]
    assert _option_value(pre_stop, "--run-dir") == _option_value(container["args"], "--run-dir")
    leave_timeout = float(_option_value(pre_stop, "--timeout"))
    assert leave_timeout >= _graceful_leave_bound(config)
    assert pod["terminationGracePeriodSeconds"] > leave_timeout

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["control"] == config.network.control_port
    # the kubelet probes the pod IP, not loopback: the control endpoint must listen on every interface
    assert ipaddress.ip_address(config.network.control_host).is_unspecified
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "control"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "control"}

    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    assert secret_volume["secret"]["secretName"] == "farloco-run-secret"
    secret_dir = mounts[secret_volume["name"]]
    assert Path(config.auth.secret_file).parent == Path(secret_dir)
    config_volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert config_volume["configMap"]["name"] == "farloco-node"
    assert _option_value(container["args"], "--config") == f"{mounts[config_volume['name']]}/node.toml"
    assert mounts["dshm"] == "/dev/shm"
    assert 'network.announce_host="$(POD_IP)"' in container["args"]


def test_k8s_bootstrap_and_config_agree() -> None:
    deployment = _k8s("Deployment", "farloco-bootstrap")
    service = _k8s("Service", "farloco-bootstrap")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 1
    port = int(_option_value(container["args"], "--port"))
    assert service["spec"]["ports"][0]["port"] == port
    identity = _option_value(container["args"], "--identity")
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    generated = {s["name"] for s in kustomization["secretGenerator"]}
    assert {"farloco-run-secret", "farloco-bootstrap-identity"} <= generated
    assert Path(identity).name == "identity.key"
    (peer,) = _k8s_node_config().network.initial_peers
    assert peer.startswith(f"/dns4/farloco-bootstrap/tcp/{port}/p2p/")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds(tmp_path: Path) -> None:
    k8s = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", k8s)
    (k8s / "run-secret").write_text("0" * 64 + "\n")
    (k8s / "bootstrap-identity.key").write_bytes(b"not a real key")
    result = subprocess.run(["kubectl", "kustomize", str(k8s)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d)
    assert kinds == ["ConfigMap", "Deployment", "Secret", "Secret", "Service", "Service", "StatefulSet"]


def test_k8s_manifests_pass_the_kubernetes_schema() -> None:
    """Every resource file against the Kubernetes OpenAPI schemas (kubernetes-validate ships them: no download),
    strictly: a misspelt field is an error, not a silently ignored key."""
    resources = sorted(
        p
        for p in [*(DEPLOY / "k8s").glob("*.yaml"), *(DEPLOY / "k8s" / "islands").glob("*.yaml")]
        if p.name != "kustomization.yaml"
    )
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", *map(str, resources)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


# ---- compose, Docker, Slurm ---------------------------------------------------------------------------------------
def test_compose_file_matches_the_compose_spec() -> None:
    """deploy/compose.yaml against the Compose Specification's JSON schema (vendored by check-jsonschema)."""
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(DEPLOY / "compose.yaml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_wires_bootstrap_to_peers() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"bootstrap", "peer1", "peer2", "peer3"}
    bootstrap = services["bootstrap"]["command"]
    assert bootstrap[0] == "bootstrap"
    maddr_file = _option_value(bootstrap, "--maddr-file")
    assert _option_value(bootstrap, "--identity").startswith("/data/")
    for name in ("peer1", "peer2", "peer3"):
        peer = services[name]
        (script,) = peer["command"]
        assert maddr_file in script and "farloco join" in script
        assert "/dns4/bootstrap/tcp/" + _option_value(bootstrap, "--port") in script
        volumes = {v.split(":")[0] for v in peer["volumes"]}
        assert f"{name}-data" in volumes and "shared" in volumes
        assert peer["stop_signal"] == "SIGTERM"
    config_file = DEPLOY / compose["configs"]["node_toml"]["file"]
    load_config(config_file)
    assert set(compose["volumes"]) == {"bootstrap-data", "shared", "peer1-data", "peer2-data", "peer3-data"}


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile(name: str) -> None:
    text = (DEPLOY / name).read_text()
    assert re.search(r"^FROM \S+", text, flags=re.M)
    assert _argv_after_farloco(json.loads(re.search(r"^ENTRYPOINT (.*)$", text, flags=re.M)[1])) == ()  # type: ignore[index]
    copied = re.findall(r"^COPY (.+) \S+$", text, flags=re.M)
    sources = [s for line in copied for s in line.split()]
    assert {"pyproject.toml", "README.md", "node", "protocol", "optim"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
    for source in sources:
        assert f"!{source}" in ignore or f"!{source}/" in ignore, (
            f"{name}.dockerignore would exclude {source}"
        )
    assert "USER farloco" in text


def test_cpu_image_pins_torch() -> None:
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    assert "python:3.11-slim" in text
    assert "ARG TORCH_VERSION=2.13.0" in text and '"torch==${TORCH_VERSION}"' in text


@pytest.mark.parametrize("path", [DEPLOY / "slurm" / "farloco.sbatch", DEPLOY / "k8s" / "init-secrets.sh"])
def test_shell_syntax(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_slurm_script_wires_bootstrap_and_nodes() -> None:
    """The static half; tests/test_slurm.py runs the script on a real Slurm cluster (leave, time limit, resume)."""
    text = (DEPLOY / "slurm" / "farloco.sbatch").read_text()
    # A fixed --signal=TERM@N is wrong for every job shorter than N (it fires at once): the script sizes the
    # leave from the config's timeouts.leave_timeout and the job's own time limit instead.
    assert not re.search(r"^#SBATCH --signal", text, flags=re.M)
    assert "timeouts.leave_timeout" in text and "squeue -h -j" in text
    joins = [
        c for c in COMMAND_LINES if c.where.startswith("deploy/slurm") and c.argv[:2] == ("join", "--config")
    ]
    assert joins and all("--initial-peer" in c.argv for c in joins)
    assert "--maddr-file" in next(
        c.argv for c in COMMAND_LINES if c.where.startswith("deploy/slurm") and c.argv[0] == "bootstrap"
    )


def test_k8s_island_is_a_statefulset_whose_pod_0_hosts_the_rendezvous() -> None:
    """deploy/k8s/islands: one StatefulSet per island; its pods name the island and pod 0's stable DNS name as the
    rendezvous endpoint, which their config accepts, with the base ConfigMap's [run] (island_slices set)."""
    documents = [
        d for d in yaml.safe_load_all((DEPLOY / "k8s" / "islands" / "island-a.yaml").read_text()) if d
    ]
    (statefulset,) = [d for d in documents if d["kind"] == "StatefulSet"]
    (service,) = [d for d in documents if d["kind"] == "Service"]
    spec = statefulset["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    args = container["args"]
    island, endpoint = _option_value(args, "--island"), _option_value(args, "--island-endpoint")
    host, port = endpoint.rsplit(":", 1)
    name = statefulset["metadata"]["name"]
    assert host == f"{name}-0.{spec['serviceName']}" and service["metadata"]["name"] == spec["serviceName"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert {"name": "island", "containerPort": int(port)} in container["ports"]
    # The island's pods are not the base StatefulSet's: their labels do not match its selector.
    base = _k8s("StatefulSet", "farloco")["spec"]["selector"]["matchLabels"]
    labels = spec["template"]["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in base.items())
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    config = build_config(
        tomllib.loads(_k8s("ConfigMap", "farloco-node")["data"]["node.toml"]),
        [f"node.island={island!r}", f"node.island_endpoint={endpoint!r}", "node.island_size=2"],
    )
    assert config.run.island_slices >= spec["replicas"]
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "islands" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../", "island-a.yaml"]
