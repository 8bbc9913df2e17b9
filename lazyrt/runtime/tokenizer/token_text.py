"""Token ids -> the text and bytes of each token on its own, for logprobs in responses.

A byte-level BPE token (GPT-2 style, SmolLM2, Llama 3, Qwen) may hold part of a UTF-8 character, so
its exact bytes come from the tokenizer's byte alphabet, not from decoding it alone; SentencePiece
byte-fallback tokens (<0xAB>) are one byte; anything else is its decoded text.
"""

from __future__ import annotations

import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (char -> byte)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Per-token text/bytes with a cache (the same ids recur in every response)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._alphabet = _byte_alphabet()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            data = b""
        elif token_id in self._special:
            data = piece.encode()
        elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            data = bytes([int(m.group(1), 16)])
        elif all(c in self._alphabet for c in piece):
            data = bytes(self._alphabet[c] for c in piece)
        else:
            data = self.tokenizer.decode([token_id]).encode()
        out = (data.decode("utf-8", errors="replace"), list(data))
        if len(self._cache) < 1 << 18:
            self._cache[token_id] = out
        return out

    def entry(self, token_id: int, logprob: float) -> dict:
        text, data = self.get(token_id)
        return {"token_id": token_id, "token": text, "logprob": logprob, "bytes": data}

    def logprobs(self, token_ids: list[int], raw: list[list] | None) -> list[dict] | None:
        """Worker entries [logprob, [top ids], [top logprobs]] (one per token) as response dicts:
        the sampled token's entry plus `top_logprobs`, a list of entries, most likely first."""
        if raw is None:
            return None
        out = []
        for t, (lp, top_ids, top_lps) in zip(token_ids, raw):
            e = self.entry(t, lp)
            e["top_logprobs"] = [self.entry(i, v) for i, v in zip(top_ids, top_lps)]
            out.append(e)
        return out
