"""deploy/compose.yaml and the Dockerfiles, run the way Docker runs them, without Docker.

Each compose service gets what its container would: a network namespace of its own on a bridge (the compose
network), its service name as hostname (a UTS namespace) and every service's name in its /etc/hosts (what Docker's
embedded DNS answers), the image's ENV and WORKDIR from deploy/Dockerfile.cpu, and the command compose builds: the
service's `entrypoint` (or the image's ENTRYPOINT) followed by its `command` (or, without an entrypoint of its own,
the image's CMD), with compose's `$$` escapes undone, under tini as PID 1's stand-in. The stop is `docker compose
stop`'s: SIGTERM to tini, waited for at most `stop_grace_period`; the health check runs the service's
`healthcheck.test` in the service's namespace within its `timeout`.

What differs from Docker, and only this: container paths (volumes, configs, secrets, the image's /data) are mapped to
directories of the test by rewriting them in the command and environment; the processes run as root; the test's
virtualenv stands in for the image's `pip install .` (its bin first on PATH). Needs root, iproute2, unshare and
tini; skips naming what is missing, and removes the namespaces and /etc/netns entries it made.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

from farloco.node.tools.demo import read_events, stop_process
from farloco.node.tools.netns import NamespaceWAN, unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(420)]

DEPLOY = ROOT / "deploy"
ETC_NETNS = Path("/etc/netns")
PEERS = ("peer1", "peer2")  # `docker compose up bootstrap peer1 peer2`: two peers keep the suite's time down


@dataclass
class Image:
    """What a Dockerfile gives a container at run time."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"


def read_dockerfile(path: Path) -> Image:
    """ENTRYPOINT, CMD (exec form), ENV and the last WORKDIR of a Dockerfile (continuations joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    image = Image([], [])
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword in ("ENTRYPOINT", "CMD"):
            value = json.loads(
                rest
            )  # exec form: the shell form would put `sh -c` in front, and tini behind it
            assert isinstance(value, list), f"{path.name}: {keyword} must be in exec form, got {rest!r}"
            setattr(image, keyword.lower(), value)
        elif keyword == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                image.env[key] = value
        elif keyword == "WORKDIR":
            image.workdir = rest.strip()
    return image


def unescape(value: str) -> str:
    """Compose's interpolation: `$$` is a literal `$`; any other `$` would be replaced from the environment, which
    the files must not rely on."""
    bare = re.findall(r"(?<!\$)\$(?!\$)[{\w]", value.replace("$$", ""))
    assert not bare, f"compose would interpolate {bare} from the environment in {value!r}"
    return value.replace("$$", "$")


def service_command(service: dict[str, Any], image: Image) -> list[str]:
    """The argv compose starts: entrypoint + command, as `docker compose` combines them."""
    entrypoint = service.get("entrypoint", image.entrypoint)
    command = service.get("command", [] if "entrypoint" in service else image.cmd)
    entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    command = shlex.split(command) if isinstance(command, str) else list(command)
    return [unescape(str(part)) for part in [*entrypoint, *command]]


class Mounts:
    """Container paths -> the test's directories, applied by rewriting strings."""

    def __init__(self) -> None:
        self.paths: dict[str, Path] = {}

    def add(self, container: str, host: Path) -> None:
        self.paths[container.rstrip("/")] = host

    def map(self, value: str) -> str:
        for container in sorted(self.paths, key=len, reverse=True):  # /data/run before /data
            pattern = r"(?<![\w./-])" + re.escape(container) + r"(?=/|$|[\s\"'])"
            value = re.sub(pattern, lambda _, c=container: str(self.paths[c]), value)
        return value


def service_mounts(
    name: str, service: dict[str, Any], compose: dict[str, Any], image: Image, root: Path, secret: Path
) -> Mounts:
    mounts = Mounts()
    # The image's WORKDIR and VOLUME (/data) exist in every container even without a volume of the service's own.
    for container in {image.workdir, "/data", "/shared"}:
        host = root / name / container.strip("/").replace("/", "_")
        host.mkdir(parents=True, exist_ok=True)
        mounts.add(container, host)
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        host = root / "volumes" / source
        host.mkdir(parents=True, exist_ok=True)
        mounts.add(target, host)
    for config in service.get("configs", []):
        mounts.add(config["target"], DEPLOY / compose["configs"][config["source"]]["file"])
    for name_ in service.get("secrets", []):
        mounts.add(f"/run/secrets/{name_}", secret)
    return mounts


def in_container(wan: NamespaceWAN, i: int, hostname: str, argv: list[str]) -> list[str]:
    """Run argv inside service i's namespace, under its hostname (`ip netns exec` and `unshare` both exec, so
    the pid is argv's own: tini's, as PID 1 is in a container)."""
    return [
        *wan.prefix_command(i),
        "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv,
    ]  # fmt: skip


def missing() -> str | None:
    if (why := unavailable()) is not None:
        return why
    for tool in ("unshare", "tini", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {'util-linux' if tool == 'unshare' else tool})"
    return None


def together(run_dirs: list[Path], rounds: int) -> list[int]:
    """Round ids every run dir committed in a group of all of them, with one outer hash."""
    by_dir = [
        {
            e["round_id"]: e
            for e in read_events(d)
            if e["event"] == "round" and len(e["group"]) == len(run_dirs)
        }
        for d in run_dirs
    ]
    common = set.intersection(*(set(b) for b in by_dir))
    agreed = sorted(r for r in common if len({b[r]["outer_hash"] for b in by_dir}) == 1)
    return agreed if len(agreed) >= rounds else []


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_an_image_run_without_a_command_prints_the_cli_help(dockerfile: str) -> None:
    """`docker run farloco:cpu`: ENTRYPOINT + CMD, under tini."""
    if shutil.which("tini") is None:
        pytest.skip("tini is not installed (apt-get install tini)")
    image = read_dockerfile(DEPLOY / dockerfile)
    assert image.entrypoint[:2] == ["tini", "--"], "tini forwards SIGTERM to farloco and reaps its ranks"
    env = {**os.environ, **image.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        [*image.entrypoint, *image.cmd], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "Usage: farloco" in result.stdout
    for command in ("join", "leave", "status", "bootstrap", "demo"):
        assert re.search(rf"^\s+{command}\b", result.stdout, re.M), f"`{command}` missing from the help"


def test_the_compose_services_train_as_one_swarm_answer_their_healthcheck_and_stop_cleanly(
    tmp_path: Path,
) -> None:
    if (why := missing()) is not None:
        pytest.skip(why)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    image = read_dockerfile(DEPLOY / Path(services["bootstrap"]["build"]["dockerfile"]).name)
    names = ["bootstrap", *PEERS]
    for name in PEERS:
        assert services[name]["depends_on"] == ["bootstrap"]
    secret = tmp_path / "run-secret"
    secret.write_text("ab" * 32 + "\n")  # what the compose header asks the user to make once
    secret.chmod(0o600)
    venv_path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    processes: dict[str, subprocess.Popen[bytes]] = {}
    etc_netns: list[Path] = []
    made_etc_netns = not ETC_NETNS.exists()
    with NamespaceWAN(len(names), "1gbit") as wan:
        try:
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{wan.address(i)} {name}\n" for i, name in enumerate(names, 1)
            )
            for i in range(1, len(names) + 1):
                # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts: Docker's service names.
                directory = ETC_NETNS / wan.namespace(i)
                directory.mkdir(parents=True, exist_ok=True)
                etc_netns.append(directory)
                (directory / "hosts").write_text(hosts)
            mounts: dict[str, Mounts] = {}
            for i, name in enumerate(names, 1):  # depends_on: the bootstrap first
                service = services[name]
                mounts[name] = service_mounts(name, service, compose, image, tmp_path, secret)
                argv = [mounts[name].map(part) for part in service_command(service, image)]
                env = {
                    **os.environ,
                    **{k: mounts[name].map(v) for k, v in image.env.items()},
                    "PATH": venv_path,
                }
                log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
                processes[name] = subprocess.Popen(
                    in_container(wan, i, name, argv),
                    cwd=mounts[name].map(image.workdir),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

            def log_tail(name: str) -> str:
                return (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]

            run_dirs = [Path(mounts[name].map("/data/run")) for name in PEERS]
            deadline = time.monotonic() + 150
            while not (agreed := together(run_dirs, 2)):
                for name, process in processes.items():
                    assert process.poll() is None, f"{name} exited {process.returncode}:\n{log_tail(name)}"
                assert time.monotonic() < deadline, "no 2 rounds with both peers in 150 s:\n" + "\n".join(
                    f"--- {name}\n{log_tail(name)}" for name in names
                )
                time.sleep(1.0)
            # Each peer announced its own container address (the compose script's gethostbyname(gethostname())),
            # and the gRPC port the service gave it: how peer1 sees the swarm, asked in its container.
            result = subprocess.run(
                in_container(wan, 2, "peer1", ["farloco", "peers", "--run-dir", str(run_dirs[0]), "--json"]),
                capture_output=True, text=True, timeout=30, env={**os.environ, "PATH": venv_path},
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            addresses = sorted(m["address"] for m in json.loads(result.stdout))
            assert addresses == [f"{wan.address(i)}:31338" for i in (2, 3)], addresses

            # The healthcheck, as Docker runs it: in the container, within its timeout, healthy on exit 0.
            for i, name in enumerate(PEERS, 2):
                check = services[name]["healthcheck"]
                assert check["test"][0] == "CMD"
                argv = [mounts[name].map(unescape(part)) for part in check["test"][1:]]
                seconds = float(str(check["timeout"]).rstrip("s"))
                result = subprocess.run(
                    in_container(wan, i, name, argv),
                    capture_output=True, text=True, timeout=seconds, env={**os.environ, "PATH": venv_path},
                )  # fmt: skip
                assert result.returncode == 0, f"{name} unhealthy: {result.stderr}"
                status = json.loads(result.stdout)
                assert status["state"] == "training", status
                assert status["round_id"] >= agreed[0], (status, agreed)

            # `docker compose stop peer2`: SIGTERM to tini, SIGKILL after stop_grace_period.
            grace = services["peer2"]["stop_grace_period"]
            assert services["peer2"]["stop_signal"] == "SIGTERM"
            grace_s = 60.0 * float(grace.rstrip("m")) if grace.endswith("m") else float(grace.rstrip("s"))
            started = time.monotonic()
            processes["peer2"].send_signal(signal.SIGTERM)
            code = processes["peer2"].wait(timeout=grace_s)
            took = time.monotonic() - started
            assert code == 0, f"peer2 exited {code} on SIGTERM:\n{log_tail('peer2')}"
            events = read_events(run_dirs[1])
            assert events[-1]["event"] == "stopped", events[-3:]
            assert not [e for e in events if e["event"] == "trainer_failed"], log_tail("peer2")
            print(f"docker compose stop peer2 -> exit 0 in {took:.1f} s")
        finally:
            stop_process(*processes.values())
            for directory in etc_netns:
                shutil.rmtree(directory, ignore_errors=True)
            if made_etc_netns and ETC_NETNS.exists() and not any(ETC_NETNS.iterdir()):
                ETC_NETNS.rmdir()
    leftover = [d for d in etc_netns if d.exists()]
    assert not leftover, f"left behind: {leftover}"
