"""Shared-chunk attention vs the per-request lazy kernel on a Zipf decode (or question-prefill) step.

Llama-3.1-8B attention (32 q / 8 kv heads, d=128, bf16, page 16). B requests, each with `--docs`
documents of `--doc-tokens` tokens drawn from a pool of `--pool` by Zipf(`--alpha`) popularity (no
repeat within a request, random order), then 128 private tokens (question + generated) holding its
`--q-len` new tokens. One layer's KV; every document's pages exist once.

Per step, median us of a CUDA-graph replay (triton.testing.do_bench_cudagraph):
- `per_request`: lazy_attention_triton over every request's full page table (today's decode path);
- `shared`: shared_chunk_attention_triton over the step's distinct documents, every query of a
  document served by one pass over its pages;
- `private`: lazy_attention_triton over the private pages only;
- `merge`: merge_partials (torch ops) of the two;
- `shared_path` = shared + private + merge, and the KV bytes each path must read.

    python benchmarks/shared_chunk_bench.py --batches 1 16 64 --out shared_chunk.json

A first measurement for issue 14 (the kernel is untuned; the private kernel does not yet return its
log-sum-exp, so `private` is timed without that store, a [tokens, heads] fp32 write).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from lazyrt.kernels.metadata import AttentionMetadata  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.kernels.shared_chunk import SharedChunkMeta, merge_partials  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, PRIVATE = 32, 8, 128, 16, 128


def zipf_docs(rng: random.Random, pool: int, k: int, alpha: float) -> list[int]:
    weights = [1 / (i + 1) ** alpha for i in range(pool)]
    docs: list[int] = []
    while len(docs) < k:
        d = rng.choices(range(pool), weights)[0]
        if d not in docs:
            docs.append(d)
    return docs


def build_step(B: int, args, rng: random.Random, dev: str):
    """Pages, the full and private AttentionMetadata, and the shared segments of one step."""
    doc_pages = -(-args.doc_tokens // PAGE)
    picks = [zipf_docs(rng, args.pool, args.docs, args.alpha) for _ in range(B)]
    distinct = sorted({d for p in picks for d in p})
    page_of = {d: list(range(i * doc_pages, (i + 1) * doc_pages)) for i, d in enumerate(distinct)}
    next_page = len(distinct) * doc_pages
    own_pages = -(-PRIVATE // PAGE)
    qo, kvp, pkvp, positions, full, priv = [0], [0], [0], [], ([], [], []), ([], [], [])
    uses: dict[int, list[tuple[int, int]]] = {d: [] for d in distinct}
    for r, docs in enumerate(picks):
        pos = 0
        for d in docs:
            uses[d].append((r, pos))
            for i, pg in enumerate(page_of[d]):
                for t, x in zip(full, (pg, pos + i * PAGE, min(PAGE, args.doc_tokens - i * PAGE))):
                    t.append(x)
            pos += args.doc_tokens
        for i in range(own_pages):
            for tl_ in (full, priv):
                for t, x in zip(tl_, (next_page + i, pos + i * PAGE, PAGE)):
                    t.append(x)
        next_page += own_pages
        positions += range(pos + PRIVATE - args.q_len, pos + PRIVATE)
        qo.append(qo[-1] + args.q_len)
        kvp.append(len(full[0]))
        pkvp.append(len(priv[0]))
    kv = torch.randn(next_page, 2, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)

    def meta(t, indptr) -> AttentionMetadata:
        i32 = dict(dtype=torch.int32, device=dev)
        return AttentionMetadata(
            qo_indptr=torch.tensor(qo, **i32),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            kv_indptr=torch.tensor(indptr, **i32), kv_indices=torch.tensor(t[0], **i32),
            pos_base=torch.tensor(t[1], **i32), valid_len=torch.tensor(t[2], **i32),
            store_pages=torch.zeros(0, dtype=torch.long, device=dev),
            store_slots=torch.zeros(0, dtype=torch.long, device=dev), rotate_keys=True,
            max_q_len=args.q_len, max_kv_entries=max(b - a for a, b in zip(indptr, indptr[1:])),
        )  # fmt: skip

    rows = lambda r: range(r * args.q_len, (r + 1) * args.q_len)  # noqa: E731
    segments = [
        (page_of[d], args.doc_tokens, [(q, s) for r, s in uses[d] for q in rows(r)]) for d in distinct
    ]
    return kv, meta(full, kvp), meta(priv, pkvp), SharedChunkMeta.build(segments, PAGE, dev), len(distinct)


def measure(B: int, args, rng: random.Random, rope: RopeCache, scale: float, bench) -> dict:
    """One step of B requests: each path timed, with the KV bytes it reads."""
    from lazyrt.kernels.triton_attention import lazy_attention_triton
    from lazyrt.kernels.triton_shared_chunk import shared_chunk_attention_triton

    kv, full, priv, shared, distinct = build_step(B, args, rng, "cuda")
    T = B * args.q_len
    q = torch.randn(T, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    o_p = torch.randn(T, Q_HEADS, HEAD_DIM, device="cuda")
    lse_p = torch.randn(T, Q_HEADS, device="cuda")
    o_s, lse_s = shared_chunk_attention_triton(q, kv, full.positions, shared, rope, scale)
    t = {
        "per_request": bench(lambda: lazy_attention_triton(q, kv, full, rope, scale)),
        "shared": bench(lambda: shared_chunk_attention_triton(q, kv, full.positions, shared, rope, scale)),
        "private": bench(lambda: lazy_attention_triton(q, kv, priv, rope, scale)),
        "merge": bench(lambda: merge_partials(o_p, lse_p, o_s, lse_s, shared.pair_row)),
    }
    t["shared_path"] = t["shared"] + t["private"] + t["merge"]
    mb = 2 * PAGE * KV_HEADS * HEAD_DIM * 2 / 1e6  # one page's K and V, bf16
    return {
        "batch": B, "q_len": args.q_len, "docs": args.docs, "doc_tokens": args.doc_tokens,
        "alpha": args.alpha, "distinct_docs": distinct, "doc_uses": B * args.docs,
        "kv_mb_per_request": full.kv_indices.numel() * mb,
        "kv_mb_shared_path": (shared.chunk_kv_indices.numel() + priv.kv_indices.numel()) * mb,
        **{f"{k}_us": round(v, 1) for k, v in t.items()},
        "speedup": round(t["per_request"] / t["shared_path"], 2),
    }  # fmt: skip


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--docs", type=int, default=5, help="documents per request")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--pool", type=int, default=100, help="documents to draw from")
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument("--q-len", type=int, default=1, help="new tokens per request (1 = decode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, args.docs * args.doc_tokens + PRIVATE + 1, "cuda")
    scale = HEAD_DIM**-0.5
    rng = random.Random(args.seed)

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000.0

    rows = []
    for B in args.batches:
        rows.append(measure(B, args, rng, rope, scale, bench))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print("| batch | distinct docs / uses | KV MB per-request / shared | per-request us | shared + private + "
          "merge us | speed-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['distinct_docs']} / {r['doc_uses']} | {r['kv_mb_per_request']:.0f} / "
              f"{r['kv_mb_shared_path']:.0f} | {r['per_request_us']} | {r['shared_us']} + "
              f"{r['private_us']} + {r['merge_us']} = {r['shared_path_us']:.1f} | {r['speedup']}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
