"""The raw bytes and display text of single tokens, for OpenAI-style logprobs (``token``, ``bytes``).

A byte-level BPE token (GPT-2 / Qwen / Llama 3 style, and the built-in tokenizer) is stored as characters
standing for bytes; a SentencePiece byte-fallback token is ``<0xHH>``; added and special tokens are their
text. A token may hold part of a multi-byte character: its bytes are exact and its text shows the
replacement character, as OpenAI's does. Ids past the tokenizer's vocabulary (padding rows of a model's
embedding, as real checkpoints have) have no bytes and show as "".
"""

from __future__ import annotations

import functools
import re

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


class TokenBytes:
    """Bytes and text of token ids of one `tokenizers.Tokenizer`, cached per id."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.added = {token_id: added.content for token_id, added in backend.get_added_tokens_decoder().items()}
        decoder = backend.decoder
        self.byte_level = decoder is not None and "ByteLevel" in repr(decoder)
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = _byte_level_decoder()
            if all(character in table for character in piece):
                return bytes(table[character] for character in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.backend.decode([token_id], skip_special_tokens=False).encode()
