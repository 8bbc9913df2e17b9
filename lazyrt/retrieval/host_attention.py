"""Worker side of retrieval attention: a step's host segments, attended on the CPU layer by layer.

The scheduler gives a request a *host segment* for a document chunk found only in the host tier
when the device pool cannot load it (Segment.host: its pages are host page ids). The step then runs
through shared-chunk attention over its device segments (which yields each part's log-sum-exp),
and every (query row, host segment) pair is one more part: per layer, the rows' queries come to
the CPU, are turned into the segment's frame (by -start_pos: the keys are stored unrotated, so
R(p) q . R(start + j) k_j = R(p - start) q . R(j) k_j), and attend to the segment's sink keys and
top-k keys from a KeyIndex over its keys at local positions (lazyrt/retrieval/attention.py), or to
all its keys when top-k covers them (exact). The parts merge with the device parts by lse.

An index is built the first time a segment needs one (per layer, on the CPU; its keys' frame is the
segment's own, so it serves every request and every position) and dropped when an offload writes
any of its host pages (the page ids then hold another chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.retrieval.attention import retrieval_attention_ref
from lazyrt.retrieval.key_index import KeyIndex, build_key_index


@dataclass(frozen=True)
class RetrievalOptions:
    top_k: int
    sink: int
    scan: float


@dataclass
class HostPart:
    """One item's host segment: its query rows of the step attend to it; their parts are the pair
    ids pair0 .. pair0 + len(rows) - 1 of the step's SharedChunkMeta."""

    rows: range
    pages: tuple[int, ...]
    num_tokens: int
    start_pos: int
    pair0: int = 0
    top_k: int | None = None  # the request's retrieval_top_k (None: the engine's)


def add_host_pairs(arrays: dict[str, np.ndarray], parts: list[HostPart]) -> None:
    """Appends one pair per (row, host part) to build_arrays' output (after the device segments'
    pairs, which the kernel's work items cover; these it leaves alone), sets each part's pair0, and
    rebuilds the merge's per-row index over all pairs."""
    rows = [arrays["pair_row"]]
    starts = [arrays["pair_start"]]
    p = len(arrays["pair_row"])
    for part in parts:
        part.pair0 = p
        rows.append(np.arange(part.rows.start, part.rows.stop, dtype=np.int32))
        starts.append(np.full(len(part.rows), part.start_pos, dtype=np.int32))
        p += len(part.rows)
    pair_row = np.concatenate(rows).astype(np.int32)
    T = len(arrays["row_part_indptr"]) - 1
    arrays["pair_row"] = pair_row
    arrays["pair_start"] = np.concatenate(starts).astype(np.int32)
    arrays["row_parts"] = np.argsort(pair_row, kind="stable").astype(np.int32)
    arrays["row_part_indptr"] = np.concatenate([[0], np.cumsum(np.bincount(pair_row, minlength=T))]).astype(
        np.int32
    )


class HostIndexCache:
    """(KeyIndex, local keys) per (host pages, tokens, layer, sink), built on first use; dropped when
    one of its pages is rewritten."""

    def __init__(self) -> None:
        self._indexes: dict[tuple, tuple[KeyIndex, torch.Tensor]] = {}
        self.builds = 0

    def get(self, key: tuple, build) -> tuple[KeyIndex, torch.Tensor]:
        idx = self._indexes.get(key)
        if idx is None:
            idx = self._indexes[key] = build()
            self.builds += 1
        return idx

    def invalidate(self, pages: list[int]) -> None:
        gone = set(pages)
        for key in [k for k in self._indexes if not gone.isdisjoint(k[0])]:
            del self._indexes[key]


class HostAttention:
    """A step's host parts (AttentionMetadata.host): `fill` computes them for one layer. host_kv: the
    host tier's pages, [pages, layers, 2, page_size, kv_heads, head_dim] (HostKVPool.kv)."""

    def __init__(
        self,
        parts: list[HostPart],
        host_kv: torch.Tensor,
        rope: RopeCache,
        sm_scale: float,
        options: RetrievalOptions,
        indexes: HostIndexCache,
    ):
        self.parts, self.host_kv, self.rope = parts, host_kv, rope
        self.sm_scale, self.options, self.indexes = sm_scale, options, indexes

    def _builder(self, k: torch.Tensor, sink: int):
        """Builds (KeyIndex, the keys at local positions in k's dtype: kept, so a step does not turn
        every key again; as much memory as the chunk's keys) from keys k [n, kv_heads, D] as stored."""

        def build() -> tuple[KeyIndex, torch.Tensor]:
            local = apply_rope_ref(k.float(), torch.arange(k.shape[0]), self.rope)
            return build_key_index(local, sink=sink), local.to(k.dtype)

        return build

    def fill(self, layer: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Writes the host parts of o [P, H, D] / lse [P, H] (fp32) from q [T, H, D] rotated at the
        rows' positions."""
        rd, half = self.rope.rotary_dim, self.rope.rotary_dim // 2
        qc = q.float().cpu()
        for part in self.parts:
            n, m = part.num_tokens, len(part.rows)
            qp = qc[part.rows.start : part.rows.stop]
            cos, sin = self.rope.cos[part.start_pos, :half], self.rope.sin[part.start_pos, :half]
            q1, q2 = qp[..., :half], qp[..., half:rd]  # turned back by start_pos: the segment's frame
            qp = torch.cat([q1 * cos + q2 * sin, q2 * cos - q1 * sin, qp[..., rd:]], dim=-1)
            pages = part.pages  # a run of consecutive host pages (the usual case) is a view, not a copy
            if pages[-1] - pages[0] == len(pages) - 1:
                kv = self.host_kv[pages[0] : pages[-1] + 1, layer]  # [pages, 2, page_size, kv_heads, D]
            else:
                kv = self.host_kv[list(pages), layer]
            k = kv[:, 0].reshape(-1, *kv.shape[3:])[:n]
            v = kv[:, 1].reshape(-1, *kv.shape[3:])[:n]
            sink = min(self.options.sink, n - 1)
            top_k = part.top_k or self.options.top_k
            index = local = None
            if top_k < n - sink:  # else every key: exact
                index, local = self.indexes.get((part.pages, n, layer, sink), self._builder(k, sink))
            # scan at least 2 x top_k keys: top-k out of fewer candidates would be no choice at all
            scan = min(1.0, max(self.options.scan, 2 * top_k / max(1, n - sink)))
            po, pl = retrieval_attention_ref(qp, k, v, index, self.rope, self.sm_scale, top_k, scan, local)
            o[part.pair0 : part.pair0 + m] = po.to(o.device)
            lse[part.pair0 : part.pair0 + m] = pl.to(lse.device)


def host_rows(parts: list[list[HostPart]], qo_indptr: np.ndarray) -> list[HostPart]:
    """Sets each item's parts' query rows from the step's layout; returns them all, in order."""
    out = []
    for i, item_parts in enumerate(parts):
        for part in item_parts:
            part.rows = range(int(qo_indptr[i]), int(qo_indptr[i + 1]))
            out.append(part)
    return out
