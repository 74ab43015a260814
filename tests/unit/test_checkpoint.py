"""Outer-state checkpoints: round trip, what is never loaded, corruption, a writer killed mid-save, pruning."""

from __future__ import annotations

import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from farloco.node.checkpoint import (
    COMMITTED_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    theta_digest,
)

RUN_HASH = "ab" * 32


def _state(seed: int, numel: int = 1000) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(numel, generator=generator)
    return {
        "theta": theta,
        "strategy.momentum": torch.randn(numel, generator=generator),
        "strategy.step": torch.tensor([seed], dtype=torch.int64),
    }


def _save(root: Path, round_id: int, seed: int | None = None) -> Path:
    return save_checkpoint(
        root, round_id, _state(round_id if seed is None else seed), {"run_hash": RUN_HASH, "inner_step": "40"}
    )


def _flip_theta_byte(path: Path) -> None:
    """Flip one byte inside theta's data (located through the safetensors header), like a bad disk would."""
    file = path / STATE_FILE
    data = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start, _ = header["theta"]["data_offsets"]
    data[8 + header_len + start + 17] ^= 0x40
    file.write_bytes(bytes(data))


def test_round_trip(tmp_path: Path) -> None:
    state = _state(7)
    state["strategy.view"] = state["strategy.momentum"][10:20]  # a view sharing storage must still save
    path = save_checkpoint(tmp_path, 42, state, {"run_hash": RUN_HASH, "inner_step": "840", "note": "x"})
    assert path == tmp_path / "round-00000042"
    assert (path / COMMITTED_FILE).read_text().strip() == theta_digest(state["theta"])
    assert [p.name for p in tmp_path.iterdir()] == ["round-00000042"]  # no .tmp- left behind

    meta, tensors = load_checkpoint(path)
    assert set(tensors) == set(state)
    for name, tensor in state.items():
        assert tensors[name].dtype == tensor.dtype
        assert torch.equal(tensors[name], tensor), name
    assert meta["round_id"] == "42"
    assert meta["run_hash"] == RUN_HASH
    assert meta["inner_step"] == "840"
    assert meta["note"] == "x"
    assert meta["format_version"] == "2"
    assert meta["outer_hash"] == theta_digest(state["theta"])
    assert float(meta["time"]) > 0
    assert latest_checkpoint(tmp_path) == path


def test_theta_hash_is_the_agents_outer_hash() -> None:
    from farloco.node.daemon.agent import theta_hash

    theta = _state(3)["theta"]
    assert theta_digest(theta) == theta_hash(theta)


def test_latest_is_newest_loadable_and_skips_tmp_and_uncommitted(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    _save(tmp_path, 3)
    newest = _save(tmp_path, 10)
    _save(tmp_path, 9)
    assert latest_checkpoint(tmp_path) == newest

    # A newer checkpoint still being written (or abandoned) under its .tmp- name is never chosen.
    tmp = _save(tmp_path, 11).rename(tmp_path / "round-00000011.tmp-999999-abcd")
    # A final-named directory without COMMITTED is never chosen either (nor loadable directly).
    uncommitted = _save(tmp_path, 12)
    (uncommitted / COMMITTED_FILE).unlink()
    assert latest_checkpoint(tmp_path) == newest
    with pytest.raises(CheckpointError, match="not committed"):
        load_checkpoint(uncommitted)
    with pytest.raises(CheckpointError, match="expected a directory named round-<8 digits>"):
        load_checkpoint(tmp)
    with pytest.raises(CheckpointError, match="expected a directory, found none"):
        load_checkpoint(tmp_path / "round-00000099")


def test_corrupt_theta_is_refused_and_latest_falls_back(tmp_path: Path) -> None:
    previous = _save(tmp_path, 4)
    newest = _save(tmp_path, 5)
    expected = theta_digest(_state(5)["theta"])
    _flip_theta_byte(newest)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(newest)
    message = str(info.value)
    assert f"expected sha256-tree-v1 {expected}" in message
    found = message.rsplit("found ", 1)[1]
    assert len(found) == 64 and found != expected
    assert latest_checkpoint(tmp_path) == previous
    # prune cleans the broken one up and keeps the loadable one, whatever `keep` says.
    assert prune_checkpoints(tmp_path, keep=1) == [newest]
    assert latest_checkpoint(tmp_path) == previous


def test_metadata_mismatches_are_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 6)
    moved = path.rename(tmp_path / checkpoint_name(7))
    with pytest.raises(CheckpointError, match="directory says round 7, metadata says 6"):
        load_checkpoint(moved)
    (moved / STATE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"cannot read outer\.safetensors"):
        load_checkpoint(moved)


GOOD_META = {"run_hash": RUN_HASH, "inner_step": "0"}


@pytest.mark.parametrize(
    ("tensors", "meta", "message"),
    [
        (
            {"theta": torch.zeros(4, dtype=torch.float16)},
            GOOD_META,
            r"expected tensors\['theta'\] 1-D float32",
        ),
        ({"momentum": torch.zeros(4)}, GOOD_META, r"expected tensors\['theta'\] 1-D float32, got nothing"),
        (
            {"theta": torch.zeros(4), "momentum": torch.zeros(4)},
            GOOD_META,
            r"'strategy\.<name>', got \['momentum'\]",
        ),
        ({"theta": torch.zeros(4)}, {"run_hash": RUN_HASH}, r"meta is missing \['inner_step'\]"),
        ({"theta": torch.zeros(4)}, {**GOOD_META, "outer_hash": "0" * 64}, "does not match theta"),
        ({"theta": torch.zeros(4)}, {**GOOD_META, "round_id": "2"}, "meta round_id '2' but round_id=1"),
    ],
)
def test_bad_input_is_refused(
    tmp_path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(tmp_path, 1, tensors, meta)
    assert not any(tmp_path.iterdir()), "a refused save must leave nothing behind"


def test_same_round_saved_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 8, seed=1)
    path = _save(tmp_path, 8, seed=2)
    _, tensors = load_checkpoint(path)
    assert torch.equal(tensors["theta"], _state(2)["theta"])
    assert [p.name for p in tmp_path.iterdir()] == ["round-00000008"]


def test_prune_keeps_newest_k_and_removes_stale_tmp(tmp_path: Path) -> None:
    paths = [_save(tmp_path, r) for r in (1, 2, 3, 4, 5)]
    stale = tmp_path / "round-00000006.tmp-999999999-00ff"  # no such pid: its writer is gone
    stale.mkdir()
    ours = tmp_path / f"round-00000006.tmp-{os.getpid()}-0a0a"  # our pid but not saving: a dead predecessor
    ours.mkdir()
    live = tmp_path / f"round-00000006.tmp-{os.getppid()}-beef"  # another live process may be writing it
    live.mkdir()
    other = tmp_path / "notes.txt"
    other.write_text("left alone")

    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(removed) == sorted([*paths[:3], stale, ours])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["round-00000004", "round-00000005", live.name, "notes.txt"]
    )
    assert prune_checkpoints(tmp_path, keep=2) == []
    with pytest.raises(CheckpointError, match="keep >= 1, got 0"):
        prune_checkpoints(tmp_path, keep=0)


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from farloco.node.checkpoint import save_checkpoint

    root, stop_at = Path(sys.argv[1]), sys.argv[2]
    real_fsync = os.fsync

    def fsync_then_wait(fd):
        # Instrument the real save: once it reaches `stop_at`, tell the parent and wait to be SIGKILLed there.
        real_fsync(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(stop_at) or (stop_at == "tmp-dir" and os.path.isdir(name) and ".tmp-" in name):
            print("reached", flush=True)
            time.sleep(600)

    os.fsync = fsync_then_wait
    big = {"theta": torch.randn(8_000_000), "strategy.momentum": torch.randn(8_000_000)}
    save_checkpoint(root, 2, big, {"run_hash": "x", "inner_step": "80"})
    print("finished", flush=True)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stop_at", ["outer.safetensors", "COMMITTED", "tmp-dir"])
def test_writer_killed_mid_save_leaves_previous_as_latest(tmp_path: Path, stop_at: str) -> None:
    """SIGKILL after the 64 MB state file / the COMMITTED file / the directory fsync, before the rename."""
    previous = _save(tmp_path, 1)
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), stop_at], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "reached"
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].name.startswith("round-00000002.tmp-")
    assert not (tmp_path / checkpoint_name(2)).exists()
    assert latest_checkpoint(tmp_path) == previous
    assert prune_checkpoints(tmp_path, keep=3) == leftovers  # the dead writer's directory is cleaned up
    assert latest_checkpoint(tmp_path) == previous


def test_the_durable_hook_runs_once_the_checkpoint_is_durable_and_before_its_rename(tmp_path: Path) -> None:
    """The fault injector's `save` phase: when `durable` runs, the round's files are complete under the temporary
    name and the final name does not exist yet; an exception there (a crash) leaves the previous checkpoint the
    newest and no temporary directory behind."""
    previous = _save(tmp_path, 1)
    seen: list[list[str]] = []

    def durable() -> None:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        (tmp,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert (tmp / STATE_FILE).is_file() and (tmp / COMMITTED_FILE).is_file()

    state = _state(2)
    final = save_checkpoint(tmp_path, 2, state, {"run_hash": RUN_HASH, "inner_step": "80"}, durable=durable)
    assert len(seen) == 1 and checkpoint_name(2) not in seen[0]
    assert latest_checkpoint(tmp_path) == final

    def crash() -> None:
        raise KeyboardInterrupt("stand-in for the SIGKILL of the chaos runner's crash@save")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, _state(3), {"run_hash": RUN_HASH, "inner_step": "120"}, durable=crash)
    assert latest_checkpoint(tmp_path) == final and previous.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(("strategy", "codec"), [("diloco", "fp32"), ("sparseloco", "topk")])
def test_a_real_outer_strategy_state_round_trips(tmp_path: Path, strategy: str, codec: str) -> None:
    """The agent's snapshot ("theta" + "strategy.<name>", incl. 0-d tensors) saves and reinstalls as is."""
    from farloco.optim import get_codec, make_strategy

    num_params = 500
    original = make_strategy(strategy, num_params, get_codec(codec))
    theta = torch.randn(num_params)
    original.propose(theta.clone(), theta.clone())
    original.apply(theta, theta.clone())
    original.commit()
    state = {f"strategy.{name}": tensor for name, tensor in original.state_dict().items()}
    path = save_checkpoint(tmp_path, 1, {"theta": theta, **state}, {"run_hash": RUN_HASH, "inner_step": "20"})
    _, tensors = load_checkpoint(path)
    restored = make_strategy(strategy, num_params, get_codec(codec))
    restored.load_state_dict({k.removeprefix("strategy."): v for k, v in tensors.items() if k != "theta"})
    for name, tensor in original.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name


# ---- the ranks' inner state (torch.distributed.checkpoint), in a one-rank gloo group of this process ----------
@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One gloo group for the module. Module-scoped because of its listening socket: once FSDP2 has run a
    backward on a group, torch keeps gloo's listener open after destroy_process_group until the process exits,
    so it belongs to the module, not to the test that happened to use the group first."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(model_overrides: dict[str, int] | None = None, steps: int = 0, lr: float = 1e-3):  # type: ignore[no-untyped-def]
    """The tiny model sharded with FSDP2 like a trainer rank does, and an AdamW that ran `steps` steps."""
    return _trained(model_overrides, steps, lr, sharded=True)


def _plain(steps: int = 0):  # type: ignore[no-untyped-def]
    """The tiny model as a single CPU rank trains it (the plain module), and an AdamW that ran `steps` steps."""
    return _trained(None, steps, 1e-3, sharded=False)


def _trained(model_overrides: dict[str, int] | None, steps: int, lr: float, *, sharded: bool):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from farloco.node.training.model import build_model, lm_loss, model_config

    model = build_model(model_config("tiny", **(model_overrides or {})), seed=0)
    if sharded:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 17), generator=generator)
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def test_inner_state_round_trips_inside_an_atomic_checkpoint(tmp_path: Path, one_rank_group: None) -> None:
    from farloco.node.checkpoint import (
        INNER_DIR,
        load_inner_state,
        optimizer_fingerprint,
        save_inner_state,
        stage_checkpoint,
        verify_inner,
    )

    model, optimizer = _sharded(steps=3)
    saved = optimizer_fingerprint(optimizer, torch.device("cpu"))
    assert saved[0] == 3 and saved[1] > 0
    root = tmp_path / "ckpt"
    staged = stage_checkpoint(root, 4)
    assert save_inner_state(staged / INNER_DIR, model, optimizer)
    # Until save_checkpoint renames it, the staged directory is no checkpoint at all.
    assert latest_checkpoint(root) is None
    path = save_checkpoint(root, 4, _state(4), {"run_hash": RUN_HASH, "inner_step": "12"}, staged=staged)
    assert path == root / checkpoint_name(4) and not staged.exists()
    inner = verify_inner(path)
    assert (inner / ".metadata").is_file() and list(inner.glob("*.distcp"))

    fresh_model, fresh_optimizer = _sharded()
    assert optimizer_fingerprint(fresh_optimizer, torch.device("cpu")) == (0, 0.0)
    assert load_inner_state(inner, fresh_model, fresh_optimizer)
    assert optimizer_fingerprint(fresh_optimizer, torch.device("cpu")) == saved
    for (name, param), fresh_param in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
        state, loaded = optimizer.state[param], fresh_optimizer.state[fresh_param]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(loaded[key]), _full(state[key])), (name, key)


@pytest.mark.parametrize("saved_by", ["sharded", "plain"])
def test_inner_state_moves_between_a_sharded_and_a_plain_module(
    tmp_path: Path, one_rank_group: None, saved_by: str
) -> None:
    """A single CPU rank trains the plain module (parallel.shards): its inner state loads where a sharded one was
    saved (a checkpoint written before, or by a node of several ranks) and the other way round."""
    from farloco.node.checkpoint import load_inner_state, optimizer_fingerprint, save_inner_state

    make_saved, make_loaded = (_sharded, _plain) if saved_by == "sharded" else (_plain, _sharded)
    model, optimizer = make_saved(steps=3)
    assert save_inner_state(tmp_path / "inner", model, optimizer)
    fresh_model, fresh_optimizer = make_loaded()
    assert load_inner_state(tmp_path / "inner", fresh_model, fresh_optimizer)
    cpu = torch.device("cpu")
    assert optimizer_fingerprint(fresh_optimizer, cpu) == optimizer_fingerprint(optimizer, cpu)
    for (name, param), fresh_param in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
        state, loaded = optimizer.state[param], fresh_optimizer.state[fresh_param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(loaded[key]), _full(state[key])), (name, key)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_inner_state_that_is_missing_or_does_not_fit_leaves_a_fresh_optimizer(
    tmp_path: Path, one_rank_group: None
) -> None:
    from farloco.node.checkpoint import load_inner_state, optimizer_fingerprint, save_inner_state

    model, optimizer = _sharded(steps=2)
    assert save_inner_state(tmp_path / "inner", model, optimizer)
    (tmp_path / "not-a-dir").write_text("a file where the directory should go")
    assert not save_inner_state(tmp_path / "not-a-dir", model, optimizer)
    nothing_model, nothing_optimizer = _sharded()
    assert not load_inner_state(tmp_path / "absent", nothing_model, nothing_optimizer)
    assert optimizer_fingerprint(nothing_optimizer, torch.device("cpu")) == (0, 0.0)
    # Another model shape: torch.distributed.checkpoint refuses it, and nothing half-loaded remains.
    other_model, other_optimizer = _sharded({"dim": 32})
    assert not load_inner_state(tmp_path / "inner", other_model, other_optimizer)
    assert not other_optimizer.state
    tokens = torch.randint(0, 256, (2, 17))
    from farloco.node.training.model import lm_loss

    lm_loss(other_model(tokens[:, :-1]), tokens[:, 1:]).backward()  # type: ignore[no-untyped-call]
    other_optimizer.step()  # and it trains on from a fresh state
    assert optimizer_fingerprint(other_optimizer, torch.device("cpu"))[0] == 1


def test_corrupt_or_missing_inner_files_are_refused(tmp_path: Path) -> None:
    from farloco.node.checkpoint import INNER_DIR, stage_checkpoint, verify_inner

    without = _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="holds no inner state"):
        verify_inner(without)
    staged = stage_checkpoint(tmp_path, 2)
    (staged / INNER_DIR).mkdir()
    (staged / INNER_DIR / ".metadata").write_bytes(b"meta")
    (staged / INNER_DIR / "__0_0.distcp").write_bytes(b"shard" * 100)
    path = save_checkpoint(tmp_path, 2, _state(2), {"run_hash": RUN_HASH, "inner_step": "8"}, staged=staged)
    assert verify_inner(path) == path / INNER_DIR
    (path / INNER_DIR / "__0_0.distcp").write_bytes(b"shard" * 99 + b"shaRd")
    with pytest.raises(CheckpointError, match=r"different \['__0_0.distcp'\]"):
        verify_inner(path)
    (path / INNER_DIR / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"missing \['__0_0.distcp'\]"):
        verify_inner(path)
    assert latest_checkpoint(tmp_path) == path  # the outer state is still good: only inner/ falls back


def test_a_staged_directory_of_another_round_is_refused(tmp_path: Path) -> None:
    from farloco.node.checkpoint import stage_checkpoint

    staged = stage_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointError, match="from stage_checkpoint"):
        save_checkpoint(tmp_path, 4, _state(4), {"run_hash": RUN_HASH, "inner_step": "8"}, staged=staged)
    assert not staged.exists()


_RESHARD = textwrap.dedent(
    """
    import os, socket, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from farloco.node.checkpoint import load_inner_state, optimizer_fingerprint, save_inner_state
    from farloco.node.training.model import build_model, lm_loss, model_config

    def worker(rank, world, directory, port, mode):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        model = build_model(model_config("tiny"), seed=0)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if mode == "save":
            generator = torch.Generator().manual_seed(1)
            for _ in range(3):
                tokens = torch.randint(0, 256, (2, 17), generator=generator)
                lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                optimizer.step()
                optimizer.zero_grad()
            assert save_inner_state(directory, model, optimizer)
        else:
            assert load_inner_state(directory, model, optimizer)
        step, fingerprint = optimizer_fingerprint(optimizer, torch.device("cpu"))
        if rank == 0:
            print(mode, world, step, repr(fingerprint), flush=True)
        dist.barrier()  # as node/training/trainer.py: nobody tears gloo down under another rank's last op
        dist.destroy_process_group()

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], free_port(), "save"), nprocs=2)
        mp.spawn(worker, args=(1, sys.argv[1], free_port(), "load"), nprocs=1)
    """
)


@pytest.mark.slow  # two spawned gloo groups: ~20 s idle, ~90 s on a loaded 2-core machine
@pytest.mark.multiprocess
def test_inner_state_of_two_ranks_loads_into_one(tmp_path: Path) -> None:
    """torch.distributed.checkpoint reshards: a node restarted with another node.num_ranks keeps its AdamW."""
    script = tmp_path / "reshard.py"
    script.write_text(_RESHARD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "inner")], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved, loaded = (line.split() for line in done.stdout.splitlines()[-2:])
    assert saved[:3] == ["save", "2", "3"] and loaded[:3] == ["load", "1", "3"]
    assert float(loaded[3]) == pytest.approx(float(saved[3]), rel=1e-12)


def test_inner_state_is_pickle_free_json_and_raw_tensor_bytes(tmp_path: Path, one_rank_group: None) -> None:
    """No file of inner/ is a pickle or a torch.save zip: `.metadata` is JSON holding only tensors (no
    param_groups), and each rank's data file is exactly the raw bytes its JSON byte ranges describe."""
    from farloco.node.checkpoint import read_inner_metadata, save_inner_state

    model, optimizer = _sharded(steps=1)
    inner = tmp_path / "inner"
    assert save_inner_state(inner, model, optimizer)
    files = sorted(p.name for p in inner.iterdir())
    assert files == [".metadata", "__0_0.distcp"]
    for name in files:
        head = (inner / name).read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", (name, head)  # pickle protocol 2+ / zip (torch.save)
    document = json.loads((inner / ".metadata").read_text())
    assert document["format"] == "farloco-dcp-json"
    assert not [key for key in document["tensors"] if "param_groups" in key]
    assert {key.rsplit(".", 1)[1] for key in document["tensors"] if key.startswith("optim.")} == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }
    ranges = sorted((entry["start"], entry["length"]) for entry in document["storage"])
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert sum(n for _, n in ranges) == (inner / "__0_0.distcp").stat().st_size

    metadata = read_inner_metadata(inner)
    embed = metadata.state_dict_metadata["optim.state.tok_embeddings.weight.exp_avg"]
    assert embed.properties.dtype == torch.float32 and list(embed.size) == [256, 128]
    assert type(embed).__name__ == "TensorStorageMetadata"
    assert all(
        type(entry).__name__ == "TensorStorageMetadata" for entry in metadata.state_dict_metadata.values()
    )


class _Trap:
    """Unpickling this creates `marker`: proof that a pickled `.metadata` was refused unread."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _edit_metadata(inner: Path, edit) -> None:  # type: ignore[no-untyped-def]
    document = json.loads((inner / ".metadata").read_text())
    edit(document)
    (inner / ".metadata").write_text(json.dumps(document))


def test_tampered_or_pickled_inner_metadata_is_refused(
    tmp_path: Path, one_rank_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    import pickle
    import shutil

    from farloco.node.checkpoint import (
        load_inner_state,
        optimizer_fingerprint,
        read_inner_metadata,
        save_inner_state,
    )

    model, optimizer = _sharded(steps=1)
    good = tmp_path / "good"
    assert save_inner_state(good, model, optimizer)
    key = "optim.state.tok_embeddings.weight.exp_avg"

    def first_storage(document: dict) -> dict:  # type: ignore[type-arg]
        return next(entry for entry in document["storage"] if entry["fqn"] == key)

    tamperings = {
        "dtype": (lambda d: d["tensors"][key].update(dtype="object"), r"expected a dtype in \["),
        "length": (lambda d: first_storage(d).update(length=12), r"expected 131072 bytes for .*, got 12"),
        "path": (lambda d: first_storage(d).update(file="../../etc/passwd"), "expected a data file named"),
        "keys": (lambda d: d.pop("planner_data"), r"expected the keys \[.*'planner_data'"),
        "chunk": (
            lambda d: d["tensors"][key]["chunks"][0].update(sizes=[257, 128]),
            "expected a chunk inside",
        ),
        "not json": (None, "expected JSON metadata, cannot parse it"),
    }
    for name, (edit, message) in tamperings.items():
        inner = tmp_path / name
        shutil.copytree(good, inner)
        if edit is None:
            (inner / ".metadata").write_bytes(b"\x00garbage")
        else:
            _edit_metadata(inner, edit)
        with pytest.raises(CheckpointError, match=message):
            read_inner_metadata(inner)

    # torch's own layout (a pickled .metadata) is refused without being unpickled, and the load leaves the
    # optimizer fresh on every rank.
    marker = tmp_path / "unpickled"
    pickled = tmp_path / "pickled"
    shutil.copytree(good, pickled)
    (pickled / ".metadata").write_bytes(pickle.dumps(_Trap(marker), protocol=2))
    with pytest.raises(CheckpointError, match=r"is a pickle .*never unpickles"):
        read_inner_metadata(pickled)
    fresh_model, fresh_optimizer = _sharded()
    assert not load_inner_state(pickled, fresh_model, fresh_optimizer)
    assert not marker.exists()
    assert optimizer_fingerprint(fresh_optimizer, torch.device("cpu")) == (0, 0.0)

    # A data file cut short: the metadata is fine, the byte range is not there.
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = truncated / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    assert not load_inner_state(truncated, fresh_model, fresh_optimizer)
    assert not fresh_optimizer.state
    assert "__0_0.distcp is truncated: expected" in caplog.text
    assert load_inner_state(good, fresh_model, fresh_optimizer)  # and the intact copy still loads
    assert optimizer_fingerprint(fresh_optimizer, torch.device("cpu"))[0] == 1


def test_a_checkpoint_of_format_1_loads_verified_by_the_plain_sha256_it_recorded(tmp_path: Path) -> None:
    """Checkpoints written before the tree hash recorded theta's plain sha256 (format_version 1): they load,
    verified by that hash, and a flipped byte in one is still refused."""
    import hashlib

    from safetensors.torch import save_file

    path = _save(tmp_path, 8)
    meta, tensors = load_checkpoint(path)
    plain = hashlib.sha256(tensors["theta"].numpy().tobytes()).hexdigest()
    save_file(tensors, str(path / STATE_FILE), metadata={**meta, "format_version": "1", "outer_hash": plain})
    (path / COMMITTED_FILE).write_text(plain + "\n")
    meta, loaded = load_checkpoint(path)
    assert meta["format_version"] == "1" and meta["outer_hash"] == plain
    assert torch.equal(loaded["theta"], tensors["theta"])
    _flip_theta_byte(path)
    with pytest.raises(CheckpointError, match=f"expected sha256 {plain}"):
        load_checkpoint(path)
    save_file(tensors, str(path / STATE_FILE), metadata={**meta, "format_version": "0"})
    with pytest.raises(CheckpointError, match="expected format_version 1 or 2, found '0'"):
        load_checkpoint(path)
