"""deploy/k8s/init-secrets.sh against a real `farloco bootstrap`: the identity the script makes fixes the peer id
in the multiaddr it prints, and running it again keeps both files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

DEPLOY = ROOT / "deploy"


@pytest.mark.dht
@pytest.mark.multiprocess
def test_init_secrets_peer_id_is_the_bootstraps(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(DEPLOY / "k8s" / "init-secrets.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    maddr = result.stdout.strip()
    assert re.fullmatch(r"/dns4/farloco-bootstrap/tcp/31337/p2p/\w+", maddr), maddr
    assert len((tmp_path / "run-secret").read_text().strip()) == 64
    assert (tmp_path / "run-secret").stat().st_mode & 0o077 == 0
    # Running it again keeps both files (and so the peer id).
    again = subprocess.run(
        ["bash", str(DEPLOY / "k8s" / "init-secrets.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.stdout.strip() == maddr

    maddr_file = tmp_path / "maddrs"
    farloco = Path(sys.executable).with_name("farloco")
    bootstrap = subprocess.Popen(
        [
            str(farloco),
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--identity",
            str(tmp_path / "bootstrap-identity.key"),
            "--maddr-file",
            str(maddr_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not maddr_file.exists() and bootstrap.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert maddr_file.exists(), (
            bootstrap.stderr.read().decode() if bootstrap.poll() is not None else "timeout"
        )
        peer_ids = {line.rsplit("/p2p/", 1)[1] for line in maddr_file.read_text().split()}
        assert peer_ids == {maddr.rsplit("/p2p/", 1)[1]}
    finally:
        bootstrap.send_signal(signal.SIGTERM)
        try:
            bootstrap.wait(timeout=30)
        except subprocess.TimeoutExpired:
            bootstrap.kill()
            bootstrap.wait()
