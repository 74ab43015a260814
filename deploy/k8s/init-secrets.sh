#!/usr/bin/env bash
# Writes the two files kustomization.yaml turns into Secrets, unless they exist, and prints the bootstrap
# multiaddr to put into configmap.yaml (initial_peers):
#   run-secret              32 random bytes (hex): the HMAC key of every RPC, shared by all nodes of the run
#   bootstrap-identity.key  the bootstrap node's libp2p private key: its peer id is fixed by it
# Usage: deploy/k8s/init-secrets.sh [DIR]   (default: this script's directory). Needs farloco installed ($PYTHON).
set -euo pipefail
dir=${1:-$(dirname "$0")}
python=${PYTHON:-python3}
umask 077
if [ ! -s "$dir/run-secret" ]; then
  "$python" -c 'import secrets; print(secrets.token_hex(32))' > "$dir/run-secret"
  echo "wrote $dir/run-secret" >&2
fi
# One python process (importing hivemind takes seconds): create the key unless it exists, print its peer id.
peer_id=$("$python" - "$dir/bootstrap-identity.key" <<'PY'
import os
import sys

from hivemind.p2p import P2P, PeerID

path = sys.argv[1]
if not os.path.exists(path) or os.path.getsize(path) == 0:
    P2P.generate_identity(path)
    print(f"wrote {path}", file=sys.stderr)
with open(path, "rb") as key:
    print(PeerID.from_identity(key.read()).to_base58())
PY
)
echo "/dns4/farloco-bootstrap/tcp/31337/p2p/$peer_id"
