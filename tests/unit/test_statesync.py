"""State transfer over real RpcServer/RpcClient on 127.0.0.1: one donor, two donors, a donor dying or lying
mid-transfer, and manifests over the joiner's limits."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import torch

from farloco.protocol.auth import Authenticator
from farloco.protocol.errors import RpcError
from farloco.protocol.rpc import CallContext, Frame, RpcClient, RpcServer
from farloco.protocol.statesync import (
    METHOD,
    Manifest,
    StateServer,
    StateSyncError,
    TensorEntry,
    fetch_state,
)

SECRET = b"statesync-test-secret"


def make_state(round_id: int = 5, seed: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "theta.w": torch.randn(700, 1024, generator=gen),  # 2.7 MiB: several chunks and two segments
        "theta.b": torch.randn(33, generator=gen).to(torch.bfloat16),
        "outer.momentum": torch.randn(300, 300, generator=gen, dtype=torch.float64),
        "mask": torch.rand(17, generator=gen) > 0.5,
        "step": torch.tensor(12345, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    meta = {"round_id": round_id, "run_hash": "h1", "run_config": {"model": "tiny", "outer_lr": 0.7}}
    return meta, tensors


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=60))


async def donor(
    state: tuple[dict[str, Any], dict[str, torch.Tensor]], name: str
) -> tuple[RpcServer, StateServer, str]:
    server = RpcServer(Authenticator("run", SECRET, name))
    state_server = StateServer(lambda: state)
    state_server.register(server)
    return server, state_server, await server.start()


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_fetch_from_one_donor_returns_identical_state_and_reports_progress() -> None:
    meta, tensors = make_state()

    async def body() -> None:
        server, _, address = await donor((meta, tensors), "donor")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        seen: list[tuple[int, int]] = []
        try:
            got_meta, got = await fetch_state(
                client, [address], timeout=20, on_progress=lambda d, t: seen.append((d, t))
            )
        finally:
            await client.close()
            await server.stop(0)
        assert_same(got, tensors)
        assert got_meta["round_id"] == 5 and got_meta["run_config"] == meta["run_config"]
        assert set(got_meta["sha256"]) == set(tensors)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert seen[0] == (0, total) and seen[-1] == (total, total)
        assert all(a < b for (a, _), (b, _) in itertools.pairwise(seen))

    run(body)


def test_fetch_from_two_donors_splits_the_work() -> None:
    state = make_state()

    async def body() -> None:
        (s1, st1, a1), (s2, st2, a2) = await donor(state, "d1"), await donor(state, "d2")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            _, got = await fetch_state(client, [a1, a2], timeout=20, segment_bytes=1 << 20)
        finally:
            await client.close()
            await s1.stop(0)
            await s2.stop(0)
        assert_same(got, state[1])
        assert st1.bytes_served > 0 and st2.bytes_served > 0

    run(body)


HANG = object()  # a fault's answer: send nothing more on this stream (until the server stops and cancels it)


async def faulty_donor(
    state: tuple[dict[str, Any], dict[str, torch.Tensor]],
    fault: Callable[[int, Frame], Frame | object | None],
) -> tuple[RpcServer, str]:
    """A donor whose GetState answers go through `fault(chunk_index, frame)`; None ends the stream abruptly, HANG
    holds it open without sending anything more."""
    server = RpcServer(Authenticator("run", SECRET, "faulty"))
    inner = StateServer(lambda: state)
    count = 0

    async def handle(ctx: CallContext, requests: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        nonlocal count
        async for frame in inner.handle(ctx, requests):
            if frame.header["kind"] == "chunk":
                count += 1
                changed = fault(count, frame)
                if changed is None:
                    raise ConnectionResetError("donor process died")
                if changed is HANG:
                    await asyncio.Event().wait()
                assert isinstance(changed, Frame)
                frame = changed
            yield frame

    server.add_stream(METHOD, handle)
    return server, await server.start()


def resumed_offsets(caplog: pytest.LogCaptureFixture) -> list[int]:
    """Byte offsets at which fetch_state handed a failed donor's segment to another donor."""
    found = [re.search(r"failed at [^@]+@(\d+)", r.getMessage()) for r in caplog.records]
    return [int(m.group(1)) for m in found if m]


def test_donor_dying_mid_transfer_is_resumed_from_the_other_donor(caplog: pytest.LogCaptureFixture) -> None:
    state = make_state()
    caplog.set_level(logging.WARNING, logger="farloco.protocol.statesync")

    async def body() -> None:
        dying, dying_address = await faulty_donor(state, lambda i, f: None if i == 3 else f)
        healthy, healthy_state, healthy_address = await donor(state, "healthy")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            _, got = await fetch_state(
                client, [dying_address, healthy_address], timeout=20, segment_bytes=4 << 20
            )
        finally:
            await client.close()
            await dying.stop(0)
            await healthy.stop(0)
        assert_same(got, state[1])
        # the dying donor delivered 2 chunks of its first segment; the rest of it came from the other donor
        assert resumed_offsets(caplog) == [2 << 20]
        total = sum(t.numel() * t.element_size() for t in state[1].values())
        assert healthy_state.bytes_served == total - (2 << 20)

    run(body)


def test_donor_server_stopped_mid_transfer_is_resumed_from_the_other_donor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = make_state()
    caplog.set_level(logging.WARNING, logger="farloco.protocol.statesync")

    async def body() -> None:
        stopping: list[RpcServer] = []

        def stop_mid_segment(i: int, frame: Frame) -> object:
            # The victim's first segment never completes: its server stops (grace 0) while the stream is open.
            # (Stopping it after a chunk that ended its segment made the test depend on scheduling: under load the
            # other donor could take every remaining segment first, and nothing was left to resume.)
            if i == 1:
                asyncio.get_running_loop().create_task(stopping[0].stop(0))
                return HANG
            return frame

        victim, victim_address = await faulty_donor(state, stop_mid_segment)
        stopping.append(victim)
        healthy, _, healthy_address = await donor(state, "healthy")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            _, got = await fetch_state(
                client, [victim_address, healthy_address], timeout=20, segment_bytes=1 << 20
            )
        finally:
            await client.close()
            await victim.stop(0)
            await healthy.stop(0)
        assert_same(got, state[1])
        assert len(resumed_offsets(caplog)) == 1

    run(body)


def corrupt(i: int, frame: Frame) -> Frame:
    if i != 2:
        return frame
    payload = bytearray(frame.payload)
    payload[10] ^= 0xFF  # the bytes change after the donor computed the crc: corruption in transit
    return Frame(frame.header, bytes(payload))


def test_corrupted_chunk_is_detected_and_fetched_again_elsewhere() -> None:
    state = make_state()

    async def body() -> None:
        bad, bad_address = await faulty_donor(state, corrupt)
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            with pytest.raises(StateSyncError, match="crc32"):
                await fetch_state(client, [bad_address], timeout=20)
            good, _, good_address = await donor(state, "good")
            _, got = await fetch_state(client, [bad_address, good_address], timeout=20, segment_bytes=1 << 20)
            await good.stop(0)
        finally:
            await client.close()
            await bad.stop(0)
        assert_same(got, state[1])

    run(body)


def test_oversized_manifest_is_refused_before_allocation() -> None:
    state = make_state()

    async def body() -> None:
        server, _, address = await donor(state, "big")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            with pytest.raises(StateSyncError, match="max_total_bytes=1000000"):
                await fetch_state(client, [address], timeout=20, max_total_bytes=1_000_000)
            with pytest.raises(StateSyncError, match=r"manifest.tensors: expected a list of 0 to 3 items"):
                await fetch_state(client, [address], timeout=20, max_tensors=3)
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_manifest_parser_refuses_lies_about_shapes_and_dtypes() -> None:
    good = TensorEntry("w", "float32", (4, 4), 64, "0" * 64)
    limits = {"max_total_bytes": 1 << 20, "max_tensors": 10}
    assert Manifest.decode(Manifest({"round_id": 1}, (good,), 1 << 20).encode(), **limits).tensors == (good,)
    lies = [
        (TensorEntry("w", "float32", (4, 4), 60, "0" * 64), "expected 64"),
        (TensorEntry("w", "object", (4,), 32, "0" * 64), r"manifest.tensors\[0\].dtype: expected one of"),
        (TensorEntry("w", "float32", (1 << 30, 1 << 30), 1 << 62, "0" * 64), "max_total_bytes"),
    ]
    for entry, message in lies:
        with pytest.raises(StateSyncError, match=message):
            Manifest.decode(Manifest({"round_id": 1}, (entry,), 1 << 20).encode(), **limits)
    with pytest.raises(StateSyncError, match="valid msgpack"):
        Manifest.decode(b"\xc1garbage", **limits)


def test_donors_of_different_rounds_the_highest_round_wins() -> None:
    old, new = make_state(round_id=4, seed=1), make_state(round_id=6, seed=2)

    async def body() -> None:
        (s1, st_old, a1), (s2, _, a2) = await donor(old, "old"), await donor(new, "new")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            meta, got = await fetch_state(client, [a1, a2], timeout=20)
            with pytest.raises(StateSyncError, match="no donor serves run_hash=other"):
                await fetch_state(client, [a1, a2], timeout=20, expect_run_hash="other")
        finally:
            await client.close()
            await s1.stop(0)
            await s2.stop(0)
        assert meta["round_id"] == 6
        assert_same(got, new[1])
        assert st_old.bytes_served == 0

    run(body)


def test_unreachable_donors_give_a_clear_error() -> None:
    async def body() -> None:
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            with pytest.raises(StateSyncError, match="no donor answered"):
                await fetch_state(client, ["127.0.0.1:1"], timeout=3)
        finally:
            await client.close()

    run(body)


def test_progress_never_goes_back_when_a_donor_dies_and_the_donor_hook_sees_each_chunk() -> None:
    state = make_state()

    async def body() -> None:
        served: list[int] = []
        server, st, address = await donor(state, "d1")
        st.on_served = served.append
        dying, dying_address = await faulty_donor(state, lambda i, f: None if i == 2 else f)
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        seen: list[tuple[int, int]] = []
        try:
            _, got = await fetch_state(
                client,
                [dying_address, address],
                timeout=20,
                segment_bytes=1 << 20,
                on_progress=lambda d, t: seen.append((d, t)),
            )
        finally:
            await client.close()
            await server.stop(0)
            await dying.stop(0)
        assert_same(got, state[1])
        total = seen[0][1]
        assert seen[-1] == (total, total) and all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))
        assert served and served[-1] == st.bytes_served and served == sorted(served)

    run(body)


def _manifest(frames: list[Frame]) -> Manifest:
    return Manifest.decode(frames[0].payload, max_total_bytes=1 << 30, max_tensors=64)


async def _request(client: RpcClient, address: str, header: dict[str, Any]) -> list[Frame]:
    async def one() -> AsyncIterator[Frame]:
        yield Frame(header)

    return [frame async for frame in client.stream(address, METHOD, one(), round_id=0, timeout=10)]


def test_a_donor_that_moved_on_still_serves_the_state_a_transfer_pinned_then_releases_it() -> None:
    """A transfer slower than a round still ends: the donor keeps the snapshot a new round replaced while a
    transfer pins it (one, for keep_seconds after its last request); an older one is refused by name."""
    states = {r: make_state(round_id=r, seed=r) for r in (5, 6, 7)}
    current = [states[5]]

    async def body() -> None:
        server = RpcServer(Authenticator("run", SECRET, "donor"))
        st = StateServer(lambda: current[0], keep_seconds=0.5)
        st.register(server)
        address = await server.start()
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        try:
            first = _manifest(await _request(client, address, {}))
            assert first.round_id == 5
            current[0] = states[6]  # the donor commits round 6; another joiner asks for the manifest
            assert _manifest(await _request(client, address, {})).round_id == 6
            assert st.kept_round == 5
            frames = await _request(
                client, address, {"ranges": [["theta.w", 0, 4096]], "manifest_id": first.manifest_id}
            )
            assert _manifest(frames).manifest_id == first.manifest_id
            assert b"".join(f.payload for f in frames[1:]) == states[5][1]["theta.w"].numpy().tobytes()[:4096]
            current[0] = states[7]  # round 7 replaces 6 (asked for just now): round 5 is no longer served
            assert _manifest(await _request(client, address, {})).round_id == 7
            assert st.kept_round == 6
            with pytest.raises(RpcError, match="STATE_CHANGED") as refused:
                await _request(
                    client, address, {"ranges": [["step", 0, 8]], "manifest_id": first.manifest_id}
                )
            assert "now serves round 7" in str(refused.value) and "keeps only round 6" in str(refused.value)
            await asyncio.sleep(0.8)  # nobody asks for round 6 any more: released
            assert st.kept_round is None
        finally:
            await client.close()
            await server.stop(0)

    run(body)


def test_a_transfer_across_the_donors_rounds_returns_the_state_it_began_on() -> None:
    """Two joiners; the donor commits a new round while the first one's transfer is half done and the second
    one starts: each gets one round's state, whole and verified (before, the first failed with STATE_CHANGED)."""
    old, new = make_state(round_id=5, seed=5), make_state(round_id=6, seed=6)
    current = [old]

    async def body() -> None:
        server = RpcServer(Authenticator("run", SECRET, "donor"))
        StateServer(lambda: current[0]).register(server)
        address = await server.start()
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        second: list[asyncio.Task[Any]] = []

        def progress(done: int, total: int) -> None:
            if not second and done > total // 2:
                current[0] = new
                second.append(asyncio.ensure_future(fetch_state(client, [address], timeout=20)))

        try:
            meta, got = await fetch_state(
                client, [address], timeout=20, segment_bytes=1 << 20, on_progress=progress
            )
            meta2, got2 = await second[0]
        finally:
            await client.close()
            await server.stop(0)
        assert meta["round_id"] == 5 and meta2["round_id"] == 6
        assert_same(got, old[1])
        assert_same(got2, new[1])

    run(body)


def with_theta(state: tuple[dict[str, Any], dict[str, torch.Tensor]], theta: torch.Tensor) -> Any:
    meta, tensors = state
    return meta, {**tensors, "theta": theta}


def theta_sha(theta: torch.Tensor) -> str:
    """What the round's members vouch for: the agent's outer_hash of that theta."""
    from farloco.node.daemon.outer import theta_hash

    return theta_hash(theta)


def test_a_donor_whose_theta_the_swarm_does_not_vouch_for_is_refused_before_a_byte_is_fetched() -> None:
    """A poisoned donor: a wrong theta under a manifest consistent with it (crc and sha256 pass). The joiner
    knows what the round's members vouch for and refuses it at its manifest (WRONG_STATE), fetching the state
    from the honest donor only; a donor of a round nobody vouches for is refused as UNVOUCHED_ROUND."""
    theta = torch.randn(4096)
    honest = with_theta(make_state(), theta)
    poisoned = with_theta(make_state(), theta + 0.01)

    async def body() -> None:
        (s1, bad_server, bad), (s2, good_server, good) = (
            await donor(poisoned, "poisoned"),
            await donor(honest, "honest"),
        )
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        refused: list[tuple[str, str, str]] = []
        try:
            vouched = {5: {theta_sha(theta)}}
            _, got = await fetch_state(
                client,
                [bad, good],
                timeout=20,
                vouched=vouched,
                on_refused=lambda *r: refused.append(r),
                segment_bytes=1 << 20,
            )
            assert_same(got, honest[1])
            assert bad_server.bytes_served == 0 and good_server.bytes_served > 0
            assert [(d, reason) for d, reason, _ in refused] == [(bad, "WRONG_STATE")]
            assert theta_sha(theta)[:16] in refused[0][2]
            refused.clear()
            with pytest.raises(StateSyncError, match="no donor answered with a usable manifest"):
                await fetch_state(
                    client,
                    [good],
                    timeout=20,
                    vouched={4: {theta_sha(theta)}},
                    on_refused=lambda *r: refused.append(r),
                )
            assert [(d, reason) for d, reason, _ in refused] == [(good, "UNVOUCHED_ROUND")]
        finally:
            await client.close()
            await s1.stop(0)
            await s2.stop(0)

    run(body)


def test_a_donor_serving_wrong_bytes_under_the_agreed_manifest_is_found_and_the_fetch_completes() -> None:
    """A donor that serves the honest manifest but other bytes (with their own crc32: only the final sha256
    shows it). The mixed download fails its hash check; each donor is then asked alone, the liar is refused
    (BAD_STATE_DATA) and the honest donor's state is returned."""
    import zlib

    state = with_theta(make_state(), torch.randn(4096))

    def lie(i: int, frame: Frame) -> Frame:
        payload = bytearray(frame.payload)
        payload[0] ^= 0xFF
        return Frame({**frame.header, "crc32": zlib.crc32(bytes(payload))}, bytes(payload))

    async def body() -> None:
        bad_server, bad = await faulty_donor(state, lie)
        good_server, _, good = await donor(state, "honest")
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        refused: list[tuple[str, str, str]] = []
        try:
            _, got = await fetch_state(
                client,
                [bad, good],
                timeout=30,
                on_refused=lambda *r: refused.append(r),
                segment_bytes=1 << 20,
            )
            assert_same(got, state[1])
            assert [(d, reason) for d, reason, _ in refused] == [(bad, "BAD_STATE_DATA")]
            refused.clear()
            with pytest.raises(StateSyncError, match="sha256"):
                await fetch_state(client, [bad], timeout=30, on_refused=lambda *r: refused.append(r))
            assert [reason for _, reason, _ in refused] == ["BAD_STATE_DATA"]
        finally:
            await client.close()
            await bad_server.stop(0)
            await good_server.stop(0)

    run(body)


async def fetch_as_joiner(
    client: RpcClient, agent: Any, donors: list[str], theta_hash: str, refused: list[tuple[str, str, str]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """fetch_state as an agent's join calls it (`Swarm.sync_from`): round 5's theta vouched, the agent's layout
    and checks, every refusal recorded in `refused`."""
    return await fetch_state(
        client,
        donors,
        timeout=30,
        vouched={5: {theta_hash}},
        on_refused=lambda *r: refused.append(r),
        layout=agent.outer.state_layout(),
        check=agent.outer.state_problem,
    )


def test_a_donor_state_the_joiner_could_not_install_is_refused_and_another_donor_gives_it(
    tmp_path: Any,
) -> None:
    """The swarm vouches for theta only. A donor serving the vouched theta beside a strategy state of another
    layout is refused before a byte is fetched (WRONG_LAYOUT); one serving it beside a NaN momentum under a
    manifest consistent with it is refused once the bytes verify (BAD_STATE_VALUES), and the honest donor's
    state is fetched and installed. Checked with a real agent's layout and checks (what `Swarm.sync_from` passes)."""
    from farloco.node.config import load_config
    from farloco.node.daemon.agent import Agent

    agent = Agent(load_config(None, []), tmp_path / "joiner")
    honest = agent.outer.round.snapshot()
    honest["theta"] += 0.25  # the swarm's theta, a few rounds on
    meta = {"round_id": 5, "run_hash": agent.state.run_hash}
    nan_momentum = {**honest, "strategy.momentum_buffer": honest["strategy.momentum_buffer"].clone()}
    nan_momentum["strategy.momentum_buffer"][123] = float("nan")
    wrong_layout = {**honest, "strategy.momentum_buffer": torch.zeros(7)}
    theta_hash = theta_sha(honest["theta"])

    async def body() -> None:
        # Two donors agree on the NaN state: the larger agreeing set is asked first (`_choose`), so the honest
        # donor is reached only after the NaN state was fetched and refused, whatever the manifests' ids.
        servers = [
            await donor((meta, state), name)
            for name, state in (
                ("layout", wrong_layout),
                ("nan", nan_momentum),
                ("nan-too", nan_momentum),
                ("honest", honest),
            )
        ]
        (_, ss_layout, layout_addr), (_, _, nan_addr), (_, _, nan_too_addr), (_, _, ok_addr) = servers
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        refused: list[tuple[str, str, str]] = []
        try:
            # The NaN donor alone: refused after its bytes verified, and nobody else to ask.
            with pytest.raises(StateSyncError, match="no donor answered with a usable manifest"):
                await fetch_as_joiner(client, agent, [layout_addr, nan_addr], theta_hash, refused)
            assert [(d, reason) for d, reason, _ in refused] == [
                (layout_addr, "WRONG_LAYOUT"),
                (nan_addr, "BAD_STATE_VALUES"),
            ]
            assert "strategy.momentum_buffer: expected torch.float32" in refused[0][2]
            assert "momentum_buffer: expected only finite values, got NaN/Inf" in refused[1][2]
            assert ss_layout.bytes_served == 0
            refused.clear()
            # With an honest donor beside them (a manifest of its own): its state, installed as it came.
            got_meta, got = await fetch_as_joiner(
                client, agent, [layout_addr, nan_addr, nan_too_addr, ok_addr], theta_hash, refused
            )
            assert sorted((d, reason) for d, reason, _ in refused) == sorted(
                [
                    (layout_addr, "WRONG_LAYOUT"),
                    (nan_addr, "BAD_STATE_VALUES"),
                    (nan_too_addr, "BAD_STATE_VALUES"),
                ]
            )
            assert_same(got, honest)
            await agent.outer.install(got_meta, got)
            assert agent.outer.round_id == 5 and agent.outer.outer_hash == theta_hash
        finally:
            await client.close()
            for server, _, _ in servers:
                await server.stop(0)

    run(body)
    agent.outer.thread().shutdown()


def test_a_donor_residual_in_the_other_precision_is_fetched_and_installed_converted(tmp_path: Any) -> None:
    """A rolling upgrade: a donor whose error-feedback residual is float32 (another `feedback_bf16`, or the version
    before the bfloat16 residual) serves a joiner that keeps it in bfloat16: its layout is accepted and the
    install rounds it, as a checkpoint of the other precision loads. A residual of any other dtype is still
    refused before a byte is fetched (WRONG_LAYOUT), naming both dtypes the joiner takes."""
    from farloco.node.config import load_config
    from farloco.node.daemon.agent import Agent

    agent = Agent(load_config(None, ["run.codec=int8"]), tmp_path / "joiner")
    mine = agent.outer.round.snapshot()
    assert mine["strategy.residual"].dtype == torch.bfloat16
    served = {**mine, "theta": mine["theta"] + 0.25}
    served["strategy.residual"] = torch.linspace(-1e-3, 1e-3, mine["theta"].numel())  # float32
    half = {**served, "strategy.residual": served["strategy.residual"].half()}
    meta = {"round_id": 5, "run_hash": agent.state.run_hash}
    theta_hash = theta_sha(served["theta"])

    async def body() -> None:
        servers = [await donor((meta, state), name) for name, state in (("fp32", served), ("fp16", half))]
        (_, _, fp32_addr), (_, _, fp16_addr) = servers
        client = RpcClient(Authenticator("run", SECRET, "joiner"))
        refused: list[tuple[str, str, str]] = []
        try:
            with pytest.raises(StateSyncError, match="no donor answered with a usable manifest"):
                await fetch_as_joiner(client, agent, [fp16_addr], theta_hash, refused)
            assert [reason for _, reason, _ in refused] == ["WRONG_LAYOUT"]
            assert "strategy.residual: expected torch.bfloat16 or torch.float32" in refused[0][2]
            got_meta, got = await fetch_as_joiner(client, agent, [fp32_addr], theta_hash, refused)
            assert got["strategy.residual"].dtype == torch.float32
            await agent.outer.install(got_meta, got)
            residual = agent.outer.strategy.state_dict()["residual"]
            assert residual.dtype == torch.bfloat16
            assert torch.equal(residual, served["strategy.residual"].to(torch.bfloat16))
            assert agent.outer.round_id == 5 and agent.outer.outer_hash == theta_hash
        finally:
            await client.close()
            for server, _, _ in servers:
                await server.stop(0)

    run(body)
    agent.outer.thread().shutdown()
