"""End to end: real `farloco join` processes (agent + elastic-launched trainer ranks) on 127.0.0.1, meeting on a
real hivemind DHT and exchanging over gRPC. Each test starts its own bootstrap node and stops every process."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.swarm import Swarm, forked_rounds, rounds_of, started_event, together_after, wait_for
from rich.console import Console

from farloco.node.checkpoint import COMMITTED_FILE
from farloco.node.tools.demo import (
    PeerProcess,
    read_events,
    run_demo,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.dht, pytest.mark.timeout(600)]


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    # Short rounds: these tests are about membership, not about training quality.
    made = Swarm(tmp_path, ["run.max_rounds=0", "run.inner_steps=8"])
    try:
        yield made
    finally:
        made.close()


# Slow: by default the README's `farloco demo` (3 peers, which CI runs as a new user does: it exits non-zero unless
# the loss fell and every hash agreed) and test_nodes_of_different_layouts_train_as_one_swarm (2-rank nodes in a
# swarm) cover what this adds, and the default suite must stay within ~15 minutes.
@pytest.mark.slow
def test_three_peers_one_with_two_ranks_train_and_agree(tmp_path: Path) -> None:
    """The demo path: 3 peers (the first with 2 gloo ranks), 4 rounds; loss falls and every hash agrees."""
    out = io.StringIO()
    code = run_demo(
        num_peers=3, rounds=4, first_ranks=2, work_dir=tmp_path, console=Console(file=out, width=160)
    )
    assert code == 0, out.getvalue()
    peers = sorted(p for p in tmp_path.iterdir() if p.name.startswith("peer-"))
    events = {p.name: [e for e in read_events(p) if e["event"] == "round"] for p in peers}
    for round_id in range(1, 5):
        hashes = {
            name: next(e["outer_hash"] for e in ev if e["round_id"] == round_id)
            for name, ev in events.items()
        }
        assert len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
    eval_losses = [e["eval_loss"] for e in events["peer-0"]]
    assert all(math.isfinite(x) for x in eval_losses)
    assert eval_losses[-1] < eval_losses[0] - 0.1, eval_losses
    # two ranks on peer-0 trained the same model as the single-rank peers: its trainer logs show both ranks
    assert (tmp_path / "peer-0" / "logs" / "trainer").exists()
    assert all(e["bytes_sent"] > 0 for ev in events.values() for e in ev)


def test_nodes_of_different_layouts_train_as_one_swarm(tmp_path: Path) -> None:
    """Nodes of different layouts: a node with tensor parallelism (tp = 2 over 2 ranks: a 1 x 2 mesh), a node with FSDP over 2
    ranks and a node of 1 rank, all gloo on CPU, train in one swarm: every round all three contribute and every
    committed hash agrees, because each node maps its shards onto the same canonical flat vector."""
    made = Swarm(tmp_path, ["run.max_rounds=3", "run.inner_steps=4"])
    try:
        peers = [
            # (its exchange's codec work on 2 threads of its own: network.codec_threads, the same bits)
            made.add("tp2", ranks=2, extra=("--set", "node.tp=2", "--set", "network.codec_threads=2")),
            # ... and this one sends its part of each exchange over 3 streams per peer (network.streams_per_peer)
            made.add("fsdp2", ranks=2, extra=("--set", "network.streams_per_peer=3")),
            # ... and this one also logs its rounds to TensorBoard (node.loggers), read back below.
            made.add("one", ranks=1, extra=("--set", 'node.loggers=["tensorboard"]')),
        ]
        wait_for(
            lambda: all(p.process.poll() == 0 for p in peers),
            400,
            "3 nodes to train 3 rounds and stop",
            peers,
        )
        by_peer = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}
        full = [r for r in by_peer["one"] if len(by_peer["one"][r]["contributors"]) == 3]
        assert full, by_peer["one"]
        for round_id in range(1, 4):
            hashes = {
                name: rounds[round_id]["outer_hash"] for name, rounds in by_peer.items() if round_id in rounds
            }
            assert len(hashes) == 3 and len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
        losses = [by_peer["tp2"][r].get("train_loss") for r in sorted(by_peer["tp2"])]
        assert all(loss is not None and math.isfinite(loss) for loss in losses), losses
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        # One TensorBoard run per node: logs/tensorboard/<run.name>/<node name, its peer id's prefix>.
        peer_id = started_event(peers[2])["peer_id"]
        [run_name] = [p.name for p in (peers[2].run_dir / "logs" / "tensorboard").iterdir()]
        board = EventAccumulator(str(peers[2].run_dir / "logs" / "tensorboard" / run_name / peer_id[:16]))
        board.Reload()
        logged = {e.step: e.value for e in board.Scalars("round/train_loss")}
        assert logged == {r: pytest.approx(e["train_loss"]) for r, e in by_peer["one"].items()}
    finally:
        made.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: two GPU nodes (NCCL inside each) in one swarm"
)
def test_two_gpu_nodes_train_as_one_swarm(tmp_path: Path) -> None:
    """Two nodes of one CUDA rank each (NCCL inside the node, bf16 by node.precision=auto,
    gRPC between the agents) train 3 rounds together with agreeing hashes."""
    made = Swarm(tmp_path, ["run.max_rounds=3", "run.inner_steps=8", 'node.device="cuda"'])
    try:
        peers = [made.add("gpu-a"), made.add("gpu-b")]
        wait_for(
            lambda: all(p.process.poll() == 0 for p in peers), 400, "2 GPU nodes to train 3 rounds", peers
        )
        by_peer = {p.name: {e["round_id"]: e for e in rounds_of(p)} for p in peers}
        for round_id in range(1, 4):
            hashes = {
                name: rounds[round_id]["outer_hash"] for name, rounds in by_peer.items() if round_id in rounds
            }
            assert len(hashes) == 2 and len(set(hashes.values())) == 1, f"round {round_id}: {hashes}"
        assert any(len(e["contributors"]) == 2 for e in by_peer["gpu-a"].values())
    finally:
        made.close()


# `-m slow`: the default suite's chaos timeline (tests/test_chaos.py) has a CLI leave of one of three members,
# checked to exit 0 while the others go on.
@pytest.mark.slow
def test_peer_leaves_mid_run_others_keep_training(swarm: Swarm) -> None:
    a, b, c = swarm.add("a"), swarm.add("b"), swarm.add("c")
    wait_for(
        lambda: all(len(rounds_of(p)) >= 2 for p in (a, b, c)), 240, "3 peers to commit 2 rounds", [a, b, c]
    )
    left = subprocess.run(
        [
            sys.executable,
            "-m",
            "farloco.node.tools.cli",
            "leave",
            "--run-dir",
            str(c.run_dir),
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert left.returncode == 0, left.stderr
    assert c.process.wait(timeout=60) == 0
    assert any(e["event"] in ("stopped",) for e in read_events(c.run_dir))
    start = max(e["round_id"] for e in rounds_of(a))
    wait_for(
        lambda: all(any(e["round_id"] >= start + 2 for e in rounds_of(p)) for p in (a, b)),
        240,
        "the two remaining peers to commit 2 more rounds",
        [a, b],
    )
    later = [e for e in rounds_of(a) if e["round_id"] >= start + 2]
    assert later and all(len(e["contributors"]) == 2 for e in later)
    by_round_b = {e["round_id"]: e["outer_hash"] for e in rounds_of(b)}
    for event in later:
        assert by_round_b.get(event["round_id"]) in (None, event["outer_hash"])
    assert any(by_round_b.get(e["round_id"]) == e["outer_hash"] for e in later)


def test_mismatched_run_hash_is_refused(swarm: Swarm) -> None:
    a = swarm.add("a")
    wait_for(lambda: any(e["event"] == "joined" for e in read_events(a.run_dir)), 120, "the first peer", [a])
    b = swarm.add("b", extra=("--set", "run.inner_steps=7"))
    assert b.process.wait(timeout=120) != 0
    output = b.log_path.read_text()
    assert "refusing to join" in output
    assert "run.inner_steps: 7 here, 8 there" in output
    assert a.process.poll() is None, "the first peer must keep running"


def test_diverged_peer_is_detected_and_repaired(swarm: Swarm) -> None:
    """A peer whose theta silently diverges (fault injected after round 1) is outvoted by the group's hashes,
    logs the mismatch, resyncs from the majority, and from then on publishes the same hash as the others."""
    a, b = swarm.add("a"), swarm.add("b")
    c = swarm.add("c", env={"FARLOCO_FAULTS": "corrupt-theta@1"})
    peers = [a, b, c]
    wait_for(lambda: all(len(rounds_of(p)) >= 4 for p in peers), 300, "3 peers to commit 4 rounds", peers)
    events_c = read_events(c.run_dir)
    mismatches = [e for e in events_c if e["event"] == "hash_mismatch"]
    assert mismatches, "the corrupted peer never noticed"
    assert any(e["event"] == "synced" and e["why"] == "hash mismatch" for e in events_c)
    # the majority noticed too, and did not resync from the corrupted peer
    assert not any(e["event"] == "synced" for p in (a, b) for e in read_events(p.run_dir))
    # Compare at the newest round every peer committed: the repaired peer has no round event for a round it
    # spent resyncing, so "the lowest of the peers' last rounds" need not be one it committed.
    committed = [{e["round_id"]: e["outer_hash"] for e in rounds_of(p)} for p in peers]
    common = set.intersection(*(set(rounds) for rounds in committed))
    assert common, [sorted(rounds) for rounds in committed]
    last = max(common)
    hashes = {p.name: rounds[last] for p, rounds in zip(peers, committed, strict=True)}
    assert len(set(hashes.values())) == 1, hashes


@pytest.mark.slow
def test_joiner_enters_the_current_round_and_agrees(swarm: Swarm) -> None:
    """A peer that joins a running swarm fetches the state its current round started from (the others wait for
    it while it syncs), and from its first round on it commits the same theta hash as the others, with all three
    contributing."""
    a, b = swarm.add("a"), swarm.add("b")
    wait_for(lambda: all(len(rounds_of(p)) >= 2 for p in (a, b)), 240, "2 peers to commit 2 rounds", [a, b])
    d = swarm.add("d")
    wait_for(lambda: len(rounds_of(d)) >= 2, 240, "the joiner to commit 2 rounds", [a, b, d])
    synced = [e for e in read_events(d.run_dir) if e["event"] == "synced"]
    assert synced and synced[0]["why"] == "join" and synced[0]["round_id"] >= 2
    hashes_a = {e["round_id"]: e["outer_hash"] for e in rounds_of(a)}
    for event in rounds_of(d):
        assert hashes_a.get(event["round_id"], event["outer_hash"]) == event["outer_hash"]
        assert d.name and len(event["contributors"]) == 3


@pytest.mark.slow
def test_survivors_go_on_after_a_member_is_sigkilled(swarm: Swarm) -> None:
    """SIGKILL one member (agent, DHT child and trainer ranks at once): the other two keep committing rounds
    together, with equal hashes, once its record has expired."""
    a, b, c = swarm.add("a"), swarm.add("b"), swarm.add("c")
    wait_for(
        lambda: all(len(rounds_of(p)) >= 2 for p in (a, b, c)), 240, "3 peers to commit 2 rounds", [a, b, c]
    )
    c_id = next(e["peer_id"] for e in read_events(c.run_dir) if e["event"] == "started")
    b_id = next(e["peer_id"] for e in read_events(b.run_dir) if e["event"] == "started")
    os.killpg(c.process.pid, signal.SIGKILL)
    c.process.wait(timeout=30)
    start = max(e["round_id"] for e in rounds_of(a))
    wait_for(
        lambda: all(any(e["round_id"] >= start + 3 for e in rounds_of(p)) for p in (a, b)),
        240,
        "the survivors to commit 3 more rounds",
        [a, b],
    )
    late = [e for e in rounds_of(a) if e["round_id"] >= start + 2]
    assert late and all(
        sorted(e["contributors"]) == sorted(e["group"]) and len(e["group"]) == 2 for e in late
    )
    hashes_b = {e["round_id"]: e["outer_hash"] for e in rounds_of(b)}
    assert all(hashes_b.get(e["round_id"], e["outer_hash"]) == e["outer_hash"] for e in late)
    # Nobody is left out silently: while c's record still lived, a round's leader named it and said why.
    named = [
        e for p in (a, b) for e in read_events(p.run_dir) if e["event"] == "left_out" and e["by"] == "leader"
    ]
    assert any(e["peer"] == c_id and e["reason"] in ("not_ready", "unreachable") for e in named), named
    from farloco.node.daemon.control import ControlClient

    shares = {m["peer_id"]: m["share"] for m in ControlClient(a.run_dir).peers()}
    assert shares[b_id] is not None and shares[b_id] >= 0.5, shares  # b was in most of a's recent rounds


@pytest.mark.slow
def test_sigkilled_node_comes_back_at_the_swarms_round(swarm: Swarm) -> None:
    """SIGKILL a node, restart it on the same run directory: it does not train on its stale checkpoint but
    fast-forwards by state sync to the swarm's current round, and its hashes agree again."""
    a, b = swarm.add("a"), swarm.add("b", extra=("--set", "checkpoint.every_rounds=1"))
    wait_for(lambda: all(len(rounds_of(p)) >= 3 for p in (a, b)), 240, "2 peers to commit 3 rounds", [a, b])
    os.killpg(b.process.pid, signal.SIGKILL)
    b.process.wait(timeout=30)
    wait_for(lambda: len(rounds_of(a)) >= 5, 240, "the survivor to go on alone", [a])
    again = swarm.add("b", extra=("--set", "checkpoint.every_rounds=1"))
    before = len(rounds_of(again))
    wait_for(
        lambda: len(rounds_of(again)) >= before + 2, 240, "the restarted node to commit 2 rounds", [a, again]
    )
    synced = [e for e in read_events(again.run_dir) if e["event"] == "synced" and e["why"] == "join"]
    assert synced and synced[-1]["round_id"] >= 5
    hashes_a = {e["round_id"]: e["outer_hash"] for e in rounds_of(a)}
    for event in rounds_of(again)[before:]:
        assert hashes_a.get(event["round_id"], event["outer_hash"]) == event["outer_hash"]


# The 3-node run is the same test with one more node (`-m slow`): the default suite keeps under ~15 minutes.
@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_sigkilled_node_restarted_is_back_in_step_in_every_round_and_nothing_forks(
    swarm: Swarm, nodes: int
) -> None:
    """SIGKILL one of 2 or 3 nodes and start it again at once on its run directory (what systemd does): it is
    in step with the swarm (same round, same hash) within a round or two of its start, in the group of the
    survivors' next rounds, and no round id ever carries two outer hashes among the nodes."""
    peers = [swarm.add(name) for name in "abc"[:nodes]]
    wait_for(
        lambda: len(together_after(peers, 0)) >= 2, 240, f"{nodes} nodes to commit 2 rounds together", peers
    )
    victim, survivor = peers[-1], peers[0]
    victim_id = started_event(victim)["peer_id"]
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=30)
    restarted_at = time.time()
    peers[-1] = again = swarm.add(victim.name)

    def back() -> dict | None:
        theirs = {e["round_id"]: e["outer_hash"] for e in rounds_of(survivor)}
        mine = [e for e in rounds_of(again) if e["time"] >= restarted_at]
        return next((e for e in mine if theirs.get(e["round_id"]) == e["outer_hash"]), None)

    wait_for(lambda: back() is not None, 60, "the restarted node in step with the survivor", peers)
    first = back()
    assert first is not None
    started = started_event(again)["time"]
    assert first["time"] - started < 20, (
        first["time"] - started,
        first,
    )  # from its start: join + sync + round
    wait_for(
        lambda: sum(e["round_id"] > first["round_id"] for e in rounds_of(survivor)) >= 8,
        120,
        "8 more rounds of the survivor",
        peers,
    )
    later = [e for e in rounds_of(survivor) if e["round_id"] > first["round_id"]][:8]
    missed = [e["round_id"] for e in later if victim_id not in e["group"]]
    assert len(missed) <= 1, (
        f"the restarted node was left out of rounds {missed} of {[e['round_id'] for e in later]}"
    )
    assert not forked_rounds(peers), forked_rounds(peers)


def test_a_whole_swarm_restarted_resumes_its_own_checkpoints_one_node_after_the_other(tmp_path: Path) -> None:
    """Both nodes of a swarm die; they start again from checkpoints of the same round, one a few seconds after
    the other (what a second Slurm job or a rack's power-on does). The second finds the first already at that
    round with the same outer hash: it resumes its own checkpoint (inner state and data position included)
    instead of fetching the same theta over the network, and the two train on together without a fork.
    run.min_peers = 2 holds the first node at the checkpoint's round until the second is there."""
    swarm = Swarm(tmp_path, ["run.max_rounds=0", "run.inner_steps=8", "run.min_peers=2"])
    every = ("--set", "checkpoint.every_rounds=1", "--set", "checkpoint.keep=10")
    try:
        peers = [swarm.add("a", extra=every), swarm.add("b", extra=every)]
        wait_for(
            lambda: len(together_after(peers, 0)) >= 3, 240, "2 nodes to commit 3 rounds together", peers
        )
        for peer in peers:
            os.killpg(peer.process.pid, signal.SIGKILL)
        for peer in peers:
            peer.process.wait(timeout=30)
        killed_at = time.time()
        # Their newest checkpoints may be a round apart (one wrote its last before the SIGKILL, the other not):
        # each keeps its checkpoints up to the newest round both hold, as if it had died before writing more.
        held = [
            {
                int(path.name.removeprefix("round-")): path
                for path in (p.run_dir / "checkpoints").glob("round-????????")
                if (path / COMMITTED_FILE).exists()
            }
            for p in peers
        ]
        common = max(set(held[0]) & set(held[1]))
        for mine in held:
            for round_id, path in mine.items():
                if round_id > common:
                    shutil.rmtree(path)
        swarm.peers.clear()
        first = swarm.add("a", extra=every)
        wait_for(
            lambda: any(e["round_id"] == common for e in _events_of(first, "resumed")),
            120,
            f"a to resume its checkpoint of round {common}",
            [first],
        )
        restarted_at = time.time()
        second = swarm.add("b", extra=every)
        peers = [first, second]
        wait_for(
            lambda: len(together_after(peers, common)) >= 2, 240, "2 rounds together after the restart", peers
        )
        resumed = [e for e in _events_of(second, "resumed") if e["time"] >= restarted_at]
        fetched = [
            e for e in _events_of(second, "synced") if e["time"] >= restarted_at and e["why"] == "join"
        ]
        assert [e["round_id"] for e in resumed] == [common] and not fetched, (resumed, fetched)
        [loaded] = [e for e in _events_of(second, "inner_resumed") if e["time"] >= restarted_at]
        assert loaded["result"] == "ok"
        # One history per life of the swarm. Rounds committed after the newest checkpoint both held died with
        # the swarm and are trained again after the restart, to another hash where the timing differs (partial
        # contributions weigh a node by the steps it ran): that is the swarm going back to its checkpoint, not a
        # fork; two live nodes that disagree on a round would be.
        assert not forked_rounds(peers, until=killed_at), forked_rounds(peers, until=killed_at)
        assert not forked_rounds(peers, since=killed_at), forked_rounds(peers, since=killed_at)
    finally:
        swarm.close()


# The 3-node run is the same test with one more node (`-m slow`): the default suite keeps under ~15 minutes.
@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_stalled_dht_process_never_forks_the_swarm(swarm: Swarm, nodes: int) -> None:
    """SIGSTOP one node's DHT process for 10 s (a DHT that hangs: its stores and reads never answer, and the
    others' requests to it time out), then SIGCONT: the swarm goes on over its links or waits, the node is in
    the group again within seconds, and no round id ever carries two outer hashes."""
    peers = [swarm.add(name) for name in "abc"[:nodes]]
    wait_for(
        lambda: len(together_after(peers, 0)) >= 2, 240, f"{nodes} nodes to commit 2 rounds together", peers
    )
    dht_pid = started_event(peers[-1])["dht_pid"]
    assert isinstance(dht_pid, int) and dht_pid != peers[-1].process.pid
    os.kill(dht_pid, signal.SIGSTOP)
    try:
        time.sleep(10)
    finally:
        os.kill(dht_pid, signal.SIGCONT)
    resumed = max(e["round_id"] for p in peers for e in rounds_of(p))
    wait_for(
        lambda: len(together_after(peers, resumed)) >= 3, 90, "3 rounds of all nodes together again", peers
    )
    assert not forked_rounds(peers), forked_rounds(peers)


def _events_of(peer: PeerProcess, kind: str) -> list[dict]:
    return [e for e in read_events(peer.run_dir) if e["event"] == kind]


def test_a_node_whose_only_peer_vanished_is_isolated_then_follows_min_peers(tmp_path: Path) -> None:
    """SIGKILL one of two nodes: the survivor's peer vanished without leaving, so it is isolated (status, metric,
    event), commits no round alone and waits timeouts.isolation_timeout; then min_peers=1 goes on alone
    (`continuing_alone`) and min_peers=2 exits with an error naming the isolation. Both cases at once: two
    independent swarms (each its own bootstrap and DHT), one per min_peers."""
    from farloco.node.daemon.control import ControlClient

    swarms: dict[int, Swarm] = {}
    try:
        for min_peers in (1, 2):
            root = tmp_path / f"min-peers-{min_peers}"
            root.mkdir()
            swarms[min_peers] = Swarm(
                root,
                [
                    "run.max_rounds=0",
                    "run.inner_steps=8",
                    f"run.min_peers={min_peers}",
                    "timeouts.isolation_timeout=6",
                ],
            )
        pairs = {m: (made.add("a"), made.add("b")) for m, made in swarms.items()}
        everyone = [p for pair in pairs.values() for p in pair]
        wait_for(
            lambda: all(len(rounds_of(p)) >= 2 for p in everyone), 240, "2 pairs to commit 2 rounds", everyone
        )
        for _, b in pairs.values():
            os.killpg(b.process.pid, signal.SIGKILL)
            b.process.wait(timeout=30)
        killed_at = {}
        for min_peers, (a, _) in pairs.items():
            wait_for(
                lambda a=a: bool(_events_of(a, "isolated")), 60, "the survivor to say it is isolated", [a]
            )
            killed_at[min_peers] = len(rounds_of(a))
            if a.process.poll() is not None:
                continue  # min_peers=2 may have ended already: the log below says it all
            status = ControlClient(a.run_dir).status()
            if status["isolated"]:  # (unless the timeout already passed: then the events below say it all)
                assert status["state"] == "isolated" and status["vanished_peers"], status
                assert "farloco_isolated 1" in ControlClient(a.run_dir).metrics()
        a = pairs[1][0]
        wait_for(lambda: bool(_events_of(a, "continuing_alone")), 60, "the survivor to go on alone", [a])
        isolated_at = _events_of(a, "isolated")[0]["time"]
        going_on_at = _events_of(a, "continuing_alone")[0]["time"]
        assert going_on_at - isolated_at >= 6 - 0.5
        # No round was committed while it waited (the one in flight when b died may end before it).
        waited = [e for e in rounds_of(a) if isolated_at < e["time"] < going_on_at]
        assert not waited, waited
        wait_for(lambda: len(rounds_of(a)) >= killed_at[1] + 2, 60, "2 rounds alone", [a])
        assert ControlClient(a.run_dir).status()["isolated"] is False
        a = pairs[2][0]
        a.process.wait(timeout=60)
        assert a.process.returncode != 0
        log = a.log_path.read_text(errors="replace")
        assert "isolated for" in log and "run.min_peers=2 forbids training alone" in log, log[-3000:]
    finally:
        for made in swarms.values():
            made.close()
