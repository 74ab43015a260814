"""Writes the two Grafana dashboards beside this file, from the nodes' /metrics:

- farloco-dashboard.json, the nodes: every series per node (`instance`), which the `instance` variable filters;
- farloco-swarm-view.json, the swarm: the member table every node exports (farloco_swarm_*, one series per
  `peer`), merged over the nodes scraped (`max by (peer)`: each node sees the same swarm, some a heartbeat
  later), so one scraped node is enough and more only fill its gaps.

    python deploy/grafana/make_dashboard.py        # after changing a panel; commit the script and the JSON

Import the JSON in Grafana (Dashboards -> New -> Import) and pick the Prometheus data source that scrapes the
nodes' control endpoints (`http://NODE:CONTROL_PORT/metrics`; OPERATORS.md). tests/unit/test_grafana.py checks
that every query names a metric the daemon exports and that the files are what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SELECTOR = '{instance=~"$instance"}'

# (title, unit, [(expr, legend)]), laid out two per row.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Loss",
        "none",
        [
            (f"farloco_loss{SELECTOR}", "train {{instance}}"),
            (f"farloco_eval_loss{SELECTOR}", "held-out {{instance}}"),
        ],
    ),
    (
        "Outer round",
        "none",
        [(f"farloco_round_id{SELECTOR}", "{{instance}}")],
    ),
    (
        "Round time (p50, p95)",
        "s",
        [
            (
                f"histogram_quantile(0.5, sum by (le, instance) (rate(farloco_round_duration_seconds_bucket{SELECTOR}[5m])))",
                "p50 {{instance}}",
            ),
            (
                f"histogram_quantile(0.95, sum by (le, instance) (rate(farloco_round_duration_seconds_bucket{SELECTOR}[5m])))",
                "p95 {{instance}}",
            ),
        ],
    ),
    (
        "Exchange time (p95) and the ranks' wait for the agent (p95)",
        "s",
        [
            (
                f"histogram_quantile(0.95, sum by (le, instance) (rate(farloco_exchange_duration_seconds_bucket{SELECTOR}[5m])))",
                "exchange {{instance}}",
            ),
            (
                f"histogram_quantile(0.95, sum by (le, instance) (rate(farloco_ranks_idle_duration_seconds_bucket{SELECTOR}[5m])))",
                "ranks idle {{instance}}",
            ),
        ],
    ),
    (
        "Bytes per second on the wire",
        "Bps",
        [
            (f"rate(farloco_bytes_sent_total{SELECTOR}[5m])", "sent {{instance}}"),
            (f"rate(farloco_bytes_received_total{SELECTOR}[5m])", "received {{instance}}"),
        ],
    ),
    (
        "Compression (fp32 bytes per wire byte)",
        "none",
        [(f"farloco_compression_ratio{SELECTOR}", "{{instance}}")],
    ),
    (
        "Peers, and this node's share of the last 100 rounds",
        "none",
        [
            (f"farloco_peers{SELECTOR}", "live peers {{instance}}"),
            (f"farloco_group_share{SELECTOR}", "share {{instance}}"),
            (f"farloco_isolated{SELECTOR}", "isolated {{instance}}"),
        ],
    ),
    (
        "Rounds committed and aborted per minute",
        "none",
        [
            (f"60 * rate(farloco_rounds_committed_total{SELECTOR}[5m])", "committed {{instance}}"),
            (f"60 * rate(farloco_rounds_aborted_total{SELECTOR}[5m])", "aborted {{instance}}"),
        ],
    ),
    (
        "Rejected messages per minute, by reason",
        "none",
        [
            (f"60 * sum by (reason) (rate(farloco_rejected_messages_total{SELECTOR}[5m]))", "{{reason}}"),
            (
                f"60 * sum by (reason) (rate(farloco_ignored_dht_records_total{SELECTOR}[5m]))",
                "DHT: {{reason}}",
            ),
        ],
    ),
    (
        "Rounds left out per minute, by reason",
        "none",
        [(f"60 * sum by (reason) (rate(farloco_left_out_total{SELECTOR}[5m]))", "{{reason}}")],
    ),
    (
        "Training tokens per second and inner step time",
        "none",
        [
            (f"farloco_tokens_per_second{SELECTOR}", "tokens/s {{instance}}"),
            (f"farloco_inner_step_seconds{SELECTOR}", "step s {{instance}}"),
        ],
    ),
    (
        "Agent memory and trainer restarts",
        "bytes",
        [
            (f"farloco_agent_process_resident_memory_bytes{SELECTOR}", "agent RSS {{instance}}"),
            (f"farloco_trainer_restarts_total{SELECTOR}", "trainer restarts {{instance}}"),
        ],
    ),
]


PEER = 'max by (peer) (farloco_swarm_peer_{name}{{instance=~"$instance"}})'
SWARM_PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Live peers and last round's contributors",
        "none",
        [
            ('max(farloco_swarm_peers{instance=~"$instance"})', "live peers"),
            ('max(farloco_round_contributors{instance=~"$instance"})', "contributors"),
        ],
    ),
    (
        "Mean training loss of the swarm",
        "none",
        [(f"avg({PEER.format(name='loss')} > 0)", "mean of the peers' last losses")],
    ),
    ("Training loss per peer", "none", [(f"{PEER.format(name='loss')} > 0", "{{peer}}")]),
    (
        "Tokens/s of the swarm",
        "none",
        [(f"sum({PEER.format(name='tokens_per_second')})", "all peers")],
    ),
    ("Tokens/s per peer", "none", [(PEER.format(name="tokens_per_second"), "{{peer}}")]),
    ("Outer round per peer", "none", [(PEER.format(name="round"), "{{peer}}")]),
    (
        "Round spread (furthest minus last peer)",
        "none",
        [
            (
                'max(farloco_swarm_max_round{instance=~"$instance"}) - '
                'min(farloco_swarm_min_round{instance=~"$instance"})',
                "rounds apart",
            )
        ],
    ),
    ("Heartbeat age per peer", "s", [(PEER.format(name="heartbeat_age_seconds"), "{{peer}}")]),
]


def dashboard(
    panel_specs: list[tuple[str, str, list[tuple[str, str]]]] = PANELS,
    title: str = "Farloco swarm",
    uid: str = "farloco-swarm",
    instance_label: str = "node",
) -> dict[str, Any]:
    panels = []
    for index, (title_, unit, queries) in enumerate(panel_specs):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": title_,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(queries)
                ],
            }
        )
    return {
        "title": title,
        "uid": uid,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "tags": ["farloco"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "instance",
                    "type": "query",
                    "label": instance_label,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(farloco_round_id, instance)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def swarm_dashboard() -> dict[str, Any]:
    return dashboard(SWARM_PANELS, "Farloco swarm view", "farloco-swarm-view", "nodes whose view is merged")


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def render_swarm() -> str:
    return json.dumps(swarm_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    (here / "farloco-dashboard.json").write_text(render())
    (here / "farloco-swarm-view.json").write_text(render_swarm())
