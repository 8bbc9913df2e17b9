"""DocTokenCache: token ids of recently seen document texts, so a popular document is tokenized once.

RAG requests resend the same documents; tokenizing five 2,048-token documents costs ~45 ms of CPU
per request, most of a cached request's time to first token. A document is tokenized on its own
(it is a chunk), so its ids do not depend on the request and can be reused exactly.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable


class DocTokenCache:
    def __init__(
        self,
        tokenize: Callable[[str], list[int]],
        max_tokens: int = 8_000_000,
        tokenize_batch: Callable[[list[str]], list[list[int]]] | None = None,
    ):
        """tokenize_batch: several texts at once (a fast tokenizer encodes a batch on all cores: a
        request's new documents in parallel); default one by one."""
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self._tokenize = tokenize
        self._tokenize_batch = tokenize_batch or (lambda texts: [tokenize(t) for t in texts])
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._unseen: set[str] = set()  # prefetched, not looked up yet
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, text: object) -> bool:
        return text in self._entries

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, text: str) -> list[int]:
        return self.get_array(text).tolist()

    def get_array(self, text: str) -> array:
        """The ids as the cache holds them (int64; not to be modified): what the tokenizer process
        sends on, packed as bytes (lazyrt.runtime.ipc.messages)."""
        ids = self._entries.get(text)
        if ids is not None:
            self._entries.move_to_end(text)
            if text in self._unseen:  # tokenized by prefetch: this is its miss
                self._unseen.discard(text)
                self.misses += 1
            else:
                self.hits += 1
            return ids
        self.misses += 1
        return self._keep(text, array("q", self._tokenize(text)))

    def get_arrays(self, texts: list[str]) -> list[array]:
        """get_array of each text, those not cached tokenized in one batch (prefetch)."""
        fresh = self.prefetch(texts)
        out = []
        for t in texts:
            if t not in self._entries and t in fresh:  # batched but not kept (no room, or caching off)
                self.misses += 1
                out.append(fresh[t])
            else:
                out.append(self.get_array(t))
        return out

    def prefetch(self, texts: list[str]) -> dict[str, array]:
        """Tokenize the texts not cached, each distinct one once, in one batch (a fast tokenizer encodes
        it on all cores) and keep them; the first get of each counts as its miss. Returns their ids
        (nothing when fewer than 2 are new: get tokenizes one alone)."""
        new = list(dict.fromkeys(t for t in texts if t not in self._entries))
        if len(new) < 2:
            return {}
        fresh = {t: array("q", ids) for t, ids in zip(new, self._tokenize_batch(new), strict=True)}
        for text, ids in fresh.items():
            self._keep(text, ids)
            if text in self._entries:
                self._unseen.add(text)
        return fresh

    def _keep(self, text: str, ids: array) -> array:
        if 0 < len(ids) <= self.max_tokens:
            self._entries[text] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                gone, old = self._entries.popitem(last=False)
                self._tokens -= len(old)
                self._unseen.discard(gone)
        return ids
