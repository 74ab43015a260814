"""Smoke run of benchmarks/byzantine.py: one Byzantine member of 4, two rounds, through the
script's own code path. The script itself raises if the workers' theta_outer ever differ (honest peers agree
whatever the rule); here: the control (plain mean) is wrecked by a sign flip x1000 while the median is not, and
the JSON renders the same table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "byzantine.py"


def test_one_byzantine_member_of_four_wrecks_the_mean_and_not_the_median(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_script(SCRIPT, "farloco_bench_byzantine")
    out = tmp_path / "byzantine.json"
    argv = ["--workers", "4", "--steps", "4", "--sync-every", "2", "--attacks", "none", "sign_flip_x1000"]
    argv += ["--aggregators", "mean", "median", "--out", str(out)]
    argv += ["--cache-dir", str(tmp_path_factory.mktemp("data"))]
    threads = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    rows = {(r["attack"], r["aggregator"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(a, g) for a in ("none", "sign_flip_x1000") for g in ("mean", "median")}
    base = rows["none", "mean"]["loss"]
    assert base is not None and 3.0 < base < 6.0, base
    wrecked = rows["sign_flip_x1000", "mean"]
    assert wrecked["loss"] is None or wrecked["loss"] > base + 1.0, wrecked
    held = rows["sign_flip_x1000", "median"]
    assert held["loss"] is not None and abs(held["loss"] - base) < 0.1, (held, base)
    assert all(r["aggregate_seconds"] > 0 for r in rows.values())
    assert "| sign_flip_x1000 |" in printed and "1 Byzantine member of 4" in printed
    assert bench.main(["--render", str(out)]) == 0
    rendered = capsys.readouterr().out
    assert (
        bench.table(
            [bench.Row(**{**r, "losses": {int(s): v for s, v in r["losses"].items()}}) for r in rows.values()]
        )
        in rendered
    )
