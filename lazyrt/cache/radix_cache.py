"""Page-granular radix prefix cache (SGLang-style) for plain prompts and prefix mode.

Each node below the root holds exactly one full page: its edge key is the tuple of that page's
``page_size`` tokens. Partial pages are never cached. The cache owns the page ids in its nodes but
never allocates or frees them: ``insert``/``evict``/``reset`` return ids for the caller to free.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


class RadixNode:
    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_used", "uid")

    def __init__(self, key: tuple[int, ...], page: int, parent: RadixNode | None, uid: int) -> None:
        self.key = key  # this page's tokens
        self.page = page  # -1 for the root
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_used = 0
        self.uid = uid  # creation order; LRU tie-break

    def __repr__(self) -> str:
        return f"RadixNode(page={self.page}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass(slots=True)
class RadixStats:
    hit_tokens: int = 0
    queries: int = 0


class RadixCache:
    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.stats = RadixStats()
        self._clock = 0
        self._next_uid = 1
        self.root = RadixNode((), -1, None, 0)
        self._owned: set[int] = set()
        self._evictable = 0  # nodes (= pages) with lock_ref == 0

    def _page_keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(int(t) for t in tokens[i * ps : (i + 1) * ps]) for i in range(len(tokens) // ps)]

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """Longest cached prefix of full pages: (page ids in order, deepest matched node or root)."""
        self._clock += 1
        node, pages = self.root, []
        for key in self._page_keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_used = self._clock
            pages.append(node.page)
        self.stats.queries += 1
        self.stats.hit_tokens += len(pages) * self.page_size
        return pages, node

    def node_of(self, tokens: Sequence[int]) -> RadixNode:
        """The deepest node on the path of tokens' full pages (root if none); no stats, no touch."""
        node = self.root
        for key in self._page_keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            node = child
        return node

    def insert(self, tokens: Sequence[int], pages: list[int]) -> list[int]:
        """Cache the full pages of ``tokens``; returns the caller's pages the cache did not take.

        Only the first ``len(tokens) // page_size`` pages are considered. Where a page's prefix is
        already cached, the cached page wins and the caller's page is returned (to be freed) unless
        it *is* the cached page (the caller matched it earlier).
        """
        keys = self._page_keys(tokens)
        n = len(keys)
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens but only {len(pages)} pages given")
        self._clock += 1
        node, i, rejected = self.root, 0, []
        while i < n and keys[i] in node.children:
            node = node.children[keys[i]]
            node.last_used = self._clock
            if pages[i] != node.page:
                rejected.append(pages[i])
            i += 1
        new_pages = pages[i:n]
        # Validate before adding nodes: a page the caller will free (rejected) or hand over (new) must
        # not be one the cache already holds, or it would end up owned twice.
        given = rejected + new_pages
        if len(set(given)) != len(given) or not self._owned.isdisjoint(given):
            raise ValueError(f"pages {given} repeat or are already held by the radix cache")
        for key, page in zip(keys[i:], new_pages, strict=True):
            child = RadixNode(key, page, node, self._next_uid)
            self._next_uid += 1
            child.last_used = self._clock
            node.children[key] = child
            node = child
        self._owned.update(new_pages)
        self._evictable += len(new_pages)
        return rejected

    def _path(self, node: RadixNode) -> list[RadixNode]:
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError("node is not in this cache (evicted or foreign)")
            path.append(node)
            node = node.parent
        return path

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors: locked nodes are never evicted. Locking the root is a no-op."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= 1
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError("unlock of a node that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += 1

    def evictable_pages(self) -> int:
        return self._evictable

    def evict(self, num_pages: int) -> list[int]:
        """Evict unlocked leaves, least recently used first, until >= num_pages are freed."""
        if num_pages <= 0:
            return []
        heap = [(n.last_used, n.uid, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            freed.append(node.page)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_used, parent.uid, parent))
        self._owned.difference_update(freed)
        self._evictable -= len(freed)
        return freed

    def drop(self, pages: set[int]) -> list[int]:
        """Remove the nodes holding these pages and every node below them (their KV was computed on top
        of theirs); returns every page removed. None of them may be locked."""
        freed: list[int] = []
        for node in [n for n in self._nodes() if n.page in pages]:
            if node.parent is None:
                continue  # already removed, below an earlier one
            below, stack = [], [node]
            while stack:
                x = stack.pop()
                below.append(x)
                stack.extend(x.children.values())
            if any(x.lock_ref for x in below):
                raise RuntimeError("cannot drop radix nodes a request holds")
            del node.parent.children[node.key]
            for x in below:
                x.parent = None
                freed.append(x.page)
        self._owned.difference_update(freed)
        self._evictable -= len(freed)
        return freed

    def reset(self) -> list[int]:
        """Flush: drop the whole tree and return its pages. Raises RuntimeError if any node is locked."""
        # A locked node locks its top-level ancestor, so checking the root's children suffices.
        if any(c.lock_ref > 0 for c in self.root.children.values()):
            raise RuntimeError("cannot reset the radix cache while requests hold locks")
        freed = [n.page for n in self._nodes()]
        for n in self._nodes():
            n.parent = None
        self.root.children = {}
        self._owned.clear()
        self._evictable = 0
        return freed

    @property
    def num_pages(self) -> int:
        return len(self._owned)

    def _nodes(self) -> list[RadixNode]:
        """All nodes except the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
