"""Shared-chunk attention vs the per-request lazy kernel on a Zipf decode (or question-prefill) step.

Llama-3.1-8B attention (32 q / 8 kv heads, d=128, bf16, page 16). B requests, each with `--docs`
documents of `--doc-tokens` tokens drawn from a pool of `--pool` by Zipf(`--alpha`) popularity (no
repeat within a request, random order), then `--private` own tokens (question + generated) holding
its `--q-len` new tokens. One layer's KV; every document's pages exist once.

The step goes through what the engine runs (kernels/shared_chunk.py `group_segments`, pieces of
`--piece-tokens`, by default the engine's choice); per step, median us of a CUDA-graph replay
(triton.testing.do_bench_cudagraph):
- `per_request`: lazy_attention_triton over every request's page table (the per-request path);
- `shared`: shared_chunk_attention_triton over the step's segments (each distinct piece of pages
  once, for every query that uses it; the requests' own runs are segments of one user);
- `merge`: merge_parts_triton, each query row's parts into its output;
- `shared_path` = shared + merge, with the KV bytes each path reads;
- `flashinfer` (with --flashinfer): FlashInfer over the same per-request page tables without RoPE
  (decode wrapper at q=1, causal paged prefill above; the keys as if pre-rotated): issue 14's
  baseline for question prefill ("lazy over shared chunks <= 1.0x FlashInfer per request").

    python benchmarks/shared_chunk_bench.py --batches 1 16 64 --out shared_chunk.json
    python benchmarks/shared_chunk_bench.py --batches 16 64 --sweep      (kernel tile/grid sweep)
    python benchmarks/shared_chunk_bench.py --batches 16 64 --q-len 16 --flashinfer
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from lazyrt.kernels.metadata import AttentionMetadata  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.kernels.shared_chunk import SharedChunkMeta, group_segments, split_last_round  # noqa: E402
from lazyrt.kernels.waves import half_piece_items, round_items  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402
from lazyrt.runtime.worker.step_inputs import SHARED_PIECE_TOKENS, piece_tokens_for  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def zipf_docs(rng: random.Random, pool: int, k: int, alpha: float) -> list[int]:
    weights = [1 / (i + 1) ** alpha for i in range(pool)]
    docs: list[int] = []
    while len(docs) < k:
        d = rng.choices(range(pool), weights)[0]
        if d not in docs:
            docs.append(d)
    return docs


def build_step(
    B: int, args, rng: random.Random, dev: str, block_pairs: int | None = None, segments_only: bool = False
):
    """KV pages, the per-request AttentionMetadata, the SharedChunkMeta, distinct docs of one step
    (segments_only: group_segments' segments of that step, nothing on the device)."""
    doc_pages = -(-args.doc_tokens // PAGE)
    picks = [zipf_docs(rng, args.pool, args.docs, args.alpha) for _ in range(B)]
    distinct = sorted({d for p in picks for d in p})
    page_of = {d: list(range(i * doc_pages, (i + 1) * doc_pages)) for i, d in enumerate(distinct)}
    next_page = len(distinct) * doc_pages
    own_pages = -(-args.private // PAGE)
    qo, kvp, positions, full, seqs = [0], [0], [], ([], [], []), []
    for docs in picks:
        pos, runs = 0, []
        for d in docs + [None]:
            pages = page_of[d] if d is not None else list(range(next_page, next_page + own_pages))
            n = args.doc_tokens if d is not None else args.private
            runs.append((pages, n, pos))
            for i, pg in enumerate(pages):
                for t, x in zip(full, (pg, pos + i * PAGE, min(PAGE, n - i * PAGE))):
                    t.append(x)
            pos += n
        next_page += own_pages
        positions += range(pos - args.q_len, pos)
        seqs.append((range(qo[-1], qo[-1] + args.q_len), runs))
        qo.append(qo[-1] + args.q_len)
        kvp.append(len(full[0]))
    kv_heads = getattr(args, "kv_heads", KV_HEADS)  # a tensor-parallel rank's share: fewer
    bp = block_pairs or max(1, 64 // (Q_HEADS // KV_HEADS))
    piece = args.piece_tokens
    if not piece:  # as the engine (step_inputs.shared_arrays): half-size pieces for few document items
        docs = [(rows, runs[:-1]) for rows, runs in seqs]  # a sequence's last run is its own
        full = group_segments(docs, PAGE, SHARED_PIECE_TOKENS)[0]
        keys = sum(n * -(-len(pairs) // bp) for _, n, pairs in full)
        piece = piece_tokens_for(keys, half_piece_items(kv_heads, torch.device(dev)))
    segments = group_segments(seqs, PAGE, piece)[0]
    if getattr(args, "split_last_round", True):  # as the engine groups its documents (its own runs too)
        cut = {k: getattr(args, f"split_{k}") for k in ("parts", "share") if hasattr(args, f"split_{k}")}
        segments = split_last_round(segments, PAGE, bp, kv_heads, round_items(torch.device(dev)), **cut)
    if segments_only:
        return segments
    kv = torch.randn(next_page, 2, PAGE, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        qo_indptr=torch.tensor(qo, **i32), positions=torch.tensor(positions, dtype=torch.long, device=dev),
        kv_indptr=torch.tensor(kvp, **i32), kv_indices=torch.tensor(full[0], **i32),
        pos_base=torch.tensor(full[1], **i32), valid_len=torch.tensor(full[2], **i32),
        store_pages=torch.zeros(0, dtype=torch.long, device=dev),
        store_slots=torch.zeros(0, dtype=torch.long, device=dev), rotate_keys=True,
        max_q_len=args.q_len, max_kv_entries=max(b - a for a, b in zip(kvp, kvp[1:])),
    )  # fmt: skip
    shared = SharedChunkMeta.build(segments, PAGE, len(positions), bp, dev)
    return kv, meta, shared, len(distinct)


def sweep(B: int, args, rope: RopeCache, scale: float, bench) -> list[dict]:
    """The shared kernel's time on one step over tile and grid choices (same documents each)."""
    from lazyrt.kernels.triton_shared_chunk import shared_chunk_attention_triton
    from lazyrt.kernels.waves import num_sms as _num_sms

    rows = []
    for piece in (512, 1024, 2048):
        for bp in (8, 16, 32):
            a = argparse.Namespace(**{**vars(args), "piece_tokens": piece})
            kv, full, shared, _ = build_step(B, a, random.Random(args.seed), "cuda", bp)
            q = torch.randn(B * args.q_len, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for bn, warps, stages, per_sm in itertools.product((32, 64), (4, 8), (1, 2, 3), (2, 4, 8)):
                kw = dict(block_n=bn, programs=_num_sms(0) * per_sm, num_warps=warps, num_stages=stages)
                try:
                    attend = shared_chunk_attention_triton
                    us = bench(functools.partial(attend, q, kv, full.positions, shared, rope, scale, **kw))
                except Exception as e:  # noqa: BLE001  (out of shared memory etc.)
                    us = float("nan")
                    print(f"skip {piece} {bp} {kw}: {type(e).__name__}")
                rows.append({"batch": B, "piece": piece, "block_pairs": bp, "block_n": bn, "warps": warps,
                             "stages": stages, "per_sm": per_sm, "us": round(us, 1)})  # fmt: skip
    rows.sort(key=lambda r: (r["us"] != r["us"], r["us"]))
    for r in rows[:8]:
        print(json.dumps(r), flush=True)
    return rows


def measure(B: int, args, rng: random.Random, rope: RopeCache, scale: float, bench) -> dict:
    """One step of B requests: each path timed, with the KV bytes it reads."""
    from lazyrt.kernels.triton_attention import lazy_attention_triton
    from lazyrt.kernels.triton_shared_chunk import (
        KEY_TABLES,
        merge_parts_blocked_triton,
        merge_parts_triton,
        persistent_programs,
        shared_chunk_attention_triton,
    )

    state = rng.getstate()  # the bucket variants rebuild this step's segments
    kv, full, shared, distinct = build_step(B, args, rng, "cuda")
    q = torch.randn(B * args.q_len, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    shared.programs = persistent_programs(q.device)  # as in a CUDA graph
    o_s, lse_s = shared_chunk_attention_triton(q, kv, full.positions, shared, rope, scale)
    ref = lazy_attention_triton(q, kv, full, rope, scale).float()
    err = (merge_parts_triton(o_s, lse_s, shared, q.dtype).float() - ref).norm() / ref.norm()
    t = {
        "per_request": bench(lambda: lazy_attention_triton(q, kv, full, rope, scale)),
        "shared": bench(lambda: shared_chunk_attention_triton(q, kv, full.positions, shared, rope, scale)),
        "merge": bench(lambda: merge_parts_triton(o_s, lse_s, shared, q.dtype)),
    }
    extra = {}
    if args.variants:  # what-ifs on the same step: no rope at all (the rotation's cost), merge head blocks
        sh = functools.partial(shared_chunk_attention_triton, q, kv, full.positions, shared, sm_scale=scale)
        no_rope = RopeCache(rope.cos[:, :0], rope.sin[:, :0])  # rotary_dim 0: plain attention
        t["v_no_rope"] = bench(lambda: sh(rope=no_rope))
        # the keys' cos/sin other than the default: fp32 / fp16 [cos|sin] table / KV dtype + 16-bit math
        for tables in [t for t in ("fp32", "half", "kv") if t != KEY_TABLES]:
            t[f"v_tables_{tables}"] = bench(functools.partial(sh, rope=rope, key_tables=tables))
            o_t, _ = sh(rope=rope, key_tables=tables)
            extra[f"tables_{tables}_rel_diff"] = float((o_t - o_s).norm() / o_s.norm())
        for hb in (1, 2, 4, 8, 32):
            merge = functools.partial(merge_parts_triton, o_s, lse_s, shared, q.dtype, hb)
            t[f"v_merge_h{hb}"] = bench(merge)
        for pb in (8, 16, 32):  # a program a (row, head), pb of its parts at a time
            t[f"v_merge_blocked_p{pb}"] = bench(
                functools.partial(merge_parts_blocked_triton, o_s, lse_s, shared, q.dtype, pb)
            )
        # tiles other than the default on the same step
        for bn, stages, warps in ((128, 2, 4), (128, 3, 4), (128, 2, 8), (32, 3, 4), (64, 4, 4), (64, 2, 4)):
            kw = dict(block_n=bn, num_stages=stages, num_warps=warps)
            t[f"v_bn{bn}_s{stages}_w{warps}"] = _try(bench, functools.partial(sh, rope=rope, **kw))
        # segments in buckets by users, each bucket its own launch with rows fitted to it: a segment
        # of 1-4 users pads its rows to 16 instead of 64 (the work items' padded rows are wasted dots)
        again = random.Random()
        again.setstate(state)
        segs = build_step(B, args, again, "cuda", segments_only=True)
        for name, limits in (("b2", ((4, 4), (None, 16))), ("b3", ((4, 4), (8, 8), (None, 16))),
                             ("b2_8", ((8, 8), (None, 16)))):
            metas, lo = [], 0
            for hi, bp in limits:
                part = [g for g in segs if lo < len(g[2]) and (hi is None or len(g[2]) <= hi)]
                lo = hi or lo
                if part:
                    metas.append(SharedChunkMeta.build(part, PAGE, q.shape[0], bp, "cuda"))
            extra[f"rows_used_{name}"] = _rows_used(metas, Q_HEADS // KV_HEADS)

            def run(metas=metas):
                for m in metas:
                    shared_chunk_attention_triton(q, kv, full.positions, m, rope, scale)
            t[f"v_buckets_{name}"] = bench(run)
        extra["rows_used_default"] = _rows_used([shared], Q_HEADS // KV_HEADS)
    if args.flashinfer:
        t["flashinfer"] = bench(flashinfer_run(full, q, kv, args.q_len))
    t["shared_path"] = t["shared"] + t["merge"]
    mb = 2 * PAGE * KV_HEADS * HEAD_DIM * 2 / 1e6  # one page's K and V, bf16
    return {
        "batch": B, "q_len": args.q_len, "docs": args.docs, "doc_tokens": args.doc_tokens,
        "alpha": args.alpha, "distinct_docs": distinct, "doc_uses": B * args.docs,
        "segments": shared.num_chunks, "pairs": shared.num_pairs, "rel_err": float(err),
        "kv_mb_per_request": full.kv_indices.numel() * mb,
        "kv_mb_shared_path": shared.chunk_kv_indices.numel() * mb,
        **{f"{k}_us": round(v, 1) for k, v in t.items()},
        "speedup": round(t["per_request"] / t["shared_path"], 2), **extra,
        **({"shared_vs_flashinfer": round(t["shared_path"] / t["flashinfer"], 2)} if args.flashinfer else {}),
    }  # fmt: skip


def _try(bench, fn) -> float:
    try:
        return bench(fn)
    except Exception as e:  # noqa: BLE001  (out of shared memory etc.)
        print(f"variant skipped: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")


def _rows_used(metas, group: int) -> float:
    """Share of the work items' query rows that hold a real (pair, head): the rest are padding."""
    from lazyrt.kernels.triton_shared_chunk import MIN_DOT, _pow2

    used = padded = 0
    for m in metas:
        rows = max(MIN_DOT, _pow2(m.block_pairs * group))
        used += m.num_pairs * group
        padded += m.num_work_host * rows
    return round(used / max(padded, 1), 3)


def flashinfer_run(full: AttentionMetadata, q: torch.Tensor, kv: torch.Tensor, q_len: int):
    """A callable running FlashInfer (no RoPE) over the step's per-request page tables (full pages)."""
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    n_seq = full.kv_indptr.numel() - 1
    last = torch.full((n_seq,), PAGE, dtype=torch.int32, device="cuda")
    dims = (q.shape[1], kv.shape[3], HEAD_DIM, PAGE)
    kw = dict(pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if q_len == 1:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(full.kv_indptr, full.kv_indices, last, *dims, **kw)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(full.qo_indptr, full.kv_indptr, full.kv_indices, last, *dims, causal=True, **kw)
    return lambda: w.run(q, kv)


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--docs", type=int, default=5, help="documents per request")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--private", type=int, default=128, help="own tokens per request (question + generated)")
    ap.add_argument("--pool", type=int, default=100, help="documents to draw from")
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument("--q-len", type=int, default=1, help="new tokens per request (1 = decode)")
    ap.add_argument("--piece-tokens", type=int, default=None,
                    help="shared segments cut at this many tokens (default: the engine's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1,
                    help="one tensor-parallel rank's share: the q and KV heads divided by this")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--sweep", action="store_true", help="sweep the shared kernel's tiles and grid instead")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer (no RoPE) over the per-request page tables")
    ap.add_argument("--variants", action="store_true",
                    help="also time what-ifs: the kernel without rope or with other cos/sin tables, "
                    "the merge's heads a program")
    args = ap.parse_args()
    global Q_HEADS, KV_HEADS  # a rank's heads under --tp (this script's shapes are module constants)
    if KV_HEADS % args.tp:
        ap.error(f"--tp {args.tp}: must divide the {KV_HEADS} KV heads")
    Q_HEADS, KV_HEADS = Q_HEADS // args.tp, KV_HEADS // args.tp
    if args.flashinfer and (args.doc_tokens % PAGE or args.private % PAGE):
        ap.error(f"--flashinfer: --doc-tokens and --private must be multiples of the page ({PAGE}): "
                 "FlashInfer's page tables allow a partial page only at the end")
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, args.docs * args.doc_tokens + args.private + 1, "cuda")
    scale = HEAD_DIM**-0.5
    rng = random.Random(args.seed)

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000.0

    if args.sweep:
        fast = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3  # noqa: E731
        rows = [r for B in args.batches for r in sweep(B, args, rope, scale, lambda fn: (fn(), fast(fn))[1])]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f)
        return
    rows = []
    for B in args.batches:
        rows.append(measure(B, args, rng, rope, scale, bench))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print("| batch | q | distinct docs / uses | KV MB per-request / shared | per-request us "
          "| shared + merge us | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['q_len']} | {r['distinct_docs']} / {r['doc_uses']} | "
              f"{r['kv_mb_per_request']:.0f} / {r['kv_mb_shared_path']:.0f} | {r['per_request_us']} | "
              f"{r['shared_us']} + {r['merge_us']} = {r['shared_path_us']:.1f} | {r['speedup']}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
