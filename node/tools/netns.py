"""A simulated WAN on one Linux machine: N network namespaces, one per "host", joined through a hub namespace.

Each host i gets its own namespace (`{prefix}{i}`) with one veth uplink into a hub namespace of its own
(`{prefix}br`), and both directions of every uplink are shaped with `tc tbf` to `rate`. Two hub kinds:

- a bridge (the default): host i is 10.{net}.0.i/24 (with `ipv6`: fd00:{net:x}::{i:x}/64 and no IPv4 address),
  every host on one L2 segment;
- a router with the userspace netem relay (`relay=True`, implied by a delay, jitter or loss): host i is
  10.{net}.i.2/24 behind 10.{net}.i.1, and the hub routes every packet arriving from an uplink through a TUN
  device served by `farloco.node.tools.netem` (delay, jitter, loss, stalls without FIN, partitions: no netem
  in the kernels this project runs on). `set_path`, `stall`, `partition` and `heal` change them while traffic
  flows.

The root namespace is never touched. Processes run inside host i through `prefix_command(i)` (`ip netns exec`).
With `cpus`, each host is also a machine of that many cores: its processes run in a CPU cgroup of their own
(v2, or v1's cpu controller) capped by CFS quota, so hosts that share this machine's cores cannot borrow each
other's idle time (a host waiting on its link leaves its share unused, as a real machine would); `set_cpus`
changes one host's cap (a straggler at half speed).
Needs root and iproute2; `unavailable()` says why not, so tests can skip with a reason. Every namespace made is
removed by `down()` (and on leaving the context manager), also when `up()` fails half-way; `up()` first removes
the namespaces of earlier WANs whose process is gone (a harness that crashed or was SIGKILLed).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from farloco.node.tools.netem import write_rules

# Namespaces this module makes are named fl<pid % 100000>h...: the pid of the process that made them.
STALE_NAME = re.compile(r"^fl(\d{1,5})h")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")


# Each namespace's own /etc/resolv.conf (`ip netns exec` bind-mounts /etc/netns/<name>/*): a simulated host has no
# DNS, and says so at once. With the machine's resolver, a lookup from behind the hub is routed into the void and
# waits out its timeouts: torch's TCPStore names every client it accepts (a reverse lookup of ::ffff:127.0.0.1,
# which /etc/hosts does not answer), so each rank start of a node in a namespace stalled 10 s per connection.
NETNS_ETC = Path("/etc/netns")
NO_DNS = "# a farloco simulated WAN host: no DNS (nothing listens here, so every lookup fails at once)\n"
NO_DNS += "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def _add_namespace(name: str) -> None:
    _ip("netns", "add", name)
    etc = NETNS_ETC / name
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text(NO_DNS)


def _del_namespace(name: str) -> None:
    try:
        _ip("netns", "del", name)
    finally:
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        with contextlib.suppress(OSError):  # /etc/netns itself, once no namespace's files are left in it
            NETNS_ETC.rmdir()


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"flprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


def nat_unavailable() -> str | None:
    """Why hosts behind NAT cannot be made here (None: they can): namespaces, plus nftables."""
    return unavailable() or (None if shutil.which("nft") else "nftables (nft) is not installed")


def relay_unavailable() -> str | None:
    """Why a WAN with the netem relay cannot be made here (None: it can): namespaces, plus a TUN device."""
    reason = unavailable()
    if reason is not None:
        return reason
    if shutil.which("sysctl") is None:
        return "sysctl (procps) is not installed"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return f"the netem relay needs a TUN device: /dev/net/tun: {exc.strerror}"
    return None


CPU_PERIOD_US = 100_000


def _cpu_cgroup_root() -> Path | None:
    """Where CPU cgroups can be made: cgroup v2 with the cpu controller, or v1's cpu hierarchy (None: neither)."""
    base = Path("/sys/fs/cgroup")
    controllers = base / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return base
    if (base / "cpu" / "cpu.cfs_quota_us").exists():
        return base / "cpu"
    return None


def cpu_cap_unavailable() -> str | None:
    """Why hosts cannot be given CPU caps here (None: they can)."""
    root = _cpu_cgroup_root()
    if root is None:
        return "no CPU cgroup controller (cgroup v2 with cpu, or v1's cpu hierarchy) under /sys/fs/cgroup"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (CPU caps need root)"
    return None


def _set_cpu_quota(group: Path, cpus: float) -> None:
    quota = max(1000, round(cpus * CPU_PERIOD_US))
    if (group / "cpu.max").exists():  # v2
        (group / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))


def _remove_cgroup(group: Path) -> None:
    """Remove a cgroup this module made; processes still in it move to the parent first."""
    if not group.is_dir():
        return
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


def _live_pid_suffixes() -> set[int]:
    return {int(entry) % 100000 for entry in os.listdir("/proc") if entry.isdigit()}


def remove_stale_namespaces() -> list[str]:
    """Remove the namespaces left by a WAN whose process is gone (crashed, SIGKILLed); returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    alive = _live_pid_suffixes()
    removed = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = STALE_NAME.match(name)
        if match and int(match.group(1)) not in alive:
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                _del_namespace(name)
                removed.append(name)
    if NETNS_ETC.is_dir():  # the resolv.conf folders of namespaces already gone
        for folder in NETNS_ETC.iterdir():
            match = STALE_NAME.match(folder.name)
            if match and int(match.group(1)) not in alive:
                shutil.rmtree(folder, ignore_errors=True)
    root = _cpu_cgroup_root()
    if root is not None:
        for group in root.iterdir():
            match = STALE_NAME.match(group.name)
            if group.is_dir() and match and int(match.group(1)) not in alive:
                _remove_cgroup(group)
                removed.append(str(group))
    return removed


class NamespaceWAN:
    """`hosts` namespaces on a shaped hub (see the module docstring). Use as a context manager."""

    def __init__(
        self,
        hosts: int,
        rate: str = "100mbit",
        *,
        prefix: str | None = None,
        net: int = 77,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        relay: bool | None = None,
        mtu: int = 9000,
        cpus: float | None = None,
        ipv6: bool = False,
        nat: Sequence[int] = (),
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        if not 0 <= net <= 255:
            raise ValueError(f"net must be in 0..255, got {net}")
        # Short and unique per process: interface names are limited to 15 characters.
        self.prefix = prefix if prefix is not None else f"fl{os.getpid() % 100000}h"
        if len(self.prefix) > 9:
            raise ValueError(f"prefix must be at most 9 characters (interface names), got {self.prefix!r}")
        self.hosts, self.rate, self.net = hosts, rate, net
        self.made: list[str] = []
        self.relay = relay if relay is not None else bool(delay_ms or jitter_ms or loss)
        if ipv6 and self.relay:
            raise ValueError("ipv6=True needs the bridge hub (no delay, jitter, loss or relay)")
        self.ipv6 = ipv6
        self.nat = frozenset(nat)
        if self.nat and (self.relay or ipv6):
            raise ValueError("nat needs the IPv4 bridge hub (no delay, jitter, loss, relay or ipv6)")
        if not self.nat <= set(range(1, hosts + 1)):
            raise ValueError(f"nat: expected host numbers in 1..{hosts}, got {sorted(self.nat)}")
        self.mtu = mtu
        if cpus is not None and not cpus > 0:
            raise ValueError(f"cpus must be a positive number of cores per host, got {cpus}")
        self.cpus = cpus
        self.cgroups: dict[int, Path] = {}
        self.rules: dict[str, Any] = {"default": {"delay_ms": delay_ms, "jitter_ms": jitter_ms, "loss": loss}}
        self._relay_process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def namespace(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def address(self, i: int) -> str:
        """The address host i binds: behind NAT its private one (nobody else can dial it)."""
        if i in self.nat:
            return f"192.168.{i}.2"
        return self.public_address(i)

    def public_address(self, i: int) -> str:
        """Host i's address on the hub: behind NAT, its router's (what the others see its connections come from)."""
        if self.ipv6:
            return f"fd00:{self.net:x}::{i:x}"
        return f"10.{self.net}.{i}.2" if self.relay else f"10.{self.net}.0.{i}"

    def prefix_command(self, i: int) -> Sequence[str]:
        """Run a command inside host i: `[*prefix_command(i), *command]` (it execs, so the pid is the command's;
        with CPU caps it first moves itself into host i's cgroup, and its children stay there)."""
        netns = ("ip", "netns", "exec", self.namespace(i))
        if i not in self.cgroups:
            return netns
        # Joined before entering the namespace: `ip netns exec` remounts /sys, without the cgroup hierarchies.
        procs = self.cgroups[i] / "cgroup.procs"
        return ("sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *netns)

    def _shape(self, i: int, rate: str, verb: str) -> None:
        """tc tbf on both directions of host i's uplink (its veth end and the hub's)."""
        uplink = f"{self.prefix}n{i}" if i in self.nat else self.namespace(i)  # behind NAT: the router's
        ends = ((uplink, f"{self.prefix}v{i}"), (f"{self.prefix}br", f"{self.prefix}p{i}"))
        for ns, dev in ends:
            result = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
                 "rate", rate, "burst", "256kb", "latency", "100ms"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if result.returncode != 0:
                raise RuntimeError(f"tc qdisc {verb} tbf rate {rate} on {dev}: {result.stderr.strip()}")

    def set_rate(self, i: int, rate: str) -> None:
        """Shape host i's uplink (both directions) to `rate` from now on, e.g. a straggler's slower link."""
        self._shape(i, rate, "change")

    def set_cpus(self, i: int, cpus: float) -> None:
        """Cap host i at `cpus` cores from now on (the WAN must have been made with `cpus`)."""
        if i not in self.cgroups:
            raise RuntimeError("CPU caps need NamespaceWAN(cpus=...)")
        if not cpus > 0:
            raise ValueError(f"cpus must be positive, got {cpus}")
        _set_cpu_quota(self.cgroups[i], cpus)

    def up(self) -> NamespaceWAN:
        remove_stale_namespaces()
        hub = f"{self.prefix}br"
        try:
            _add_namespace(hub)
            self.made.append(hub)
            _ip("-n", hub, "link", "set", "lo", "up")
            if not self.relay:
                _ip("-n", hub, "link", "add", "br0", "type", "bridge")
                _ip("-n", hub, "link", "set", "br0", "up")
            for i in range(1, self.hosts + 1):
                host, inner, outer = self.namespace(i), f"{self.prefix}v{i}", f"{self.prefix}p{i}"
                _add_namespace(host)
                self.made.append(host)
                _ip(
                    "link",
                    "add",
                    inner,
                    "mtu",
                    str(self.mtu),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outer,
                    "mtu",
                    str(self.mtu),
                )
                _ip("link", "set", inner, "netns", host)
                _ip("link", "set", outer, "netns", hub)
                if self.relay:
                    _ip("-n", hub, "addr", "add", f"10.{self.net}.{i}.1/24", "dev", outer)
                    _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                elif self.ipv6:  # no duplicate address detection: the address works at once
                    _ip("-n", hub, "link", "set", outer, "master", "br0")
                    _ip("-n", host, "-6", "addr", "add", f"{self.address(i)}/64", "dev", inner, "nodad")
                elif i in self.nat:
                    _ip("-n", hub, "link", "set", outer, "master", "br0")
                    self._nat_router(i)
                else:
                    _ip("-n", hub, "link", "set", outer, "master", "br0")
                    _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                _ip("-n", hub, "link", "set", outer, "up")
                if i not in self.nat:  # behind NAT the uplink is the router's (up already)
                    _ip("-n", host, "link", "set", inner, "up")
                _ip("-n", host, "link", "set", "lo", "up")
                if self.relay:
                    _ip("-n", host, "route", "add", "default", "via", f"10.{self.net}.{i}.1")
                if i in self.nat:
                    _ip("-n", host, "route", "add", "default", "via", f"192.168.{i}.1")
                self._shape(i, self.rate, "add")
            if self.relay:
                self._start_relay(hub)
            if self.cpus is not None:
                reason = cpu_cap_unavailable()
                root = _cpu_cgroup_root()
                if reason is not None or root is None:
                    raise RuntimeError(f"cannot cap the hosts' CPUs: {reason}")
                control = root / "cgroup.subtree_control"  # v2: the children get cpu.max only once enabled
                if control.exists() and "cpu" not in control.read_text().split():
                    control.write_text("+cpu")
                for i in range(1, self.hosts + 1):
                    group = root / self.namespace(i)
                    group.mkdir()
                    self.cgroups[i] = group
                    _set_cpu_quota(group, self.cpus)
        except BaseException:
            self.down()
            raise
        return self

    def _nat_router(self, i: int) -> None:
        """Host i behind a router namespace of its own that masquerades: the uplink ({prefix}v{i}, made in host
        i's namespace) moves into the router with host i's public address, host i gets 192.168.i.2 behind it. The
        router forwards and masquerades what host i opens and drops every connection from outside: host i can
        dial out, nobody can dial in (a home router, a VPC's NAT gateway, an HPC cluster's compute node)."""
        host, router = self.namespace(i), f"{self.prefix}n{i}"
        uplink, inside, outside = f"{self.prefix}v{i}", f"{self.prefix}x{i}", f"{self.prefix}y{i}"
        _add_namespace(router)
        self.made.append(router)
        _ip("-n", host, "link", "set", uplink, "netns", router)
        _ip("-n", router, "addr", "add", f"{self.public_address(i)}/24", "dev", uplink)
        _ip("-n", router, "link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("-n", router, "link", "set", outside, "netns", host)
        _ip("-n", router, "addr", "add", f"192.168.{i}.1/24", "dev", inside)
        _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", outside)
        for ns, dev in ((router, uplink), (router, inside), (router, "lo"), (host, outside)):
            _ip("-n", ns, "link", "set", dev, "up")
        rules = f"""
table ip farloco_nat {{
    chain forward {{
        type filter hook forward priority 0; policy drop;
        iifname "{inside}" oifname "{uplink}" accept
        iifname "{uplink}" oifname "{inside}" ct state established,related accept
    }}
    chain postrouting {{
        type nat hook postrouting priority 100;
        oifname "{uplink}" masquerade
    }}
}}
"""
        for command, stdin in (
            (["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], None),
            (["nft", "-f", "-"], rules),
        ):
            result = subprocess.run(
                ["ip", "netns", "exec", router, *command],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if result.returncode != 0:
                raise RuntimeError(f"NAT router of host {i}: {' '.join(command)}: {result.stderr.strip()}")

    def _start_relay(self, hub: str) -> None:
        """Forwarding in the hub, every uplink's packets routed into the relay's TUN device, the relay started."""
        self._workdir = tempfile.TemporaryDirectory(prefix="farloco-wan-")
        rules, ready = Path(self._workdir.name) / "rules.json", Path(self._workdir.name) / "ready"
        write_rules(rules, self.rules)
        for key in (
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ):
            subprocess.run(
                ["ip", "netns", "exec", hub, "sysctl", "-qw", key],
                check=True,
                capture_output=True,
                timeout=30,
            )
        tun = f"{self.prefix}t"
        self._relay_process = subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, "-m", "farloco.node.tools.netem",
             "--tun", tun, "--rules", str(rules), "--net", str(self.net), "--ready", str(ready)],
            stdout=subprocess.DEVNULL, stderr=open(Path(self._workdir.name) / "relay.log", "wb"),  # noqa: SIM115
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self._relay_process.poll() is not None or time.monotonic() > deadline:
                log = (Path(self._workdir.name) / "relay.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the netem relay did not start: {log}")
            time.sleep(0.05)
        _ip("-n", hub, "link", "set", tun, "mtu", str(self.mtu), "up")
        subprocess.run(
            ["ip", "netns", "exec", hub, "sysctl", "-qw", f"net.ipv4.conf.{tun}.rp_filter=0"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _ip("-n", hub, "route", "add", "default", "dev", tun, "table", "100")
        for i in range(1, self.hosts + 1):
            _ip("-n", hub, "rule", "add", "iif", f"{self.prefix}p{i}", "lookup", "100")

    def _rewrite_rules(self) -> None:
        if not self.relay or self._workdir is None:
            raise RuntimeError("delay, loss, stalls and partitions need NamespaceWAN(relay=True)")
        write_rules(Path(self._workdir.name) / "rules.json", self.rules)

    def set_path(self, src: int, dst: int, **rule: float) -> None:
        """Give the path src -> dst its own delay_ms, jitter_ms and/or loss (one direction)."""
        self.rules.setdefault("paths", {})[f"{src}>{dst}"] = rule
        self._rewrite_rules()

    def stall(self, src: int, dst: int) -> None:
        """Drop every packet src -> dst from now on, silently (no FIN, no RST): a half-open link."""
        self.rules.setdefault("stalled", []).append(f"{src}>{dst}")
        self._rewrite_rules()

    def partition(self, *groups: Sequence[int]) -> None:
        """Drop every packet between hosts of different groups (hosts in no group are cut from all)."""
        self.rules["partition"] = [list(group) for group in groups]
        self._rewrite_rules()

    def heal(self) -> None:
        """Undo `stall` and `partition` (per-path delays and loss stay)."""
        self.rules.pop("stalled", None)
        self.rules.pop("partition", None)
        self._rewrite_rules()

    def cut(self, i: int) -> None:
        """Partition host i from every other host (its uplink goes down on the bridge side): a network split
        that neither side can tell from the other's crash."""
        _ip("-n", f"{self.prefix}br", "link", "set", f"{self.prefix}p{i}", "down")

    def mend(self, i: int) -> None:
        """Undo `cut(i)`."""
        _ip("-n", f"{self.prefix}br", "link", "set", f"{self.prefix}p{i}", "up")

    def down(self) -> None:
        """Stop the relay and remove every namespace this WAN made (their veths go with them)."""
        if self._relay_process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._relay_process.send_signal(signal.SIGTERM)
            try:
                self._relay_process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._relay_process.kill()
                self._relay_process.wait(timeout=10)
            self._relay_process = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        for group in self.cgroups.values():
            _remove_cgroup(group)
        self.cgroups.clear()
        errors = []
        for ns in reversed(self.made):
            try:
                _del_namespace(ns)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self.made.clear()
        if errors:
            raise RuntimeError("could not remove every namespace: " + "; ".join(errors))

    def __enter__(self) -> NamespaceWAN:
        return self.up()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.down()
