"""Worker side of retrieval attention: a step's host segments, attended layer by layer (on the CPU
here; with the queries on a GPU, DeviceFill in device_fill.py does the same on the device).

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

`fill` attends every host part of a layer at once (parts of one shape, i.e. tokens, sink and top-k,
together): each part's list scores are one product, then the lists each query scans (best first
while they hold at most the scan budget), the candidates' table positions, their exact scores, the
top-k and the softmax over sink + top-k keys are a few ops over [parts, KV heads, query rows, ...].
The per-part data a step reads is prepared once per (chunk, layer) in HostIndexCache (IndexEntry:
keys list by list, list sizes and starts; stacked per group of chunks). `fill_reference` is the
per-part torch reference (retrieval_attention_ref part by part) it equals.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import queue
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.retrieval.attention import retrieval_attention_ref
from lazyrt.retrieval.device_fill import DeviceFill, DeviceStacks, FillGraphs, kv_rows
from lazyrt.retrieval.key_index import KeyIndex, build_key_index, check_int
from lazyrt.retrieval.part_layout import attend_every_key, part_queries, part_rows, same_chunk_parts

WORK_ELEMENTS = 1 << 22  # the batched fill's buffers hold at most this many keys' elements (4M: 16 MB fp32)


@dataclass(frozen=True)
class RetrievalOptions:
    top_k: int
    sink: int
    scan: float
    build_threads: int = 0  # background index builders (0: a step builds what it needs, and waits)
    # where the k-means of an index build runs (the worker's CUDA device; None = CPU): ~10 GFLOP a
    # chunk-layer at 2K keys, minutes of CPU for a 128K context, milliseconds of GPU
    build_device: str | None = None
    # the device fill (CUDA): the query heads of a KV head share one candidate set per token (lists
    # ranked by the best of their scores): 1/group of the keys read over the bus
    share_lists: bool = False
    # a part with more than one query row (a question's prefill) attends every key of the chunk: its
    # pages are read whole (contiguous blocks, the bus's fast case), where each of its rows searching
    # its own keys would read that many scattered sets; and the question's KV, which every later token
    # attends, is then exact
    exact_prefill: bool = True

    def __post_init__(self) -> None:
        check_int("top_k", self.top_k, 1)
        check_int("sink", self.sink, 0)
        check_int("build_threads", self.build_threads, 0)
        if isinstance(self.scan, bool) or not isinstance(self.scan, numbers.Real) or not 0 < self.scan <= 1:
            raise ValueError(f"scan={self.scan!r}: must be a number in (0, 1] (share of keys scanned)")


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

    def __post_init__(self) -> None:
        if self.top_k is not None:  # (0 would not mean the engine's: that is None)
            check_int("top_k", self.top_k, 1)


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


class IndexEntry:
    """One (host chunk, layer)'s index in the form the batched fill reads, built once.

    table [kv_heads, n, head_dim] (the keys' dtype): the keys at local positions, per KV head the sink
    keys first, then the indexed keys list by list (a list is a run of the table); slot_of
    [kv_heads, n] int64: the chunk slot of each table position; probes_t [kv_heads, head_dim, lists]
    fp32 and bias [kv_heads, 1, lists] (None: centroids) score the lists; sizes / starts [kv_heads,
    lists] int64: each list's keys and its first table position past the sinks; size_cum
    [kv_heads, lists]: the sizes sorted ascending, summed (the most lists a scan budget can take)."""

    def __init__(self, index: KeyIndex, local: torch.Tensor):
        n, kv_heads, d = local.shape
        self.index, self.num_keys, self.sink = index, n, index.sink
        sinks = torch.arange(index.sink).expand(kv_heads, index.sink)
        self.slot_of = torch.cat([sinks, index.slots], 1).contiguous()  # [kv_heads, n]
        order = self.slot_of[:, :, None].expand(kv_heads, n, d)
        self.table = local.transpose(0, 1).gather(1, order).contiguous()
        self.batched = index.group_probes is None  # two-level probing: the per-part reference only
        if index.probes is None:  # views of the index's (the products read them transposed)
            self.probes_t, self.bias = index.centroids.transpose(1, 2), None
        else:
            probes = index.probes.transpose(1, 2)
            self.probes_t, self.bias = probes[:, :d], probes[:, d:]
        self.sizes = index.offsets[:, 1:] - index.offsets[:, :-1]
        self.starts = index.offsets[:, :-1].contiguous()
        self.size_cum = self.sizes.sort(-1).values.cumsum(-1)
        self._on_device: dict[str, tuple[torch.Tensor, ...]] = {}

    @property
    def lists(self) -> int:
        return self.sizes.shape[1]

    def on_device(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """(centroids, sizes, starts, slot_of) on `device`, copied once (by an index builder thread as
        the index is built, see _run_build; else on first use) and kept with the entry. Centroids in
        bf16 where that holds them exactly (the plain build's), else fp32."""
        key = str(device)
        got = self._on_device.get(key)
        if got is None:
            cent = self.index.centroids.float()
            half = cent.to(torch.bfloat16)
            cent = half if torch.equal(half.float(), cent) else cent
            got = tuple(t.to(device) for t in (cent, self.sizes, self.starts, self.slot_of))
            self._on_device[key] = got
        return got

    def local(self) -> torch.Tensor:
        """The keys at local positions in slot order [n, kv_heads, head_dim] (the reference's layout)."""
        kv_heads, n, d = self.table.shape
        out = torch.empty(n, kv_heads, d, dtype=self.table.dtype)
        out.transpose(0, 1).scatter_(1, self.slot_of[:, :, None].expand(kv_heads, n, d), self.table)
        return out


@dataclass
class _Stack:
    """A group's per-chunk index data of one layer, stacked (cached with the group's chunks)."""

    entries: list[IndexEntry]
    sizes: torch.Tensor  # [G, kv_heads, lists]
    starts: torch.Tensor  # [G, kv_heads, lists]
    slot_of: torch.Tensor  # [G, kv_heads, n]
    size_cum: torch.Tensor  # [G, kv_heads, lists]
    max_size: int


class HostIndexCache:
    """IndexEntry per (host pages, tokens, layer, sink), built on first use; dropped when one of its
    pages is rewritten. Also keeps the stacked data of each group of chunks a layer attends together
    (a decode step asks for the same groups every step) and the batched fill's work buffers.

    build_threads > 0: `ready` queues a missing index for daemon threads that build it off the step
    and returns None meanwhile (the caller attends that part exactly); 0: `ready` builds it at once.
    An index whose pages are rewritten while it builds is thrown away when done."""

    MAX_STACKS = 512

    def __init__(self, build_threads: int = 0, device: str | None = None) -> None:
        """device: where the device fill runs (CUDA): builder threads copy each new index's data there."""
        self.device = device
        self._indexes: dict[tuple, IndexEntry] = {}
        self._stacks: dict[tuple, _Stack] = {}
        self.fill_graphs = FillGraphs()  # the device fill's CUDA graphs (decode steps)
        # the device fill's stacks of index data (a dropped stack drops the graphs that read it)
        self.device_stacks = DeviceStacks(on_drop=functools.partial(_drop_graphs, weakref.ref(self)))
        self._work: dict[str, torch.Tensor] = {}
        self.builds = 0
        self.build_threads = build_threads
        self._lock = threading.Lock()  # the dicts and counters, shared with the builder threads
        self._queued: dict[tuple, object] = {}  # key -> token of its queued build (a newer one replaces it)
        self._failed: dict[tuple, BaseException] = {}
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue | None = None
        self.key_tables: torch.Tensor | None = None  # see key_tables_for

    def key_tables_for(self, host_kv: torch.Tensor) -> torch.Tensor:
        """Every index's table (keys turned to local positions, sink keys first, then list by list) laid
        out over its chunk's host pages: [host pages, layers, kv_heads, page_size, D], pinned like
        host_kv. The device fill reads a list's keys there as runs of consecutive rows, which come
        over the bus at ~4x the rate of scattered rows (benchmarks/experiments/zero_copy_gather.py),
        already turned. Allocated on first use, with the indexes built so far; kept up to date after."""
        P, layers, _, ps, kvh, d = host_kv.shape
        with self._lock:
            if self.key_tables is None:
                pin = host_kv.is_pinned()
                self.key_tables = torch.empty(P, layers, kvh, ps, d, dtype=host_kv.dtype, pin_memory=pin)
                for key, entry in self._indexes.items():
                    self._write_key_table(key, entry)
            return self.key_tables

    def _write_key_table(self, key: tuple, entry: IndexEntry) -> None:
        """(under self._lock) entry's table into key_tables at its key's pages and layer."""
        if self.key_tables is None:
            return
        pages, n, layer, _ = key
        kvh, _, d = entry.table.shape
        ps = self.key_tables.shape[3]
        t = torch.nn.functional.pad(entry.table, (0, 0, 0, len(pages) * ps - n))  # [kvh, pages * ps, d]
        self.key_tables[list(pages), layer] = t.view(kvh, len(pages), ps, d).transpose(0, 1)

    def get(self, key: tuple, build) -> IndexEntry:
        """The index, built now if missing (build() -> (KeyIndex, keys at local positions))."""
        with self._lock:
            idx = self._indexes.get(key)
        if idx is None:
            idx = IndexEntry(*build())
            _after_device_reads(self.key_tables)
            with self._lock:
                self._indexes[key] = idx
                self._write_key_table(key, idx)
                self.builds += 1
        return idx

    def ready(self, key: tuple, build) -> IndexEntry | None:
        """The index if built; else (build_threads > 0) queues its build and returns None, or (0) builds
        it now. A build that failed raises its error here."""
        if not self.build_threads:
            return self.get(key, build)
        with self._lock:
            idx = self._indexes.get(key)
            if idx is not None:
                return idx
            if key in self._failed:
                raise self._failed.pop(key)
            if key not in self._queued:
                self._start_builders()
                token = self._queued[key] = object()
                self._queue.put((key, build, token))
        return None

    def prebuild(self, keys: list[tuple], build) -> None:
        """Queues one build of several indexes (build() -> [(KeyIndex, local keys)] in keys' order):
        a chunk's layers indexed together as it moves to the host. Needs build_threads > 0; keys
        already built or queued are left alone (the whole job is skipped when none is missing)."""
        if not self.build_threads:
            raise ValueError("prebuild needs build_threads > 0")
        with self._lock:
            if all(k in self._indexes or k in self._queued for k in keys):
                return
            self._start_builders()
            token = object()
            for k in keys:
                if k not in self._indexes:
                    self._queued[k] = token
            self._queue.put((tuple(keys), build, token, True))

    def _start_builders(self) -> None:
        if self._queue is None:  # (under self._lock)
            self._queue = queue.SimpleQueue()
            weakref.finalize(self, _stop_builders, self._queue, self.build_threads)
            for i in range(self.build_threads):
                threading.Thread(
                    target=_build_loop, args=(weakref.ref(self), self._queue),
                    name=f"retrieval-index-{i}", daemon=True,
                ).start()  # fmt: skip

    def _built(self, key: tuple, token: object, entry: IndexEntry | None, error: Exception | None) -> None:
        with self._lock:
            if self._queued.get(key) is token:  # else its pages were rewritten meanwhile: stale
                del self._queued[key]
                if error is not None:
                    self._failed[key] = error
                else:
                    self._indexes[key] = entry
                    self._write_key_table(key, entry)
                    self.builds += 1
            self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until no build is queued (True) or timeout seconds pass (False)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._queued, timeout)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queued)

    def stack(self, keys: tuple[tuple, ...], entries: list[IndexEntry]) -> _Stack:
        st = self._stacks.get(keys)
        if st is None or any(a is not b for a, b in zip(st.entries, entries)):
            if len(self._stacks) >= self.MAX_STACKS:
                self._stacks.pop(next(iter(self._stacks)))
            st = self._stacks[keys] = _Stack(
                entries,
                torch.stack([e.sizes for e in entries]),
                torch.stack([e.starts for e in entries]),
                torch.stack([e.slot_of for e in entries]),
                torch.stack([e.size_cum for e in entries]),
                max(int(e.sizes.max()) for e in entries),
            )
        return st

    def work(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer (fresh large tensors cost page faults every step)."""
        numel = math.prod(shape)
        buf = self._work.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._work[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)

    def invalidate(self, pages: list[int]) -> None:
        gone = set(pages)
        with self._lock:
            for d in (self._indexes, self._queued, self._failed):
                for key in [k for k in d if not gone.isdisjoint(k[0])]:
                    del d[key]
            for key in [k for k in self._stacks if any(not gone.isdisjoint(e[0]) for e in k)]:
                del self._stacks[key]
            self.device_stacks.invalidate(gone)
            self.fill_graphs.invalidate(gone)
            self._idle.notify_all()


LAYERS_PER_BUILD = 4  # layers clustered in one k-means call (its buffers grow with layers x KV heads)


def offload_index_build(
    host_kv: torch.Tensor, pages: list[int], num_tokens: int, sink: int, rope: RopeCache, device: str | None
):
    """A build() for HostIndexCache.prebuild: every layer's index of a chunk just offloaded to host
    pages `pages` of host_kv [pages, layers, 2, page_size, kv_heads, D]. On a builder thread it waits
    for the offload (a CUDA event recorded now, after the copy was queued), copies the keys to
    `device` (None: stays on the CPU) on a stream of its own, rotates them to local positions and
    clusters LAYERS_PER_BUILD layers' KV heads in one k-means (rope: a RopeCache on that device).
    Returns [(KeyIndex, local keys on the CPU in the pages' dtype)] per layer. Nothing is held on the
    device while the build waits in the queue; if the host pages are reused first, the offload that
    reuses them invalidates the queued build, so its result is dropped."""
    cuda = device is not None and torch.device(device).type == "cuda"
    offloaded = torch.cuda.Event() if cuda else None
    if offloaded is not None:
        offloaded.record()

    def build() -> list[tuple[KeyIndex, torch.Tensor]]:
        _, layers, _, _, kv_heads, d = host_kv.shape
        n = num_tokens
        out: list[tuple[KeyIndex, torch.Tensor]] = []
        with torch.inference_mode():
            if offloaded is not None:
                offloaded.synchronize()  # the host pages are read by this thread: the copy must be done
            for lo in range(0, layers, LAYERS_PER_BUILD):
                kl = host_kv[pages, lo : lo + LAYERS_PER_BUILD, 0]  # [pages, m, page_size, kv_heads, D]
                m = kl.shape[1]
                kl = kl.transpose(0, 1).reshape(m, -1, kv_heads, d)[:, :n].transpose(0, 1)  # [n, m, ...]
                # the layers' heads as one batch
                index, local = _local_index(kl.reshape(n, m * kv_heads, d), sink, rope, device)
                local = local.view(n, m, kv_heads, d)
                out += [(_layer_of(index, i, kv_heads), local[:, i]) for i in range(m)]
        return out

    return build


def _local_index(
    k: torch.Tensor, sink: int, rope: RopeCache, device: str | None
) -> tuple[KeyIndex, torch.Tensor]:
    """(KeyIndex, the keys at local positions on the CPU in k's dtype: kept, so a step does not turn
    every key again) from stored keys k [n, heads, D]. The keys are turned on rope's device and
    clustered on `device` (None: the CPU), on a CUDA stream of its own: a builder thread's kernels
    must not queue behind the model's step."""
    cuda = device is not None and torch.device(device).type == "cuda"
    with torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext():
        at = rope.cos.device
        local = apply_rope_ref(k.to(at).float(), torch.arange(k.shape[0], device=at), rope)
        index = build_key_index(local if device is None else local.to(device), sink=sink)  # back on the CPU
        return index, local.to(k.dtype).cpu()


def _layer_of(index: KeyIndex, i: int, kv_heads: int) -> KeyIndex:
    """Layer i's KV heads of an index built over several layers' heads at once (plain build)."""
    h = slice(i * kv_heads, (i + 1) * kv_heads)
    return KeyIndex(index.centroids[h], index.slots[h], index.offsets[h], index.list_of[h], index.sink,
                    index.num_keys)  # fmt: skip


def _build_loop(cache_ref: weakref.ref, jobs: queue.SimpleQueue) -> None:
    """A builder thread: builds queued indexes until its cache is collected (it holds the cache only
    while handing a result over). A job whose key was invalidated while queued is skipped."""
    while True:
        job = jobs.get()
        if job is None or not _run_build(cache_ref, *job):
            return
        del job  # (its build closure holds the cache: not while waiting for the next)


def _run_build(cache_ref: weakref.ref, key: tuple, build, token: object, many: bool = False) -> bool:
    """Builds one queued job unless it went stale; False when the cache is gone. A job is one key, or
    (many, from prebuild) a tuple of keys that one build() answers in order."""
    cache = cache_ref()
    if cache is None:
        return False
    keys = key if many else (key,)
    with cache._lock:
        live = [cache._queued.get(k) is token for k in keys]
    if any(live):
        entries: list = [None] * len(keys)
        error = None
        try:
            built = build() if many else [build()]
            entries = [IndexEntry(*b) if ok else None for b, ok in zip(built, live)]
            if cache.device is not None:
                _copy_to_device([e for e in entries if e is not None], cache.device)
        except Exception as e:  # raised in the step that next asks for it
            error = e
        _after_device_reads(cache.key_tables)
        for k, e, ok in zip(keys, entries, live):
            if ok:
                cache._built(k, token, e, error)
    return True


def _copy_to_device(entries: list[IndexEntry], device: str) -> None:
    """(a builder thread) the entries' index data onto the device, on a stream of this thread's, done
    before they are published. The step reads them on the device's default stream: recorded there, so
    their memory is not reused before the step's reads finish once an entry is dropped."""
    if torch.device(device).type != "cuda":
        return
    stream, main = torch.cuda.Stream(device), torch.cuda.default_stream(device)
    with torch.cuda.stream(stream):
        for e in entries:
            for t in e.on_device(device):
                t.record_stream(main)
    stream.synchronize()


def _drop_graphs(cache_ref: weakref.ref, stack) -> None:
    cache = cache_ref()
    if cache is not None and cache.fill_graphs is not None:
        cache.fill_graphs.drop_stack(stack)


def _after_device_reads(key_tables: torch.Tensor | None) -> None:
    """Before the CPU writes key tables: a step still running on the device may read the pages being
    rewritten (as their previous chunk's; the host tier's own copies are stream-ordered, these
    writes are not), so wait for the device. Index builds are rare: once per chunk and layer."""
    if key_tables is not None and key_tables.is_pinned():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _stop_builders(jobs: queue.SimpleQueue, threads: int) -> None:
    for _ in range(threads):
        jobs.put(None)


@dataclass
class _Group:
    """Host parts of a step attended together: the same tokens, sink and top-k (so the same shapes),
    query rows padded to the most any of them has."""

    parts: list[HostPart]
    n: int
    sink: int
    top_k: int
    exact: bool
    budget: float  # keys a query scans (approximate)
    m: int  # query rows per part (padded)
    rows: torch.Tensor  # [G, m] the query rows of each part (padding repeats its first)
    cos: torch.Tensor  # [G, 1, 1, rotary_dim // 2]: turns the queries back by each part's start_pos
    sin: torch.Tensor
    pages: torch.Tensor  # [G, pages] host page ids of each part (padded)
    keep: torch.Tensor  # [rows] the real rows among the G * m
    pairs: torch.Tensor  # [rows] their pair ids (o / lse rows)
    # parts over the same chunk (None: no repeats): an exact group reads it once for all of them
    # (attend_every_key); the device fill stacks its index data once
    same_chunk: tuple[torch.Tensor, torch.Tensor] | None = None


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
        device_rope: RopeCache | None = None,
    ):
        self.parts, self.host_kv, self.rope = parts, host_kv, rope
        self.sm_scale, self.options, self.indexes = sm_scale, options, indexes
        self.device_rope = device_rope  # the RoPE cache on the queries' device: fill there (DeviceFill)
        self._groups: list[_Group] | None = None
        self._device_fill: DeviceFill | None = None

    def _builder(self, k: torch.Tensor, sink: int):
        """Builds (KeyIndex, the keys at local positions in k's dtype: kept, so a step does not turn
        every key again; as much memory as the chunk's keys) from keys k [n, kv_heads, D] as stored."""
        return lambda: _local_index(k, sink, self.rope, self.options.build_device)

    def _part_kv(self, part: HostPart, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = part.pages  # a run of consecutive host pages (the usual case) is a view, not a copy
        if pages == tuple(range(pages[0], pages[0] + len(pages))):  # (not only the ends: (3, 9, 5) isn't)
            kv = self.host_kv[pages[0] : pages[-1] + 1, layer]  # [pages, 2, page_size, kv_heads, D]
        else:
            kv = self.host_kv[list(pages), layer]
        n = part.num_tokens
        return kv[:, 0].reshape(-1, *kv.shape[3:])[:n], kv[:, 1].reshape(-1, *kv.shape[3:])[:n]

    def _shape(self, part: HostPart) -> tuple[int, int, bool, float]:
        """(sink, top_k, exact, budget: the keys a query scans) of a part."""
        n = part.num_tokens
        sink = min(self.options.sink, n - 1)
        top_k = self.options.top_k if part.top_k is None else part.top_k
        # scan at least 2 x top_k keys: top-k out of fewer candidates would be no choice at all (kept a
        # whole number: a list ending exactly at the budget is scanned, not lost to rounding)
        budget = float(min(n - sink, max(self.options.scan * (n - sink), 2 * top_k)))
        exact = top_k >= n - sink or (self.options.exact_prefill and len(part.rows) > 1)
        return sink, top_k, exact, budget

    def _builder_of(self, part: HostPart, layer: int, sink: int):
        return lambda: self._builder(self._part_kv(part, layer)[0], sink)()

    def _entry(self, part: HostPart, layer: int, sink: int) -> IndexEntry:
        """The part's index, built now if missing (the reference path)."""
        key = (part.pages, part.num_tokens, layer, sink)
        return self.indexes.get(key, self._builder_of(part, layer, sink))

    def fill_reference(self, layer: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        """`fill` part by part through retrieval_attention_ref (the torch reference of the batched fill)."""
        rd, half = self.rope.rotary_dim, self.rope.rotary_dim // 2
        qc = q.float().cpu()
        for part in self.parts:
            m = len(part.rows)
            qp = qc[part.rows.start : part.rows.stop]
            cos, sin = self.rope.cos[part.start_pos, :half], self.rope.sin[part.start_pos, :half]
            q1, q2 = qp[..., :half], qp[..., half:rd]  # turned back by start_pos: the segment's frame
            qp = torch.cat([q1 * cos + q2 * sin, q2 * cos - q1 * sin, qp[..., rd:]], dim=-1)
            k, v = self._part_kv(part, layer)
            sink, top_k, exact, budget = self._shape(part)
            index = local = None
            if not exact:
                entry = self._entry(part, layer, sink)
                index, local = entry.index, entry.local()
            scan = budget / (part.num_tokens - sink)
            po, pl = retrieval_attention_ref(qp, k, v, index, self.rope, self.sm_scale, top_k, scan, local)
            o[part.pair0 : part.pair0 + m] = po.to(o.device)
            lse[part.pair0 : part.pair0 + m] = pl.to(lse.device)

    def _plan(self) -> list[_Group]:
        """Groups the parts by shape (the same for every layer of the step)."""
        by_shape: dict[tuple, list[HostPart]] = {}
        for part in self.parts:
            by_shape.setdefault((part.num_tokens, *self._shape(part)), []).append(part)
        return [
            self._group(parts, n, sink, top_k, exact, budget)
            for (n, sink, top_k, exact, budget), parts in by_shape.items()
        ]

    def _group(
        self, parts: list[HostPart], n: int, sink: int, top_k: int, exact: bool, budget: float
    ) -> _Group:
        half = self.rope.rotary_dim // 2
        m = max(len(p.rows) for p in parts)
        rows = torch.tensor([[p.rows[min(i, len(p.rows) - 1)] for i in range(m)] for p in parts])
        starts = torch.tensor([p.start_pos for p in parts])
        npages = max(len(p.pages) for p in parts)
        pages = torch.tensor([list(p.pages) + [p.pages[0]] * (npages - len(p.pages)) for p in parts])
        keep = torch.tensor([g * m + i for g, p in enumerate(parts) for i in range(len(p.rows))])
        pairs = torch.tensor([p.pair0 + i for p in parts for i in range(len(p.rows))])
        cos = self.rope.cos[starts, :half].view(len(parts), 1, 1, half)
        sin = self.rope.sin[starts, :half].view(len(parts), 1, 1, half)
        same = same_chunk_parts([p.pages for p in parts])
        return _Group(parts, n, sink, top_k, exact, budget, m, rows, cos, sin, pages, keep, pairs, same)

    def _ready_groups(self, g: _Group, layer: int) -> list[tuple[_Group, list[IndexEntry] | None]]:
        """An approximate group as (group, its parts' index entries), or, while some parts' indexes
        are still being built off the step, those parts as an exact group (entries None) beside the rest."""
        entries = [
            self.indexes.ready((p.pages, p.num_tokens, layer, g.sink), self._builder_of(p, layer, g.sink))
            for p in g.parts
        ]
        if all(e is not None for e in entries):
            return [(g, entries)]
        shape = (g.n, g.sink, g.top_k)
        waiting = [p for p, e in zip(g.parts, entries) if e is None]
        out = [(self._group(waiting, *shape, True, g.budget), None)]
        ready = [(p, e) for p, e in zip(g.parts, entries) if e is not None]
        if ready:
            sub = self._group([p for p, _ in ready], *shape, False, g.budget)
            out.append((sub, [e for _, e in ready]))
        return out

    def fill(self, layer: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Writes the host parts of o [P, H, D] / lse [P, H] (fp32) from q [T, H, D] rotated at the
        rows' positions: every part of a shape at once (a few batched ops over [parts, heads, ...])."""
        if not self.parts:
            return
        if not self.host_kv.is_contiguous():
            return self.fill_reference(layer, q, o, lse)
        if q.is_cuda and self.device_rope is not None and self.host_kv.is_pinned():
            return self.fill_device(layer, q, o, lse)
        qc = q.float().cpu()
        outs, lses, pairs = [], [], []
        for g, entries in self._todo(layer):
            qg = part_queries(qc[g.rows], g.cos, g.sin, self.rope, self.host_kv.shape[4])
            if entries is None:
                go, gl = self._exact(g, layer, qg)
            else:
                if not all(e.batched for e in entries):
                    self._fill_parts_reference(g, layer, q, o, lse)
                    continue
                go, gl = self._approx(g, layer, qg, entries)
            go, gl = part_rows(go, gl, g.m, g.keep)
            outs.append(go)
            lses.append(gl)
            pairs.append(g.pairs)
        if outs:
            idx = torch.cat(pairs).to(o.device)
            o.index_copy_(0, idx, torch.cat(outs).to(o.device))
            lse.index_copy_(0, idx, torch.cat(lses).to(lse.device))

    def _todo(self, layer: int) -> list[tuple[_Group, list[IndexEntry] | None]]:
        """The step's groups for one layer: exact ones (entries None), and approximate ones with their
        parts' index entries (parts whose index is still being built: an exact group beside them)."""
        if self._groups is None:
            self._groups = self._plan()
        todo: list[tuple[_Group, list[IndexEntry] | None]] = [(g, None) for g in self._groups if g.exact]
        for g in self._groups:
            if not g.exact:
                todo += self._ready_groups(g, layer)
        return todo

    def _fill_parts_reference(self, g: _Group, layer: int, q, o, lse) -> None:
        """A group whose indexes the batched fills do not read (two-level probes): part by part."""
        for p in g.parts:
            one = HostAttention([p], self.host_kv, self.rope, self.sm_scale, self.options, self.indexes)
            one.fill_reference(layer, q, o, lse)

    def fill_device(self, layer: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        """`fill` on q's device (device_rope's), reading the host tier in place (DeviceFill); on the
        CPU it runs the same ops (what tests compare with `fill`)."""
        if self.device_rope is None:
            raise ValueError("fill_device needs device_rope (the RoPE cache on the queries' device)")
        if self._device_fill is None:
            self._device_fill = DeviceFill(self, self.device_rope, q.device)
        self._device_fill.fill(layer, q, o, lse)

    def _exact(self, g: _Group, layer: int, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key of each part: (o [G, kv_heads, Q, d], lse [G, kv_heads, Q])."""
        kv = self.host_kv[:, layer]
        return attend_every_key(kv, g.pages, g.n, qg, self.rope, self.sm_scale, WORK_ELEMENTS, g.same_chunk)

    def _approx(
        self, g: _Group, layer: int, qg: torch.Tensor, entries: list[IndexEntry]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sink keys + each query's top-k of the lists it scans (search_key_index's semantics): probe
        every list, take lists best first while they hold at most the budget (at least one), score
        their keys exactly, keep the top-k; (o [G, kv_heads, Q, d], lse [G, kv_heads, Q])."""
        G, kvh, Q, d = qg.shape
        n, sink, cache = g.n, g.sink, self.indexes
        keys = tuple((p.pages, n, layer, sink) for p in g.parts)
        st = cache.stack(keys, entries)
        lists = entries[0].lists
        # list scores [G, kv_heads, Q, lists]: one product per part (its probes are its own tensors)
        scores = torch.stack([
            torch.matmul(qg[i], e.probes_t) if e.bias is None else torch.baddbmm(e.bias, qg[i], e.probes_t)
            for i, e in enumerate(entries)
        ])  # fmt: skip
        # at most t lists fit the budget: the t smallest already fill it (and always the best one)
        t = max(1, min(lists, int((st.size_cum <= g.budget).sum(-1).max())))
        order = _largest(scores, t, ordered=True)  # [G, kvh, Q, t] best first
        size = st.sizes.unsqueeze(2).expand(G, kvh, Q, lists).gather(3, order)
        take = size.cumsum(-1) <= g.budget
        take[..., 0] = True
        size = size * take
        ends = size.cumsum(-1)  # candidate c of a query is in its list j where ends[j - 1] <= c < ends[j]
        c = max(int(g.budget), st.max_size, g.top_k)
        cand = torch.arange(c).expand(G, kvh, Q, c).contiguous()
        j = torch.searchsorted(ends, cand, right=True)
        valid = j < t
        j.clamp_(max=t - 1)
        first = st.starts.unsqueeze(2).expand(G, kvh, Q, lists).gather(3, order) - (ends - size)
        pos = (first.gather(3, j) + cand).masked_fill_(~valid, 0) + sink  # table positions
        sinks = torch.arange(sink).expand(G, kvh, Q, sink)
        cols = torch.cat([sinks, pos], -1)  # [G, kvh, Q, sink + c]
        rows = cols + (torch.arange(kvh) * n).view(1, kvh, 1, 1)
        # the candidates' scores, part by part (a part's keys are its own tensor) and in blocks of rows
        # (one block's fp32 keys stay in cache, where all parts' at once would not; and the buffers
        # stay small however many query rows a part has)
        w, hq = sink + c, kvh * Q
        b = max(1, min(hq, WORK_ELEMENTS // (w * d)))
        kb = cache.work("keys", (b * w, d), entries[0].table.dtype)
        kf = cache.work("keys32", (b, w, d), torch.float32)
        s = torch.empty(G, hq, w)
        qv, rows = qg.view(G, hq, 1, d), rows.view(G, hq * w)
        for i, e in enumerate(entries):  # (a product per key: faster here than bmm's matrix-vector)
            for r in range(0, hq, b):
                nb = min(hq, r + b) - r
                torch.index_select(e.table.view(-1, d), 0, rows[i, r * w : (r + nb) * w], out=kb[: nb * w])
                kfr = kf[:nb].copy_(kb[: nb * w].view(nb, w, d)).mul_(qv[i, r : r + nb])
                torch.sum(kfr, -1, out=s[i, r : r + nb])
        s = s.view(G, kvh, Q, w)
        cand_s = s[..., sink:].masked_fill(~valid, float("-inf"))
        found = _largest(cand_s, min(g.top_k, n - sink), ordered=False)
        s = torch.cat([s[..., :sink], cand_s.gather(3, found)], -1) * self.sm_scale
        cols = torch.cat([sinks, cols[..., sink:].gather(3, found)], -1)  # [G, kvh, Q, sink + k]
        slots = st.slot_of.unsqueeze(2).expand(G, kvh, Q, n).gather(3, cols)
        w = cols.shape[-1]
        vrows = kv_rows(self.host_kv.shape, g.pages, layer, slots, 1).view(G, hq * w)
        p = torch.softmax(s, -1).view(G, hq, 1, w)
        b = max(1, min(hq, WORK_ELEMENTS // (w * d)))
        vb = cache.work("values", (b * w, d), self.host_kv.dtype)
        vf = cache.work("values32", (b, w, d), torch.float32)
        o = torch.empty(G, hq, 1, d)
        flat = self.host_kv.view(-1, d)
        for i in range(G):
            for r in range(0, hq, b):
                nb = min(hq, r + b) - r
                torch.index_select(flat, 0, vrows[i, r * w : (r + nb) * w], out=vb[: nb * w])
                vfr = vf[:nb].copy_(vb[: nb * w].view(nb, w, d))
                torch.bmm(p[i, r : r + nb], vfr, out=o[i, r : r + nb])
        return o.view(G, kvh, Q, d), torch.logsumexp(s, -1)


def _largest(x: torch.Tensor, k: int, ordered: bool) -> torch.Tensor:
    """Indices of the k largest of x [..., n] (fp32, no NaN) along the last dim, best first if ordered
    (ties: the lower index first). Like x.topk(k).indices, but 2-3x faster on the CPU: the scores,
    mapped to int32 in descending order and packed with their index into int64, through numpy's
    partition / sort."""
    n = x.shape[-1]
    b = x.contiguous().view(torch.int32)
    key = ~(b ^ ((b >> 31) & 0x7FFFFFFF))  # a float's order is its bits' (negatives: reversed); ~: descending
    packed = ((key.long() << 32) | torch.arange(n)).numpy()
    if k < n:
        packed = np.partition(packed, k - 1, -1)[..., :k]
    if ordered:
        packed = np.sort(packed, -1)
    return torch.from_numpy(packed & 0xFFFFFFFF)


def host_rows(parts: list[list[HostPart]], qo_indptr: np.ndarray) -> list[HostPart]:
    """Sets each item's parts' query rows from the step's layout; returns them all, in order."""
    out = []
    for i, item_parts in enumerate(parts):
        for part in item_parts:
            part.rows = range(int(qo_indptr[i]), int(qo_indptr[i + 1]))
            out.append(part)
    return out
