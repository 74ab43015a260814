"""The chaos table's scenarios (benchmarks/chaos_runner.py runs them; RELIABILITY.md shows their rows): data,
one `Scenario` per row, each a swarm and a timeline of `Fault`s."""

from __future__ import annotations

from chaos_runner import CONTROL_IDLE, Fault, Scenario

_BACK = "it restarts from its checkpoint, catches up with the swarm's state and contributes again"

LONG_RUN_ROUNDS = 500
CHURN_ROUNDS = 160  # about 10 minutes at ~3.5 s a round on 2 cores
CHURN_EVERY = 8


def churn_faults() -> tuple[Fault, ...]:
    """The churn scenario's timeline: a fault every CHURN_EVERY rounds, turning over nodes 1-3 and the kinds."""
    faults: list[Fault] = []
    kinds = ("sigkill", "hang", "leave", "sigkill-slow")
    for n, at in enumerate(range(4, CHURN_ROUNDS - 2 * CHURN_EVERY, CHURN_EVERY)):
        peer, kind = 1 + n % 3, kinds[n % len(kinds)]
        name = f"churn {n + 1}: {kind} node {peer} at round {at}"
        if kind == "sigkill":
            faults.append(Fault(name, peer, at, signal="sigkill", restart_after=1.0, checks=("back",)))
        elif kind == "sigkill-slow":
            faults.append(Fault(name, peer, at, signal="sigkill", restart_after=3.0, checks=("back",)))
        elif kind == "hang":
            faults.append(Fault(name, peer, at, signal="hang=8", checks=("back",)))
        else:
            faults.append(Fault(name, peer, at, signal="leave", checks=("left_out",)))
            faults.append(
                Fault(f"{name}: joins again", peer, at + CHURN_EVERY // 2, signal="join", checks=("back",))
            )
    return tuple(faults)


def _poisoned_donors(name: str, setup: str, what: str, plan: str, joined: str, check: str) -> Scenario:
    """Nodes 1 and 2 of 4 serve joiners a poisoned state (`plan`) from the start; node 3 joins once round 3
    committed and must refuse theirs (`check`) and take node 0's (`joined`: what it does)."""
    donors = tuple(
        Fault(
            f"{what} (node {peer})",
            peer,
            0,
            plan=plan,
            expected="serves its poisoned state to whoever asks; its own rounds go on"
            if peer == 1
            else "the same",
            checks=("fired",),
        )
        for peer in (1, 2)
    )
    joiner = Fault("a node joins", 3, 3, signal="join", expected=joined, checks=(check, "synced", "back"))
    # A joiner starts its ranks and trains its first round while the swarm goes on: 14 rounds.
    return Scenario(name, setup, (*donors, joiner), peers=4, late_peers=(3,), rounds=14)


# The rows whose held-out loss is compared# The rows whose held-out loss is compared with the healthy run's train every inner step of every round: a node
# a moment behind would otherwise end its steps early (a partial contribution), by timing, and the final loss
# moved by up to ~0.1 between runs of the same row, as much as what the comparison looks for.
DETERMINISTIC = "node.partial_contributions=false"

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "healthy",
            "3 nodes, 8 rounds, nothing goes wrong: the reference for the others (node.partial_contributions off: "
            "every node runs every inner step, so the loss is the same run after run)",
            overrides=(DETERMINISTIC,),
        ),
        Scenario(
            "sigkill-exchange",
            "3 nodes, 14 rounds; node 2 SIGKILLed (with its ranks and DHT process) as its round-3 exchange "
            "starts, restarted 1 s after",
            (
                Fault(
                    "SIGKILL mid-exchange",
                    2,
                    3,
                    plan="crash@exchange:3",
                    restart_after=1.0,
                    expected=f"the others finish the round without it (its pushes refused), nothing forks; {_BACK}",
                    checks=("left_out", "back"),
                ),
            ),
            # The restarted node is a fresh agent (imports, the DHT node, the identity check) and fresh ranks: about
            # 10 s from the SIGKILL to its agent's start and 5 s more to its ranks' first round on a 2-core machine
            # where a round of the tiny preset takes 3-4 s. With 8 rounds the swarm finished first (4 of 4 runs,
            # on this commit and on the one before the agent's restructure alike).
            rounds=14,
        ),
        Scenario(
            "sigkill-train",
            "3 nodes; node 2 SIGKILLed while its ranks run round 3's inner steps, restarted 1 s after",
            (
                Fault(
                    "SIGKILL during inner steps",
                    2,
                    3,
                    plan="crash@train:3",
                    restart_after=1.0,
                    expected="it was in the others' last group, so they wait for it (up to the straggler wait); "
                    f"{_BACK}, in time for that round or a later one",
                    checks=("back",),
                ),
            ),
        ),
        Scenario(
            "sigstop-straggler",
            "3 nodes, match_timeout 8 s; node 2 frozen (SIGSTOP, whole process group) for 15 s in round 3's inner "
            "steps, then SIGCONT",
            (
                Fault(
                    "SIGSTOP/SIGCONT straggler",
                    2,
                    3,
                    plan="hang=15@train:3",
                    expected="the others go on without it; back, it is late for the swarm's round, resyncs and "
                    "contributes again",
                    checks=("left_out", "back"),
                ),
            ),
            overrides=("timeouts.match_timeout=8",),
            # The others must still be training when it is back: 15 s are 6-12 rounds at 1.2-2.6 s a round.
            rounds=16,
        ),
        Scenario(
            "frozen-exchange",
            "3 nodes; node 2 frozen (SIGSTOP, its whole process group) as round 3's exchange starts, for 30 s",
            (
                Fault(
                    "member frozen mid-exchange",
                    2,
                    3,
                    plan="hang=30@exchange:3",
                    expected="its heartbeat stops: once its record expired (timeouts.member_ttl, 5 s here), it "
                    "sent nothing for 2 s and answered no ping, the other two, a strict majority of the group, give "
                    "it up and retry "
                    "without it, long before the exchange's data deadline (60% of timeouts.exchange_timeout, 36 s "
                    "here); thawed, it resyncs and contributes again",
                    checks=("left_out", "given_up_early", "back"),
                ),
            ),
            rounds=16,
        ),
        Scenario(
            "cli-leave",
            "3 nodes; `farloco leave` on node 2 once round 3 committed",
            (
                Fault(
                    "CLI leave",
                    2,
                    3,
                    signal="leave",
                    expected="it finishes its round and exits 0; the others never wait for it",
                    checks=("left_out", "exit_0", "no_abort", "not_waited"),
                ),
            ),
        ),
        Scenario(
            "cli-join",
            "3 nodes, 14 rounds; a 4th joins with `farloco join` once round 3 committed",
            (
                Fault(
                    "CLI join",
                    3,
                    3,
                    signal="join",
                    expected="it fetches the swarm's state (hash-verified) and contributes from the first round its "
                    "fresh ranks are ready for",
                    checks=("back", "synced"),
                ),
            ),
            peers=4,
            late_peers=(3,),
            # As the poisoned-donor rows: the joiner's ranks start (a fresh process each) and train their first
            # round while the swarm goes on. With 8 rounds a join on a loaded 2-core machine sometimes found the
            # swarm finished before its first round (2 of 7 runs).
            rounds=14,
        ),
        Scenario(
            "below-min-peers",
            "2 nodes, run.min_peers = 2; node 1 SIGKILLed once round 3 committed, restarted 3 s later",
            (
                Fault(
                    "below min_peers and back",
                    1,
                    3,
                    signal="sigkill",
                    restart_after=3.0,
                    expected="the survivor commits nothing alone, waits (isolated), and trains on once it is back",
                    checks=("nothing_alone", "back"),
                ),
            ),
            peers=2,
            overrides=("run.min_peers=2", "timeouts.isolation_timeout=60"),
        ),
        Scenario(
            "corrupt-payload",
            "3 nodes; node 2's round-3 exchange chunks overwritten with 0xFF bytes on the way out",
            (
                Fault(
                    "corrupted payload",
                    2,
                    3,
                    plan="corrupt@exchange:3",
                    expected="refused by every receiver (counted by reason), the round commits without it, it resyncs",
                    checks=("refused", "left_out", "back"),
                ),
            ),
        ),
        Scenario(
            "dropped-connections",
            "3 nodes; node 2 resets every connection it has 20 ms into round 3's exchange",
            (
                Fault(
                    "dropped connections",
                    2,
                    3,
                    plan="drop@exchange+0.02:3",
                    expected="every member's attempt ends at once (no wait for a deadline) and, with nobody to "
                    "drop, the round aborts alike everywhere; nothing forks, the next round has all",
                    checks=("fired",),
                ),
            ),
        ),
        Scenario(
            "delay",
            "3 nodes; node 2's agent stalls 6 s as round 3's matchmaking starts",
            (
                Fault(
                    "delayed phase",
                    2,
                    3,
                    plan="delay=6@match:3",
                    expected="the others wait for it (within the straggler wait) or go on without it; no fork",
                    checks=("fired",),
                ),
            ),
        ),
        Scenario(
            "late-round",
            "3 nodes, match_timeout 3 s, H = 40 (~7 s a round); node 2's agent stalls 6 s as round 3's "
            "matchmaking starts, past the others' straggler wait",
            (
                Fault(
                    "late for one round",
                    2,
                    3,
                    plan="delay=6@match:3",
                    expected="the others commit round 3 without it; it takes their state and brings its steps of "
                    "round 3 into its next round (run.late_work = merge: none of them lost); no fork",
                    checks=("fired", "left_out", "back"),
                ),
            ),
            overrides=("timeouts.match_timeout=3", "timeouts.match_timeout_min=1", "run.inner_steps=40"),
        ),
        Scenario(
            "wrong-update-mean",
            "3 nodes, run.aggregator = mean; node 2 sends its update negated x1000 in rounds 3-4",
            (
                Fault(
                    "wrong-but-valid update (mean)",
                    2,
                    3,
                    plan="wrong=sign_flip_x1000@exchange:3-4",
                    expected="accepted (valid values: the control): the mean takes the step, training "
                    "diverges, and every node stops with an error naming the non-finite parameters",
                    checks=("fired", "stopped_loudly"),
                ),
            ),
            diverges=True,
        ),
        Scenario(
            "wrong-update-median",
            "3 nodes, run.aggregator = median; node 2 sends its update negated x1000 in rounds 3-4",
            (
                Fault(
                    "wrong-but-valid update (median)",
                    2,
                    3,
                    plan="wrong=sign_flip_x1000@exchange:3-4",
                    expected="outvoted per coordinate: the loss falls as in the healthy run",
                    checks=("fired", "loss_as_healthy"),
                ),
            ),
            overrides=('run.aggregator="median"', DETERMINISTIC),
        ),
        Scenario(
            "insider-bad-data",
            "3 nodes, run.codec = fp32 (raw float32 chunks); node 2's round-3 chunks go out as float32 +Inf, its "
            "round-7 chunks cut to half their size",
            (
                Fault(
                    "Inf values",
                    2,
                    3,
                    plan="corrupt=inf@exchange:3",
                    expected="refused by every receiver (counted by reason), the round commits without it, it resyncs",
                    checks=("refused", "left_out", "back"),
                ),
                Fault(
                    "wrong size",
                    2,
                    7,
                    plan="corrupt=short@exchange:7",
                    expected="the same",
                    checks=("left_out", "back"),
                ),
            ),
            rounds=12,
            overrides=('run.codec="fp32"',),
        ),
        Scenario(
            "huge-values-mean",
            "3 nodes, run.codec = fp32, run.aggregator = mean; node 2's round-3 chunks go out as float32 1e38 "
            "(finite: a valid, wrong value)",
            (
                Fault(
                    "1e38 values (mean)",
                    2,
                    3,
                    plan="corrupt=huge@exchange:3",
                    expected="accepted (the control): the mean takes the step, theta overflows, and every node stops "
                    "with an error naming the non-finite parameters",
                    checks=("fired", "stopped_loudly"),
                ),
            ),
            overrides=('run.codec="fp32"',),
            diverges=True,
        ),
        Scenario(
            "huge-values-median",
            "3 nodes, run.codec = fp32, run.aggregator = median; node 2's round-3 chunks go out as float32 1e38",
            (
                Fault(
                    "1e38 values (median)",
                    2,
                    3,
                    plan="corrupt=huge@exchange:3",
                    expected="outvoted per coordinate: the loss falls as in the healthy run",
                    checks=("fired", "loss_as_healthy"),
                ),
            ),
            overrides=('run.codec="fp32"', 'run.aggregator="median"', DETERMINISTIC),
        ),
        Scenario(
            "probes",
            "3 nodes; once round 3 committed, a client without the run secret and one with it send node 0 bad "
            "requests: no token, a wrong secret, a flood of 300, a replayed token, an inflated round id, a "
            "malformed frame, a header claiming 1 MiB, a 9 MiB message, a ready record speaking for another peer "
            "and one for another round than its token's",
            (
                Fault(
                    "bad requests and a flood",
                    0,
                    3,
                    signal="probe",
                    expected="each refused with its reason and counted; the node's rounds never notice",
                    checks=("all_refused", "refused", "never_left_out", "no_abort", "not_waited"),
                ),
            ),
        ),
        Scenario(
            "control-api",
            f"3 nodes; once round 3 committed, node 0's control endpoint (what `farloco status` and `leave` call) "
            f"gets calls without its token or with a wrong one (status, leave now), malformed ones (a bad mode, a "
            f"1 MiB body, Content-Length -1, a body that is not JSON), an unknown path, {CONTROL_IDLE} connections "
            "that never send a request, and a connection to the port from the host's non-loopback address",
            (
                Fault(
                    "remote and malformed control calls",
                    0,
                    3,
                    signal="control-probe",
                    expected="each refused (401, 400, 413, 404; nothing listens beyond loopback); the idle "
                    "connections cost the real caller nothing; the node neither leaves nor notices",
                    checks=("all_refused", "never_left_out", "no_abort", "not_waited", "exit_0"),
                ),
            ),
            rounds=12,
        ),
        Scenario(
            "forged-records",
            "3 nodes; once round 3 committed, a DHT node of an outsider (the run's config, not its secret) joins the "
            "swarm's DHT and writes a member record with a forged proof and ready records for the next 3 rounds, "
            "an unsigned member record, a record of the wrong schema, and a real member's record rewritten under "
            "that member's key",
            (
                Fault(
                    "forged and unsigned DHT records",
                    0,
                    3,
                    signal="forge",
                    expected="the unsigned, the wrong-schema and the rewritten records are refused by the DHT "
                    "itself; the well-signed forgery is stored but no node believes it (counted by reason), "
                    "lists it, waits for it or groups it",
                    checks=("forged_ignored", "never_left_out", "no_abort", "not_waited"),
                ),
            ),
        ),
        _poisoned_donors(
            "poisoned-donor",
            "4 nodes; nodes 1 and 2 serve joiners the same wrong theta (the swarm's, nudged by 0.01) under a manifest "
            "consistent with it, their own rounds and records honest; node 3 joins with `farloco join` once round 3 "
            "committed, nodes 0-2 its donors: the poisoned manifest outvotes the honest one 2 to 1",
            "poisoned state donor",
            "poison-state",
            "it refuses both poisoned states before fetching a byte (their theta is not the one the round's members "
            "vouch for in their signed records: WRONG_STATE), fetches node 0's and contributes from its next round; "
            "no fork",
            "poison_refused",
        ),
        _poisoned_donors(
            "poisoned-strategy-donor",
            "4 nodes; nodes 1 and 2 serve joiners the swarm's theta beside the same strategy state with a NaN in "
            "its momentum, under a manifest consistent with it (the theta the swarm vouches for: only the install "
            "would refuse it), their own rounds honest; node 3 joins once round 3 committed, nodes 0-2 its donors: "
            "the poisoned manifest outvotes the honest one 2 to 1",
            "poisoned strategy state",
            "poison-strategy-state",
            "it fetches the poisoned manifest (the vouched theta, two donors), finds the NaN before installing "
            "anything (BAD_STATE_VALUES), fetches node 0's state and contributes from its next round; no fork, no "
            "crash",
            "strategy_poison_refused",
        ),
        Scenario(
            "bootstrap-lost",
            "3 nodes; once round 3 committed the bootstrap node (the only initial peer) is SIGKILLed for good, "
            "then node 2, restarted 1 s after",
            (
                Fault(
                    "bootstrap lost, then a node restarts",
                    2,
                    3,
                    signal="bootstrap-lost",
                    restart_after=1.0,
                    expected="the swarm trains on; the restarted node finds it through the peers it last saw "
                    "(known-peers.json) and contributes again",
                    checks=("fallback", "back"),
                ),
            ),
            rounds=10,
        ),
        Scenario(
            "whole-swarm-restart",
            "3 nodes, checkpoints every 2 rounds; node 2 SIGKILLed once round 3 committed and down 25 s, nodes 0 "
            "and 1 SIGKILLed once round 6 committed and restarted 1 s and 4 s after: every node down at once, "
            "back from checkpoints of different rounds",
            (
                Fault(
                    "node 2 down first",
                    2,
                    3,
                    signal="sigkill",
                    restart_after=25.0,
                    checks=("back",),
                    expected="the others go on; back, it takes the swarm's newer state",
                ),
                Fault(
                    "node 0 down",
                    0,
                    6,
                    signal="sigkill",
                    restart_after=1.0,
                    checks=("back",),
                    expected="resumes its own newest checkpoint",
                ),
                Fault(
                    "node 1 down",
                    1,
                    6,
                    signal="sigkill",
                    restart_after=4.0,
                    checks=("back",),
                    expected="resumes its own checkpoint or the state node 0 went on from; one swarm, no fork",
                ),
            ),
            rounds=30,
            timeout=360.0,
        ),
        Scenario(
            "crash-before-rename",
            "3 nodes, checkpoints every 2 rounds; node 2 SIGKILLed (with its ranks) once its round-4 checkpoint is "
            "durable under its temporary name (files and directory fsynced), before the rename; restarted 1 s after",
            (
                Fault(
                    "crash between fsync and rename",
                    2,
                    4,
                    plan="crash@save:4",
                    restart_after=1.0,
                    expected="the torn checkpoint is never loaded (never under a final name): the node comes back "
                    "from its round-2 checkpoint or the swarm's state, contributes again, and its next save "
                    "removes the dead writer's directory",
                    checks=("torn_cleaned", "back"),
                ),
            ),
            rounds=12,
        ),
        Scenario(
            "stalled-dht",
            "3 nodes; node 2's DHT process (hivemind's daemon, a child of the node) frozen with SIGSTOP for 10 s "
            "once round 3 committed, then SIGCONT; the agent and its links live on",
            (
                Fault(
                    "DHT process stalled 10 s",
                    2,
                    3,
                    signal="dht-stop=10",
                    expected="its stores and reads time out, the others' requests to it too; the rounds go on over "
                    "the members' links (with or without it), no fork, and it is in the rounds again after SIGCONT",
                    checks=("back",),
                ),
            ),
            rounds=12,
        ),
        Scenario(
            "partition-2-2",
            "4 nodes, each a network namespace on a 100 Mbit/s WAN (the bootstrap on a fifth, with nodes 0-1); once "
            "round 3 committed every packet between nodes 0-1 and nodes 2-3 is dropped silently (no FIN, no RST) "
            "for 60 s, then the network heals",
            (
                Fault(
                    "a 2|2 partition healed after a minute",
                    2,
                    3,
                    signal="partition=60",
                    expected="neither side is alone, so each trains on apart (no fork within a side); after the "
                    "heal the sides meet, the hash check (or the round ids) finds two states, one side takes the "
                    "other's (the healing rule: the larger side, then more outer steps, then the lowest peer id; or "
                    "the side ahead), and "
                    "no round after that has two hashes",
                    checks=("one_state_after_heal", "left_out", "back"),
                ),
            ),
            peers=4,
            rounds=60,
            wan="100mbit",
            sides=((0, 1), (2, 3)),
            timeout=900.0,
        ),
        Scenario(
            "half-open",
            "3 nodes, each a network namespace on a 100 Mbit/s WAN; once round 3 committed node 2's packets are "
            "dropped both ways and it is SIGKILLed, so its FIN and RST reach nobody (every connection to it "
            "half-open); the network heals 20 s later and it restarts",
            (
                Fault(
                    "peer gone without FIN (half-open connections)",
                    2,
                    3,
                    signal="vanish=20",
                    restart_after=1.0,
                    expected="the others find it gone (its record expires; its links, dead without a word, are "
                    "given up by their deadlines and keepalives) and go on without it; back, it catches up and "
                    "contributes again",
                    checks=("left_out", "back"),
                ),
            ),
            rounds=20,
            wan="100mbit",
            timeout=600.0,
        ),
        Scenario(
            "long-run",
            f"4 nodes, {LONG_RUN_ROUNDS} rounds of H = 2 inner steps on a real DHT, nothing goes wrong: no round "
            "may deadlock or lose a node (round-time distribution)",
            peers=4,
            rounds=LONG_RUN_ROUNDS,
            overrides=("run.inner_steps=2", "node.eval_batches=1", "checkpoint.every_rounds=50"),
            timeout=2400.0,
        ),
        Scenario(
            "churn",
            f"4 nodes for about 10 minutes: every {CHURN_EVERY} rounds one of nodes 1-3 is SIGKILLed "
            "(restarted 1-3 s after), frozen 8 s, or leaves with `farloco leave` and joins again "
            f"{CHURN_EVERY // 2} rounds later; node 0 is never touched",
            churn_faults(),
            peers=4,
            rounds=CHURN_ROUNDS,
            # 837 s on this machine on a fast day, over 1200 s on a slow one (inner steps 0.67 s instead of
            # ~0.35 s): the budget is a bound against a hang, the row's figures say how long it took.
            timeout=2400.0,
        ),
    )
}
