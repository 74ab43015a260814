"""deploy/grafana/farloco-dashboard.json: every query names a metric the daemon really exports (read back from a
real NodeMetrics registry with prometheus_client's parser), and the file is what its generator writes."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from types import ModuleType
from typing import Any

from helpers import ROOT
from prometheus_client.parser import text_string_to_metric_families

from farloco.node.daemon.metrics import BY_REASON, COUNTERS, GAUGES, NodeMetrics

GRAFANA = ROOT / "deploy" / "grafana"
METRIC = re.compile(r"\bfarloco_[a-z_]+")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("farloco_grafana_dashboard", GRAFANA / "make_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SWARM_MEMBER = {
    "peer_id": "QmSomePeerAAAAAAAAAAAAAA",
    "round_id": 7,
    "inner_step": 140,
    "loss": 3.5,
    "tokens_per_second": 1200.0,
    "heartbeat_age": 0.4,
    "share": 1.0,
}


def exported_sample_names() -> set[str]:
    """Every sample name of a scrape in which each status value and each histogram has something to show."""
    values: dict[str, Any] = {key: 1.0 for _, key, _ in (*GAUGES, *COUNTERS)}
    values.update({key: {"SOME_REASON": 1} for _, key, _ in BY_REASON})
    values.update(trainer_last_exit_code=-9, trainer_last_exit="rank 0 killed", last_contributors=2)
    values["swarm"] = [SWARM_MEMBER, {**SWARM_MEMBER, "peer_id": "QmOtherPeerBBBBBBBBBBBB", "round_id": 6}]
    metrics = NodeMetrics(lambda: values)
    for histogram in (
        metrics.round_duration,
        metrics.exchange_duration,
        metrics.inner_step_duration,
        metrics.ranks_idle,
    ):
        histogram.observe(0.5)
    return {
        sample.name for family in text_string_to_metric_families(metrics.text()) for sample in family.samples
    }


def queries(board: dict[str, Any]) -> list[str]:
    found = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    found += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_query_names_a_metric_the_daemon_exports() -> None:
    board = json.loads((GRAFANA / "farloco-dashboard.json").read_text())
    exported = exported_sample_names()
    used = {name for expr in queries(board) for name in METRIC.findall(expr)}
    unknown = sorted(used - exported)
    assert not unknown, f"the dashboard queries metrics the daemon does not export: {unknown}"
    # What an operator needs the dashboard to show: loss, round time, bytes and compression, peers, rejections.
    for wanted in (
        "farloco_loss",
        "farloco_eval_loss",
        "farloco_round_duration_seconds_bucket",
        "farloco_bytes_sent_total",
        "farloco_compression_ratio",
        "farloco_peers",
        "farloco_rejected_messages_total",
    ):
        assert wanted in used, wanted


def test_every_swarm_view_query_names_a_metric_the_daemon_exports() -> None:
    board = json.loads((GRAFANA / "farloco-swarm-view.json").read_text())
    exported = exported_sample_names()
    used = {name for expr in queries(board) for name in METRIC.findall(expr)}
    assert not sorted(used - exported), sorted(used - exported)
    # The swarm at a glance: how many, their loss, their throughput, who lags, how many contribute.
    for wanted in (
        "farloco_swarm_peers",
        "farloco_swarm_peer_loss",
        "farloco_swarm_peer_tokens_per_second",
        "farloco_swarm_peer_round",
        "farloco_round_contributors",
    ):
        assert wanted in used, wanted
    assert text_of("farloco-swarm-view.json") == generator().render_swarm(), (
        "run python deploy/grafana/make_dashboard.py and commit the JSON"
    )


def text_of(name: str) -> str:
    return (GRAFANA / name).read_text()


def test_the_swarm_view_reads_the_member_table_per_peer() -> None:
    """The samples themselves: one series per member, labelled by its peer id's first 16 characters, and the
    totals over the members."""
    values: dict[str, Any] = {
        "swarm": [
            SWARM_MEMBER,
            {**SWARM_MEMBER, "peer_id": "QmOtherPeerBBBBBBBBBBBB", "round_id": 6, "loss": 0.0},
        ]
    }
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(NodeMetrics(lambda: values).text())
        for sample in family.samples
    }
    assert samples[("farloco_swarm_peers", ())] == 2
    assert samples[("farloco_swarm_peer_round", (("peer", "QmSomePeerAAAAAA"),))] == 7
    assert samples[("farloco_swarm_peer_round", (("peer", "QmOtherPeerBBBBB"),))] == 6
    assert samples[("farloco_swarm_mean_loss", ())] == 3.5  # a loss of 0 is "not known yet"
    assert samples[("farloco_swarm_tokens_per_second", ())] == 2400.0
    assert (samples[("farloco_swarm_max_round", ())], samples[("farloco_swarm_min_round", ())]) == (7, 6)


def test_the_dashboard_is_well_formed_and_what_its_generator_writes() -> None:
    text = (GRAFANA / "farloco-dashboard.json").read_text()
    assert text == generator().render(), "run python deploy/grafana/make_dashboard.py and commit the JSON"
    board = json.loads(text)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "farloco-swarm"
    for panel in board["panels"]:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"]), panel["title"]
