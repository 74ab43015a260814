"""Tokenizers for farloco's data pipeline: the offline byte tokenizer and Hugging Face tokenizer.json files.

This file owns the ``Tokenizer`` protocol that ``farloco.node.training.data`` writes shards with, and the two
implementations:
- ``ByteTokenizer``: token id = UTF-8 byte value, vocab 256, no download, no dependency. Documents are separated
  by byte 0 (NUL) rather than an extra id 256, so the vocabulary stays exactly 256 (the "tiny"/"small" model
  presets) and every id fits a byte. Text corpora practically never contain NUL; one that does simply looks like
  an extra document boundary to the model.
- ``HFTokenizer``: a ``tokenizer.json`` loaded with the ``tokenizers`` package, imported only when used so the
  package stays an optional dependency.

A tokenizer's ``name`` is recorded in every dataset manifest, and for tokenizer.json files it contains a hash of
the file's bytes: two datasets with the same name were tokenized identically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def name(self) -> str:
        """Identifies the tokenization exactly (recorded in dataset manifests)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids; every id is in [0, vocab_size)."""
        ...

    @property
    def eos_id(self) -> int:
        """Id written after every document."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (for samples and debugging; need not invert encode exactly)."""
        ...


class ByteTokenizer:
    """Token id = byte of the UTF-8 encoding; id 0 (the NUL byte) doubles as end of document."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The ids as a bytes object: what ``prepare_dataset`` uses, ~50x faster than a list of ints."""
        return text.encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        # Model samples can cut a multi-byte character in half; show a replacement char, do not fail.
        return bytes(ids).decode("utf-8", errors="replace")


# End-of-text spellings of the common tokenizer families, tried in this order.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (needs ``pip install tokenizers``)."""

    def __init__(self, path: Path | str, eos_token: str | None = None) -> None:
        path = Path(path)
        try:
            import tokenizers
        except ImportError as exc:
            raise ImportError(
                f"loading tokenizer {str(path)!r} needs the 'tokenizers' package, which is not installed; "
                "run `pip install tokenizers` (or use the offline byte tokenizer, spec 'bytes')"
            ) from exc
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {str(path)!r} does not exist (expected a tokenizer.json)"
            )
        content = path.read_bytes()
        try:
            self._tokenizer: Any = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"{str(path)!r} is not a valid tokenizer.json: {exc}") from exc
        self._vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self._eos_id = self._find_eos(path, eos_token)
        self._name = hf_tokenizer_name(content)
        # Kept so `farloco data prepare` can copy the file next to the shards (and the export ship it).
        self.content = content
        self.eos_token = str(self._tokenizer.id_to_token(self._eos_id))

    def _find_eos(self, path: Path, eos_token: str | None) -> int:
        candidates = (eos_token,) if eos_token is not None else _EOS_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"tokenizer {str(path)!r} has no end-of-text token: expected one of {list(candidates)} in its vocabulary"
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def hf_tokenizer_name(content: bytes) -> str:
    """The name a tokenizer.json's bytes give a dataset's manifest (and that the export checks a copy against)."""
    return f"hf:sha256={hashlib.sha256(content).hexdigest()[:16]}"


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` -> :class:`ByteTokenizer`; anything else is a path to a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer spec {spec!r}: expected 'bytes' or the path of a tokenizer.json file")
    return HFTokenizer(path)
