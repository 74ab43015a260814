"""The island's collective path (node/daemon/island.py) with real processes: torch's c10d elastic rendezvous on
127.0.0.1 and a gloo group, no mocks. Run as a script, this file is one island node: it joins the island, goes
through the rounds its spec names (the exchange in between replaced by the identity: the island's mean of our
slice is what comes back), and prints one JSON line per round; results travel as raw float32 files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

NUMEL = 10_007
SLICES = 8


def contribution(node: int, round_id: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * round_id + node))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_main(spec: dict[str, Any]) -> None:
    from farloco.node.daemon.island import Island, IslandError

    time.sleep(spec.get("start_after", 0.0))
    started = time.monotonic()
    island = Island(
        name="test",
        endpoint=spec["endpoint"],
        run_id="island-test",
        host="127.0.0.1",
        max_nodes=spec["max_nodes"],
        slices=SLICES,
        wait=spec.get("wait", 5.0),
        collective_timeout=10.0,
        backend=spec.get("backend", "gloo"),
        device=spec.get("device", "cpu"),
        stage_elems=spec.get("stage", 0),
    )
    island.start()
    out = Path(spec["out"])
    try:
        for round_id in range(spec["rounds"]):
            deadline = time.monotonic() + 60
            while round_id == 0 and not (island.ready and island.size >= spec["want"]):
                assert time.monotonic() < deadline, "the island never formed"
                time.sleep(0.05)
            formed_after = time.monotonic() - started
            time.sleep(spec.get("pace", 0.3))  # a round's work between two exchanges
            if spec.get("die_at") == round_id:
                os.kill(os.getpid(), signal.SIGKILL)
            mine = contribution(spec["node"], round_id)
            weight = spec.get("weight", 1.0)
            result = island.submit_reduce(round_id, f"group-{round_id}", mine, weight).result(timeout=60)
            line: dict[str, Any] = {"round": round_id, "alone": result is None}
            if round_id == 0:
                line["formed_after"] = formed_after
            if result is not None:
                line.update(rank=result.rank, size=result.size, span=result.span, weight=result.weight)
                mean_out = torch.full((NUMEL,), float("nan"))
                sent_out = torch.full((NUMEL,), float("nan"))
                exchanged = (
                    result.mean.clone()
                )  # the identity exchange: our span's mean comes back as it went
                try:
                    island.submit_gather(True, exchanged, exchanged, mean_out, sent_out).result(timeout=60)
                except IslandError as exc:
                    line["gather_error"] = str(exc)
                else:
                    (out / f"mean-{spec['node']}-{round_id}.f32").write_bytes(mean_out.numpy().tobytes())
                    line["finite"] = bool(torch.isfinite(mean_out).all() and torch.isfinite(sent_out).all())
            print(json.dumps(line), flush=True)
    finally:
        island.close()


def island_specs(tmp_path: Path, count: int, **common: Any) -> list[dict[str, Any]]:
    """One spec per node of an island of `count` on a fresh endpoint: every node waits for all of them."""
    endpoint = f"127.0.0.1:{free_port()}"
    base = {"endpoint": endpoint, "max_nodes": count, "want": count, "out": str(tmp_path), **common}
    return [{**base, "node": i} for i in range(count)]


def start_nodes(specs: list[dict[str, Any]]) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[list[dict[str, Any]]]:
    lines = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            lines.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
            if proc.returncode not in (0, -signal.SIGKILL):
                raise AssertionError(f"island node exited {proc.returncode}: {stderr[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return lines


def read_mean(out: Path, node: int, round_id: int) -> torch.Tensor:
    return torch.frombuffer(
        bytearray((out / f"mean-{node}-{round_id}.f32").read_bytes()), dtype=torch.float32
    )


@pytest.mark.parametrize("stage", [0, 997])
def test_three_nodes_reduce_scatter_then_all_gather_the_weighted_mean(tmp_path: Path, stage: int) -> None:
    """stage: the collectives in place on the host buffers (gloo), or piece by piece through staging buffers of
    997 values per node (NCCL's path, here on the CPU with gloo)."""
    weights = [1.0, 0.5, 2.0]
    specs = island_specs(tmp_path, 3, rounds=3, stage=stage)
    for spec, weight in zip(specs, weights, strict=True):
        spec["weight"] = weight
    lines = finish(start_nodes(specs))
    for round_id in range(3):
        expected = sum(contribution(i, round_id) * w for i, w in enumerate(weights)) / sum(weights)
        means = [read_mean(tmp_path, i, round_id) for i in range(3)]
        for mean in means:
            assert torch.equal(mean, means[0])  # every node of the island holds the same bytes
        assert float((means[0] - expected).abs().max()) < 1e-5
    spans = sorted(tuple(lines[i][0]["span"]) for i in range(3))
    assert spans == [(0, 2), (2, 5), (5, 8)]  # the slices shared out, rank by rank
    assert all(line["weight"] == sum(weights) and line["size"] == 3 for node in lines for line in node)


def test_a_node_that_comes_later_is_in_the_island_within_seconds(tmp_path: Path) -> None:
    """Node 0 forms an island of one, node 1 starts 4 s later: torch's wait list brings node 0 back to the
    rendezvous and the two form one island at once (it took 95 s when a re-joining rank 0 left the newcomer
    waiting for torch's MASTER_ADDR, which only the first rendezvous of a handler writes)."""
    specs = island_specs(tmp_path, 2, rounds=2)
    specs[0]["want"] = 1
    specs[0]["rounds"] = 8
    specs[0]["pace"] = 2.0  # node 0 goes through rounds (alone at first) while node 1 starts and joins
    specs[1]["start_after"] = 4.0
    lines = finish(start_nodes(specs))
    formed = next(line["formed_after"] for line in lines[1] if "formed_after" in line)
    assert formed < 20.0, f"node 1 was in an island of two only {formed:.1f} s after its start"


def test_a_node_that_dies_costs_the_island_one_round_then_it_re_forms_without_it(tmp_path: Path) -> None:
    specs = island_specs(tmp_path, 3, rounds=12, wait=2.0)
    specs[2]["die_at"] = 2  # SIGKILLed before its round 2: the other two never get its post
    lines = finish(start_nodes(specs), timeout=180)
    survivors = lines[:2]
    for node in survivors:
        by_round = {line["round"]: line for line in node}
        assert not by_round[0]["alone"] and by_round[0]["size"] == 3
        assert by_round[2]["alone"], by_round[2]  # nobody waited for the dead node past the island's wait
        # Re-formed as an island of two (keep-alive expiry and a new rendezvous round) within the run.
        later = [line for line in node if line["round"] > 2 and not line["alone"]]
        assert later and all(line["size"] == 2 and "gather_error" not in line for line in later), node
    last = max(line["round"] for line in survivors[0] if not line["alone"])
    assert torch.equal(read_mean(tmp_path, 0, last), read_mean(tmp_path, 1, last))
    expected = (contribution(0, last) + contribution(1, last)) / 2
    assert float((read_mean(tmp_path, 0, last) - expected).abs().max()) < 1e-5


def test_a_node_whose_exchange_failed_makes_the_whole_island_sit_out(tmp_path: Path) -> None:
    """Every node of the island gets IslandError from the gather when one says its exchange gave no mean."""
    specs = island_specs(tmp_path, 2, rounds=2)
    specs[1]["mode"] = "fail-exchange"
    lines = finish(start_nodes(specs))
    assert [len(node) for node in lines] == [2, 2], lines  # a line per round from each node: none left out
    for node in lines:
        assert all("gather_error" in line and "no mean" in line["gather_error"] for line in node), node


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: an NCCL island of two nodes (NCCL refuses two ranks on one GPU)",
)
def test_an_nccl_island_of_two_gives_the_gloo_result(tmp_path: Path) -> None:
    specs = island_specs(tmp_path, 2, rounds=2, backend="nccl", stage=1009)
    for spec in specs:
        spec["device"] = f"cuda:{spec['node']}"
    finish(start_nodes(specs))
    for round_id in range(2):
        expected = (contribution(0, round_id) + contribution(1, round_id)) / 2
        means = [read_mean(tmp_path, i, round_id) for i in range(2)]
        assert torch.equal(means[0], means[1])
        assert float((means[0] - expected).abs().max()) < 1e-5


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("mode") == "fail-exchange":
        import farloco.node.daemon.island as island_module

        original = island_module.Island.submit_gather

        def failing(self: Any, ok: bool, *args: Any) -> Any:
            return original(self, False, *args)

        island_module.Island.submit_gather = failing  # type: ignore[method-assign]
    node_main(spec)
