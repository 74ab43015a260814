"""The fault injector's plan (node/faults/plan.py `parse_faults`): what FARLOCO_FAULTS and `farloco join --fault`
accept, and the clear error for what they do not."""

from __future__ import annotations

import asyncio
import socket

import pytest
from click.testing import CliRunner

from farloco.node.faults import PhaseFault, parse_faults


def test_phase_faults_name_action_phase_offset_and_rounds() -> None:
    plan = parse_faults(
        "crash@exchange+0.25:5, hang=20@train:3-4,drop@heal:7+,delay=1.5@match,corrupt@exchange:2,"
        "wrong=sign_flip_x1000@exchange:1-2"
    )
    crash, hang, drop, delay, corrupt, wrong = plan.phase
    assert crash == PhaseFault("crash", "exchange", None, 0.25, 5, 5, spec="crash@exchange+0.25:5")
    assert (hang.action, hang.value, hang.first, hang.last) == ("hang", 20.0, 3, 4)
    assert (drop.first, drop.last) == (7, None) and drop.applies("heal", 100) and not drop.applies("heal", 6)
    assert delay.applies("match", 0) and delay.applies("match", 10**6) and not delay.applies("exchange", 1)
    assert corrupt.applies("exchange", 2) and not corrupt.applies("exchange", 3)
    assert wrong.value == "sign_flip_x1000"
    assert [f.action for f in plan.at("exchange", 2)] == ["corrupt", "wrong"]
    assert [f.action for f in plan.at("train", 4)] == ["hang"]
    assert plan.at("commit", 1) == []
    assert corrupt.value == "bytes"
    assert [f.value for f in parse_faults("corrupt=inf@exchange:3,corrupt=short@exchange:5").phase] == [
        "inf",
        "short",
    ]
    (save,) = parse_faults("crash@save:4").phase
    assert save.applies("save", 4) and not save.applies("commit", 4)


def test_the_older_entries_keep_their_meaning() -> None:
    plan = parse_faults(
        "dht-refuse-stores=3,slow-steps=0.5,die-serving-state@4096,corrupt-theta@2,byzantine=noise,poison-state"
    )
    assert plan.poison_state and not parse_faults("slow-steps=1").poison_state
    assert parse_faults("poison-strategy-state").poison_strategy and not plan.poison_strategy
    assert plan.dht == {"refuse_stores": 3}
    assert plan.slow_steps == 0.5 and plan.die_serving_state == 4096 and plan.corrupt_theta == {2}
    # byzantine=KIND is a wrong update in every round's exchange
    (wrong,) = plan.phase
    assert (wrong.action, wrong.value, wrong.phase, wrong.first, wrong.last) == (
        "wrong",
        "noise",
        "exchange",
        0,
        None,
    )
    assert not parse_faults("") and not parse_faults(" , ")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode@exchange", "unknown fault 'explode'; expected ACTION"),
        (
            "crash@lunch",
            "expected a phase of \\['train', 'match', 'heal', 'exchange', 'commit', 'save'\\], got 'lunch'",
        ),
        ("hang@train", "expected hang=SECONDS"),
        ("corrupt@save:4", "the save phase takes crash, hang or delay, got 'corrupt'"),
        ("corrupt=lava@exchange", "expected corrupt or corrupt=MODE with MODE one of \\['bytes', 'inf'"),
        ("crash=3@train", "expected crash without a value"),
        ("delay=-1@match", "expected seconds >= 0, got '-1'"),
        ("delay=nan@match", "expected seconds >= 0, got 'nan'"),
        ("crash@exchange:5-3", "expected rounds N, N-M \\(N <= M\\) or N\\+, got '5-3'"),
        ("crash@exchange:x", "expected rounds N, N-M"),
        ("wrong=bribe@exchange", "expected an attack of \\['sign_flip_x1000', .*got 'bribe'"),
        ("slow-steps=fast", "expected seconds >= 0, got 'fast'"),
        ("corrupt-theta@two", "expected corrupt-theta@N with N a whole number"),
        ("dht-refuse-stores=x", "expected dht-refuse-stores=N"),
    ],
)
def test_a_plan_it_cannot_read_is_refused_naming_the_entry(spec: str, message: str) -> None:
    from farloco.optim import ATTACKS

    with pytest.raises(ValueError, match=message) as info:
        parse_faults(f"delay=1@match,{spec}", ATTACKS)
    assert "FARLOCO_FAULTS entry" in str(info.value)


def test_farloco_join_refuses_a_bad_fault_before_starting(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from farloco.node.tools.cli import main

    monkeypatch.setenv("FARLOCO_FAULTS", "")  # join sets it in this process: restored after the test
    result = CliRunner().invoke(
        main, ["join", "--run-dir", str(tmp_path / "node"), "--fault", "crash@nowhere"]
    )
    assert result.exit_code == 2, result.output
    assert "FARLOCO_FAULTS entry 'crash@nowhere': expected a phase of" in result.output


def test_drop_all_resets_open_data_plane_connections() -> None:
    """`drop` shuts every data-plane socket down both ways: a reader on either side sees the connection end."""
    from farloco.protocol import tcpstream

    async def run() -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
        listener.close()
        a = tcpstream._Conn(left, "left")
        b = tcpstream._Conn(right, "right")
        reader = asyncio.ensure_future(b.read(16))
        await asyncio.sleep(0.05)
        dropped = tcpstream.drop_all()
        with pytest.raises(ConnectionResetError, match="closed the connection"):
            await asyncio.wait_for(reader, 5)
        a.close()
        b.close()
        return dropped

    assert asyncio.run(run()) >= 2
