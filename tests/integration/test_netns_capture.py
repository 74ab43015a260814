"""What an eavesdropper on the wire sees: two nodes and a bootstrap in their own network namespaces on one
bridge, `farloco join` as a user runs it (run secret, default config), and tcpdump on the bridge. With the
default `network.encryption` ("auto": TLS beyond loopback) the capture holds none of the run's plaintext
markers; the same run with encryption off holds them, which shows the capture would see them. Needs root,
iproute2 and tcpdump: skips with the reason elsewhere, and removes every namespace it made."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.swarm import rounds_of, started_event, wait_for_exit

from farloco.node.config import load_config, run_hash
from farloco.node.tools.demo import demo_config, start_bootstrap, start_peer, stop_process
from farloco.node.tools.netns import NamespaceWAN, unavailable
from farloco.protocol.tcpstream import MAGIC

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht]

ROUNDS = 3
# A data-plane connection's first bytes in clear: the magic, the preamble's length, then its msgpack map (3 entries)
# opening with the key "m". The magic alone is 4 bytes, which N bytes of ciphertext hold by chance with a
# probability of about N / 2^32: ~0.1% a run at these megabytes (one failed so, with no other marker in clear, not
# even the method name that follows a real preamble).
PREAMBLE = re.compile(re.escape(MAGIC) + b".{4}" + re.escape(b"\x83\xa1m"), re.DOTALL)


def _capture(tmp_path: Path, tag: str, overrides: list[str]) -> tuple[bytes, bytes, list[bytes]]:
    """Run a 2-node swarm for ROUNDS rounds under tcpdump: (captured bytes, run hash, peer ids)."""
    work = tmp_path / tag
    work.mkdir()
    config = work / "swarm.toml"
    config.write_text(demo_config(ROUNDS, ["run.inner_steps=4", "node.eval_batches=0", *overrides]))
    pcap = work / "bridge.pcap"
    processes: list[subprocess.Popen[bytes]] = []
    with NamespaceWAN(2, "1gbit", prefix=None) as wan:
        hub = f"{wan.prefix}br"
        dump = subprocess.Popen(
            ["ip", "netns", "exec", hub, "tcpdump", "-i", "br0", "-U", "-s", "0", "-w", str(pcap), "tcp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert dump.stderr is not None
            line = dump.stderr.readline().decode(errors="replace")  # "listening on br0, ..." once it captures
            assert "listening on" in line, line
            bootstrap, maddr = start_bootstrap(work, host=wan.address(1), prefix=wan.prefix_command(1))
            processes.append(bootstrap)
            peers = [
                start_peer(f"n{i}", work, config, maddr, 1, host=wan.address(i), prefix=wan.prefix_command(i))
                for i in (1, 2)
            ]
            processes += [p.process for p in peers]
            wait_for_exit(peers, 150, f"2 nodes to finish {ROUNDS} rounds")
        finally:
            stop_process(*processes)
            dump.send_signal(signal.SIGINT)
            dump.wait(timeout=30)
    started = [started_event(p) for p in peers]
    hashes = {e["outer_hash"] for p in peers for e in rounds_of(p)}
    assert len({e["round_id"] for p in peers for e in rounds_of(p)}) == ROUNDS
    assert len(hashes) == ROUNDS, hashes  # one hash per round: the two trained together
    assert len(started) == 2 and started[0]["run_hash"] == run_hash(load_config(config))
    return pcap.read_bytes(), started[0]["run_hash"].encode(), [e["peer_id"].encode() for e in started]


def test_a_capture_on_the_bridge_holds_no_plaintext_marker_of_the_run(tmp_path: Path) -> None:
    reason = unavailable() or (None if shutil.which("tcpdump") else "tcpdump is not installed")
    if reason is not None:
        pytest.skip(reason)
    captured, hash_hex, ids = _capture(tmp_path, "tls", [])
    # 1M parameters x 3 rounds (int8: ~1 MiB a round each way) and the trainers' state crossed the bridge...
    assert len(captured) > 3 << 20, len(captured)
    markers = {
        "data-plane preamble": PREAMBLE,
        "run hash": re.compile(re.escape(hash_hex)),
        "method": re.compile(b"ExchangePush"),
        # every call's auth metadata (the TLS server name farloco-peer is in clear)
        "token": re.compile(b"farloco-run"),
    }
    markers |= {f"peer id {i.decode()[:8]}": re.compile(re.escape(i)) for i in ids}
    # ...and none of the run's own bytes did in clear.
    seen = [name for name, marker in markers.items() if marker.search(captured)]
    assert not seen, f"in clear on the wire: {seen}"

    # The control: the same run with encryption off shows those markers, so their absence above is TLS's doing.
    plain, hash_hex, _ = _capture(
        tmp_path, "plain", ["network.encryption=off", "auth.insecure_no_secret=true"]
    )
    assert (
        PREAMBLE.search(plain) and hash_hex in plain and b"ExchangePush" in plain and b"farloco-run" in plain
    )
