"""On-device sweep of the lazy attention kernel's tiles at the RAG shape, against FlashInfer.

    python benchmarks/experiments/sweep_kernels.py --batches 1 4 16 64 [--decode-batches 1 4]
        [--skip-flashinfer] [--extend-set full|stages|slots|bound|rot] [--decode-set tiles|flags|rot]
        [--budget-s S] [--then-bench B...]

Extend (the 128-token question over 5 x 2,048 chunk keys): every (rows, keys/step, warps,
stages, 16-bit rotation) variant below, timed like benchmarks/kernels.py (median CUDA-graph
replay) on the same pages as FlashInfer's paged prefill without RoPE; each variant is checked
against the default variant's output (--extend-set stages: the committed tiles and a few stage
counts; slots: split slots per SM instead). Decode (--decode-set tiles): PDL merge, keys/step,
splits, stages and warps vs FlashInfer decode; (flags): 16-bit rotation math (DECODE_ROT_LOWP 0 / 1 / 2).
--extend-set bound: only the default with and without key rotation (the most a design without
per-key rotation could gain).
--decode-set rot / --extend-set rot: per-key cos/sin gather vs angle addition x 16-bit math (ROT_VARIANTS),
each with its error vs the fp32 reference, and the same kernel without rotation.
--then-bench B...: then benchmarks/kernels.py's rows with the best extend and decode-flag choices.
Prints every result as it goes, then a short table of the best variant per batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.kernels import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    Q_HEADS,
    QUESTION,
    build_layout,
    lazy_meta,
    rel_err,
)
from lazyrt.kernels import triton_attention as ta  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

# extend tiles (rows, block_n, warps, stages) x flags (rotate in 16-bit math)
EXTEND_TILES = [(128, 32, 4, 2), (256, 64, 8, 2), (128, 128, 8, 2)]
EXTEND_FLAGS = [(False,), (True,)]
# --extend-set stages: the committed tiles and a few stage counts
EXTEND_TILES_STAGES = [(128, 32, 4, 2), (256, 64, 8, 2), (128, 64, 4, 3), (256, 64, 8, 3), (256, 128, 8, 2)]
EXTEND_FLAGS_STAGES = [(False,)]
DECODE_SPLITS = [None, 24, 48, 66]  # None: the kernel's own pick
DECODE_BLOCK_NS = [32, 64]
DEV = "cuda"


def set_extend(rows, block_n, warps, stages, lowp, large_min=10**9):
    """One explicit tile for every grid size (large_min=10**9 turns the large-grid tile off)."""
    ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = rows, block_n, warps, stages
    ta.EXTEND_ROT_LOWP, ta.EXTEND_LARGE_MIN_PER_SM = lowp, large_min


def choose(results) -> tuple:
    """Flags and (small-grid, large-grid) tiles with the lowest mean time / FlashInfer over batches
    (small grid: batch <= 4 at the RAG shape)."""
    ext = [r for r in results if r["kind"] == "extend" and r["fi_us"]]
    if not ext:
        return None
    best = None
    for f in EXTEND_FLAGS:
        for small in EXTEND_TILES:
            for large in EXTEND_TILES:
                rs = [r["us"] / r["fi_us"] for r in ext
                      if tuple(r["var"]) == (small if r["batch"] <= 4 else large) + f]
                if len(rs) != len({r["batch"] for r in ext}):
                    continue
                score = sum(rs) / len(rs)
                if best is None or score < best[0]:
                    best = (score, f, small, large)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[])
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--extend-set", choices=["full", "stages", "slots", "bound", "rot"], default="full",
                    help="stages: the committed tiles and a few stage counts; slots: the committed "
                         "small / large tile with 1-4 split slots per SM; rot: key-rotation "
                         "variants (angle addition x 16-bit math, ROT_VARIANTS)")
    ap.add_argument("--decode-set", choices=["tiles", "flags", "rot"], default="tiles",
                    help="tiles: PDL merge x keys/step x splits x stages/warps; flags: 16-bit "
                         "rotation math (then-bench applies the best by mean ratio to FlashInfer); "
                         "rot: key-rotation variants as --extend-set rot")
    ap.add_argument("--rounds", type=int, default=2, help="rot sets: timing rounds over all variants")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting variants after this")
    ap.add_argument("--then-bench", type=int, nargs="*", default=[],
                    help="then benchmarks/kernels.py's rows for these batches with the best extend choice")
    args = ap.parse_args()
    import triton.testing

    dev = DEV
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, 5 * 2048 + QUESTION + 1, dev)
    scale = HEAD_DIM**-0.5
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    fi = workspace = None
    if not args.skip_flashinfer:
        import flashinfer

        fi = flashinfer
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1000.0

    global EXTEND_TILES, EXTEND_FLAGS
    if args.extend_set == "stages":
        EXTEND_TILES, EXTEND_FLAGS = EXTEND_TILES_STAGES, EXTEND_FLAGS_STAGES
    variants = [t + f for f in EXTEND_FLAGS for t in EXTEND_TILES] if args.extend_set != "bound" else []
    deadline = time.time() + args.budget_s if args.budget_s else None
    default = (ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES, False)
    saved = (ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES, ta.EXTEND_ROT_LOWP,
             ta.EXTEND_LARGE_MIN_PER_SM)
    results: list[dict] = []
    for B in args.decode_batches:
        if args.decode_set == "rot":
            sweep_rot(B, 1, gen, rope, scale, fi, workspace, bench, results, args.rounds)
        elif args.decode_set == "flags":
            sweep_decode_flags(B, gen, rope, scale, fi, workspace, bench, results)
        else:
            sweep_decode_batch(B, gen, rope, scale, fi, workspace, bench, results, deadline)
        torch.cuda.empty_cache()
    for B in args.batches:
        if args.extend_set == "rot":
            sweep_rot(B, QUESTION, gen, rope, scale, fi, workspace, bench, results, args.rounds)
        elif args.extend_set == "slots":
            sweep_extend_slots(B, gen, rope, scale, bench, results, deadline)
        else:
            sweep_extend_batch(B, default, variants, gen, rope, scale, fi, workspace, bench, results,
                               deadline)
        torch.cuda.empty_cache()

    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)
    set_extend(*saved)
    if args.then_bench and fi is not None:
        # The full kernels.py benchmark with the chosen extend settings (decode unchanged).
        from benchmarks.kernels import bench_batch, print_table

        dbest = choose_decode(results)
        if dbest is not None:
            ta.DECODE_ROT_LOWP = dbest[1]
            print(f"CHOSEN-DECODE mean ratio {dbest[0]:.3f}: lowp={dbest[1]}")
        best = choose(results)
        if best is not None:
            _, (lowp,), small, large = best
            ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = small
            ta.EXTEND_LARGE = large
            ta.EXTEND_ROT_LOWP = lowp
            print(f"CHOSEN mean ratio {best[0]:.3f}: small {small} large {large} lowp={lowp}")
        rows = []
        for B in args.then_bench:
            rows.append(bench_batch(B, gen, rope, scale, fi, workspace, bench))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out.replace(".json", "_bench.json"), "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "chosen": best, "results": rows}, fh,
                          indent=1)
        print_table(rows)
    print("== best per batch (variant: rows, block_n, warps, stages, lowp | "
          "pdl, block_n, splits, stages, warps)")
    for kind in ("extend", "decode", "slots", "dflags", "rot_decode", "rot_extend"):  # ext_bound: as they run
        for B in sorted({r["batch"] for r in results if r["kind"] == kind}):
            rs = sorted((r for r in results if r["kind"] == kind and r["batch"] == B), key=lambda r: r["us"])
            fi_us = rs[0]["fi_us"]
            top = "; ".join(
                f"{r['var']} {r['us']:.1f}" + (f" x{r['us'] / fi_us:.2f}" if fi_us else "") for r in rs[:3])
            print(f"{kind} B={B} FI={fi_us and round(fi_us, 1)} | {top}")


def flashinfer_us(fi, workspace, bench, lay, meta, q, q_len: int) -> float:
    """FlashInfer without RoPE on the same pages: batch decode (q_len 1) or causal paged prefill."""
    last = torch.full((meta.kv_indptr.numel() - 1,), PAGE, dtype=torch.int32, device=DEV)  # full pages
    if q_len == 1:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        w.plan(meta.kv_indptr, lay.indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE,
               pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(meta.qo_indptr, meta.kv_indptr, lay.indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE,
               causal=True, pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    return bench(functools.partial(w.run, q, lay.kv))


def sweep_extend_batch(B, default, variants, gen, rope, scale, fi, workspace, bench, results,
                       deadline=None) -> None:
    dev = DEV
    lay = build_layout(B, dev, gen)
    ppr = lay.pages_per_req
    meta = lazy_meta(lay, QUESTION)
    qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    f = functools.partial(ta.lazy_attention_triton, qp, lay.kv, meta, rope, scale, max_q_len=QUESTION,
                          max_kv_entries=ppr)
    set_extend(*default)
    ref = f()
    fi_us = None
    if fi is not None:
        fi_us = flashinfer_us(fi, workspace, bench, lay, meta, qp, QUESTION)
        print(f"FI prefill B={B}: {fi_us:.1f}us", flush=True)
    us0 = bench(f)
    meta.rotate_keys = False  # same kernel and pages, keys taken as stored: what rotation costs
    us_norot = bench(f)
    meta.rotate_keys = True
    results.append({"kind": "ext_bound", "batch": B, "var": "default", "us": us0, "no_rotation_us": us_norot,
                    "fi_us": fi_us})
    ratio = (lambda us: f" x{us / fi_us:.2f}" if fi_us else "")
    print(f"EXT B={B} default: {us0:.1f}us{ratio(us0)}; no rotation: {us_norot:.1f}us{ratio(us_norot)}",
          flush=True)
    for var in variants:
        if deadline is not None and time.time() > deadline:
            print(f"EXT B={B}: time budget spent", flush=True)
            break
        set_extend(*var)
        try:
            err = rel_err(f(), ref)
            us = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"EXT B={B} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results.append({"kind": "extend", "batch": B, "var": var, "us": us, "err": err, "fi_us": fi_us})
        ratio = f" x{us / fi_us:.2f}" if fi_us else ""
        print(f"EXT B={B} {var}: {us:.1f}us{ratio} err={err:.1e}", flush=True)
    set_extend(*default)


DECODE_FLAGS = [0, 1, 2]  # DECODE_ROT_LOWP


def choose_decode(results):
    """(mean time / FlashInfer over batches, flags) of the best decode flag variant, or None."""
    rs = [r for r in results if r["kind"] == "dflags" and r["fi_us"] and r["err"] <= 1e-2]
    batches = {r["batch"] for r in rs}
    best = None
    for flags in DECODE_FLAGS:
        mine = [r["us"] / r["fi_us"] for r in rs if r["var"] == flags]
        if mine and len(mine) == len(batches):
            score = sum(mine) / len(mine)
            if best is None or score < best[0]:
                best = (score, flags)
    return best


def sweep_decode_flags(B, gen, rope, scale, fi, workspace, bench, results) -> None:
    lay = build_layout(B, DEV, gen)
    meta = lazy_meta(lay, 1)
    q = torch.randn(B, Q_HEADS, HEAD_DIM, generator=gen, device=DEV, dtype=torch.bfloat16)
    f = functools.partial(ta.lazy_attention_triton, q, lay.kv, meta, rope, scale, max_q_len=1,
                          max_kv_entries=lay.pages_per_req)
    ref = f()
    fi_us = None
    if fi is not None:
        fi_us = flashinfer_us(fi, workspace, bench, lay, meta, q, 1)
        print(f"FI decode B={B}: {fi_us:.1f}us", flush=True)
    saved = ta.DECODE_ROT_LOWP
    for var in DECODE_FLAGS:
        ta.DECODE_ROT_LOWP = var
        try:
            err = rel_err(f(), ref)
            us = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"DFLAGS B={B} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results.append({"kind": "dflags", "batch": B, "var": var, "us": us, "err": err, "fi_us": fi_us})
        ratio = f" x{us / fi_us:.2f}" if fi_us else ""
        print(f"DFLAGS B={B} lowp={var}: {us:.1f}us{ratio} err={err:.1e}", flush=True)
    ta.DECODE_ROT_LOWP = saved


# --decode-set / --extend-set rot: (rotation angles, 16-bit math) = (DECODE|EXTEND)_ROT_ANGLE,
# (DECODE|EXTEND)_ROT_LOWP. Angles 0: per-key cos/sin gather; 1: angle addition, slot rows hoisted;
# 2: angle addition, slot rows re-read per block. lowp 1: rotation in 16-bit math; 2: the angle
# combination too. "norot" = the same kernel with rotate_keys=False (the floor).
# (2, 0) and (1, 1) were measured once (session 3: angle 2 is 2-3x slower; (1, 1) between (1, 0) and
# (1, 2)) and left out. "default" = the committed settings (decode: angle addition only on small grids).
ROT_VARIANTS = [(0, 0), (0, 1), (1, 0), (1, 2)]


def sweep_rot(B, q_len, gen, rope, scale, fi, workspace, bench, results, rounds=2) -> None:
    """Rotation variants at one batch, decode (q_len 1) or extend (q_len = QUESTION), on the same
    pages as FlashInfer (decode / paged prefill, no RoPE). Each variant (and the committed default):
    error vs the fp32 torch reference (batches <= 4) and vs the committed default's output; time =
    min over `rounds` rounds of all variants (rounds interleave, so drift hits every variant alike)."""
    from lazyrt.kernels.attention_ref import lazy_attention_ref

    kind = "rot_decode" if q_len == 1 else "rot_extend"
    pre = "DECODE" if q_len == 1 else "EXTEND"
    lay = build_layout(B, DEV, gen)
    meta = lazy_meta(lay, q_len)
    q = torch.randn(B * q_len, Q_HEADS, HEAD_DIM, generator=gen, device=DEV, dtype=torch.bfloat16)
    f = functools.partial(ta.lazy_attention_triton, q, lay.kv, meta, rope, scale, max_q_len=q_len,
                          max_kv_entries=lay.pages_per_req)
    saved = getattr(ta, pre + "_ROT_ANGLE"), getattr(ta, pre + "_ROT_LOWP")
    saved_grid = ta.DECODE_ANGLE_MAX_GRID
    default_out = f()
    ref = None
    if B <= 4:
        ref = lazy_attention_ref(q.float(), lay.kv.float(), meta, rope, scale)
        print(f"{kind} B={B} committed default err vs fp32 ref {rel_err(default_out, ref):.1e}", flush=True)
    fi_us = None
    if fi is not None:
        fi_us = flashinfer_us(fi, workspace, bench, lay, meta, q, q_len)
    errs: dict = {"default": (rel_err(default_out, ref) if ref is not None else None, 0.0)}
    ta.DECODE_ANGLE_MAX_GRID = 1 << 30  # explicit variants: angle addition at every grid size
    for var in ROT_VARIANTS:
        setattr(ta, pre + "_ROT_ANGLE", var[0])
        setattr(ta, pre + "_ROT_LOWP", var[1])
        try:
            out = f()
        except Exception as e:  # noqa: BLE001
            print(f"{kind} B={B} {var}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        errs[var] = (rel_err(out, ref) if ref is not None else None, rel_err(out, default_out))
    times: dict = {}
    for _ in range(rounds):
        for var in list(errs) + ["norot"]:
            ta.DECODE_ANGLE_MAX_GRID = saved_grid if var in ("default", "norot") else 1 << 30
            if var in ("default", "norot"):
                setattr(ta, pre + "_ROT_ANGLE", saved[0])
                setattr(ta, pre + "_ROT_LOWP", saved[1])
                meta.rotate_keys = var == "default"
            else:
                setattr(ta, pre + "_ROT_ANGLE", var[0])
                setattr(ta, pre + "_ROT_LOWP", var[1])
            us = bench(f)
            meta.rotate_keys = True
            times[var] = min(times.get(var, us), us)
    setattr(ta, pre + "_ROT_ANGLE", saved[0])
    setattr(ta, pre + "_ROT_LOWP", saved[1])
    ta.DECODE_ANGLE_MAX_GRID = saved_grid
    for var, us in times.items():
        e_ref, e_def = errs.get(var, (None, None))
        results.append({"kind": kind, "batch": B, "var": var, "us": us, "fi_us": fi_us, "err_ref": e_ref,
                        "err_vs_default": e_def})
        ratio = f" x{us / fi_us:.3f}" if fi_us else ""
        err = (f" err_ref={e_ref:.1e}" if e_ref is not None else "") + (
            f" err_vs_default={e_def:.1e}" if e_def is not None else "")
        print(f"{kind} B={B} angle,lowp={var}: {us:.1f}us{ratio}{err}", flush=True)
    if fi_us:
        print(f"{kind} B={B} FlashInfer {fi_us:.1f}us", flush=True)


def sweep_extend_slots(B, gen, rope, scale, bench, results, deadline=None) -> None:
    """Split-KV slots per SM (EXTEND_SLOTS) for the committed small tile, and the large tile forced on
    small grids (EXTEND_LARGE_MIN_PER_SM=0) with 1-4 slots."""
    lay = build_layout(B, DEV, gen)
    meta = lazy_meta(lay, QUESTION)
    qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device=DEV, dtype=torch.bfloat16)
    f = functools.partial(ta.lazy_attention_triton, qp, lay.kv, meta, rope, scale, max_q_len=QUESTION,
                          max_kv_entries=lay.pages_per_req)
    ref = f()
    saved = ta.EXTEND_SLOTS, ta.EXTEND_LARGE_MIN_PER_SM
    for large_min, slots in [(saved[1], s) for s in (1, 2, 3, 4)] + [(0, s) for s in (1, 2, 4)]:
        if deadline is not None and time.time() > deadline:
            break
        ta.EXTEND_SLOTS, ta.EXTEND_LARGE_MIN_PER_SM = slots, large_min
        try:
            err = rel_err(f(), ref)
            us = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"SLOTS B={B} large_min={large_min} slots={slots}: {type(e).__name__}", flush=True)
            continue
        results.append({"kind": "slots", "batch": B, "var": (large_min, slots), "us": us, "err": err,
                        "fi_us": None})
        print(f"SLOTS B={B} large_min={large_min} slots={slots}: {us:.1f}us err={err:.1e}", flush=True)
    ta.EXTEND_SLOTS, ta.EXTEND_LARGE_MIN_PER_SM = saved


def sweep_decode_batch(B, gen, rope, scale, fi, workspace, bench, results, deadline=None) -> None:
    """Decode variants (PDL merge, keys/step, splits, stages, warps), each checked against the
    default's output."""
    dev = DEV
    lay = build_layout(B, dev, gen)
    ppr = lay.pages_per_req
    meta = lazy_meta(lay, 1)
    q = torch.randn(B, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    f0 = functools.partial(ta.lazy_attention_triton, q, lay.kv, meta, rope, scale, max_q_len=1,
                           max_kv_entries=ppr)
    ref = f0()
    fi_us = None
    if fi is not None:
        fi_us = flashinfer_us(fi, workspace, bench, lay, meta, q, 1)
        print(f"FI decode B={B}: {fi_us:.1f}us", flush=True)
    us0 = bench(f0)
    print(f"DEC B={B} default: {us0:.1f}us x{us0 / fi_us if fi_us else 0:.2f}", flush=True)
    meta.rotate_keys = False  # same kernel and pages, keys taken as stored: what rotation costs
    print(f"DEC B={B} default, no rotation: {bench(f0):.1f}us", flush=True)
    meta.rotate_keys = True
    saved = ta.DECODE_BLOCK_N_WIDE, ta.DECODE_BLOCK_N, ta.DECODE_STAGES, ta.DECODE_WARPS, ta.MERGE_PDL
    # (PDL merge, keys/step, splits, stages, warps)
    variants = [(pdl, bn, sp, 2, 4) for pdl in (True, False) for bn in DECODE_BLOCK_NS
                for sp in DECODE_SPLITS]
    variants += [(True, bn, None, st, w) for bn in DECODE_BLOCK_NS for st, w in ((3, 4), (2, 8), (3, 8))]
    for var in variants:
        if deadline is not None and time.time() > deadline:
            print(f"DEC B={B}: time budget spent", flush=True)
            break
        pdl, bn, sp, st, w = var
        ta.DECODE_BLOCK_N_WIDE = ta.DECODE_BLOCK_N = bn
        ta.DECODE_STAGES, ta.DECODE_WARPS, ta.MERGE_PDL = st, w, pdl
        f = functools.partial(f0, num_splits=sp)
        try:
            err = rel_err(f(), ref)
            us = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"DEC B={B} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results.append({"kind": "decode", "batch": B, "var": var, "us": us, "err": err,
                        "fi_us": fi_us, "default_us": us0})
        ratio = f" x{us / fi_us:.2f}" if fi_us else ""
        print(f"DEC B={B} pdl={pdl} n={bn} splits={sp} stages={st} warps={w}: "
              f"{us:.1f}us{ratio} err={err:.1e}", flush=True)
    ta.DECODE_BLOCK_N_WIDE, ta.DECODE_BLOCK_N, ta.DECODE_STAGES, ta.DECODE_WARPS, ta.MERGE_PDL = saved

if __name__ == "__main__":
    main()
