"""The WAN harness itself (node/tools/netns.py with the userspace netem relay of node/tools/netem.py): hosts in
network namespaces see the delay, the rate, the loss, a stall without FIN and a partition they were given, and
nothing is left behind, in the root namespace or after a harness that was SIGKILLed. Needs root and iproute2:
skips with the reason elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from farloco.node.tools.netem import Rules
from farloco.node.tools.netns import (
    NamespaceWAN,
    cpu_cap_unavailable,
    relay_unavailable,
    remove_stale_namespaces,
)

pytestmark = [pytest.mark.multiprocess]

# Runs inside a host: a TCP or UDP echo server, or a client measuring what came back (one JSON line).
PROBE = textwrap.dedent(
    """
    import json, socket, sys, time
    mode, host = sys.argv[1], sys.argv[2]
    if mode == "tcp-server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 9000)); s.listen()
        print("ready", flush=True)
        while True:
            c, _ = s.accept()
            while data := c.recv(1 << 20):
                c.sendall(data)
    elif mode == "udp-server":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((host, 9001)); s.settimeout(3)
        print("ready", flush=True)
        got = 0
        try:
            while True:
                s.recv(2048); got += 1
        except TimeoutError:
            print(json.dumps({"received": got}), flush=True)
    elif mode == "udp-client":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(int(sys.argv[3])):
            s.sendto(b"x" * 1000, (host, 9001)); time.sleep(0.0005)
    else:  # tcp-client: round-trip time of 1-byte echoes, then the time to echo N bytes
        c = socket.create_connection((host, 9000), timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(9):
            t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
        size = int(sys.argv[3]); t = time.perf_counter(); c.sendall(b"y" * size); got = 0
        while got < size:
            got += len(c.recv(1 << 20))
        print(json.dumps({"rtt_ms": sorted(rtts)[4] * 1000, "seconds": time.perf_counter() - t}), flush=True)
    """
)


@pytest.fixture
def root_ok() -> None:
    reason = relay_unavailable()
    if reason is not None:
        pytest.skip(reason)


def server(wan: NamespaceWAN, i: int, mode: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [*wan.prefix_command(i), sys.executable, "-c", PROBE, mode, wan.address(i)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def client(wan: NamespaceWAN, i: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*wan.prefix_command(i), sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def echo(wan: NamespaceWAN, src: int, dst: int, size: int = 1) -> dict[str, float]:
    done = client(wan, src, "tcp-client", wan.address(dst), str(size))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def root_namespace() -> str:
    return "\n".join(
        subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30).stdout
        for args in (["link"], ["addr"], ["route"], ["rule"])
    )


def test_a_host_has_no_dns_and_says_so_at_once(root_ok: None) -> None:
    """Behind the relay every packet to the machine's own resolver is lost: a lookup would wait out its timeouts
    (10 s on this machine), and torch's TCPStore names each client it accepts, so every rank start of a node in
    a namespace stalled. Each namespace gets a resolv.conf of its own that fails at once."""
    script = (
        "import socket, time\nstart = time.monotonic()\n"
        "try:\n    socket.getnameinfo(('::ffff:127.0.0.1', 1), 0)\nexcept OSError:\n    pass\n"
        "print(time.monotonic() - start)"
    )
    with NamespaceWAN(2, "100mbit", delay_ms=5) as wan:
        resolv = Path("/etc/netns") / wan.namespace(1) / "resolv.conf"
        assert "nameserver 127.0.0.1" in resolv.read_text()
        out = subprocess.run(
            [*wan.prefix_command(1), sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout) < 1.0, out.stdout
    assert not resolv.parent.exists()


def test_rules_are_validated_and_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        Rules({"dealy": {}})
    with pytest.raises(ValueError, match="'src>dst' host numbers, got '1-2'"):
        Rules({"paths": {"1-2": {"delay_ms": 5}}})
    with pytest.raises(ValueError, match=r"loss must be in \[0, 1\], got 2"):
        Rules({"default": {"loss": 2}})
    rules = Rules({"default": {"delay_ms": 25}, "paths": {"1>3": {"loss": 0.5}}, "partition": [[1, 2], [3]]})
    assert rules.rule(1, 2) is not None and rules.rule(1, 2).delay_ms == 25  # type: ignore[union-attr]
    assert rules.rule(1, 3) is None and rules.rule(3, 3) is not None  # across the partition: dropped


def test_delay_rate_per_path_delay_and_nothing_left_in_the_root_namespace(root_ok: None) -> None:
    before = root_namespace()
    with NamespaceWAN(3, "20mbit", delay_ms=25) as wan:
        servers = [server(wan, i, "tcp-server") for i in (2, 3)]
        try:
            plain = echo(wan, 1, 2, size=2_000_000)
            # RTT = the two directions' 25 ms (plus the relay's own time on a busy machine)
            assert 50 <= plain["rtt_ms"] < 80, plain
            # 2 MB each way at 20 Mbit/s: at least 0.8 s; tbf makes the rate, the relay does not slow it 3x
            assert 0.75 <= plain["seconds"] < 4.0, plain
            wan.set_path(1, 3, delay_ms=100)  # one direction only: RTT 100 + 25
            slow = echo(wan, 1, 3)
            assert 125 <= slow["rtt_ms"] < 160, slow
            wan.set_rate(2, "4mbit")  # a straggler's link: 2 MB each way at 4 Mbit/s, at least 4 s
            assert 3.8 <= echo(wan, 1, 2, size=2_000_000)["seconds"] < 12.0
        finally:
            for process in servers:
                process.kill()
                process.wait()
    assert root_namespace() == before


def test_loss_drops_its_share_of_packets(root_ok: None) -> None:
    with NamespaceWAN(2, "100mbit", loss=0.3) as wan:
        receiver = server(wan, 2, "udp-server")
        try:
            sent = client(wan, 1, "udp-client", wan.address(2), "1000")
            assert sent.returncode == 0, sent.stderr
            out, _ = receiver.communicate(timeout=30)
        finally:
            receiver.kill()
    received = json.loads(out.strip().splitlines()[-1])["received"]
    assert 600 <= received <= 800, received  # 1000 x 0.7, binomial sd 14.5


def test_a_stall_is_silent_and_heals_and_a_partition_splits_groups(root_ok: None) -> None:
    with NamespaceWAN(3, "100mbit", relay=True) as wan:
        servers = [server(wan, i, "tcp-server") for i in (2, 3)]
        try:
            stalled_probe = textwrap.dedent(
                """
                import socket, sys, time
                c = socket.create_connection((sys.argv[1], 9000), timeout=10)
                c.sendall(b"a"); assert c.recv(1) == b"a"
                print("connected", flush=True); sys.stdin.readline()      # the test stalls the path now
                c.settimeout(2.0); c.sendall(b"b")
                try:
                    got = c.recv(1); print("answer", got, flush=True)     # b"" would be a FIN
                except TimeoutError:
                    print("silent", flush=True)
                except ConnectionError as exc:
                    print("reset", exc, flush=True)
                sys.stdin.readline()                                      # healed
                c.settimeout(30.0); print("after", c.recv(1), flush=True)  # TCP's retransmission gets through
                """
            )
            probe = subprocess.Popen(
                [*wan.prefix_command(1), sys.executable, "-c", stalled_probe, wan.address(2)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert probe.stdin is not None and probe.stdout is not None
            assert probe.stdout.readline().strip() == "connected"
            wan.stall(2, 1)  # the answers stop coming, and nothing says so
            time.sleep(0.2)
            probe.stdin.write("\n")
            probe.stdin.flush()
            assert probe.stdout.readline().strip() == "silent"
            wan.heal()
            probe.stdin.write("\n")
            probe.stdin.flush()
            assert probe.stdout.readline().strip() == "after b'b'"
            probe.wait(timeout=30)

            wan.partition([1, 2], [3])
            assert echo(wan, 1, 2)["rtt_ms"] < 50
            cut = client(wan, 1, "tcp-client", wan.address(3), "1", timeout=60)
            assert cut.returncode != 0 and "timed out" in cut.stderr, cut.stderr[-500:]
            wan.heal()
            assert echo(wan, 1, 3)["rtt_ms"] < 50
        finally:
            for process in servers:
                process.kill()
                process.wait()


def test_a_sigkilled_harness_leaves_nothing_after_the_next_one_starts(root_ok: None, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from farloco.node.tools.netns import NamespaceWAN
        from farloco.node.tools.netns import cpu_cap_unavailable
        wan = NamespaceWAN(2, "100mbit", delay_ms=10, cpus=None if cpu_cap_unavailable() else 0.5).up()
        print(wan.prefix, wan._relay_process.pid, ",".join(map(str, wan.cgroups.values())) or "-", flush=True)
        time.sleep(600)
        """
    )
    crashed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert crashed.stdout is not None
    prefix, relay_pid, groups = crashed.stdout.readline().split()
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait(timeout=30)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert prefix + "br" in listed  # left behind by the crash...
    removed = remove_stale_namespaces()  # ...and removed by the next harness (up() calls this first)
    assert {prefix + "br", prefix + "1", prefix + "2"} <= set(removed), removed
    assert not any(Path("/etc/netns", prefix + suffix).exists() for suffix in ("br", "1", "2"))
    if groups != "-":  # the CPU cgroups too
        assert set(groups.split(",")) <= set(removed) and not any(Path(g).exists() for g in groups.split(","))
    deadline = time.monotonic() + 10
    while Path(f"/proc/{relay_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the relay ends with its parent (PR_SET_PDEATHSIG)
    assert (
        not Path(f"/proc/{relay_pid}").exists()
        or "netem" not in Path(f"/proc/{relay_pid}/cmdline").read_text()
    )


BUSY = "import os, time\nt = time.time()\nwhile time.time() - t < 2.0: pass\nprint(sum(os.times()[:2]))"


def test_cpu_caps_make_each_host_a_machine_of_that_many_cores(root_ok: None) -> None:
    reason = cpu_cap_unavailable()
    if reason is not None:
        pytest.skip(reason)

    def busy_cpu_seconds(wan: NamespaceWAN, i: int) -> float:
        done = subprocess.run(
            [*wan.prefix_command(i), sys.executable, "-c", BUSY], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout)

    with NamespaceWAN(2, "100mbit", cpus=0.2) as wan:
        groups = list(wan.cgroups.values())
        assert len(groups) == 2 and all(g.is_dir() for g in groups)
        # 2 s of a busy loop at 0.2 cores: 0.4 s of CPU (one CFS period of slack), not 2 s
        capped = busy_cpu_seconds(wan, 1)
        assert 0.1 < capped < 0.6, capped
        wan.set_cpus(1, 1.0)
        assert busy_cpu_seconds(wan, 1) > 2 * capped
        with pytest.raises(ValueError, match="positive"):
            wan.set_cpus(2, 0)
    assert not any(g.exists() for g in groups)  # removed with the namespaces
    with pytest.raises(ValueError, match="cores per host"):
        NamespaceWAN(2, cpus=-1)


def test_a_host_behind_nat_dials_out_and_nobody_dials_in() -> None:
    """NamespaceWAN(nat=...): host 3 sits behind a masquerading router of its own. Its connections to host 1
    arrive from the router's public address; host 1 can reach neither its private address nor, through the
    router, its listener."""
    from farloco.node.tools.netns import nat_unavailable

    reason = nat_unavailable()
    if reason is not None:
        pytest.skip(reason)
    before = root_namespace()
    with NamespaceWAN(3, "100mbit", nat=[3]) as wan:
        assert wan.address(3) == "192.168.3.2" and wan.public_address(3) == f"10.{wan.net}.0.3"
        servers = [server(wan, 1, "tcp-server"), server(wan, 3, "tcp-server")]
        try:
            assert echo(wan, 3, 1)["rtt_ms"] < 50  # out through the NAT: fine
            assert echo(wan, 2, 1)["rtt_ms"] < 50
            for target in (wan.address(3), wan.public_address(3)):
                refused = client(wan, 1, "tcp-client", target, "1", timeout=30)
                assert refused.returncode != 0 and (
                    "unreachable" in refused.stderr
                    or "refused" in refused.stderr
                    or "timed out" in refused.stderr
                ), refused.stderr[-500:]
        finally:
            for process in servers:
                process.kill()
                process.wait()
    assert root_namespace() == before
