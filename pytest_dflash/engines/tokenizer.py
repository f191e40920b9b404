"""Byte-level tokenizer of the reference model: 256 byte tokens plus BOS, EOS and PAD.

Bytes need no vocabulary file, cannot go out of date with the corpus and make bits per byte a
direct reading of the mean negative log-likelihood (one token is one byte).
"""

from __future__ import annotations

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 259


def encode(text: str, bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids, optionally with the BOS token in front."""
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: list[int]) -> str:
    """Text of the byte tokens in ``ids``; special tokens are dropped, broken UTF-8 is replaced
    (U+FFFD) so the output contract can see the corruption instead of an exception hiding it."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
