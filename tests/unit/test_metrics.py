"""node/daemon/metrics.py: the agent's /metrics through prometheus_client, read back with prometheus_client's own parser
(what a Prometheus server does with it): the status values as gauges and counters, counters by reason, the
histograms observed as rounds happen, nothing for values that do not exist yet."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from farloco.node.daemon.metrics import NodeMetrics


def parsed(metrics: NodeMetrics) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(metrics.text())}


def test_status_values_become_gauges_counters_and_counters_by_reason() -> None:
    values: dict[str, Any] = {
        "loss": 2.5,
        "eval_loss": math.nan,  # not evaluated yet: no sample at all, never a NaN sample
        "round_id": 7,
        "compression_ratio": None,
        "bytes_sent": 1024,
        "rejected": {"BAD_SIGNATURE": 3, "STALE_ROUND": 1},
        "left_out": {},
        "trainer_last_exit_code": -9,
        "trainer_last_exit": 'rank 0 "killed" by SIGKILL',
    }
    families = parsed(NodeMetrics(lambda: values))
    assert families["farloco_loss"].type == "gauge" and families["farloco_loss"].samples[0].value == 2.5
    assert families["farloco_round_id"].samples[0].value == 7
    assert "farloco_eval_loss" not in families and "farloco_compression_ratio" not in families
    sent = families["farloco_bytes_sent"]
    assert sent.type == "counter" and sent.samples[0].name == "farloco_bytes_sent_total"
    rejected = {s.labels["reason"]: s.value for s in families["farloco_rejected_messages"].samples}
    assert rejected == {"BAD_SIGNATURE": 3.0, "STALE_ROUND": 1.0}
    assert "farloco_left_out" not in families  # no reason counted yet
    exit_code = families["farloco_trainer_last_exit_code"].samples[0]
    assert exit_code.value == -9 and exit_code.labels["reason"] == 'rank 0 "killed" by SIGKILL'
    assert families["farloco_agent_process_resident_memory_bytes"].samples[0].value > 0


def test_histograms_count_what_was_observed_and_read_the_status_at_each_scrape() -> None:
    values: dict[str, Any] = {"round_id": 1}
    metrics = NodeMetrics(lambda: values)
    for seconds in (0.2, 0.3, 12.0):
        metrics.round_duration.observe(seconds)
    metrics.ranks_idle.observe(0.004)
    values["round_id"] = 4  # the next scrape sees the status as it is then
    families = parsed(metrics)
    samples = {
        (s.name, s.labels.get("le")): s.value for s in families["farloco_round_duration_seconds"].samples
    }
    assert samples[("farloco_round_duration_seconds_count", None)] == 3
    assert math.isclose(samples[("farloco_round_duration_seconds_sum", None)], 12.5)
    assert samples[("farloco_round_duration_seconds_bucket", "0.25")] == 1
    assert samples[("farloco_round_duration_seconds_bucket", "+Inf")] == 3
    idle = {s.name: s.value for s in families["farloco_ranks_idle_duration_seconds"].samples}
    assert idle["farloco_ranks_idle_duration_seconds_count"] == 1
    assert families["farloco_round_id"].samples[0].value == 4
    # Two agents in one process keep apart registries.
    fresh = parsed(NodeMetrics(lambda: {}))["farloco_round_duration_seconds"].samples
    assert {s.name: s.value for s in fresh}["farloco_round_duration_seconds_count"] == 0
