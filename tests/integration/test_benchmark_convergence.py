"""Smoke run of benchmarks/convergence.py: every kind of config through the script's own code path, 2 steps.

Checks what the table's figures are made of, not convergence: the byte counts follow the exchange pattern
from the real payload sizes, every worker ends with the same theta_outer (the run raises otherwise), the JSON
round-trips into the same table, and DDP's loss at a given number of bytes is read off its curve.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "convergence.py"
SMOKE_CONFIGS = [
    "ddp",
    "lone",
    "diloco-h10-int8",
    "streaming-diloco-h10-p5-tau1-a0.5-int8",
    "sparseloco-h10-top64of4096-2bit",
    "demo-top12of1024-lr0.001-b0.999-wd0",
    "diloco-h10-int8-eager",
    "diloco-h10-int8-muon",
]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(SCRIPT, "farloco_bench_convergence")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared copy of the bundled corpus for the module's tests (preparing it is most of their time)."""
    return tmp_path_factory.mktemp("data")


def test_smoke_run_counts_real_payload_bytes(
    bench: ModuleType, tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "results.json"
    argv = ["--quick", "--steps", "2", "--json", str(out), "--cache-dir", str(cache_dir)]
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
    demo = "demo-top12of1024-lr0.001-b0.999-wd0"
    dct = configs[demo].make_codec()
    assert results[demo].bytes_per_worker[2] == 2 * 3 * len(dct.encode(zeros))
    # streaming: one round at step 2 carrying one of 5 fragments, so its peak is ~1/5 of diloco's.
    streaming = results["streaming-diloco-h10-p5-tau1-a0.5-int8"]
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


def one_step_of_every_worker(bench: ModuleType, cache_dir: Path, config: Any) -> tuple[Any, ...]:
    """(runner, strategies, theta0, thetas, learners) of `config` with every worker one inner step in."""
    from farloco.node.training.data import builtin_dataset, open_dataset

    setup = bench.Setup(steps=2, report_steps=(2,), num_eval_batches=1)
    runner = bench.Bench(setup, open_dataset(builtin_dataset(cache_dir)), lambda _: None)
    strategies = [
        bench.make_strategy(config.strategy, runner.num_params, config.make_codec(), **config.hparams)
        for _ in range(bench.NUM_WORKERS)
    ]
    theta0 = bench.flat_parameters(runner.initial)
    thetas = [theta0.clone() for _ in range(bench.NUM_WORKERS)]
    learners = [bench.Learner(runner.fresh_model(), setup) for _ in range(bench.NUM_WORKERS)]
    for learner, sampler in zip(learners, runner.samplers, strict=True):
        learner.step(0, sampler.batch(0))
    return runner, strategies, theta0, thetas, learners


def test_overlapped_round_lands_on_the_then_current_local_weights(bench: ModuleType, cache_dir: Path) -> None:
    """Streaming DiLoCo with tau: the contribution is taken at the sync point, and the merged result is mixed
    into the weights the worker has trained on since (alpha of them), on the synced fragment only."""
    config = bench.streaming_config(num_fragments=2, tau=1, alpha=0.5, h=4)
    runner, strategies, theta0, thetas, learners = one_step_of_every_worker(bench, cache_dir, config)
    at_sync = [bench.flat_parameters(learner.model) for learner in learners]
    exchanged = runner._exchange(strategies, thetas, learners, [None] * bench.NUM_WORKERS)
    assert all(torch.equal(theta, theta0) for theta in thetas)  # nothing applied at the sync point
    for learner, sampler in zip(learners, runner.samplers, strict=True):
        learner.step(1, sampler.batch(1))  # the tau = 1 step the exchange overlaps
    current = [bench.flat_parameters(learner.model) for learner in learners]
    runner._land(strategies, thetas, learners, exchanged, None)

    part = strategies[0].fragments[0]
    other = strategies[0].fragments[1]
    # The outer step used the contributions of the sync point: -lr * (1 + momentum) * mean(theta0 - at_sync).
    pseudo = torch.stack([theta0[part] - local[part] for local in at_sync]).mean(0)
    assert torch.allclose(thetas[0][part], theta0[part] - 0.5 * 1.9 * pseudo, atol=1e-4)
    assert torch.equal(thetas[0][other], theta0[other])
    assert all(torch.equal(thetas[0], theta) for theta in thetas[1:])
    for learner, now in zip(learners, current, strict=True):
        merged = bench.flat_parameters(learner.model)
        expected = now[part] * 0.5 + thetas[0][part] * 0.5
        assert torch.allclose(merged[part], expected, atol=1e-6)
        assert torch.equal(merged[other], now[other])  # the other fragment keeps its local progress
    assert exchanged.bytes_sent == round(1.5 * len(config.make_codec().encode(torch.zeros(part.stop))))


def test_delayed_and_eager_start_the_next_phase_before_the_mean_lands(
    bench: ModuleType, cache_dir: Path
) -> None:
    """run.outer_update as the script runs it: at a sync point nothing is applied yet (delayed: the workers
    restart from theta_outer as it was), eager's start previews each worker's own transmitted contribution, and
    the round lands one sync later as a plain first Nesterov step from the same theta_outer on every worker."""
    config = next(c for c in bench.overlapped_configs() if c.name == "diloco-h10-int8-eager")
    runner, strategies, theta0, thetas, learners = one_step_of_every_worker(bench, cache_dir, config)
    exchanged = runner._exchange(strategies, thetas, learners, [None] * bench.NUM_WORKERS)
    assert all(torch.equal(theta, theta0) for theta in thetas)  # delayed: the next phase starts from theta0
    lr, momentum = config.hparams["lr"], config.hparams["momentum"]
    for s, sent in zip(strategies, exchanged.transmitted, strict=True):
        start = theta0.clone()
        s.eager_preview(start, sent, torch.zeros_like(sent), bench.NUM_WORKERS)
        expected = theta0 - lr * (1 + momentum) / bench.NUM_WORKERS * sent
        assert torch.allclose(start, expected, atol=1e-6)
    bench.land_shared(strategies, thetas, exchanged)
    mean = torch.stack(exchanged.transmitted).mean(0)
    assert torch.allclose(thetas[0], theta0 - lr * (1 + momentum) * mean, atol=1e-5)
    assert all(torch.equal(thetas[0], theta) for theta in thetas[1:])
    with pytest.raises(ValueError, match="expects diloco or sparseloco"):
        bench.RunConfig("x", "outer", "demo", "int8", sync_every=1, outer_update="delayed")


@pytest.mark.parametrize("mode", ["merge", "discard"])
def test_a_late_workers_steps_reach_the_next_round_weighted_by_their_steps(
    bench: ModuleType, cache_dir: Path, mode: str
) -> None:
    """The late rows as the daemon runs them: in round 1 worker 4 is late, the others commit without it and it
    takes their state; in round 2 its contribution carries its round-1 steps too (merge), so the mean is
    (d1 + d2 + d3 + d4 + d4_late) / 5, or they are gone (discard: / 4). fp32, lr 1, no momentum: theta moves by
    exactly the mean."""
    config = bench.RunConfig(
        "late", "outer", "diloco", "fp32", hparams={"lr": 1.0, "momentum": 0.0}, sync_every=1, late_every=2
    )
    config = dataclasses.replace(config, late_work=mode)
    runner, strategies, theta0, thetas, learners = one_step_of_every_worker(bench, cache_dir, config)
    late = bench.NUM_WORKERS - 1
    at_sync = [bench.flat_parameters(learner.model) for learner in learners]
    kept: list[Any] = [None] * bench.NUM_WORKERS
    runner._round_with_late(config, strategies, thetas, learners, late, kept)
    mean = torch.stack([theta0 - local for local in at_sync[:late]]).mean(0)
    assert torch.allclose(thetas[0], theta0 - mean, atol=1e-6)
    assert all(torch.equal(thetas[0], theta) for theta in thetas[1:])  # the late one took their state
    assert torch.equal(bench.flat_parameters(learners[late].model), thetas[0])
    assert (kept[late] is None) == (mode == "discard")
    theta1 = thetas[0].clone()
    for learner, sampler in zip(learners, runner.samplers, strict=True):
        learner.step(1, sampler.batch(1))
    now = [bench.flat_parameters(learner.model) for learner in learners]
    runner._round_with_late(config, strategies, thetas, learners, None, kept)
    pseudo = [theta1 - local for local in now]
    late_steps = [theta0 - at_sync[late]] if mode == "merge" else []
    expected = sum(pseudo + late_steps) / len(pseudo + late_steps)
    assert torch.allclose(thetas[0], theta1 - expected, atol=1e-6)
    assert all(torch.equal(thetas[0], theta) for theta in thetas[1:]) and kept == [None] * bench.NUM_WORKERS
    with pytest.raises(ValueError, match="late_every expects >= 2 with diloco, sync and tau 0"):
        bench.RunConfig("x", "outer", "sparseloco", "topk", sync_every=10, late_every=2)


def test_overlap_longer_than_the_sync_interval_is_refused(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="tau < sync_every"):
        bench.streaming_config(num_fragments=5, tau=2, alpha=0.5)


def test_stdlib_corpus_is_large_enough_for_long_runs_and_is_reused(tmp_path: Path) -> None:
    """`--corpus stdlib`: the library sources shipped with this CPython, about one DDP epoch at --long."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from stdlib_corpus import stdlib_dataset, stdlib_sources
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from farloco.node.training.data import open_dataset

    sources = stdlib_sources()
    assert sources == sorted(sources) and not any("test" in p.parts for p in sources)
    first = stdlib_dataset(tmp_path)
    dataset = open_dataset(first, verify=True)
    # 2400 steps x 4 workers x 8 x 128 tokens = 9.8M: the train split must hold about that much.
    assert dataset.num_tokens("train") > 8_000_000 and dataset.num_tokens("val") > 100_000
    assert stdlib_dataset(tmp_path) == first  # reused, not rebuilt


def test_cosine_schedule_drives_every_config_and_runs_of_two_schedules_do_not_merge(
    bench: ModuleType, tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--schedule cosine: warm-up, then a decay from the peak to 10% at the last step, applied to AdamW and to
    DeMo's sign-SGD lr alike; the JSON records the schedule and --merge refuses to mix schedules."""
    setup = bench.Setup(steps=120, report_steps=(30, 120), schedule="cosine")
    assert setup.lr_factor(0) == pytest.approx(1 / 20) and setup.lr_factor(20) == pytest.approx(1.0)
    assert setup.lr_factor(119) == pytest.approx(0.1)
    factors = [setup.lr_factor(step) for step in range(20, 120)]
    assert all(a >= b for a, b in itertools.pairwise(factors)) and factors[50] == pytest.approx(
        0.55, abs=0.01
    )
    assert bench.Setup(steps=120, report_steps=(120,)).lr_factor(119) == 1.0  # constant is the default
    with pytest.raises(ValueError, match=r"expected schedule constant\|cosine"):
        bench.Setup(steps=10, report_steps=(10,), schedule="linear")

    from farloco.node.training.data import builtin_dataset, open_dataset

    dataset = open_dataset(builtin_dataset(cache_dir))
    demo = next(c for c in bench.default_configs() if c.kind == "outer" and c.strategy == "demo")
    losses = {}
    threads = torch.get_num_threads()
    runs = {}
    try:
        # One thread, as the benchmark runs by default: two torch threads on a 2-core machine whose other core
        # is busy wait for each other at every op (beside a CPU hog this test took 12 s, and 75 s once in the
        # stress suite, against 7 s with one thread).
        torch.set_num_threads(1)
        for schedule in ("constant", "cosine"):
            short = bench.Setup(
                steps=3, report_steps=(3,), warmup_steps=0, num_eval_batches=1, schedule=schedule
            )
            losses[schedule] = bench.Bench(short, dataset, lambda _: None).run(demo).eval_loss[3]
        assert losses["constant"] != losses["cosine"]  # DeMo's sign-SGD lr followed the schedule
        for schedule in ("constant", "cosine"):
            runs[schedule] = tmp_path / f"{schedule}.json"
            argv = ["--quick", "--steps", "2", "--schedule", schedule, "--json", str(runs[schedule])]
            argv += ["--cache-dir", str(cache_dir), "--only", "ddp"]
            assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    assert (
        bench.read_schedule(runs["cosine"]) == "cosine"
        and bench.read_schedule(runs["constant"]) == "constant"
    )
    with pytest.raises(SystemExit):
        bench.main(["--merge", str(runs["constant"]), str(runs["cosine"])])
    assert "one lr schedule" in capsys.readouterr().err


@pytest.mark.slow  # the merge of runs; the smoke and cosine tests run the benchmark itself by default
def test_runs_at_two_inner_lrs_merge_labelled_against_the_stronger_ddp(
    bench: ModuleType, tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--inner-lr runs read back labelled with their lr; a merged table's "vs DDP" is against the best DDP at
    that step; --report-every adds intermediate report steps (saved in the JSON as the run goes)."""
    threads = torch.get_num_threads()
    runs = {}
    try:
        for lr in ("3e-3", "1e-2"):
            runs[lr] = tmp_path / f"ilr{lr}.json"
            argv = ["--quick", "--steps", "4", "--inner-lr", lr, "--report-every", "2"]
            argv += ["--json", str(runs[lr]), "--cache-dir", str(cache_dir)]
            argv += ["--only", "ddp", "--only", "diloco-h10-int8"]
            assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    default, other = bench.read_json(runs["3e-3"]), bench.read_json(runs["1e-2"])
    assert [r.config.name for r in default] == ["ddp", "diloco-h10-int8"]
    assert [r.config.name for r in other] == ["ddp@ilr0.01", "diloco-h10-int8@ilr0.01"]
    assert all(sorted(r.eval_loss) == [2, 4] for r in default + other)
    best = min((default[0], other[0]), key=lambda r: r.eval_loss[4])
    row = bench.table(default + other, 4, 1_016_960).splitlines()[3]  # diloco at the default lr
    assert row.startswith("| diloco-h10-int8 |")
    expected = 100 * (default[1].eval_loss[4] / best.eval_loss[4] - 1)
    assert f"{expected:+.1f}%" in row
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--report-every", "-1", "--only", "ddp"])
    assert "--report-every: expected >= 0" in capsys.readouterr().err
