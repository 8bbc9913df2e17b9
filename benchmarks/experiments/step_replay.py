"""The shared-chunk kernel on an engine's own step inputs, replayed alone with variants (issue 17).

Runs decode_profile's workload (decode_roofline.make_workload: B RAG prompts by Zipf popularity)
eagerly, captures layer 0's shared-chunk call of the first timed decode step (q, the KV layer, the
step's SharedChunkMeta), then times the kernel on exactly those inputs (device_us: the profiler's
kernel records, L2 flushed before each launch), as the engine called it (with --load: as the
engine would launch that grouping now) and with:
- launch settings: pipeline stages / register cap, warps, key tile, persistent grid size;
- the same segments regrouped: pairs per work item (block_pairs), pieces re-cut smaller (each
  segment's pages split, its pairs' starts shifted), items ordered by their pair count;
- the pool's pages head-major (HND) instead of token-major (NHD, the pool's layout);
each variant's merged output checked against the engine call's.

Made to ask why a tensor-parallel rank's step (4 kv heads) takes 0.84x the 8-head step's kernel
time, not ~0.5x: `--model DIR` with a config of a rank's shape runs it on one GPU.

    python benchmarks/experiments/step_replay.py --batches 8 16 --model /path/rank4 --save DIR
    python benchmarks/experiments/step_replay.py --load docs/data/steps/*.npz   (no engine: the
        saved steps on random KV; `bash benchmarks/gpu_run.sh replay` on the GPU machine)

Saved steps (docs/data/steps/, H200, 2026-11-28, 530ce1a's grouping): decode steps of the Zipf 2.1
workload at batch 8 and 16 on a TP=2 rank's shape (rank4_config.json beside them) and at batch 16
and 64 on the Llama-3.1-8B shape (the default `--model llama-3.1-8b`); llama8b_question_b1.npz
(2026-11-29) is constructed, not captured: a lone 16-token question over 5 cached 2,048-token
documents in 512-token pieces, with the prefix's and the question's own runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.decode_roofline import add_workload_args, decode_step_seconds, make_workload  # noqa: E402
from benchmarks.experiments.decode_splits import head_major  # noqa: E402
from lazyrt.kernels import triton_shared_chunk as tsc  # noqa: E402
from lazyrt.kernels.shared_chunk import SharedChunkMeta, finish_arrays, wave_items  # noqa: E402


def host_flat(sh: SharedChunkMeta) -> dict[str, np.ndarray]:
    """The meta's segments as flatten_segments arrays (host)."""
    c = lambda t: t.cpu().numpy()  # noqa: E731
    return dict(kv_indptr=c(sh.chunk_kv_indptr), indices=c(sh.chunk_kv_indices), lens=c(sh.chunk_len),
                pair_indptr=c(sh.pair_indptr), rows=c(sh.pair_row), starts=c(sh.pair_start))  # fmt: skip


def recut(flat: dict[str, np.ndarray], piece: int, page_size: int) -> dict[str, np.ndarray]:
    """Each segment cut into pieces of `piece` tokens (whole pages), its pairs on every piece with
    their starts moved by the piece's offset."""
    pp = max(1, piece // page_size)
    kv, idx, lens, pi, rows, starts = [0], [], [], [0], [], []
    for c in range(len(flat["lens"])):
        pages = flat["indices"][flat["kv_indptr"][c]:flat["kv_indptr"][c + 1]]
        n = int(flat["lens"][c])
        prs = range(flat["pair_indptr"][c], flat["pair_indptr"][c + 1])
        for k in range(0, len(pages), pp):
            idx += pages[k:k + pp].tolist()
            kv.append(len(idx))
            lens.append(min(pp * page_size, n - k * page_size))
            rows += [flat["rows"][p] for p in prs]
            starts += [flat["starts"][p] + k * page_size for p in prs]
            pi.append(len(rows))
    a = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return dict(kv_indptr=a(kv), indices=a(idx), lens=a(lens), pair_indptr=a(pi), rows=a(rows),
                starts=a(starts))


def regroup(sh: SharedChunkMeta, page_size: int, block_pairs: int | None = None, piece: int | None = None,
            by_pairs: bool = False) -> SharedChunkMeta:  # fmt: skip
    flat = host_flat(sh)
    if piece:
        flat = recut(flat, piece, page_size)
    bp = block_pairs or sh.block_pairs
    arrays = finish_arrays(flat, sh.num_rows, bp)
    if by_pairs:  # items with the most pairs first, then the longest
        wc, wp = arrays["work_chunk"], arrays["work_pair"]
        npairs = np.minimum(arrays["pair_indptr"][wc + 1] - wp, bp)
        order = np.lexsort((-arrays["chunk_len"][wc], -npairs))
        arrays["work_chunk"], arrays["work_pair"] = wc[order], wp[order]
    return SharedChunkMeta.from_arrays(arrays, bp, sh.chunk_len.device)


def describe(sh: SharedChunkMeta) -> str:
    lens = sh.chunk_len.cpu().numpy()
    wc, wp = sh.work_chunk.cpu().numpy(), sh.work_pair.cpu().numpy()
    pi = sh.pair_indptr.cpu().numpy()
    npairs = np.minimum(pi[wc + 1] - wp, sh.block_pairs)
    long = lens[wc] >= 256
    mean = npairs[long].mean() if long.any() else 0.0
    return (f"{len(wc)} items ({int(long.sum())} of >= 256 keys, mean {mean:.1f} pairs each), "
            f"{sh.num_pairs} pairs, {int(lens.sum())} distinct keys")


def device_us(fn, device: torch.device, reps: int = 20) -> float:
    """Mean device time (us) of the shared-chunk kernel's launches in `reps` calls of fn, each after
    a 256 MB write that flushes L2, from the profiler's kernel records (host time between launches,
    which an event pair around an eager call counts, left out)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    times = [e.self_device_time_total for e in prof.events()
             if e.device_type == cuda and e.name.startswith("_shared_chunk")]  # fmt: skip
    return sum(times) / max(1, len(times))


def save_step(path: str, cap: tuple) -> None:
    """One captured call's inputs without the KV values (the kernel's time does not depend on them)."""
    q, kv, pos, sh, rope, scale, kw = cap
    arrays = {k: getattr(sh, k).cpu().numpy() for k in (
        "chunk_kv_indptr", "chunk_kv_indices", "chunk_len", "pair_indptr", "pair_row", "pair_start",
        "work_chunk", "work_pair", "num_work", "row_part_indptr", "row_parts")}  # fmt: skip
    np.savez(path, **arrays, positions=pos.cpu().numpy(), q_shape=np.asarray(q.shape),
             kv_shape=np.asarray(kv.shape), block_pairs=np.asarray(sh.block_pairs), scale=np.asarray(scale))


def saved_steps() -> list[str]:
    """The steps saved in docs/data/steps/ (save_step files), sorted."""
    saved = os.path.join(__file__.rsplit("/benchmarks/", 1)[0], "docs", "data", "steps")
    return sorted(os.path.join(saved, f) for f in os.listdir(saved) if f.endswith(".npz"))


def step_config(path: str, model: str) -> str:
    """The model a saved step belongs to: a config beside it (NAME_step_bB.npz -> NAME_config.json),
    else `model` (a folder with a config.json, a config.json file or a dummy preset's name)."""
    beside = path.rsplit("_step_b", 1)[0] + "_config.json"
    return beside if "_step_b" in path and os.path.isfile(beside) else model


def load_step(path: str, config: str, device: torch.device) -> tuple:
    """save_step's file as a call on random q and KV (bf16) in the saved shapes, the model's RoPE
    (config: as step_config's answer)."""
    from lazyrt.kernels.rope import RopeCache
    from lazyrt.models.config import ModelConfig
    from lazyrt.models.dummy import PRESETS

    z = np.load(path)
    names = ("chunk_kv_indptr", "chunk_kv_indices", "chunk_len", "pair_indptr", "pair_row", "pair_start",
             "work_chunk", "work_pair", "num_work", "row_part_indptr", "row_parts")  # fmt: skip
    sh = SharedChunkMeta(**{k: torch.from_numpy(z[k]).to(device) for k in names},
                         block_pairs=int(z["block_pairs"]), num_work_host=int(z["num_work"][0]),
                         wave_items_host=wave_items(z))  # fmt: skip
    pos = torch.from_numpy(z["positions"]).to(device)
    q = torch.randn(*z["q_shape"].tolist(), dtype=torch.bfloat16, device=device)
    kv = torch.randn(*z["kv_shape"].tolist(), dtype=torch.bfloat16, device=device)
    if os.path.isdir(config):
        config = os.path.join(config, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            cfg = ModelConfig.from_hf(json.load(f))
    else:  # a dummy preset's name
        cfg = ModelConfig.from_hf(dict(PRESETS[config]))
    rope = RopeCache.build(cfg, int(pos.max()) + 1024, device)
    return q, kv, pos, sh, rope, float(z["scale"]), {"programs": None}


def replay(b: int, cap: tuple, kernel, ps: int, rows: list) -> None:
    """Times the kernel on one captured call (q, kv, positions, meta, rope, scale, kwargs) and variants."""
    q, kv, pos, sh, rope, scale, kw = cap
    heads = kv.shape[3]
    o0, lse0 = kernel(q, kv, pos, sh, rope, scale, **kw)
    ref = tsc.merge_parts_triton(o0, lse0, sh, q.dtype).float()
    print(f"\n== batch {b}, {heads} kv heads, engine call {kw}: {describe(sh)}")

    def run(name, meta=sh, pool=kv, **over):
        args_kw = {**kw, **over}
        o, lse = kernel(q, pool, pos, meta, rope, scale, **args_kw)
        err = (tsc.merge_parts_triton(o, lse, meta, q.dtype).float() - ref).abs().max().item()
        us = device_us(lambda: kernel(q, pool, pos, meta, rope, scale, **args_kw), q.device)
        keys = int(meta.chunk_len.sum())
        gbs = keys * heads * kv.shape[4] * 2 * kv.element_size() / us / 1e3
        rows.append((b, heads, name, us, err))
        print(f"  {us:8.1f} us  {gbs:7.0f} GB/s  max|diff| {err:.1e}  {name}")

    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    run("engine call")
    run("programs = whole persistent grid", programs=tsc.persistent_programs(q.device))
    for st, nreg in ((2, 0), (1, 168), (2, 168), (1, 0), (3, 0)):
        run(f"stages {st}, maxnreg {nreg}", num_stages=st, maxnreg=nreg)
    run("8 warps", num_warps=8)
    run("8 warps, stages 2, maxnreg 0", num_warps=8, num_stages=2, maxnreg=0)
    for bn in (32, 128):
        run(f"block_n {bn}", block_n=bn)
    for per_sm in (1, 2, 3, 4):
        run(f"programs {per_sm} an SM", programs=sms * per_sm)
    for bp in (4, 8):
        m = regroup(sh, ps, block_pairs=bp)
        run(f"block_pairs {bp}: {describe(m)}", meta=m)
    run("items by pairs", meta=regroup(sh, ps, by_pairs=True))
    # 32 pairs (128 query rows) an item on two warpgroups: a key tile loaded and turned once for
    # twice the rows (a segment used by more than 16 requests is read by half as many items)
    m32 = regroup(sh, ps, block_pairs=32)
    for st, nreg in ((2, 0), (1, 0), (1, 168)):
        run(f"block_pairs 32, 8 warps, stages {st}, maxnreg {nreg}: {describe(m32)}", meta=m32, num_warps=8,
            num_stages=st, maxnreg=nreg)
    # the pool's pages head-major (FlashInfer's HND: a head's page is one contiguous run of page_size
    # x head_dim, where NHD, the pool's layout, interleaves the heads token by token); the kernel
    # takes strides, so a permuted view runs it unchanged
    hnd = head_major(kv)
    run("pool head-major (HND)", pool=hnd)
    run("pool head-major (HND), stages 2, maxnreg 0", pool=hnd, num_stages=2, maxnreg=0)
    del hnd
    for piece in (512, 256, 128):
        m = regroup(sh, ps, piece=piece)
        run(f"pieces of {piece}: {describe(m)}", meta=m)
        run(f"pieces of {piece}, stages 2 maxnreg 0", meta=m, num_stages=2, maxnreg=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, [16])
    p.add_argument("--save", default=None, help="folder: each batch's captured step as step_b{B}.npz")
    p.add_argument("--load", nargs="*", default=None,
                   help="save_step files to replay instead of running the engine (--model: the config dir)")
    args = p.parse_args()
    if args.load:
        rows: list = []
        for path in args.load:
            cap = load_step(path, step_config(path, args.model), torch.device("cuda"))
            b = int(path.rsplit("_b", 1)[1].split(".")[0])
            replay(b, cap, tsc.shared_chunk_attention_triton, cap[1].shape[2], rows)
        return
    args.cuda_graph_max_batch = 0  # eager: the kernel's Python call is where the capture happens

    captured: list = []
    armed = [False]
    kernel = tsc.shared_chunk_attention_triton

    def capture(q, kv, positions, meta, rope, sm_scale, **kw):
        if armed[0]:
            armed[0] = False
            captured.append((q.clone(), kv, positions.clone(), meta, rope, sm_scale, kw))
        return kernel(q, kv, positions, meta, rope, sm_scale, **kw)

    tsc.shared_chunk_attention_triton = capture  # the backend binds it when the engine is built
    eng, make_prompts, _ = make_workload(args)
    ps = eng.runner.pool.page_size
    rows = []
    for b in args.batches:
        captured.clear()

        @contextlib.contextmanager
        def arm():
            armed[0] = True
            yield

        decode_step_seconds(eng, make_prompts(b)[0], 1, around_steps=arm)
        if not captured:
            print(f"batch {b}: no shared-chunk call in the timed step")
            continue
        if args.save:
            save_step(f"{args.save}/step_b{b}.npz", captured[0])
        replay(b, captured[0], kernel, ps, rows)
    print("\nbatch heads      us  variant")
    for b, h, name, us, _ in rows:
        print(f"{b:5d} {h:5d} {us:7.1f}  {name[:70]}")


if __name__ == "__main__":
    main()
