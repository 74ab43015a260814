"""The codec registry: names the rest of farloco (configs, wire headers of the exchange) refer to codecs by."""

from __future__ import annotations

from typing import Any

from farloco.optim.dense import Bf16Codec, Fp16Codec, Fp32Codec, Int4Codec, Int8Codec
from farloco.optim.sparse import DctTopKCodec, TopKCodec
from farloco.optim.wire import Codec, CodecError

_CODECS: dict[str, type[Codec]] = {
    "fp32": Fp32Codec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopKCodec,
    "dct-topk": DctTopKCodec,
}
_OPTIONS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "fp16": (),
    "bf16": (),
    "int8": ("block_size",),
    "int4": ("block_size",),
    "topk": ("k", "chunk", "value_bits"),
    "dct-topk": ("k", "chunk"),
}


def available_codecs() -> list[str]:
    """Registered codec names, in the order of their wire ids."""
    return list(_CODECS)


def get_codec(name: str, **options: Any) -> Codec:
    """Build codec `name` with its options (int8/int4: block_size; topk: k, chunk, value_bits; dct-topk: k, chunk)."""
    if name not in _CODECS:
        raise CodecError(f"codec name: expected one of {available_codecs()}, got {name!r}")
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        raise CodecError(
            f"codec {name!r} options: expected a subset of {list(_OPTIONS[name])}, got {unknown}"
        )
    return _CODECS[name](**options)
