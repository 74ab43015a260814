"""Encode/decode throughput and error of every farloco codec on one 64 MiB float32 tensor.

Beside them, in the same run: a plain memcpy (bytes out, tensor back) and hivemind's Float16Compression and
Uniform8BitQuantization, so the numbers are comparable on a noisy shared machine (compare ratios within a run).
Times are the best of --repeats runs. Prints one JSON line per codec, or a markdown table with --markdown.

    .venv/bin/python benchmarks/codec_speed.py [--numel 16777216] [--repeats 3] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from farloco.optim import get_codec

MIB = 1 << 20


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / x.double().norm())


def row(
    name: str,
    x: torch.Tensor,
    wire_bytes: int,
    encode_s: float,
    decode_s: float | None,
    error: float | None,
    note: str = "",
) -> dict[str, Any]:
    input_mib = x.numel() * 4 / MIB
    return {
        "codec": name,
        "numel": x.numel(),
        "wire_bytes": wire_bytes,
        "bits_per_value": round(8 * wire_bytes / x.numel(), 4),
        "ratio": round(wire_bytes / (4 * x.numel()), 5),
        "encode_ms": round(encode_s * 1e3, 1),
        "decode_ms": None if decode_s is None else round(decode_s * 1e3, 1),
        "encode_mib_s": round(input_mib / encode_s),
        "decode_mib_s": None if decode_s is None else round(input_mib / decode_s),
        "rel_l2_error": None if error is None else float(f"{error:.3g}"),
        "note": note,
    }


def farloco_rows(x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    cases: list[tuple[str, str, dict[str, int]]] = [
        ("fp32", "fp32", {}),
        ("fp16", "fp16", {}),
        ("bf16", "bf16", {}),
        ("int8 (block 128)", "int8", {}),
        ("int4 (block 64)", "int4", {}),
        ("topk 64/4096, fp16 values", "topk", {}),
        ("topk 64/4096, 2-bit values", "topk", {"value_bits": 2}),
        ("dct-topk 4/128", "dct-topk", {}),
    ]
    rows = []
    for label, name, options in cases:
        codec = get_codec(name, **options)
        encode_s, payload = best_time(lambda codec=codec: codec.encode(x), repeats)
        decode_s, decoded = best_time(lambda codec=codec, payload=payload: codec.decode(payload), repeats)
        rows.append(row(f"farloco {label}", x, len(payload), encode_s, decode_s, relative_error(x, decoded)))
    return rows


def memcpy_row(x: torch.Tensor, repeats: int) -> dict[str, Any]:
    array = x.numpy()
    encode_s, payload = best_time(lambda: array.tobytes(), repeats)
    decode_s, decoded = best_time(lambda: torch.frombuffer(bytearray(payload), dtype=torch.float32), repeats)
    return row(
        "memcpy (tobytes / frombuffer copy)", x, len(payload), encode_s, decode_s, relative_error(x, decoded)
    )


def hivemind_rows(x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization

    rows = []
    info = CompressionInfo.from_tensor(x)
    for label, compression in (
        ("Float16Compression", Float16Compression()),
        ("Uniform8BitQuantization", Uniform8BitQuantization()),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.quantize_per_tensor deprecation inside hivemind
            encode_s, message = best_time(lambda c=compression: c.compress(x, info), repeats)
        wire = message.ByteSize()
        try:
            decode_s, decoded = best_time(lambda c=compression, m=message: c.extract(m), repeats)
            rows.append(row(f"hivemind {label}", x, wire, encode_s, decode_s, relative_error(x, decoded)))
        except Exception as exc:  # report the failure as data: that is what this column is for
            # Measure the error anyway by reading the buffer the way extract() means to (count=1 -> [0]).
            buffer = message.buffer
            size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
            codebook = torch.from_numpy(np.frombuffer(buffer, offset=8, count=size, dtype=np.float32).copy())
            indices = torch.from_numpy(
                np.frombuffer(buffer, offset=8 + 4 * size, dtype=np.uint8).astype(np.int64)
            )
            note = f"extract() fails: {type(exc).__name__}: {exc} (error measured with a patched reader)"
            rows.append(
                row(f"hivemind {label}", x, wire, encode_s, None, relative_error(x, codebook[indices]), note)
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any) -> str:
        return "—" if value is None else str(value)

    lines = [
        "| codec | bits/value | wire/fp32 | encode ms | decode ms | encode MiB/s | decode MiB/s | rel. L2 error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        name = r["codec"] + (f" [{len(notes) + 1}]" if r["note"] else "")
        if r["note"]:
            notes.append(f"[{len(notes) + 1}] {r['note']}")
        lines.append(
            f"| {name} | {r['bits_per_value']} | {r['ratio']} | {r['encode_ms']} | {fmt(r['decode_ms'])} | "
            f"{r['encode_mib_s']} | {fmt(r['decode_mib_s'])} | {fmt(r['rel_l2_error'])} |"
        )
    return "\n".join(lines + (["", *notes] if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * MIB, help="float32 values (default: 64 MiB worth)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best is reported")
    parser.add_argument(
        "--markdown", action="store_true", help="print a markdown table instead of JSON lines"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed))
    rows = [memcpy_row(x, args.repeats), *farloco_rows(x, args.repeats), *hivemind_rows(x, args.repeats)]
    if args.markdown:
        print(
            f"{args.numel} float32 values ({args.numel * 4 / MIB:.0f} MiB), N(0,1), "
            f"best of {args.repeats}, torch threads {torch.get_num_threads()}\n"
        )
        print(markdown(rows))
    else:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
