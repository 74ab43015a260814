"""A real Slurm cluster on loopback for the tests: munge, slurmctld and N emulated `slurmd -N` nodes.

Everything lives in one temporary directory: the munge key and socket, a generated slurm.conf (every port drawn
free at start, nodes n1..nN on 127.0.0.1 with a port each), state, spool and logs. `SLURM_CONF` in `env` points
the client commands (sbatch, squeue, scancel, scontrol) at it. `stop()` cancels what is still queued or running,
waits for it, then ends the daemons it started, by pid, and only those.

Needs Debian's packages (`apt-get install slurmctld slurmd slurm-client munge`) and root (slurmd runs jobs as
their user); `unavailable()` says why not, so tests can skip with a reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here (None: it can)."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; `{INSTALL}`)"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd starts jobs as their user)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """`nodes` emulated Slurm nodes on this host (see the module docstring). Use as a context manager."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, memory_mb: int = 4000) -> None:
        self.root = root
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus, self.memory_mb = cpus, memory_mb
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.env: dict[str, str] = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start and stop ---------------------------------------------------------------------------------

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (handed to the process)
        with log:
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        # munged insists that the socket's directory can be entered by everyone (clients of any user).
        (self.root / "munge").chmod(0o711)
        self.root.chmod(0o711)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = self.root / "munge" / "socket"
        ports = _free_ports(2 + len(self.names))
        host = socket.gethostname()
        node_lines = [
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} State=UNKNOWN"
            for name, port in zip(self.names, ports[2:], strict=True)
        ]
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=farloco-test",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={ports[0]}",
                    f"SlurmdPort={ports[1]}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={sock}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool/%n",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd-%n.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd-%n.log",
                    # No cgroups in a container: track a job's processes by their parent pids.
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/backfill",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "KillWait=30",
                    "InactiveLimit=0",
                    "MinJobAge=300",
                    *node_lines,
                    f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=YES",
                    "",
                ]
            )
        )
        try:
            self._daemon(
                "munged",
                [
                    "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={r}/munge/pid", f"--log-file={r}/log/munged.log",
                    f"--seed-file={r}/munge/seed",
                ],
            )  # fmt: skip
            self._wait(lambda: sock.exists(), timeout, "munged's socket")
            self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for name in self.names:
                self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout, f"nodes {self.names} idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(name) == "idle" for name in self.names)

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():  # type: ignore[operator]
            for proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmError(f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}:\n"
                                     + self.logs())  # fmt: skip
            if time.monotonic() > deadline:
                raise SlurmError(f"not within {timeout:.0f} s: {what}\n" + self.logs())
            time.sleep(0.2)

    def logs(self) -> str:
        """The tail of each daemon's log, without the lines every start of Debian's build writes (PMIx)."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            lines = [
                line
                for line in path.read_text(errors="replace").splitlines()
                if "pmix" not in line.lower() and "MPI: Cannot create context" not in line
            ]
            parts.append(f"--- {path.name}\n" + "\n".join(lines[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job still there and wait for them, then end the daemons we started."""
        if any(p.poll() is None for p in self.procs) and self.conf.exists():
            self.run("scancel", "--full", "--signal=KILL", *self.job_ids(), check=False)
            deadline = time.monotonic() + 30
            while self.job_ids() and time.monotonic() < deadline:
                time.sleep(0.3)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- jobs -------------------------------------------------------------------------------------------

    def run(
        self, *argv: str, check: bool = True, env: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv, capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=timeout
        )
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}")
        return result

    def job_ids(self) -> list[str]:
        if not any(p.poll() is None for p in self.procs):
            return []
        out = self.run("squeue", "-h", "-o", "%i", check=False).stdout
        return out.split()

    def sbatch(self, *argv: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        result = subprocess.run(
            ["sbatch", "--parsable", *argv],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=cwd,
            timeout=30,
        )
        if result.returncode != 0:
            raise SlurmError(
                f"sbatch {' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (empty once the job is gone)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        fields = {}
        for part in out.split():
            key, _, value = part.partition("=")
            fields[key] = value
        return fields

    def wait_job(self, job_id: str, timeout: float, states: tuple[str, ...] = ("COMPLETED", "FAILED",
                 "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:  # fmt: skip
        """Until the job is in one of `states`; its fields then."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"job {job_id} not in {states} within {timeout:.0f} s: {fields}\n" + self.logs()
                )
            time.sleep(0.3)
