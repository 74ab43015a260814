"""The node's Prometheus metrics (`/metrics` of the control server), through prometheus_client.

Two kinds, in one registry per agent (never the process-global one: tests run several agents' code in one
process):

- what the agent's status says at scrape time (round, losses, bytes, shares, isolation, refused messages by
  reason...), read through a custom collector from `values()`, so nothing is stored twice and a scrape always
  sees one consistent status;
- histograms observed as things happen: each round's duration, each exchange's, the ranks' inner step time and
  the time they waited for the agent at each hand-off (what a Grafana panel of percentiles wants, and what the
  gauges of the last value cannot show);

plus prometheus_client's process collector (resident memory, CPU seconds, open files) for the agent process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# name (without farloco_), key of values(), help
GAUGES = (
    ("loss", "loss", "Mean inner training loss of the last round."),
    ("eval_loss", "eval_loss", "Held-out loss of theta_outer."),
    ("round_id", "round_id", "Current outer round."),
    ("inner_step", "inner_step", "Inner steps done by this node."),
    ("peers", "num_peers", "Live members of the swarm seen by this node."),
    ("compression_ratio", "compression_ratio", "fp32 bytes per wire byte actually achieved."),
    ("round_seconds", "last_round_seconds", "Duration of the last outer round."),
    (
        "match_wait_seconds",
        "match_wait_seconds",
        "Straggler wait this node proposed last round (adapts between match_timeout_min and match_timeout).",
    ),
    ("inner_step_seconds", "inner_step_seconds", "Mean inner step time of the last round."),
    ("inner_lr", "inner_lr", "Inner learning rate of the last sequence's last step (run.lr_schedule)."),
    ("outer_lr", "outer_lr", "Outer learning rate the next commit applies (run.outer_lr_schedule)."),
    ("tokens_per_second", "tokens_per_second", "Training tokens per second in inner steps."),
    ("sync_bytes_done", "sync_bytes_done", "Bytes of outer state fetched by the running sync."),
    ("sync_bytes_total", "sync_bytes_total", "Bytes of outer state the running sync fetches."),
    ("group_share", "group_share", "Fraction of the last 100 rounds this node contributed to."),
    ("isolated", "isolated", "1 while peers this node had vanished without leaving and none is live."),
    ("isolated_seconds", "isolated_seconds", "How long the current isolation has lasted."),
)
COUNTERS = (
    ("bytes_sent", "bytes_sent", "Bytes of outer updates sent."),
    ("bytes_received", "bytes_received", "Bytes of outer updates received."),
    ("trainer_restarts", "trainer_restarts", "Trainer rank groups restarted by the elastic launcher."),
    ("rounds_committed", "rounds_committed", "Committed rounds."),
    ("rounds_aborted", "rounds_aborted", "Aborted rounds."),
    (
        "partial_contributions",
        "partial_contributions",
        "Rounds whose inner steps this node cut short because the round's other members waited for it.",
    ),
    ("isolations", "isolations", "Times this node found itself isolated."),
    (
        "ranks_idle_seconds",
        "ranks_idle_seconds",
        "Seconds the trainer ranks waited for the agent between two sequences of inner steps.",
    ),
)
# Counters by reason: name, key of values() (a {reason: count} mapping), help.
BY_REASON = (
    ("left_out", "left_out", "Rounds this node did not contribute to, by reason."),
    ("peers_left_out", "peers_left_out", "Live members this node's groups left out, by reason."),
    ("rejected_messages", "rejected", "Messages refused, by reason."),
    ("ignored_dht_records", "ignored", "DHT records not believed, by reason."),
)
# The swarm as this node sees it (its member table, refreshed every heartbeat): one series per live member,
# labelled peer = its peer id's first 16 characters (the name the experiment loggers give it).
SWARM_PEER_GAUGES = (
    ("round", "round_id", "The outer round the member works on."),
    ("inner_step", "inner_step", "Inner steps the member's ranks have done."),
    ("loss", "loss", "The member's mean training loss in its last round (0 while unknown)."),
    ("tokens_per_second", "tokens_per_second", "The member's training tokens/s in its inner steps."),
    ("heartbeat_age_seconds", "heartbeat_age", "Seconds since the member's record was refreshed."),
    ("share", "share", "Fraction of this node's recent rounds the member contributed to."),
)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 600.0)


def _number(value: Any) -> float | None:
    """A metric value, or None where there is none yet (absent, None, NaN)."""
    if value is None or isinstance(value, str):
        return None
    number = float(value)
    return None if math.isnan(number) else number


class _StatusCollector(Collector):
    def __init__(self, values: Callable[[], Mapping[str, Any]]) -> None:
        self.values = values

    def collect(self) -> Iterator[Metric]:
        values = self.values()
        for name, key, help_text in GAUGES:
            value = _number(values.get(key))
            if value is not None:
                yield GaugeMetricFamily(f"farloco_{name}", help_text, value=value)
        for name, key, help_text in COUNTERS:
            value = _number(values.get(key))
            if value is not None:
                yield CounterMetricFamily(f"farloco_{name}", help_text, value=value)
        for name, key, help_text in BY_REASON:
            counts = values.get(key) or {}
            if counts:
                family = CounterMetricFamily(f"farloco_{name}", help_text, labels=["reason"])
                for reason, count in sorted(counts.items()):
                    family.add_metric([str(reason)], float(count))
                yield family
        yield from _swarm_families(values.get("swarm") or [])
        contributors = _number(values.get("last_contributors"))
        if contributors is not None:
            yield GaugeMetricFamily(
                "farloco_round_contributors",
                "Contributors of the last round this node committed.",
                value=contributors,
            )
        exit_code = values.get("trainer_last_exit_code")
        if exit_code is not None:
            exit_family = GaugeMetricFamily(
                "farloco_trainer_last_exit_code",
                "Exit code of the last failed rank (-N: signal N).",
                labels=["reason"],
            )
            exit_family.add_metric([str(values.get("trainer_last_exit") or "")], float(exit_code))
            yield exit_family


def _swarm_families(members: list[Mapping[str, Any]]) -> Iterator[Metric]:
    """farloco_swarm_*: the member table as series per peer, and the swarm's totals as this node sees them."""
    yield GaugeMetricFamily(
        "farloco_swarm_peers", "Live members in this node's member table.", value=len(members)
    )
    if not members:
        return
    for name, key, help_text in SWARM_PEER_GAUGES:
        family = GaugeMetricFamily(f"farloco_swarm_peer_{name}", help_text, labels=["peer"])
        for member in members:
            value = _number(member.get(key))
            if value is not None:
                family.add_metric([str(member["peer_id"])[:16]], value)
        yield family
    losses = [float(m["loss"]) for m in members if _number(m.get("loss"))]
    if losses:
        yield GaugeMetricFamily(
            "farloco_swarm_mean_loss",
            "Mean of the members' last training losses (those known).",
            value=sum(losses) / len(losses),
        )
    yield GaugeMetricFamily(
        "farloco_swarm_tokens_per_second",
        "The members' training tokens/s, summed.",
        value=sum(_number(m.get("tokens_per_second")) or 0.0 for m in members),
    )
    rounds = [int(m["round_id"]) for m in members]
    yield GaugeMetricFamily(
        "farloco_swarm_max_round", "The furthest member's outer round.", value=max(rounds)
    )
    yield GaugeMetricFamily("farloco_swarm_min_round", "The last member's outer round.", value=min(rounds))


class NodeMetrics:
    """One agent's registry: the status collector, the event histograms and the process collector."""

    def __init__(self, values: Callable[[], Mapping[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatusCollector(values))
        ProcessCollector(namespace="farloco_agent", registry=self.registry)

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(f"farloco_{name}", help_text, buckets=SECONDS_BUCKETS, registry=self.registry)

        self.round_duration = histogram("round_duration_seconds", "Outer rounds, from hand-off to close.")
        self.exchange_duration = histogram(
            "exchange_duration_seconds", "Exchanges of a group of two or more, matchmaking excluded."
        )
        self.inner_step_duration = histogram(
            "inner_step_duration_seconds", "Mean inner step time of each sequence the ranks ran."
        )
        self.ranks_idle = histogram(
            "ranks_idle_duration_seconds", "Time the ranks waited for the agent at each hand-off."
        )

    def text(self) -> str:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry).decode()
