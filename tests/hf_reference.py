"""Independent references built on Hugging Face transformers (no lazyrt code on the compute path)."""

from __future__ import annotations

import math

import torch


def hf_greedy(model, prompt_ids: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=sorted(eos_ids) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def rag_layout(prefix: list[int], docs: list[list[int]], suffix: list[int], parallel: bool = False):
    """Token ids, position ids and a boolean [N, N] mask (True = may attend) for RagPrompt semantics.

    Each doc sees its own private copy of the prefix, placed so the copy ends right where the doc
    starts (a doc sees the prefix as if it came right after it); the suffix sees the real prefix, every
    doc at its contiguous position, and itself. Copies are invisible to everything else.
    parallel: every doc starts right after the prefix and the suffix right after the longest doc.
    """
    ids, pos, groups = [], [], []  # group: ("prefix",) | ("copy", i) | ("doc", i) | ("suffix",)
    P = len(prefix)
    ids += prefix
    pos += list(range(P))
    groups += [("prefix",)] * P
    start = P
    for i, d in enumerate(docs):
        ids += prefix
        pos += list(range(start - P, start))
        groups += [("copy", i)] * P
        ids += d
        pos += list(range(start, start + len(d)))
        groups += [("doc", i)] * len(d)
        start += 0 if parallel else len(d)
    if parallel:
        start = P + max(map(len, docs), default=0)
    ids += suffix
    pos += list(range(start, start + len(suffix)))
    groups += [("suffix",)] * len(suffix)

    def may_attend(q: int, k: int) -> bool:
        if k > q:
            return False
        gq, gk = groups[q], groups[k]
        if gq[0] in ("prefix", "copy"):
            return gk == gq
        if gq[0] == "doc":
            return gk == gq or gk == ("copy", gq[1])
        return gk[0] != "copy"

    # built as Python lists, then one tensor (setting [N, N] tensor elements one by one is slow)
    n = len(ids)
    mask = torch.tensor([[may_attend(q, k) for k in range(n)] for q in range(n)], dtype=torch.bool)
    return ids, pos, mask


@torch.inference_mode()
def hf_rag_greedy(model, prefix, docs, suffix, max_new: int, eos_ids: set[int]) -> list[int]:
    """Greedy tokens under RagPrompt semantics: one forward of the whole layout with an explicit 4-D
    mask, then one token at a time on Hugging Face's own KV cache. A generated token is a suffix
    token: it sees what the last suffix token sees (everything but the private prefix copies) and
    itself, at the next position. Same tokens as re-forwarding rag_layout(prefix, docs, suffix +
    generated) every step (test_hf_reference checks that), without re-running the whole layout."""
    model.config._attn_implementation = "sdpa"
    if max_new <= 0:
        return []
    ids, pos, mask = rag_layout(prefix, docs, suffix)
    res = model(
        torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([pos]), use_cache=True
    )
    row, next_pos = mask[-1], pos[-1] + 1
    out: list[int] = []
    while True:
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
        if tok in eos_ids or len(out) == max_new:
            return out
        row = torch.cat([row, torch.ones(1, dtype=torch.bool)])
        res = model(
            torch.tensor([[tok]]),
            attention_mask=row[None, None, None],
            position_ids=torch.tensor([[next_pos]]),
            cache=res.cache,
            use_cache=True,
        )
        next_pos += 1


def recompute_layout(prefix, docs, suffix, recomputed: list[set[int]]):
    """Selective recompute semantics: token ids, positions, a boolean [N, N] mask (True = may attend)
    and the layout index of every recomputed token ({doc: [index per recomputed offset, ascending]}).

    Each doc's chunk is laid out after a private copy of the prefix (it sees that copy and itself).
    The request's view of doc j's token i is the chunk's token, or, for i in recomputed[j], a fresh
    token at the same position that sees the request's view of everything at or before its
    position (prefix, earlier docs, the doc's earlier tokens, itself). The suffix sees that view too.
    """
    P = len(prefix)
    # kind: 0 prefix, 1 a chunk's prefix copy, 2 chunk token, 3 recomputed token, 4 suffix
    ids, pos, kind, vis = list(prefix), list(range(P)), [0] * P, [True] * P
    doc_of = [-1] * P
    start = P
    starts = []
    for j, d in enumerate(docs):
        starts.append(start)
        ids += prefix
        pos += list(range(start - P, start))
        kind += [1] * P
        vis += [False] * P
        doc_of += [j] * P
        ids += d
        pos += list(range(start, start + len(d)))
        kind += [2] * len(d)
        vis += [i not in recomputed[j] for i in range(len(d))]
        doc_of += [j] * len(d)
        start += len(d)
    rec_index = {}
    for j, d in enumerate(docs):
        offs = sorted(recomputed[j])
        rec_index[j] = list(range(len(ids), len(ids) + len(offs)))
        ids += [d[i] for i in offs]
        pos += [starts[j] + i for i in offs]
        kind += [3] * len(offs)
        vis += [True] * len(offs)
        doc_of += [j] * len(offs)
    ids += suffix
    pos += list(range(start, start + len(suffix)))
    kind += [4] * len(suffix)
    vis += [True] * len(suffix)
    doc_of += [-1] * len(suffix)
    p, k, v, dj = map(torch.tensor, (pos, kind, vis, doc_of))
    n = len(ids)
    idx = torch.arange(n)
    causal = idx[None, :] <= idx[:, None]
    same_group = (k[:, None] == k[None, :]) & (dj[:, None] == dj[None, :])
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = k[:, None]
    mask |= (rows <= 1) & same_group & causal  # prefix, copies: themselves, causally
    # a chunk token: its prefix copy and its doc's chunk tokens up to itself
    chunk = ((k[None, :] == 1) & (dj[None, :] == dj[:, None])) | (same_group & (p[None, :] <= p[:, None]))
    mask |= (rows == 2) & chunk
    # recomputed and suffix tokens: the request's view at or before their position
    mask |= (rows >= 3) & v[None, :] & (p[None, :] <= p[:, None])
    return ids, pos, mask, rec_index


@torch.inference_mode()
def masked_greedy(model, layout, suffix: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    """Greedy tokens by full re-forwards with a 4-D mask: layout(suffix + generated) gives
    (ids, pos, mask, ...) of the whole sequence."""
    model.config._attn_implementation = "sdpa"
    out: list[int] = []
    for _ in range(max_new):
        ids, pos, mask = layout(suffix + out)[:3]
        logits = model(
            torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([pos])
        ).logits
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos_ids:
            break
    return out


@torch.inference_mode()
def masked_kv(model, ids, pos, mask, index: dict[int, list[int]]):
    """One forward with a 4-D mask; per layer {key: (unrotated K, rotated K, V)} of the positions in
    index[key] (sequence indices), each [n, kv_heads, head_dim]. Unrotated K is k_proj's output
    (families without a k norm)."""
    model.config._attn_implementation = "sdpa"
    raw = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: raw.append(o[0]))
        for layer in model.model.layers
    ]
    try:
        out = model(
            torch.tensor([ids]),
            attention_mask=mask[None, None],
            position_ids=torch.tensor([pos]),
            use_cache=True,
        )
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    kvh, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    res = []
    for layer, k_raw in enumerate(raw):
        cache = out.past_key_values.layers[layer]
        res.append({
            j: (k_raw[idx].view(len(idx), kvh, hd), cache.keys[0, :, idx].transpose(0, 1),
                cache.values[0, :, idx].transpose(0, 1))
            for j, idx in index.items() if idx
        })
    return res


def hf_recompute_greedy(
    model, prefix, docs, suffix, recomputed, max_new: int, eos_ids: set[int]
) -> list[int]:
    """Greedy tokens under selective-recompute semantics (full re-forward with a 4-D mask)."""
    return masked_greedy(
        model, lambda sfx: recompute_layout(prefix, docs, sfx, recomputed), suffix, max_new, eos_ids
    )


def hf_recompute_kv(model, prefix, docs, suffix, recomputed):
    """Per layer: {doc: (unrotated K, rotated K, V)} of its recomputed tokens (ascending offsets)."""
    return masked_kv(model, *recompute_layout(prefix, docs, suffix, recomputed))


def capture_recomputed_kv(engine) -> dict:
    """rid -> per layer, (start_pos, K, V) of each recomputed run segment as the request finishes."""
    from lazyrt.runtime.scheduler.request import RequestState

    snaps: dict = {}
    orig = engine.scheduler.finish

    def finish(req, reason):
        if req.state is not RequestState.FINISHED and req.recomputed_pages:
            own = set(req.recomputed_pages)
            segs = [s for s in req.segments if s.pages and set(s.pages) <= own]
            snaps[req.rid] = [
                [
                    (
                        s.start_pos,
                        kv[s.pages, 0].reshape(-1, *kv.shape[3:])[: s.num_tokens].clone(),
                        kv[s.pages, 1].reshape(-1, *kv.shape[3:])[: s.num_tokens].clone(),
                    )
                    for s in segs
                ]
                for kv in engine.pool.kv
            ]
        orig(req, reason)

    engine.scheduler.finish = finish
    return snaps


def assert_no_leaked_pages(engine) -> None:
    s = engine.cache_stats()
    assert s["held_pages"] == 0
    assert s["free_pages"] + s["chunk_pages"] + s["radix_pages"] == s["total_pages"]


def doc_attention_layout(prefix, docs, suffix, temperature: float, scale: float, parallel: bool = False):
    """rag_layout plus the document attention transform as [N, N] matrices: rows of the suffix (the
    question and generated tokens) scale their logits on document tokens by 1 / temperature and add
    log(scale); every other pair is left alone (logit * 1 + 0)."""
    ids, pos, mask = rag_layout(prefix, docs, suffix, parallel)
    n, P = len(ids), len(prefix)
    is_doc = torch.zeros(n, dtype=torch.bool)
    at = P
    for d in docs:
        is_doc[at + P : at + P + len(d)] = True  # after the doc's private prefix copy
        at += P + len(d)
    is_suffix_row = torch.zeros(n, dtype=torch.bool)
    is_suffix_row[at:] = True
    pair = is_suffix_row[:, None] & is_doc[None, :]
    logit_scale = torch.where(pair, 1.0 / temperature, 1.0)
    log_mass = torch.where(pair, math.log(scale), 0.0)
    return ids, pos, mask, logit_scale, log_mass


def _pairwise_attention(logit_scale, log_mass):
    """An HF attention function: softmax(scaling * q.k * logit_scale + log_mass) under the mask."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        sm = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = (query @ key.transpose(-1, -2)) * sm
        q_len, k_len = scores.shape[-2:]
        scores = scores * logit_scale[-q_len:, :k_len] + log_mass[-q_len:, :k_len]
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask, float("-inf"))
            else:
                scores = scores + attention_mask
        out = torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value
        return out.transpose(1, 2).contiguous(), None

    return attend


@torch.inference_mode()
def hf_doc_attention_logits(
    model, prefix, docs, suffix, temperature: float, scale: float, parallel: bool = False
) -> torch.Tensor:
    """Logits [len(suffix), vocab] of the suffix positions under block semantics with the document
    attention transform (parallel: docs at shared positions, rag_layout), by one full forward with an
    explicit mask (no lazyrt code)."""
    from transformers import AttentionInterface

    ids, pos, mask, logit_scale, log_mass = doc_attention_layout(
        prefix, docs, suffix, temperature, scale, parallel
    )
    name = "lazyrt_test_pairwise"
    AttentionInterface.register(name, _pairwise_attention(logit_scale, log_mass))
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        logits = model(
            torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([pos])
        ).logits
    finally:
        model.config._attn_implementation = old
    return logits[0, -len(suffix) :]
