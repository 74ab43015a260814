"""Exchange tests across processes: each member is a worker process (tests/helpers/exchange.py run as a script)
on 127.0.0.1; members are SIGKILLed, frozen or started late mid-exchange."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.exchange import TopKCodec, load_result, make_input, run_workers, spawn_workers, tolerance


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("count", "codec"),
    [
        pytest.param(2, "int8", marks=pytest.mark.slow),
        (3, "fp32"),
        pytest.param(4, "topk", marks=pytest.mark.slow),
    ],
)
def test_mean_across_processes(count: int, codec: str, tmp_path: Path) -> None:
    numel = 300_007
    _, reports = run_workers(count, numel, codec, tmp_path)
    assert all(r.get("ok") for r in reports), reports
    results = [load_result(tmp_path, i) for i in range(count)]
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(r["contributors"] == [f"peer-{i}" for i in range(count)] for r in reports)
    inputs = [make_input(i, numel) for i in range(count)]
    if codec == "topk":
        c = TopKCodec()
        inputs = [c.decode(c.encode(t)) for t in inputs]
    assert float((results[0] - torch.stack(inputs).mean(0)).abs().max()) <= tolerance(codec, inputs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("codec", "die_at"),
    [
        ("fp32", 3),  # while sending its contributions (reduce-scatter)
        pytest.param(
            "int8", 14, marks=pytest.mark.slow
        ),  # while re-encoding the means of its part (all-gather)
        pytest.param("topk", 1, marks=pytest.mark.slow),  # before its sparse payload left
    ],
)
def test_sigkill_member_mid_exchange(codec: str, die_at: int, tmp_path: Path) -> None:
    numel = 600_000  # 2.3 MiB fp32 -> ~12 chunks per part with 3 members
    procs, reports = run_workers(3, numel, codec, tmp_path, die={1: die_at})
    assert procs[1].returncode == -signal.SIGKILL
    survivors = [reports[0], reports[2]]
    # Whatever happened, the bytes of the failed attempt are counted and never beat their fp32 equivalent
    # for fp32 (a member dropped mid-round once made the ratio 8/7).
    for report in survivors:
        assert report["bytes_sent"] > 0, report
        if codec == "fp32":
            assert report["fp32_bytes"] <= report["bytes_sent"], report
    if all(r.get("ok") for r in survivors):
        assert survivors[0]["contributors"] == survivors[1]["contributors"]
        assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
        contributors = survivors[0]["contributors"]
        # The victim died before its contribution reached every part, so the mean must exclude it everywhere.
        assert contributors == ["peer-0", "peer-2"], contributors
        inputs = [make_input(i, numel) for i in (0, 2)]
        if codec == "topk":
            c = TopKCodec()
            inputs = [c.decode(c.encode(t)) for t in inputs]
        err = float((load_result(tmp_path, 0) - torch.stack(inputs).mean(0)).abs().max())
        assert err <= tolerance(codec, inputs), err
    else:
        # Never one survivor with a mean and the other without.
        assert not any(r.get("ok") for r in survivors), survivors
        assert all(r.get("aborted") for r in survivors), survivors


@pytest.mark.multiprocess
def test_parent_sigkill_mid_exchange_keeps_survivors_consistent(tmp_path: Path) -> None:
    """The victim encodes slowly; the test process SIGKILLs it from outside while the exchange runs."""
    numel = 400_000
    procs = spawn_workers(3, numel, "fp32", {}, tmp_path, codecs={1: "slow-fp32"})
    try:
        addresses = [p.stdout.readline().strip() for p in procs if p.stdout]
        group = json.dumps({"round": 3, "members": [[f"peer-{i}", a] for i, a in enumerate(addresses)]})
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(group + "\n")
            proc.stdin.flush()
        assert procs[1].stdout is not None
        assert procs[1].stdout.readline().strip() == "averaging"
        time.sleep(0.5)  # slow-fp32 sleeps 0.1 s per encode (~36 encodes): well under way, far from done
        procs[1].send_signal(signal.SIGKILL)
        reports = []
        for proc in (procs[0], procs[2]):
            out, _ = proc.communicate(timeout=60)
            reports.append(json.loads(out.strip().splitlines()[-1]))
        procs[1].wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
    exact = (make_input(0, numel) + make_input(2, numel)) / 2
    assert torch.allclose(load_result(tmp_path, 0), exact, atol=1e-6)
    for report in reports:
        # Two attempts: the re-run among the two survivors alone sends 2 * 1/2 * 4 bytes per value (its part
        # out, the mean of its part back); the failed attempt of three came on top, and fp32 never beats itself.
        assert report["fp32_bytes"] > 4 * numel, report
        assert report["fp32_bytes"] <= report["bytes_sent"] < 1.001 * report["fp32_bytes"], report


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hung_member_is_dropped_after_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped member keeps its sockets open: only the deadlines can drop it."""
    numel = 300_000
    # Data phase 7.2 s, votes 1.8 s, then a retry among the others.
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "12")
    _, reports = run_workers(3, numel, "fp32", tmp_path, die={1: -3}, collect=(0, 2))
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))
    exact = (make_input(0, numel) + make_input(2, numel)) / 2
    assert torch.allclose(load_result(tmp_path, 0), exact, atol=1e-6)


@pytest.mark.multiprocess
def test_a_frozen_member_is_given_up_by_a_majority_before_the_data_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGSTOPped member whose membership record expired (the agent's view: no heartbeat for the member ttl)
    and that sent nothing for GONE_SILENCE_SECONDS is given up by the two others, a strict majority of the
    group, long before the data deadline (18 s here): they retry without it and agree bit for bit."""
    numel = 300_000
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "30")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    _, reports = run_workers(3, numel, "fp32", tmp_path, die={1: -1}, collect=(0, 2))
    assert all(r.get("ok") for r in reports), reports
    assert reports[0]["contributors"] == reports[1]["contributors"] == ["peer-0", "peer-2"]
    assert all(r["seconds"] < 12.0 for r in reports), reports  # the data deadline alone would be 18 s
    assert torch.equal(load_result(tmp_path, 0), load_result(tmp_path, 2))


@pytest.mark.multiprocess
def test_a_silent_member_that_answers_is_kept_even_when_its_record_expired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that starts its attempt 5 s late (silent meanwhile) and whose record the others see expired (a
    frozen member's DHT replica makes healthy members' heartbeats fail too): it answers their ping, so it is
    waited for and the mean has all three."""
    numel = 300_000
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "30")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    monkeypatch.setenv("EXCHANGE_TEST_LATE", "peer-1:5")
    _, reports = run_workers(3, numel, "fp32", tmp_path)
    assert all(r.get("ok") for r in reports), reports
    assert all(r["contributors"] == ["peer-0", "peer-1", "peer-2"] for r in reports), reports


@pytest.mark.multiprocess
def test_neither_side_of_a_one_one_split_gives_up_the_other_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members, one frozen and gone from the other's view: one member is no strict majority of two (from
    one side a freeze and a partition look alike, and each side of a 1|1 partition would go on alone), so the
    survivor waits for the data deadline (3.6 s of a 6 s exchange) as it would without the callback."""
    monkeypatch.setenv("EXCHANGE_TEST_TIMEOUT", "6")
    monkeypatch.setenv("EXCHANGE_TEST_GONE", "peer-1")
    _, (report,) = run_workers(2, 300_000, "fp32", tmp_path, die={1: -1}, collect=(0,))
    elapsed = report.get("elapsed", report.get("seconds"))
    assert elapsed is not None and elapsed >= 3.5, report
    assert "MEMBER_GONE" not in json.dumps(report), report
