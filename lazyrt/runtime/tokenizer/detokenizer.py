"""Incremental detokenization of one request's output, with stop strings.

Text grows only by whole characters: a decode ending in U+FFFD (an incomplete UTF-8 sequence split
across tokens) waits for the next token. Each step decodes only a short window of ids (from the
last point where the text was complete), not the whole output. Stop strings: the text is cut
before the first stop match, and while running, the last (longest stop - 1) characters are held
back so a stop string that is still arriving is never emitted. A stop token id ends the text too,
its own text left out.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.stop_token_ids = set(stop_token_ids or [])  # end the text; their own text is not shown
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (whole characters), cut at a stop string once one is seen
        self.stopped = False  # a stop string was seen; later tokens are ignored
        self._prefix_offset = 0  # ids[prefix:read] decode to the tail of `text` (context for spaces)
        self._read_offset = 0
        self._sent = 0  # characters of `text` handed out by take()
        self.logprobs: list[dict] = []  # the offline engine's per-token logprobs (requests asking them)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> int:
        """Feed new tokens; returns how many were consumed (fewer than given once a stop is seen)."""
        used = 0
        for t in token_ids:
            if self.stopped:
                break
            if t in self.stop_token_ids:
                self._advance(final=True)  # flush the text before it, then stop
                self.ids.append(t)
                self._prefix_offset = self._read_offset = len(self.ids)
                self.stopped = True
                return used + 1
            self.ids.append(t)
            used += 1
            self._advance(final=False)
        return used

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        now = self._decode(self.ids[self._prefix_offset :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            start = max(0, len(self.text) - self.hold)  # a new match must end in the new text
            self.text += now[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """Text that is safe to emit now (all of it when final or stopped)."""
        if final and not self.stopped:
            self._advance(final=True)  # flush a trailing partial character as U+FFFD, like decode()
        end = len(self.text) if (final or self.stopped) else len(self.text) - self.hold
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
