"""A question step's attention over cached documents: piece size, work-item rows, tiles and the merge.

A lone request's question (16 tokens over 5 x 2,048 cached tokens) goes through the shared-chunk
kernel with the documents cut into pieces (step_inputs.lone_arrays); on an H100 at f83cc77 its
layer took 32.8 us + 11.6 us of merge against ~14 us to read its 42 MB of KV once (ttft_profile.py).
This times, on shared_chunk_bench.py's step (Llama-3.1-8B heads, bf16, one layer, CUDA-graph
replay), at batch 1 and a few requests at once:
- the shared kernel per (piece tokens, pairs an item, key block, stages, register cap; "auto": the
  engine's launch_settings for the launch's items);
- the merge: one program per (row, 4 heads) looping over parts (merge_parts_triton), and one per
  (row, head) over blocks of parts (merge_parts_blocked_triton);
- the per-request lazy kernel and FlashInfer's paged prefill without RoPE on the same pages.

    python benchmarks/experiments/lone_question.py [--batches 1 4] [--q-len 16] [--kv-heads 4]
        [--cold-layers 16] [--out F]

(--cold-layers N: the kernels run over N layers' pools in turn and each launch's time is the total / N,
so that, as in a model's step, no launch finds its KV in L2.)

Prints the fastest configurations per batch and each merge's largest difference from the default
merge (must stay at fp32 rounding). GPU only.
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

from benchmarks.shared_chunk_bench import build_step, flashinfer_run  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

MERGES = ("loop_h4", "blocked_p8", "blocked_p16", "blocked_p32")
DEFAULT = (512, 16, 64, "auto")  # the engine's lone question: pieces, pairs an item, key block, settings
# (key block, stages, register cap; None: launch_settings' choice) timed per piece
TILES = ((64, 2, 0), (64, 3, 0), (32, 3, 0), (32, 4, 0), (128, 2, 0))
# the engine's, and each (stages, register cap) it could take
ENGINE_TILES = ((64, None, None), (64, 1, 0), (64, 2, 0), (64, 1, 168), (64, 2, 168))


def one_step(B: int, a, bp: int, rope: RopeCache, scale: float, bench, ref: dict, tiles=TILES) -> list[dict]:
    """Rows for one step cut into a.piece_tokens pieces, bp pairs an item: each tile x the merges.
    ref: the per-request and FlashInfer times of the batch, filled on its first call."""
    from lazyrt.kernels.triton_attention import lazy_attention_triton
    from lazyrt.kernels.triton_shared_chunk import (
        merge_parts_blocked_triton,
        merge_parts_triton,
        shared_chunk_attention_triton,
    )

    kv, full, shared, _ = build_step(B, a, random.Random(a.seed), "cuda", bp)
    q = torch.randn(B * a.q_len, 4 * a.kv_heads, 128, device="cuda", dtype=torch.bfloat16)  # groups of 4
    # --cold-layers: the step over that many layers' pools, one launch each, timed per launch (a
    # model's step reads each layer's KV once: a lone layer replayed keeps part of it in L2)
    layers = [kv] + [torch.randn_like(kv) for _ in range(a.cold_layers - 1)]

    def bench_layers(launch) -> float:  # launch(kv) -> output of the last layer
        return bench(lambda: [launch(k) for k in layers][-1]) / len(layers)

    if not ref:
        ref["per_request_us"] = bench_layers(lambda k: lazy_attention_triton(q, k, full, rope, scale))
        try:
            if not a.skip_flashinfer:
                ref["flashinfer_us"] = bench(flashinfer_run(full, q, kv, a.q_len))
        except Exception as e:  # noqa: BLE001
            print(f"flashinfer skipped: {type(e).__name__}: {str(e)[:100]}")
        print(json.dumps({"batch": B, **{k: round(v, 1) for k, v in ref.items()}}), flush=True)
    def sh_on(k: torch.Tensor, **kw):
        return shared_chunk_attention_triton(q, k, full.positions, shared, rope, scale, **kw)

    sh = functools.partial(sh_on, kv)
    o, lse = sh()
    want = merge_parts_triton(o, lse, shared, q.dtype).float()
    merges = {"loop_h4": bench(lambda: merge_parts_triton(o, lse, shared, q.dtype))}
    diff = 0.0
    for pb in (8, 16, 32):
        m = functools.partial(merge_parts_blocked_triton, o, lse, shared, q.dtype, pb)
        merges[f"blocked_p{pb}"] = bench(m)
        diff = max(diff, float((m().float() - want).abs().max()))
    best_merge = min(merges, key=merges.get)
    rows = []
    for bn, stages, nreg in tiles:
        setting = "auto" if stages is None else f"s{stages}" + (f" r{nreg}" if nreg else "")
        try:
            us = bench_layers(functools.partial(sh_on, block_n=bn, num_stages=stages, maxnreg=nreg))
        except Exception as e:  # noqa: BLE001 (out of shared memory)
            print(f"skip {a.piece_tokens} {bp} {bn} {setting}: {type(e).__name__}")
            continue
        rows.append({
            "batch": B, "piece": a.piece_tokens, "block_pairs": bp, "block_n": bn, "stages": setting,
            "items": shared.num_work_host * a.kv_heads,
            "parts_per_row": round(shared.num_pairs / (B * a.q_len), 1),
            "shared_us": round(us, 1), **{f"merge_{k}_us": round(v, 1) for k, v in merges.items()},
            "best_merge": best_merge, "total_us": round(us + merges[best_merge], 1),
            "merge_max_abs_diff": diff, **{k: round(v, 1) for k, v in ref.items()},
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--q-len", type=int, default=16)
    ap.add_argument("--pieces", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--block-pairs", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--engine-tile", action="store_true",
                    help="time only the engine's key block, with its settings and each one it picks from")
    ap.add_argument("--engine-choice", action="store_true",
                    help="time only the engine's key block and settings")
    ap.add_argument("--kv-heads", type=int, default=8,
                    help="KV heads (query heads: 4x): 4 is a rank's share of Llama-3.1-8B at TP=2")
    ap.add_argument("--skip-flashinfer", action="store_true",
                    help="no FlashInfer reference (its JIT build for a new head count takes minutes)")
    ap.add_argument("--cold-layers", type=int, default=1,
                    help="time the kernels over this many layers' KV (1: one layer replayed, partly in L2)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="the documents' Zipf draw (a table each): how many work items a draw gives moves "
                    "where a launch's last round of programs falls")
    ap.add_argument("--split-last-round", choices=("on", "off", "both"), default="on",
                    help="cut the longest pieces that spill into a last round "
                    "(shared_chunk.split_last_round, as the engine groups) or not")
    ap.add_argument("--split-parts", type=int, nargs="+", default=[4],
                    help="with the cut on: the parts a cut piece becomes (a row each)")
    ap.add_argument("--split-share", type=float, default=0.5,
                    help="with the cut on: the largest last round, as a share of a round, that is cut")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tiles = ENGINE_TILES[:1] if args.engine_choice else ENGINE_TILES if args.engine_tile else TILES
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    base = argparse.Namespace(docs=5, doc_tokens=2048, private=args.q_len, pool=100, alpha=2.1,
                              q_len=args.q_len, piece_tokens=None, seed=0, kv_heads=args.kv_heads,
                              skip_flashinfer=args.skip_flashinfer, cold_layers=max(1, args.cold_layers))
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, base.docs * base.doc_tokens + base.private + 1, "cuda")
    scale = 128**-0.5

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1000.0

    rows = []
    for seed, B in itertools.product(args.seeds, args.batches):
        ref: dict = {}
        on = [(True, n) for n in args.split_parts]
        splits = {"on": on, "off": [(False, 0)], "both": on + [(False, 0)]}[args.split_last_round]
        for piece, bp, (split, parts) in itertools.product(args.pieces, args.block_pairs, splits):
            opts = {"piece_tokens": piece, "seed": seed, "split_last_round": split, "split_parts": parts,
                    "split_share": args.split_share}
            a = argparse.Namespace(**{**vars(base), **opts})
            rows += [dict(r, **opts) for r in one_step(B, a, bp, rope, scale, bench, ref, tiles)]
            for r in rows[-len(tiles):]:
                print(f"seed {seed} batch {B} piece {piece} split {split} parts {parts} {r['stages']}: "
                      f"{r['items']} items, shared {r['shared_us']} us, total {r['total_us']} us", flush=True)
            torch.cuda.empty_cache()
    print("| seed | batch | piece | pairs an item | key block | stages, registers | items | parts a row "
          "| shared us | merge loop h4 / blocked p8 / p16 / p32 us | total us | per-request us "
          "| FlashInfer us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seed, B in itertools.product(args.seeds, args.batches):
        mine = sorted([r for r in rows if (r["seed"], r["batch"]) == (seed, B)], key=lambda r: r["total_us"])
        default = [r for r in mine if (r["piece"], r["block_pairs"], r["block_n"], r["stages"]) == DEFAULT]
        for r in mine[:6] + default:
            merges = " / ".join(str(r[f"merge_{k}_us"]) for k in MERGES)
            print(f"| {seed} | {B} | {r['piece']} | {r['block_pairs']} | {r['block_n']} | {r['stages']} "
                  f"| {r['items']} | {r['parts_per_row']} | {r['shared_us']} | {merges} | {r['total_us']} | "
                  f"{r['per_request_us']} | {r.get('flashinfer_us', '-')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
