"""Kernel benchmark at the RAG shape: lazy (in-kernel key rotation) vs FlashInfer without RoPE.

Llama-3.1-8B attention (32 q heads, 8 KV heads, d=128, bf16), page size 16, each request
5 chunks x 2,048 tokens + a 128-token question. One layer's pages; every request has its own
pages (no L2 sharing), the same pages for every kernel compared.

    python benchmarks/kernels.py --batches 1 4 16 64 --out docs/data/kernels.json

Rows: lazy decode vs FlashInfer decode (no RoPE), FlashInfer decode with ROPE_LLAMA for scale;
lazy prefill of the question vs FlashInfer paged prefill (no RoPE); materialize (copy the chunk
pages, re-rotate keys) per request, the Block-Attention cost; and the query-rotation design (keys
stored rotated at chunk-local positions, the query de-rotated once per chunk, chunks merged by LSE).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from lazyrt.kernels.attention_ref import lazy_attention_ref  # noqa: E402
from lazyrt.kernels.metadata import AttentionMetadata  # noqa: E402
from lazyrt.kernels.rope import RopeCache, apply_rope_ref  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CHUNKS, CHUNK_TOKENS, QUESTION = 5, 2048, 128


@dataclass
class Layout:
    batch: int
    kv: torch.Tensor  # [pages, 2, PAGE, KV_HEADS, HEAD_DIM], keys unrotated
    indices: torch.Tensor  # [batch * pages_per_req] int32
    pages_per_req: int
    chunk_start: list[int]  # position of each chunk in the request (a shuffled order)
    local_start: int  # positions the chunks were computed at (after a 0-token prefix here)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def build_layout(batch: int, device: str, gen: torch.Generator) -> Layout:
    pages_per_req = (CHUNKS * CHUNK_TOKENS + QUESTION) // PAGE
    n = batch * pages_per_req
    kv = torch.randn(n, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(n, generator=gen, device=device).int()  # scattered pages, like a real pool
    order = torch.randperm(CHUNKS, generator=gen, device=gen.device).tolist()
    starts = [0] * CHUNKS
    for slot, c in enumerate(order):
        starts[c] = slot * CHUNK_TOKENS  # chunk c sits at this offset in the request
    return Layout(batch, kv, perm, pages_per_req, starts, 0)


def lazy_meta(lay: Layout, q_len: int) -> AttentionMetadata:
    """Page table of each request: its 5 chunks (stored order) then the question pages."""
    dev = lay.kv.device
    B, ppr = lay.batch, lay.pages_per_req
    cpages = CHUNK_TOKENS // PAGE
    base = []
    for c in range(CHUNKS):
        base += [lay.chunk_start[c] + j * PAGE for j in range(cpages)]
    qstart = CHUNKS * CHUNK_TOKENS
    base += [qstart + j * PAGE for j in range(QUESTION // PAGE)]
    pos_base = torch.tensor(base, dtype=torch.int32, device=dev).repeat(B)
    total = CHUNKS * CHUNK_TOKENS + QUESTION
    positions = torch.arange(total - q_len, total, device=dev).repeat(B)
    return AttentionMetadata(
        qo_indptr=torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device=dev),
        positions=positions,
        kv_indptr=torch.arange(0, B * ppr + 1, ppr, dtype=torch.int32, device=dev),
        kv_indices=lay.indices,
        pos_base=pos_base,
        valid_len=torch.full((B * ppr,), PAGE, dtype=torch.int32, device=dev),
        store_pages=positions,  # unused by attention
        store_slots=positions,
        rotate_keys=True,
        max_q_len=q_len,
        max_kv_entries=ppr,
    )


def rotate_at_local_positions(lay: Layout, rope: RopeCache) -> torch.Tensor:
    """The pages as a conventional cache holds them: chunk keys rotated at chunk-local positions,
    question keys at their absolute positions (what block mode stores)."""
    B, dev = lay.batch, lay.kv.device
    cpages = CHUNK_TOKENS // PAGE
    base = [lay.local_start + j * PAGE for _ in range(CHUNKS) for j in range(cpages)]
    base += [CHUNKS * CHUNK_TOKENS + j * PAGE for j in range(QUESTION // PAGE)]
    pos = (torch.tensor(base, device=dev)[:, None] + torch.arange(PAGE, device=dev)).repeat(B, 1)
    stored = lay.kv.clone()
    idx = lay.indices.long()
    for part in torch.arange(idx.numel(), device=dev).split(4096):  # bounded fp32 temporaries
        k = stored[idx[part], 0].float()
        k = apply_rope_ref(k.reshape(-1, KV_HEADS, HEAD_DIM), pos[part].flatten(), rope).view_as(k)
        stored[idx[part], 0] = k.to(stored.dtype)
    return stored


def materialize(lay: Layout, stored: torch.Tensor, rope: RopeCache, out_kv: torch.Tensor) -> None:
    """Block-Attention: copy every page of every request (dense) and re-rotate each chunk's keys
    from their local positions to the chunk's offset in this request."""
    from lazyrt.kernels.triton_kv import rerotate_pages_triton

    src = lay.indices.long()
    out_kv.copy_(stored[src])
    cpages = CHUNK_TOKENS // PAGE
    B, ppr = lay.batch, lay.pages_per_req
    for c in range(CHUNKS):  # per chunk: one rotation delta
        rows = (
            torch.arange(B, device=src.device)[:, None] * ppr
            + c * cpages
            + torch.arange(cpages, device=src.device)
        )
        rerotate_pages_triton(out_kv, rows.flatten(), lay.chunk_start[c] - lay.local_start, rope)


def bench_batch(B: int, gen, rope, scale, fi, workspace, bench) -> dict:
    from lazyrt.kernels.triton_attention import lazy_attention_triton

    dev = "cuda"
    lay = build_layout(B, dev, gen)
    ppr = lay.pages_per_req
    row: dict = {"batch": B}
    # ---- decode ----------------------------------------------------------------------------
    meta = lazy_meta(lay, 1)
    q = torch.randn(B, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    out_lazy = lazy_attention_triton(q, lay.kv, meta, rope, scale, max_q_len=1, max_kv_entries=ppr)
    if B <= 4:  # fp32 reference on the same pages
        ref = lazy_attention_ref(q.float(), lay.kv.float(), meta, rope, scale)
        row["decode_rel_err_vs_ref"] = rel_err(out_lazy, ref)
    row["lazy_decode_us"] = bench(
        lambda: lazy_attention_triton(q, lay.kv, meta, rope, scale, max_q_len=1, max_kv_entries=ppr)
    )
    stored = rotate_at_local_positions(lay, rope)
    mat_kv = torch.empty_like(lay.kv)
    row["materialize_us"] = bench(lambda: materialize(lay, stored, rope, mat_kv))
    row["materialize_us_per_req"] = row["materialize_us"] / B
    if fi is not None:
        kv_indptr = meta.kv_indptr
        dense = torch.arange(B * ppr, dtype=torch.int32, device=dev)  # materialized copies are dense
        last = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
        dec = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        dec.plan(
            kv_indptr,
            lay.indices,
            last,
            Q_HEADS,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            pos_encoding_mode="NONE",
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        row["flashinfer_decode_us"] = bench(lambda: dec.run(q, lay.kv))
        # correctness: FlashInfer over the materialized (rotated) copy == lazy over unrotated pages
        materialize(lay, stored, rope, mat_kv)
        dec_m = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        dec_m.plan(
            kv_indptr,
            dense,
            last,
            Q_HEADS,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            pos_encoding_mode="NONE",
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        row["decode_rel_err_vs_materialized_flashinfer"] = rel_err(out_lazy, dec_m.run(q, mat_kv))
        dec_r = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        dec_r.plan(
            kv_indptr,
            lay.indices,
            last,
            Q_HEADS,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            pos_encoding_mode="ROPE_LLAMA",
            rope_theta=500000.0,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        row["flashinfer_rope_decode_us"] = bench(lambda: dec_r.run(q, lay.kv))
        row["decode_ratio"] = row["lazy_decode_us"] / row["flashinfer_decode_us"]
        row["block_decode_us"] = row["materialize_us"] + row["flashinfer_decode_us"]
        row.update(query_rotation_decode(fi, workspace, lay, stored, q, rope, scale, bench))
    # ---- prefill of the question over the chunks ---------------------------------------------
    meta_p = lazy_meta(lay, QUESTION)
    qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    outp = lazy_attention_triton(qp, lay.kv, meta_p, rope, scale, max_q_len=QUESTION, max_kv_entries=ppr)
    if B == 1:
        refp = lazy_attention_ref(qp.float(), lay.kv.float(), meta_p, rope, scale)
        row["prefill_rel_err_vs_ref"] = rel_err(outp, refp)
    row["lazy_prefill_us"] = bench(
        lambda: lazy_attention_triton(qp, lay.kv, meta_p, rope, scale, max_q_len=QUESTION, max_kv_entries=ppr)
    )
    if fi is not None:
        pre = flashinfer_prefill(fi, workspace, meta_p.qo_indptr, meta_p.kv_indptr, lay.indices, causal=True)
        row["flashinfer_prefill_us"] = bench(lambda: pre.run(qp, lay.kv))
        row["prefill_ratio"] = row["lazy_prefill_us"] / row["flashinfer_prefill_us"]
        row.update(query_rotation_prefill(fi, lay, stored, rope, scale, bench, gen))
        row["qrot_prefill_ratio"] = row["qrot_prefill_us"] / row["flashinfer_prefill_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--out", default=None, help="write results as JSON here")
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--qrot-only", action="store_true", help="only the query-rotation prefill breakdown")
    ap.add_argument("--sweep-extend", action="store_true", help="time lazy prefill over extend tile settings")
    args = ap.parse_args()

    import triton.testing

    dev = "cuda"
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    total = CHUNKS * CHUNK_TOKENS + QUESTION
    rope = RopeCache.build(cfg, total + 1, dev)
    scale = HEAD_DIM**-0.5
    gen = torch.Generator(device=dev)
    gen.manual_seed(torch.seed() % (1 << 31))
    fi = workspace = None
    if not args.skip_flashinfer:
        import flashinfer

        fi = flashinfer
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    results = []

    def bench(fn) -> float:
        """Median us of a CUDA-graph replay (host launch cost out, as in the engine's decode graphs);
        plain do_bench when the callable cannot be captured."""
        fn()
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000.0
        except Exception as e:  # noqa: BLE001
            print(f"no graph capture ({type(e).__name__}: {e}); timing eagerly", file=sys.stderr)
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0

    if args.qrot_only:  # the query-rotation prefill and FlashInfer's prefill only
        for B in args.batches:
            row = qrot_only_row(B, gen, rope, scale, fi, workspace, bench)
            print(json.dumps(row), flush=True)
            results.append(row)
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
        return
    if args.sweep_extend:
        sweep_extend(args.batches, gen, rope, scale, bench)
        return
    for B in args.batches:
        row = bench_batch(B, gen, rope, scale, fi, workspace, bench)
        results.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


def flashinfer_prefill(fi, workspace, qo_indptr, kv_indptr, indices, causal: bool, backend: str = "auto"):
    """FlashInfer paged prefill, no RoPE, bf16, full pages, planned on these page tables."""
    n_seq = qo_indptr.numel() - 1
    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(
        qo_indptr, kv_indptr, indices, torch.full((n_seq,), PAGE, dtype=torch.int32, device=indices.device),
        Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=causal, pos_encoding_mode="NONE",
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip
    return w


def qrot_only_row(B: int, gen, rope, scale, fi, workspace, bench) -> dict:
    """FlashInfer paged prefill of the question and the query-rotation prefill (with its breakdown)."""
    dev = "cuda"
    lay = build_layout(B, dev, gen)
    meta_p = lazy_meta(lay, QUESTION)
    qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    pre = flashinfer_prefill(fi, workspace, meta_p.qo_indptr, meta_p.kv_indptr, lay.indices, causal=True)
    row = {"batch": B, "flashinfer_prefill_us": bench(lambda: pre.run(qp, lay.kv))}
    row.update(query_rotation_prefill(fi, lay, rotate_at_local_positions(lay, rope), rope, scale, bench, gen))
    row["qrot_prefill_ratio"] = row["qrot_prefill_us"] / row["flashinfer_prefill_us"]
    return row


def query_rotation_decode(fi, workspace, lay: Layout, stored, q_raw, rope, scale, bench) -> dict:
    """LazyAttention's code shape: keys stored rotated at chunk-local positions; per chunk the query
    is rotated to (its position - chunk offset + local start); FlashInfer decode per (request, chunk)
    with LSE; the states merged. Checked against the lazy kernel on the same inputs."""
    from lazyrt.kernels.triton_attention import lazy_attention_triton
    from lazyrt.kernels.triton_kv import apply_rope_triton

    B, ppr, dev = lay.batch, lay.pages_per_req, lay.kv.device
    cpages = CHUNK_TOKENS // PAGE
    qpos = CHUNKS * CHUNK_TOKENS + QUESTION - 1
    n_sub = CHUNKS + 1  # (request, chunk) sub-sequences plus the question part
    sub_len = [cpages] * CHUNKS + [QUESTION // PAGE]
    indptr = [0]
    for _ in range(B):
        for n in sub_len:
            indptr.append(indptr[-1] + n)
    sub_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
    last = torch.full((B * n_sub,), PAGE, dtype=torch.int32, device=dev)
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    dec.plan(
        sub_indptr,
        lay.indices,
        last,
        Q_HEADS,
        KV_HEADS,
        HEAD_DIM,
        PAGE,
        pos_encoding_mode="NONE",
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    qrot_pos = torch.tensor(
        [qpos - lay.chunk_start[c] + lay.local_start for c in range(CHUNKS)] + [qpos], device=dev
    ).repeat(B)

    def run():
        qs = apply_rope_triton(q_raw.repeat_interleave(n_sub, 0), qrot_pos, rope)
        o, lse = dec.run(qs, stored, return_lse=True)
        return fi.merge_states(o.view(B, n_sub, Q_HEADS, HEAD_DIM), lse.view(B, n_sub, Q_HEADS))[0]

    out = run()
    q_abs = apply_rope_ref(q_raw, torch.full((B,), qpos, device=dev), rope)
    ref = lazy_attention_triton(
        q_abs, lay.kv, lazy_meta(lay, 1), rope, scale, max_q_len=1, max_kv_entries=ppr
    )
    return {"qrot_decode_us": bench(run), "qrot_rel_err_vs_lazy": rel_err(out, ref)}


@triton.jit
def _rope_gather_kernel(
    x_ptr, y_ptr, src_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_yt, stride_cos,
    HEADS: tl.constexpr, HALF: tl.constexpr,
):
    """y[i] = RoPE(x[src[i]], pos[i]): the per-chunk query copies in one pass over q."""
    i = tl.program_id(0)
    h = tl.arange(0, HEADS)[:, None] * (2 * HALF)
    c = tl.arange(0, HALF)[None, :]
    src = tl.load(src_ptr + i).to(tl.int64)
    pos = tl.load(pos_ptr + i)
    cos = tl.load(cos_ptr + pos * stride_cos + c)
    sin = tl.load(sin_ptr + pos * stride_cos + c)
    x = x_ptr + src * stride_xt + h + c
    x1 = tl.load(x).to(tl.float32)
    x2 = tl.load(x + HALF).to(tl.float32)
    y = y_ptr + i.to(tl.int64) * stride_yt + h + c
    tl.store(y, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty))
    tl.store(y + HALF, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty))


@triton.jit
def _merge_chunk_states_kernel(
    oc_ptr, lc_ptr, oq_ptr, lq_ptr, out_ptr, q_len,
    CHUNKS_C: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
):
    """Token row i = (request r, token t): merge the question state (row i of oq / lq) with the
    CHUNKS_C chunk states (rows (r * CHUNKS_C + c) * q_len + t of oc / lc); FlashInfer LSE is log2."""
    i = tl.program_id(0)
    r = i // q_len
    t = i % q_len
    h = tl.arange(0, HEADS)
    hd = h[:, None] * D + tl.arange(0, D)[None, :]
    m = tl.load(lq_ptr + i * HEADS + h)
    acc = tl.load(oq_ptr + i.to(tl.int64) * HEADS * D + hd).to(tl.float32)
    w = tl.full([HEADS], 1.0, tl.float32)
    for c in tl.static_range(CHUNKS_C):
        row = ((r * CHUNKS_C + c) * q_len + t).to(tl.int64)
        lse = tl.load(lc_ptr + row * HEADS + h)
        o = tl.load(oc_ptr + row * HEADS * D + hd).to(tl.float32)
        m_new = tl.maximum(m, lse)
        a = tl.math.exp2(m - m_new)
        bw = tl.math.exp2(lse - m_new)
        acc = acc * a[:, None] + o * bw[:, None]
        w = w * a + bw
        m = m_new
    tl.store(out_ptr + i.to(tl.int64) * HEADS * D + hd, (acc / w[:, None]).to(out_ptr.dtype.element_ty))


def query_rotation_prefill(fi, lay: Layout, stored, rope, scale, bench, gen) -> dict:
    """Prefill of the question in the query-rotation design, on FlashInfer's prefill core: keys
    stored rotated at chunk-local positions (question keys at their own positions); one pass writes
    the query rotated for each chunk (to position - chunk offset + local start) and at its own
    positions; FlashInfer paged prefill runs the (request, chunk) sub-sequences non-causally and the
    question causally, returning LSEs; one kernel merges the 6 states a token. Checked against the
    lazy kernel on the same inputs."""
    from lazyrt.kernels.triton_attention import lazy_attention_triton

    B, ppr, dev = lay.batch, lay.pages_per_req, lay.kv.device
    cpages, qpages, T = CHUNK_TOKENS // PAGE, QUESTION // PAGE, QUESTION
    q_raw = torch.randn(B * T, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    qpos = torch.arange(CHUNKS * CHUNK_TOKENS, CHUNKS * CHUNK_TOKENS + T, device=dev)
    r_idx = torch.arange(B, device=dev)
    shift = torch.tensor([lay.chunk_start[c] - lay.local_start for c in range(CHUNKS)], device=dev)
    # rows (r, c, t) for the chunk copies, then (r, t) for the question
    src = torch.cat([
        (r_idx[:, None, None] * T + torch.arange(T, device=dev)).expand(B, CHUNKS, T).flatten(),
        torch.arange(B * T, device=dev),
    ]).int()
    pos = torch.cat([
        (qpos[None, None, :] - shift[None, :, None]).expand(B, CHUNKS, T).flatten(),
        qpos.repeat(B),
    ]).int()
    n_c = B * CHUNKS * T
    q_all = torch.empty(src.numel(), Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    idx = lay.indices.view(B, ppr)

    def plan(n_seq, q_per, pages_per, indices, causal, backend="auto"):
        return flashinfer_prefill(
            fi, torch.empty(256 << 20, dtype=torch.uint8, device=dev),
            torch.arange(0, n_seq * q_per + 1, q_per, dtype=torch.int32, device=dev),
            torch.arange(0, n_seq * pages_per + 1, pages_per, dtype=torch.int32, device=dev),
            indices.contiguous(), causal, backend,
        )  # fmt: skip

    pre_c = plan(B * CHUNKS, T, cpages, idx[:, : CHUNKS * cpages].reshape(-1), False)
    pre_q = plan(B, T, qpages, idx[:, CHUNKS * cpages :].reshape(-1), True)
    out = torch.empty(B * T, Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)

    def rotate():
        _rope_gather_kernel[(src.numel(),)](
            q_raw, q_all, src, pos, rope.cos, rope.sin, q_raw.stride(0), q_all.stride(0), rope.cos.stride(0),
            HEADS=Q_HEADS, HALF=HEAD_DIM // 2, num_warps=4,
        )

    def merge(oc, lc, oq, lq):
        _merge_chunk_states_kernel[(B * T,)](
            oc, lc, oq, lq, out, T, CHUNKS_C=CHUNKS, HEADS=Q_HEADS, D=HEAD_DIM, num_warps=4
        )

    def run():
        rotate()
        oc, lc = pre_c.run(q_all[:n_c], stored, return_lse=True)
        oq, lq = pre_q.run(q_all[n_c:], stored, return_lse=True)
        merge(oc, lc, oq, lq)
        return out

    got = run().clone()
    meta = lazy_meta(lay, T)
    q_abs = apply_rope_ref(q_raw.float(), meta.positions, rope).to(torch.bfloat16)
    ref = lazy_attention_triton(q_abs, lay.kv, meta, rope, scale, max_q_len=T, max_kv_entries=ppr)
    row = {"qrot_prefill_us": bench(run), "qrot_prefill_rel_err_vs_lazy": rel_err(got, ref)}
    # where the time goes: each piece alone
    oc, lc = pre_c.run(q_all[:n_c], stored, return_lse=True)
    oq, lq = pre_q.run(q_all[n_c:], stored, return_lse=True)
    row["qrot_rotate_us"] = bench(rotate)
    row["qrot_chunks_us"] = bench(lambda: pre_c.run(q_all[:n_c], stored, return_lse=True))
    row["qrot_question_us"] = bench(lambda: pre_q.run(q_all[n_c:], stored, return_lse=True))
    row["qrot_merge_us"] = bench(lambda: merge(oc, lc, oq, lq))
    for backend in ("fa2", "fa3"):
        try:
            w = plan(B * CHUNKS, T, cpages, idx[:, : CHUNKS * cpages].reshape(-1), False, backend)
            row[f"qrot_chunks_{backend}_us"] = bench(lambda w=w: w.run(q_all[:n_c], stored, return_lse=True))
        except Exception as e:  # noqa: BLE001
            print(f"{backend}: {type(e).__name__}: {e}", file=sys.stderr)
    return row


def sweep_extend(batches, gen, rope, scale, bench) -> None:
    from lazyrt.kernels import triton_attention as ta

    for B in batches:
        lay = build_layout(B, "cuda", gen)
        meta = lazy_meta(lay, QUESTION)
        qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
        ref = ta.lazy_attention_triton(qp, lay.kv, meta, rope, scale, max_q_len=QUESTION)
        for rows in (64, 128, 256):
            for block_n in (32, 64):
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = (
                            rows,
                            block_n,
                            warps,
                            stages,
                        )
                        f = functools.partial(
                            ta.lazy_attention_triton,
                            qp,
                            lay.kv,
                            meta,
                            rope,
                            scale,
                            max_q_len=QUESTION,
                            max_kv_entries=lay.pages_per_req,
                        )
                        try:
                            err = rel_err(f(), ref)
                            us = bench(f)
                        except Exception as e:  # noqa: BLE001
                            print(f"B={B} rows={rows} n={block_n} w={warps} s={stages}: {type(e).__name__}")
                            continue
                        print(
                            f"SWEEP B={B} rows={rows} n={block_n} w={warps} s={stages}: {us:.1f}us {err=:.0e}"
                        )


def print_table(results: list[dict]) -> None:
    cols = [
        "batch",
        "lazy_decode_us",
        "flashinfer_decode_us",
        "decode_ratio",
        "flashinfer_rope_decode_us",
        "qrot_decode_us",
        "materialize_us_per_req",
        "block_decode_us",
        "lazy_prefill_us",
        "flashinfer_prefill_us",
        "prefill_ratio",
        "qrot_prefill_us",
        "qrot_prefill_ratio",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)))
        print("| " + " | ".join(cells) + " |")
    errs = {k: max(r[k] for r in results if k in r) for r in results for k in r if "rel_err" in k}
    print("max relative errors:", json.dumps(errs))


if __name__ == "__main__":
    main()
