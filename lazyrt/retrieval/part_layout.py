"""How a group of host parts' query rows are laid out for the batched fill, shared by the CPU fill
(host_attention.py) and the device fill (device_fill.py): the queries turned into each part's frame,
per KV head, the outputs back to the parts' rows, and exact attention over whole chunks."""

from __future__ import annotations

import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref


def part_queries(
    qp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeCache, kv_heads: int
) -> torch.Tensor:
    """qp [G, m, q_heads, d] (each part's query rows, rotated at their positions), turned back by each
    part's start (cos / sin [G, 1, 1, rotary_dim // 2] at it): [G, kv_heads, m * group, d]."""
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    q1, q2 = qp[..., :half], qp[..., half:rd]
    qp = torch.cat([q1 * cos + q2 * sin, q2 * cos - q1 * sin, qp[..., rd:]], dim=-1)
    G, m, qh, d = qp.shape
    group = qh // kv_heads
    return qp.view(G, m, kv_heads, group, d).transpose(1, 2).reshape(G, kv_heads, m * group, d)


def part_rows(
    o: torch.Tensor, lse: torch.Tensor, m: int, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [G, kv_heads, m * group, d] / lse [G, kv_heads, m * group] -> the parts' real rows
    ([rows, q_heads, d] / [rows, q_heads]; keep: their indices among the G * m padded rows)."""
    G, H, _, d = o.shape
    o = o.view(G, H, m, -1, d).permute(0, 2, 1, 3, 4).reshape(G * m, -1, d)
    lse = lse.view(G, H, m, -1).permute(0, 2, 1, 3).reshape(G * m, -1)
    return o[keep], lse[keep]


def attend_every_key(
    layer_kv: torch.Tensor, pages: torch.Tensor, n: int, qg: torch.Tensor, rope: RopeCache,
    sm_scale: float, work_elements: int, same_chunk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Exact attention of each part's queries qg [G, kv_heads, Q, d] (in the part's frame) to all n
    keys of its chunk: (o [G, kv_heads, Q, d], lse [G, kv_heads, Q]) fp32. layer_kv [pages, 2,
    page_size, kv_heads, d] is one layer of the host tier (or a device view of it), pages [G, pages]
    the parts' page ids: whole pages are read (each a contiguous block), keys turned at their slots,
    a few parts at a time (about work_elements elements of keys, values and scores at once).
    same_chunk (members [U, c], where [G]): parts of one chunk (a batch's requests over the same
    documents) as rows of members (padded with its first); the chunk is read once for all their
    queries, part g's rows are row where[g] of members.view(-1)'s."""
    if same_chunk is None:
        return _attend_every_key(layer_kv, pages, n, qg, rope, sm_scale, work_elements)
    members, where = same_chunk
    (U, c), (_, kvh, Q, d) = members.shape, qg.shape
    qq = qg[members.view(-1)].view(U, c, kvh, Q, d).transpose(1, 2).reshape(U, kvh, c * Q, d)
    o, lse = _attend_every_key(layer_kv, pages[members[:, 0]], n, qq, rope, sm_scale, work_elements)
    o = o.view(U, kvh, c, Q, d).transpose(1, 2).reshape(U * c, kvh, Q, d)[where]
    return o, lse.view(U, kvh, c, Q).transpose(1, 2).reshape(U * c, kvh, Q)[where]


def _attend_every_key(
    layer_kv: torch.Tensor, pages: torch.Tensor, n: int, qg: torch.Tensor, rope: RopeCache,
    sm_scale: float, work_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    G, kvh, Q, d = qg.shape
    per_block = max(1, work_elements // (kvh * n * (Q + 2 * d)))
    pos = torch.arange(n, device=qg.device)
    o = torch.empty(G, kvh, Q, d, device=qg.device)
    lse = torch.empty(G, kvh, Q, device=qg.device)
    for a in range(0, G, per_block):
        b = min(G, a + per_block)
        kv = layer_kv.index_select(0, pages[a:b].reshape(-1)).view(b - a, -1, 2, *layer_kv.shape[2:])
        kv = kv.transpose(1, 2).reshape(b - a, 2, -1, kvh, d)[:, :, :n].float()  # [parts, 2, n, kvh, d]
        k = apply_rope_ref(kv[:, 0].transpose(0, 1).reshape(n, -1, d), pos, rope)  # [n, parts * kvh, d]
        k = k.view(n, b - a, kvh, d).permute(1, 2, 3, 0)  # [parts, kvh, d, n]
        s = torch.matmul(qg[a:b], k) * sm_scale  # [parts, kvh, Q, n]
        del k
        torch.matmul(torch.softmax(s, -1), kv[:, 1].transpose(1, 2), out=o[a:b])
        torch.logsumexp(s, -1, out=lse[a:b])
    return o, lse


def same_chunk_parts(chunks: list[tuple]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """attend_every_key's same_chunk for parts whose chunks are `chunks` (one key each, e.g. the
    pages): None when no chunk repeats."""
    members: dict[tuple, list[int]] = {}
    for g, key in enumerate(chunks):
        members.setdefault(key, []).append(g)
    if len(members) == len(chunks):
        return None
    c = max(len(m) for m in members.values())
    rows = [m + [m[0]] * (c - len(m)) for m in members.values()]
    where = [0] * len(chunks)
    for u, m in enumerate(members.values()):
        for j, g in enumerate(m):
            where[g] = u * c + j
    return torch.tensor(rows), torch.tensor(where)
