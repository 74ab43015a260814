"""A tokenizer process of `farloco data prepare --workers N`: texts in, token bytes out, over its stdin/stdout.

Run as `python -m farloco.node.training.tokenize_worker SPEC DTYPE` by `TokenizerPool` (never by hand). Each
request is one msgpack array of strings (a chunk of documents); each reply one msgpack array of bytes, each
document's token ids in DTYPE (little-endian) followed by the tokenizer's EOS id. msgpack, not pickle: nothing
that crosses a process boundary is unpickled. Imports neither torch nor the rest of farloco's data module, so a
worker starts in a fraction of a second.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from queue import Queue
from typing import IO, Any

import msgpack
import numpy as np

from farloco.node.training.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

MAX_REPLY = 1 << 31  # a chunk's reply: far above what CHUNK_CHARS of text make


def encode_document(tokenizer: Tokenizer, text: str, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """One document's ids in `dtype`, followed by the EOS id."""
    if isinstance(tokenizer, ByteTokenizer):
        # Bytes are already the ids: skip building a Python list of ints per character.
        raw = tokenizer.encode_bytes(text) + bytes([tokenizer.eos_id])
        return np.frombuffer(raw, dtype=np.uint8).astype(dtype)
    ids = tokenizer.encode(text)
    ids.append(tokenizer.eos_id)
    array = np.asarray(ids, dtype=np.int64)
    if array.min() < 0 or array.max() >= tokenizer.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name} produced ids outside [0, {tokenizer.vocab_size}): "
            f"min {array.min()}, max {array.max()}"
        )
    return array.astype(dtype)


def messages(stream: Any) -> Iterator[Any]:
    """The msgpack messages of a pipe, each as soon as its last byte arrived. (An Unpacker reading the file
    itself asks for read_size bytes at a time, and a pipe's read blocks until that many came: a short message
    then waits forever for bytes that never come.)"""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_REPLY)
    while True:
        yield from unpacker
        data = stream.read1(1 << 16)
        if not data:
            return
        unpacker.feed(data)


def serve(spec: str, dtype_name: str, stdin: IO[bytes], stdout: IO[bytes]) -> None:
    tokenizer = load_tokenizer(spec)
    dtype = np.dtype(dtype_name).newbyteorder("<")
    for texts in messages(stdin):
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise SystemExit(f"tokenize_worker: expected an array of strings, got {type(texts).__name__}")
        reply = [encode_document(tokenizer, text, dtype).tobytes() for text in texts]
        stdout.write(msgpack.packb(reply, use_bin_type=True))
        stdout.flush()


class TokenizerPool:
    """N worker processes tokenizing chunks of documents in parallel; results come back in input order.

    At most `depth` chunks per worker are in flight, so a corpus larger than memory streams through: the reader
    is never more than N x depth chunks ahead of the writer. A writer thread per worker feeds its stdin, so a
    worker blocked on writing a reply never blocks the chunks sent to the others."""

    def __init__(self, spec: str, dtype_name: str, workers: int, depth: int = 2) -> None:
        self.depth = depth
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "farloco.node.training.tokenize_worker", spec, dtype_name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(workers)
        ]
        self.replies = [messages(p.stdout) for p in self.processes]
        self.queues: list[Queue[bytes | None]] = [Queue() for _ in self.processes]
        self.threads = [
            threading.Thread(target=self._feed, args=(p, q), daemon=True)
            for p, q in zip(self.processes, self.queues, strict=True)
        ]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _feed(process: subprocess.Popen[bytes], queue: Queue[bytes | None]) -> None:
        assert process.stdin is not None
        try:
            while (payload := queue.get()) is not None:
                process.stdin.write(payload)
                process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: the reader reports it
        finally:
            process.stdin.close()

    def _result(self, index: int) -> list[bytes]:
        worker = index % len(self.processes)
        try:
            reply = next(self.replies[worker])
        except StopIteration:
            code = self.processes[worker].wait()
            raise RuntimeError(f"tokenizer worker {worker} exited with {code} (its error is above)") from None
        return list(reply)

    def map(self, chunks: Iterable[Sequence[str]]) -> Iterator[list[bytes]]:
        """Each chunk's documents as token bytes, chunk by chunk, in order."""
        pending: deque[int] = deque()
        for sent, chunk in enumerate(chunks):
            if len(pending) >= self.depth * len(self.processes):
                yield self._result(pending.popleft())
            self.queues[sent % len(self.processes)].put(msgpack.packb(list(chunk), use_bin_type=True))
            pending.append(sent)
        while pending:
            yield self._result(pending.popleft())

    def close(self) -> None:
        for queue in self.queues:
            queue.put(None)
        for thread in self.threads:
            thread.join(timeout=10)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if any(exc):
            for process in self.processes:
                process.kill()
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.stdin.buffer, sys.stdout.buffer)
