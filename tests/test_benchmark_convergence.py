"""Smoke run of benchmarks/convergence.py: every kind of config through the script's own code path, 2 steps.

Checks what the table's figures are made of, not convergence: the byte counts follow the exchange pattern
from the real payload sizes, every worker ends with the same theta_outer (the run raises otherwise), the JSON
round-trips into the same table, and DDP's loss at a given number of bytes is read off its curve.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"
SMOKE_CONFIGS = [
    "ddp",
    "lone",
    "diloco-h10-int8",
    "streaming-diloco-h10-p5-int8",
    "sparseloco-h10-top64of4096-2bit",
    "demo-top12of1024",
]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("farloco_bench_convergence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script()


def test_smoke_run_counts_real_payload_bytes(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "results.json"
    argv = ["--quick", "--steps", "2", "--json", str(out), "--cache-dir", str(tmp_path / "data")]
    for name in SMOKE_CONFIGS:
        argv += ["--only", name]
    try:
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "benchmarks/convergence.py --quick --steps 2" in printed
    for name in SMOKE_CONFIGS:
        assert f"| {name} |" in printed

    results = {r.config.name: r for r in bench.read_json(out)}
    assert list(results) == SMOKE_CONFIGS
    num_params = 1016960
    configs = {c.name: c for c in bench.default_configs()}
    for name, result in results.items():
        assert math.isfinite(result.eval_loss[2]) and result.eval_loss[2] < math.log(256) + 0.5, name
    # DDP: a fp32 ring all-reduce of the gradients per step.
    assert results["ddp"].bytes_per_worker[2] == 2 * int(2 * 3 / 4 * 4 * num_params)
    assert results["lone"].bytes_per_worker[2] == 0 and len(results["lone"].worker_losses[2]) == 4
    zeros = torch.zeros(num_params)
    # diloco H=10 over 2 steps: the final round only; int8 is dense, so reduce-scatter + all-gather.
    int8 = configs["diloco-h10-int8"].make_codec()
    assert results["diloco-h10-int8"].bytes_per_worker[2] == round(1.5 * len(int8.encode(zeros)))
    # sparseloco: all-gather, the payload goes to each of the 3 peers.
    topk = configs["sparseloco-h10-top64of4096-2bit"].make_codec()
    assert results["sparseloco-h10-top64of4096-2bit"].bytes_per_worker[2] == 3 * len(topk.encode(zeros))
    # demo syncs every step.
    dct = configs["demo-top12of1024"].make_codec()
    assert results["demo-top12of1024"].bytes_per_worker[2] == 2 * 3 * len(dct.encode(zeros))
    # streaming: one round at step 2 carrying one of 5 fragments, so its peak is ~1/5 of diloco's.
    streaming = results["streaming-diloco-h10-p5-int8"]
    fragment = zeros[: -(-num_params // 5)]
    assert streaming.peak_bytes_per_sync == round(1.5 * len(int8.encode(fragment)))
    assert streaming.peak_bytes_per_sync < results["diloco-h10-int8"].peak_bytes_per_sync / 4

    assert bench.main(["--merge", str(out)]) == 0
    merged = capsys.readouterr().out
    assert "| ddp | " in merged and "| 100% |" in merged and "| 0% |" in merged


def test_ddp_loss_at_bytes_interpolates_the_curve(bench: ModuleType) -> None:
    config = bench.RunConfig("ddp", "ddp")
    ddp = bench.RunResult(config, {}, {}, curve=[(0, 5.0), (2, 4.0), (4, 3.0)])
    assert bench.ddp_loss_at_bytes(ddp, 300, 100) == (3.0, 3.5)
    assert bench.ddp_loss_at_bytes(ddp, 0, 100) == (0.0, 5.0)
    assert bench.ddp_loss_at_bytes(ddp, 10_000, 100) == (100.0, 3.0)  # past the curve: its last value


def test_unknown_config_is_refused(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--only", "no-such-config"])
    assert "no-such-config" in capsys.readouterr().err
