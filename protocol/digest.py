"""The digest of a large buffer (theta, a strategy's state): a sha256 tree hash, computed over several cores.

One sequential sha256 of a 1B-parameter theta (4 GB) takes ~2.3 s on a core with SHA-NI: the largest single
phase of the agent's round at that size, and it cannot use a second core. The tree hash splits the bytes into
leaves of `LEAF_BYTES`, hashes contiguous runs of leaves on up to `threads` threads (hashlib releases the GIL
while it hashes) and hashes their digests::

    digest(b) = sha256(b"farloco-sha256-tree-v1\\0" || le64(len(b)) || le64(LEAF_BYTES)
                       || sha256(leaf_0) || sha256(leaf_1) || ... )

The leaf size is fixed (part of the value), so the digest is the same on every host whatever its core count;
the leaves of each thread are a contiguous run, so a thread reads memory in order. A buffer shorter than a leaf
is one leaf (an empty one is one empty leaf). Two different buffers with one digest would need a collision of
sha256 (the root's input fixes the length and so every leaf's boundaries): it vouches for bytes as the plain
sha256 did.

Used for everything that vouches for the model's bytes: the agent's `outer_hash` (members compare it after every
round), the state-sync manifest's per-tensor hashes (a joiner checks theta's against the hashes the round's
members vouch for), and a checkpoint's `outer_hash`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from farloco.util.parallel import map_ranges

LEAF_BYTES = 1 << 20
PREFIX = b"farloco-sha256-tree-v1\0"
SCHEME = "sha256-tree-v1"
"""Its name where a file records which digest it holds (a checkpoint's `format_version` 2)."""


def _leaves(view: memoryview, first: int, last: int) -> bytes:
    """The concatenated sha256 digests of leaves [first, last)."""
    sha256 = hashlib.sha256
    return b"".join(
        sha256(view[index * LEAF_BYTES : (index + 1) * LEAF_BYTES]).digest() for index in range(first, last)
    )


def digest(data: Any, threads: int | None = None) -> str:
    """Hex tree hash (above) of `data`: anything exposing a C-contiguous buffer (bytes, a numpy array, its
    `.data`). `threads`: how many threads may hash leaves (default: `farloco.util.parallel.set_threads`'s,
    the agent's share of the host's cores); the value does not depend on it."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("digest: expected a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    nbytes = view.nbytes
    count = max(1, -(-nbytes // LEAF_BYTES))
    leaves = map_ranges(lambda first, last: _leaves(view, first, last), count, nbytes, threads)
    root = hashlib.sha256(PREFIX + struct.pack("<QQ", nbytes, LEAF_BYTES))
    for part in leaves:
        root.update(part)
    return root.hexdigest()
