"""One layer of documents' own prefill (each after a 24-token prefix) at the Llama-3.1-8B attention
shape, bf16: the lazy Triton kernel against the ragged FlashInfer path (--lazy-flashinfer-prefill),
same pages, us per layer (CUDA events, median of 20), store included. With --decodes N the step also
holds N running decodes of --decode-context tokens (the usual step under load): the ragged path then
splits (the documents through FlashInfer, the decodes through the lazy kernel), and the lazy kernel is
also timed with the decodes in a launch of their own (ragged_prefill.decode_split, the engine's path
for mixed steps that do not take FlashInfer). With --prior-tokens P
each document sequence has P cached keys before its --doc-tokens new ones (a long document's second
prefill step, or a long question over cached documents): the what-if behind the rule of at most 2 keys
a new token (the ragged path is timed whatever the ratio). With --lazy-splits S... the one lazy launch
is also timed with its key splits forced to each S (the launch's own pick is the "lazy kernel"
column), appended to the row: the sweep behind extend_num_splits' whole-wave rule.

    python benchmarks/experiments/ragged_vs_lazy.py [--docs 1 4] [--doc-tokens 2048] [--decodes 0 32]
    python benchmarks/experiments/ragged_vs_lazy.py --docs 1 8 --doc-tokens 16 64 256 --prior-tokens 8192
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from lazyrt.kernels.backend import TritonAttentionBackend
from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import RaggedKeys, contiguous_keys, decode_split, rows_index, split_keys
from lazyrt.kernels.rope import RopeCache
from lazyrt.kernels.triton_attention import lazy_attention_triton
from lazyrt.models.config import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--docs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--doc-tokens", type=int, nargs="+", default=[2048], help="new tokens a sequence")
    p.add_argument("--prior-tokens", type=int, nargs="+", default=[0], help="cached keys before them")
    p.add_argument("--decodes", type=int, nargs="+", default=[0], help="running decodes in the step")
    p.add_argument("--decode-context", type=int, default=10240, help="each decode's keys")
    p.add_argument("--lazy-splits", type=int, nargs="*", default=[],
                   help="also time the one lazy launch with its keys split S ways")
    args = p.parse_args()
    hq, hk, d, prefix = 32, 8, 128, 24
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    rope = RopeCache.build(ModelConfig("llama", 1000, hq * d, 1, 1, hq, hk, d, rope_theta=500000.0,
                                       rope_scaling=scaling), 16384, "cuda")  # fmt: skip
    print(f"{torch.cuda.get_device_name()}; sequences after a {prefix}-token prefix; decodes over "
          f"{args.decode_context} keys each")  # fmt: skip
    print("| sequences | new tokens | cached keys before | decodes | lazy kernel (us) | ragged FlashInfer "
          "(us) | ratio | lazy, decodes apart (us) | ratio |")
    print("|---:" * 9 + "|")
    for m in args.decodes:
        for prior in args.prior_tokens:
            for n in args.doc_tokens:
                for b in args.docs:
                    lazy, ragged, apart, err, forced = one_size(
                        b, n, prefix, rope, m, args.decode_context, prior, args.lazy_splits)
                    cells = f"{apart:.1f} | {apart / lazy:.2f}" if apart else "- | -"
                    split_cells = ", ".join(f"{k}: {us:.1f}" for k, us in forced.items())
                    tail = f" lazy split {split_cells} us" if forced else ""
                    print(f"| {b} | {n} | {prior} | {m} | {lazy:.1f} | {ragged:.1f} | {ragged / lazy:.2f} | "
                          f"{cells} | (rel diff {err:.1e}){tail}", flush=True)  # fmt: skip


def one_size(
    b: int, n: int, prefix: int, rope: RopeCache, decodes: int = 0, context: int = 0, prior: int = 0,
    lazy_splits: list[int] = (),
) -> tuple[float, float, float, float, dict[int, float]]:
    """(lazy us, ragged us, lazy with the decodes apart us (0: no decodes), relative difference, lazy
    us with its keys split S ways for each S of lazy_splits) for b sequences of n new tokens after
    prior cached ones (after decodes running decodes over context keys each, listed first as the
    scheduler lists running requests)."""
    dev, ps, hq, hk, d = "cuda", 16, 32, 8, 128
    # per sequence: its runs of tokens (each from a page boundary) and its new tokens, the last ones
    seqs = [((context,), 1)] * decodes + [((prefix, prior + n), n)] * b
    kv = torch.randn(sum(-(-m // ps) for runs, _ in seqs for m in runs) + 4, 2, ps, hk, d, device=dev,
                     dtype=torch.bfloat16)  # fmt: skip
    qo, kvp, idx, base, valid, pos, sp, ss = [0], [0], [], [], [], [], [], []
    nxt = 0
    for runs, new in seqs:
        at = 0
        for m in runs:
            pages = list(range(nxt, nxt + -(-m // ps)))
            nxt += len(pages)
            idx += pages
            base += [at + j * ps for j in range(len(pages))]
            valid += [min(ps, m - j * ps) for j in range(len(pages))]
            at += m
        pos += range(at - new, at)
        sp += [pages[j // ps] for j in range(runs[-1] - new, runs[-1])]
        ss += [j % ps for j in range(runs[-1] - new, runs[-1])]
        kvp.append(len(idx))
        qo.append(qo[-1] + new)

    def t(x, dt=torch.int32):
        return torch.tensor(x, dtype=dt, device=dev)

    meta = AttentionMetadata(t(qo), t(pos, torch.long), t(kvp), t(idx), t(base), t(valid),
                             t(sp, torch.long), t(ss, torch.long), rotate_keys=True, max_q_len=n,
                             max_kv_entries=max(y - x for x, y in zip(kvp, kvp[1:])))  # fmt: skip
    rmeta = AttentionMetadata(**meta.__dict__)
    keys = None if decodes else contiguous_keys(qo, pos, kvp, idx, base, valid, max_key_ratio=float("inf"))
    if keys is None:  # the decodes split off (they never fit: a ratio just under theirs lets the rest in)
        keys = split_keys(qo, pos, kvp, idx, base, valid, max_key_ratio=context / 1.01, min_tokens=1)
        rmeta.ragged_rest = AttentionMetadata.split_rest(keys, torch.device(dev))
    rmeta.ragged = RaggedKeys.from_arrays(keys, torch.device(dev))
    T = qo[-1]
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    tri = TritonAttentionBackend([kv], rope, d**-0.5)
    fi = FlashInferPrefillBackend(tri, [kv], rope, d**-0.5)
    times = {}
    runs = [("lazy", lambda: tri.forward(0, q, k, v, meta)),
            ("ragged", lambda: fi.forward(0, q, k, v, rmeta))]  # fmt: skip
    if decodes:  # the lazy kernel with the decodes in a launch of their own (the engine's decode_split)
        pmeta = AttentionMetadata(**meta.__dict__)
        parts = decode_split(qo, pos, kvp, idx, base, valid, min_keys=1)
        pmeta.parts = tuple((rows_index(p["rows"], torch.device(dev)),
                             AttentionMetadata.from_tables(p, torch.device(dev))) for p in parts)  # fmt: skip
        runs.append(("apart", lambda: tri.forward(0, q, k, v, pmeta)))

    def forced_launch(splits: int) -> None:  # the step's store, then the lazy kernel split `splits` ways
        tri._store(kv, k, v, meta.store_pages, meta.store_slots)
        lazy_attention_triton(q, kv, meta, rope, d**-0.5, num_splits=splits)

    runs += [(sp, functools.partial(forced_launch, sp)) for sp in lazy_splits]
    for name, fn in runs:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        times[name] = statistics.median(ts)
    want = tri.forward(0, q, k, v, meta).float()
    err = (fi.forward(0, q, k, v, rmeta).float() - want).norm() / want.norm()
    if decodes:
        err = max(err, (tri.forward(0, q, k, v, pmeta).float() - want).norm() / want.norm())
    for splits in lazy_splits:
        got = lazy_attention_triton(q, kv, meta, rope, d**-0.5, num_splits=splits).float()
        err = max(err, (got - want).norm() / want.norm())
    forced = {sp: times[sp] for sp in lazy_splits}
    return times["lazy"], times["ragged"], times.get("apart", 0.0), float(err), forced


if __name__ == "__main__":
    main()
