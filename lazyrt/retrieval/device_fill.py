"""Retrieval attention's host parts computed on the worker's device, reading the host tier in place.

On CUDA the host tier is pinned memory, which the GPU reads directly over PCIe (unified virtual
addressing): `device_view` wraps it as a CUDA tensor without copying, so a step's candidate keys and
chosen values are gathered by the device's own index_select, and nothing of a step goes to the CPU:
no synchronization, no per-layer round trip, no CPU scan of thousands of keys per layer (the CPU
fill, HostAttention._approx, spent ~0.9 ms a chunk-layer on an H100 host's 16 cores: 0.36 s a token
for 12 host documents). The reads are the cost, and their shape sets it: on an H100, single
scattered 256-byte rows come over the bus at ~11 GB/s, runs of 4 consecutive rows at ~35, runs of
16 at ~51, the rate of a contiguous copy (benchmarks/experiments/zero_copy_gather.py). So the
candidate keys are read from the index tables (HostIndexCache.key_tables_for: each chunk's keys
already turned to local positions, list by list, over its host pages), where a scanned list is a
run of rows; the chosen values (the top-k, scattered) from the host pages; the sink keys and
values, the same every step, are kept on the device with the group's index data.

Same semantics as the CPU fill (tests compare the two): per (part, KV head, query row) the lists
best first by centroid score while they hold at most the scan budget, their keys scored exactly,
the top-k kept, softmax over the sink keys and the top-k. A group's index data (centroids, list
sizes and starts, slots in list order) is stacked on the device once per distinct chunk and layer
(DeviceStacks; a decode step asks for the same groups every step). Parts of several query rows (a
question's prefill, RetrievalOptions.exact_prefill) attend every key: their pages read whole.

Runs on the CPU as well (the same torch ops; `device_view` returns the tensor itself): that is how
the CPU tests check it against the CPU fill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lazyrt.kernels.rope import RopeCache
from lazyrt.retrieval.key_index import KEYS_PER_LIST
from lazyrt.retrieval.part_layout import attend_every_key, part_queries, part_rows

# host_attention.py imports this module: its HostAttention, _Group and IndexEntry are typed Any here
HostAttention = _Group = IndexEntry = Any

# the fill's gathered keys / values hold at most this many elements at once (fp32: 256 MB)
DEVICE_WORK_ELEMENTS = 1 << 26
DEVICE_STACK_BYTES = 4 << 30  # stacked index data kept on the device (oldest dropped past this)
# share_lists: a KV head's shared set scans this many times one query head's budget. On the default
# model's real keys (benchmarks/experiments/retrieval_recall.py --shared, 3 query heads a KV head),
# sets ranked by the sum of the heads' scores at 2x the budget find 0.90 of the top-10 (per-head
# search at 5%: 0.92) reading 0.68x the keys; at 1x they lose ~0.1 (lists of 4 keys, two texts).
SHARED_BUDGET = 2.0


def reserved_device_bytes(host_tokens: int, layers: int, kv_heads: int, head_dim: int) -> int:
    """Device memory the device fill can hold for a host tier of host_tokens tokens (what a KV pool
    sized from free memory must leave): every host chunk-layer's index data (IndexEntry.on_device:
    bf16 centroids, one a KEYS_PER_LIST keys, list sizes and starts, a slot per key), the stacks of it
    (up to DEVICE_STACK_BYTES) and one fill's work buffers (keys / scores of DEVICE_WORK_ELEMENTS)."""
    per_key = 8 + (head_dim * 2 + 2 * 8) / KEYS_PER_LIST  # slot + a share of a list's centroid, size, start
    index = int(host_tokens * layers * kv_heads * per_key)
    return index + min(index, DEVICE_STACK_BYTES) + 4 * DEVICE_WORK_ELEMENTS * 4


class _PinnedView:
    """__cuda_array_interface__ over a pinned host tensor's bytes: with unified addressing its host
    address is valid on the device (torch.as_tensor wraps it without a copy; the view keeps it alive)."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.__cuda_array_interface__ = {
            "shape": (t.numel() * t.element_size(),),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t (contiguous) as a tensor on `device` without copying: itself if already there; a pinned
    CPU tensor as a CUDA tensor that reads host memory over the bus."""
    if t.device == device or device.type != "cuda":
        return t
    if not t.is_contiguous() or not t.is_pinned():
        raise ValueError("device_view needs a contiguous, pinned host tensor")
    raw = torch.as_tensor(_PinnedView(t), device=device)
    return raw.view(t.dtype).view(t.shape)


def kv_rows(
    shape: torch.Size, pages: torch.Tensor, layer: int, slots: torch.Tensor, which: int
) -> torch.Tensor:
    """Rows of host_kv.view(-1, head_dim) holding (slot, KV head) of each part: host_kv's shape
    [pages, layers, 2, page_size, kv_heads, D]; pages [G, pages] the parts' host page ids; slots
    [G, kv_heads, ...] chunk slots; which 0: keys, 1: values. Same shape as slots."""
    _, layers, _, ps, kvh, _ = shape
    G = slots.shape[0]
    page = pages.gather(1, (slots // ps).view(G, -1)).view(slots.shape)
    head = torch.arange(kvh, device=slots.device).view(1, kvh, *([1] * (slots.dim() - 2)))
    return ((page * layers + layer) * 2 + which) * (ps * kvh) + (slots % ps) * kvh + head


def table_rows(shape: torch.Size, pages: torch.Tensor, layer: int, pos: torch.Tensor) -> torch.Tensor:
    """Rows of key_tables.view(-1, head_dim) holding table position `pos` [G, kv_heads, ...] of each
    part's (KV head's) index table: key_tables' shape [pages, layers, kv_heads, page_size, D] (a
    table's positions in order over its chunk's host pages `pages` [G, pages])."""
    _, layers, kvh, ps, _ = shape
    G = pos.shape[0]
    page = pages.gather(1, (pos // ps).view(G, -1)).view(pos.shape)
    head = torch.arange(kvh, device=pos.device).view(1, kvh, *([1] * (pos.dim() - 2)))
    return ((page * layers + layer) * kvh + head) * ps + pos % ps


@dataclass
class DeviceStack:
    """One layer's index data of a group's distinct chunks, stacked on the device (a batch whose
    requests share documents has many parts per chunk; a part reads its chunk's row)."""

    entries: list
    centroids: torch.Tensor  # [U, kv_heads, lists, D] bf16 (the plain build's), else fp32
    sizes: torch.Tensor  # [U, kv_heads, lists] int64
    starts: torch.Tensor  # [U, kv_heads, lists] int64
    slot_of: torch.Tensor  # [U, kv_heads, n] int64
    lists_in_budget: int  # the most lists any query can take (the t smallest already fill the budget)
    max_size: int
    nbytes: int
    # the chunks' sink keys (fp32, turned) and values [U, kv_heads, sink, d]: read from the host the
    # first time the stack is used (the fill's _sinks; counted in nbytes as if present)
    sink_k: torch.Tensor | None = None
    sink_v: torch.Tensor | None = None


class DeviceStacks:
    """DeviceStack per (distinct chunks, budget, device), newest kept, at most DEVICE_STACK_BYTES:
    stacked on the device from each index's own device copy (IndexEntry.on_device), so a batch of
    other requests over the same documents finds it, and a new one costs no host-to-device copy."""

    def __init__(self, on_drop=None) -> None:
        """on_drop(stack): called for each stack dropped (FillGraphs lets go of the graphs reading it,
        so the memory is given back and DEVICE_STACK_BYTES bounds it)."""
        self._stacks: OrderedDict[tuple, DeviceStack] = OrderedDict()
        self._bytes = 0
        self._on_drop = on_drop or (lambda st: None)

    def get(self, keys: tuple, entries: list[IndexEntry], budget: float, device) -> DeviceStack:
        """The stack of the parts' distinct chunks (part keys `keys`, their index entries), in the
        order of their first parts (chunk_rows gives each part's row)."""
        part_of: dict[tuple, int] = {}
        for g, k in enumerate(keys):
            part_of.setdefault(k, g)
        ukeys = tuple(part_of)
        uentries = [entries[g] for g in part_of.values()]
        key = (ukeys, budget, str(device))
        st = self._stacks.get(key)
        if st is None or any(a is not b for a, b in zip(st.entries, uentries)):
            st = self._stack(uentries, budget, device)
            self._put(key, st)
        else:
            self._stacks.move_to_end(key)
        return st

    @staticmethod
    def _stack(entries: list[IndexEntry], budget: float, device) -> DeviceStack:
        on = [e.on_device(device) for e in entries]
        cent, sizes, starts, slot_of = (torch.stack([o[i] for o in on]) for i in range(4))
        size_cum = torch.stack([e.size_cum for e in entries])  # (CPU: the budget's list count, here)
        t = max(1, min(entries[0].lists, int((size_cum <= budget).sum(-1).max())))
        max_size = max(int(e.sizes.max()) for e in entries)
        nbytes = sum(x.numel() * x.element_size() for x in (cent, sizes, starts, slot_of))
        U, kvh, _, d = cent.shape  # + the sink keys (fp32) and values (at most 4 bytes) it will hold
        nbytes += U * kvh * entries[0].sink * d * 8
        return DeviceStack(list(entries), cent, sizes, starts, slot_of, t, max_size, nbytes)

    def _put(self, key: tuple, st: DeviceStack) -> None:
        old = self._stacks.pop(key, None)
        if old is not None:
            self._drop(old)
        while self._stacks and self._bytes + st.nbytes > DEVICE_STACK_BYTES:
            self._drop(self._stacks.popitem(last=False)[1])
        self._stacks[key] = st
        self._bytes += st.nbytes

    def _drop(self, st: DeviceStack) -> None:
        self._bytes -= st.nbytes
        self._on_drop(st)

    def invalidate(self, gone: set[int]) -> None:
        for key in [k for k in self._stacks if any(not gone.isdisjoint(e[0]) for e in k[0])]:
            self._drop(self._stacks.pop(key))


def _ids(entries: list | None) -> tuple | None:
    return None if entries is None else tuple(map(id, entries))


@dataclass
class _FillGraph:
    graph: Any  # torch.cuda.CUDAGraph
    q: torch.Tensor  # its input: the step's queries are copied here
    idx: torch.Tensor  # its outputs: pair ids, o rows, lse rows
    out: torch.Tensor
    lse: torch.Tensor
    keep: list  # what it reads (index entries, group tensors; stacks through the entries): kept alive


class FillGraphs:
    """CUDA graphs of the device fill, one per (layer, the step's host parts, their indexes). A
    decode step's fill is ~60 small ops a layer whose launches cost more host time than the device
    spends on them (an H100 at batch 1: ~2.7 ms of host a layer for ~1.3 of device work,
    benchmarks/experiments/device_fill_cost.py), and decode repeats the same parts step after step:
    the second time a (layer, parts) comes, its fill is captured after the eager run; from the third
    it is replayed (its queries copied in, its outputs copied out: 4 launches). Graphs share one memory
    pool (replayed one at a time, their outputs read at once); the oldest beyond MAX are dropped, and
    those over pages that now hold another chunk (invalidate)."""

    MAX = 256

    def __init__(self) -> None:
        self._graphs: OrderedDict[tuple, _FillGraph] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._pool = None
        self._stream = None
        self.captures = 0
        self.replays = 0

    def replay(self, key: tuple, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> bool:
        fg = self._graphs.get(key)
        if fg is None:
            return False
        self._graphs.move_to_end(key)
        fg.q.copy_(q)
        fg.graph.replay()
        DeviceFill._write(o, lse, (fg.idx, fg.out, fg.lse))
        self.replays += 1
        return True

    def seen_before(self, key: tuple) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        while len(self._seen) > 4 * self.MAX:
            self._seen.popitem(last=False)
        return False

    def capture(self, key: tuple, compute, q: torch.Tensor, keep: list) -> None:
        """Captures compute(static q) -> (idx, out, lse) on a side stream (no device sync, no gc:
        a capture happens inside a step). Thread-local capture mode: index builder threads go on."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(q.device)
        static_q = q.clone()
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(self._stream):
            if not self.captures:  # first use of this stream (library handles, workspaces): warm it
                compute(static_q)
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                res = compute(static_q)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(q.device).wait_stream(self._stream)
        if res is None:
            return
        self._graphs[key] = _FillGraph(graph, static_q, *res, keep)
        self.captures += 1
        while len(self._graphs) > self.MAX:
            self._graphs.popitem(last=False)

    def invalidate(self, gone: set[int]) -> None:
        """Drops the graphs over any of the host pages `gone` (they now hold another chunk)."""
        for key in [k for k in self._graphs if any(not gone.isdisjoint(p[2]) for p in k[1])]:
            del self._graphs[key]
        self._seen.clear()

    def drop_stack(self, st: DeviceStack) -> None:
        """Drops the graphs that read `st` (DeviceStacks dropped it: its memory goes back with them)."""
        for key in [k for k, fg in self._graphs.items() if any(x is st for x in fg.keep[2])]:
            del self._graphs[key]


@dataclass
class _GroupOnDevice:
    rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    pages: torch.Tensor
    keep: torch.Tensor
    pairs: torch.Tensor
    same_chunk: tuple[torch.Tensor, torch.Tensor] | None  # (members [U, c], where [G]): _Group's
    # from it, where parts share chunks (else None): each part's chunk (its row in the group's
    # DeviceStack, in the order of the chunks' first parts) and each chunk's first part
    chunk_rows: torch.Tensor | None
    first_parts: torch.Tensor | None


class DeviceFill:
    """HostAttention.fill on q's device: `fill(layer, q, o, lse)` with q, o, lse on the device
    (rope: the RoPE cache on that device)."""

    def __init__(self, ha: HostAttention, rope: RopeCache, device: torch.device):
        self.ha, self.rope, self.device = ha, rope, device
        self.kv = device_view(ha.host_kv, device)
        self.tables = device_view(ha.indexes.key_tables_for(ha.host_kv), device)
        self._on_device: dict[int, tuple[_Group, _GroupOnDevice]] = {}
        self._signature: tuple | None = None

    def _dev(self, g: _Group) -> _GroupOnDevice:
        hit = self._on_device.get(id(g))
        if hit is not None and hit[0] is g:
            return hit[1]
        to = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        same = chunk_rows = first_parts = None
        if g.same_chunk is not None:
            members, where = g.same_chunk
            same = (to(members), to(where))
            chunk_rows, first_parts = same[1] // members.shape[1], same[0][:, 0]
        parts = (to(g.rows), to(g.cos), to(g.sin), to(g.pages), to(g.keep), to(g.pairs))
        d = _GroupOnDevice(*parts, same, chunk_rows, first_parts)
        self._on_device[id(g)] = (g, d)
        return d

    def fill(self, layer: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        ha = self.ha
        todo = ha._todo(layer)
        readable = [(g, e) for g, e in todo if e is None or all(x.batched and x.bias is None for x in e)]
        if len(readable) < len(todo):
            kept = {id(g) for g, _ in readable}
            for g, _ in todo:  # indexes this path does not read: part by part, on the CPU
                if id(g) not in kept:
                    ha._fill_parts_reference(g, layer, q, o, lse)
            return self._write(o, lse, self._compute(layer, q, readable))
        graphs = ha.indexes.fill_graphs if q.is_cuda else None
        if graphs is None:
            return self._write(o, lse, self._compute(layer, q, todo))
        if self._signature is None:  # what the step's parts are (the same every layer)
            parts = ha.parts
            self._signature = tuple(
                (p.rows.start, p.rows.stop, p.pages, p.num_tokens, p.start_pos, p.pair0, p.top_k)
                for p in parts
            )
        key = (layer, self._signature, q.shape, q.dtype, o.dtype, tuple(_ids(e) for _, e in todo))
        if graphs.replay(key, q, o, lse):
            return
        self._write(o, lse, self._compute(layer, q, todo))
        # a repeated step (decode): capture it for the next ones; not while index builds run: a builder
        # thread's device-wide sync would break the capture (and be refused)
        if graphs.seen_before(key) and not ha.indexes.pending:
            stacks: list[DeviceStack] = []
            keep = [todo, [self._dev(g) for g, _ in todo], stacks]
            graphs.capture(key, lambda static_q: self._compute(layer, static_q, todo, stacks), q, keep)

    @staticmethod
    def _write(o: torch.Tensor, lse: torch.Tensor, res) -> None:
        if res is not None:
            idx, out, lse_out = res
            o.index_copy_(0, idx, out.to(o.dtype))
            lse.index_copy_(0, idx, lse_out.to(lse.dtype))

    def _compute(self, layer: int, q: torch.Tensor, todo: list, stacks: list | None = None):
        """(pair ids, o rows, lse rows) of the groups in `todo` (None: no group); the device stacks
        read are appended to `stacks` (a graph keeps them)."""
        qd = q.float()
        outs, lses, pairs = [], [], []
        for g, entries in todo:
            dev = self._dev(g)
            qg = part_queries(qd[dev.rows], dev.cos, dev.sin, self.rope, self.kv.shape[4])
            if entries is None:
                go, gl = self._exact(g, dev, layer, qg)
            else:
                go, gl = self._approx(g, dev, layer, qg, entries, stacks)
            go, gl = part_rows(go, gl, g.m, dev.keep)
            outs.append(go)
            lses.append(gl)
            pairs.append(dev.pairs)
        if not outs:
            return None
        return torch.cat(pairs), torch.cat(outs), torch.cat(lses)

    def _attend(
        self, pages: torch.Tensor, layer: int, qg: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
        slot_of: torch.Tensor, top_k: int, sink_k: torch.Tensor | None, sink_v: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Scores the candidate keys at index table positions `pos` [G, kv_heads, R, w] of the parts
        (their chunks on host pages `pages` [G, pages]; slot_of [G, kv_heads, n] each table position's
        chunk slot), each of the R sets for Q / R query rows of qg [G, kv_heads, Q, d] (those not
        `valid` [G, kv_heads, R, w] are no candidates), keeps each row's top-k, and attends to them and
        to the sink keys (sink_k [G, kv_heads, sink, d] fp32 at local positions, sink_v the values;
        None: no sink): (o [G, kvh, Q, d], lse [G, kvh, Q])."""
        G, kvh, Q, d = qg.shape
        R, w = pos.shape[2], pos.shape[3]
        heads = Q // R
        rows = table_rows(self.tables.shape, pages, layer, pos)  # keys turned already, a list's in a run
        k = self.tables.view(-1, d).index_select(0, rows.view(-1)).view(G, kvh, R, w, d).float()
        s = torch.matmul(qg.view(G, kvh, R, heads, d), k.transpose(-1, -2))  # [G, kvh, R, heads, w]
        del k
        s = s.masked_fill_(~valid.unsqueeze(3), float("-inf")).view(G, kvh, Q, w)
        found = s.topk(min(top_k, w), -1, sorted=False).indices
        if heads > 1:  # rows share a set: their top-k as masks over it, the union's values read once
            keep = torch.zeros_like(s, dtype=torch.bool).scatter_(3, found, True)
            s = s.masked_fill_(~keep, float("-inf"))
            u = heads * found.shape[-1]
            if u < w:  # the union of the heads' top-k (padded with keys none of them kept: -inf)
                union = keep.view(G, kvh, R, heads, w).any(3).float().topk(u, -1, sorted=False).indices
                s = s.view(G, kvh, R, heads, w).gather(4, union.unsqueeze(3).expand(G, kvh, R, heads, u))
                s, pos = s.view(G, kvh, Q, u), pos.gather(3, union)
        else:
            s, pos = s.gather(3, found), pos.gather(3, found)
        sink = 0 if sink_k is None else sink_k.shape[2]
        if sink:
            s = torch.cat([torch.matmul(qg, sink_k.transpose(-1, -2)), s], -1)
        s = s * self.ha.sm_scale
        p = torch.softmax(s, -1)
        w = pos.shape[-1]
        slots = slot_of.unsqueeze(2).expand(G, kvh, R, slot_of.shape[-1]).gather(3, pos)
        v = self.kv.view(-1, d).index_select(0, kv_rows(self.kv.shape, pages, layer, slots, 1).view(-1))
        o = torch.matmul(p[..., sink:].view(G, kvh, R, heads, w), v.view(G, kvh, R, w, d).float())
        o = o.view(G, kvh, Q, d)
        if sink:
            o += torch.matmul(p[..., :sink], sink_v.float())
        return o, torch.logsumexp(s, -1)

    def _sinks(self, pages: torch.Tensor, layer: int, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `sink` keys (fp32, at local positions: the first `sink` of each index table) and
        values of chunks on host pages `pages` [U, pages]: ([U, kv_heads, sink, d], as stored)."""
        U, kvh, d = pages.shape[0], self.kv.shape[4], self.kv.shape[5]
        first = torch.arange(sink, device=pages.device).expand(U, kvh, sink)  # (sink i: slot i)
        rows = table_rows(self.tables.shape, pages, layer, first)
        k = self.tables.view(-1, d).index_select(0, rows.view(-1))
        v = self.kv.view(-1, d).index_select(0, kv_rows(self.kv.shape, pages, layer, first, 1).view(-1))
        return k.view(U, kvh, sink, d).float(), v.view(U, kvh, sink, d)

    def _exact(
        self, g: _Group, dev: _GroupOnDevice, layer: int, qg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key of each part, its pages read whole (a contiguous block each), once for all the
        parts over the same chunk."""
        kv, work = self.kv[:, layer], DEVICE_WORK_ELEMENTS
        return attend_every_key(kv, dev.pages, g.n, qg, self.rope, self.ha.sm_scale, work, dev.same_chunk)

    def _approx(
        self, g: _Group, dev: _GroupOnDevice, layer: int, qg: torch.Tensor, entries: list[IndexEntry],
        stacks: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """HostAttention._approx's lists, candidates and top-k, from the device stack; with
        RetrievalOptions.share_lists the query heads of a KV head (one token) share one candidate set:
        lists ranked by the sum of their scores, SHARED_BUDGET x one head's budget (each head still
        keeps its own top-k of the candidates; the set's keys and values are read once)."""
        G, kvh, Q, d = qg.shape
        n, sink, budget = g.n, g.sink, g.budget
        shared = self.ha.options.share_lists
        if shared:  # one set for the KV head's query heads: twice one head's budget (module docstring)
            budget = min(float(n - sink), SHARED_BUDGET * budget)
        keys = tuple((p.pages, n, layer, sink) for p in g.parts)
        st = self.ha.indexes.device_stacks.get(keys, entries, budget, qg.device)
        if stacks is not None:
            stacks.append(st)
        lists, t = st.sizes.shape[-1], st.lists_in_budget
        # the parts' chunks' data ([U, ...] -> [G, ...] where chunks repeat: on the device, not per part)
        if dev.chunk_rows is None:
            per_part, chunk_pages = (lambda t: t), dev.pages  # noqa: E731
        else:
            per_part = lambda t: t.index_select(0, dev.chunk_rows)  # noqa: E731
            chunk_pages = dev.pages[dev.first_parts]  # [U, pages]
        sizes, starts = per_part(st.sizes), per_part(st.starts)
        cent = per_part(st.centroids).transpose(-1, -2).float()
        if shared:  # lists ranked by the sum of the query heads' scores: (sum of q) . centroid
            Q = g.m
            scores = torch.matmul(qg.view(G, kvh, Q, -1, d).sum(3), cent)
        else:
            scores = torch.matmul(qg, cent)  # [G, kvh, Q, lists]
        del cent
        order = scores.topk(t, -1, sorted=True).indices  # best first
        size = sizes.unsqueeze(2).expand(G, kvh, Q, lists).gather(3, order)
        take = size.cumsum(-1) <= budget
        take[..., 0] = True
        size = size * take
        ends = size.cumsum(-1)  # candidate c of a query is in its list j where ends[j - 1] <= c < ends[j]
        c = max(int(budget), st.max_size, g.top_k)
        cand = torch.arange(c, device=qg.device).expand(G, kvh, Q, c).contiguous()
        j = torch.searchsorted(ends, cand, right=True)
        valid = j < t
        j.clamp_(max=t - 1)
        first = starts.unsqueeze(2).expand(G, kvh, Q, lists).gather(3, order) - (ends - size)
        pos = (first.gather(3, j) + cand).masked_fill_(~valid, 0) + sink  # table positions
        slot_of = per_part(st.slot_of)
        sink_k = sink_v = None
        if sink:  # the sink keys / values, the same every step: kept on the device with the stack
            if st.sink_k is None:
                st.sink_k, st.sink_v = self._sinks(chunk_pages, layer, sink)
            sink_k, sink_v = per_part(st.sink_k), per_part(st.sink_v)
        rows = qg.shape[2]
        o, lse = torch.empty(G, kvh, rows, d, device=qg.device), torch.empty(G, kvh, rows, device=qg.device)
        step = max(1, DEVICE_WORK_ELEMENTS // max(1, kvh * (Q + rows) * (sink + c) * d))
        for a in range(0, G, step):
            b = min(G, a + step)
            sk, sv = (None, None) if sink_k is None else (sink_k[a:b], sink_v[a:b])
            part = (dev.pages[a:b], layer, qg[a:b], pos[a:b], valid[a:b], slot_of[a:b])
            o[a:b], lse[a:b] = self._attend(*part, g.top_k, sk, sv)
        return o, lse
