"""Issue 15: plain key-IVF vs the attention-aware build of lazyrt.retrieval's KeyIndex, side by side,
on the default model's real keys and queries.

Per text: the first `--chunk` tokens are the chunk (pos_base 0); its keys and its own prefill
queries (rotated at local positions 0..chunk-1) build the index; the queries of the next `--queries`
tokens are the held-out test queries (never used to build). Methods (lazyrt.retrieval.build_key_index):
- key-IVF: k-means on the keys into lists of 8, probed in order of q . centroid (the build without
  queries: the current method);
- aware: the chunk's queries turned to offsets where later queries meet it (log-uniform in
  [chunk, model context)), keys clustered after whitening by their second moment, lists probed in
  order of a least-squares probe q . p + b fit to each list's best score. "aware 2-level" (the
  default aware build): lists of 4 keys in groups of 16 lists, groups probed the same way first,
  and only the lists of the best groups (holding 5x the keys to scan) scored; "aware flat": lists
  of 8, one level; --aware-configs adds 2-level builds of other shapes (keys/list, lists/group,
  group_scan);
- whitened only (ablation): the aware flat lists probed by their means, as key-IVF probes.
Columns: keys scanned = share of the indexed keys whose score a query head computes (mean); extra
products = products per query head spent choosing lists (one per list or group probe scored), as a
share of the indexed keys; recall@k = share of the exact top-k (over the indexed keys, sinks
excluded) among the top-k found. "union/KV" = share of the keys that the 3 query heads of one KV
head scan together (what one KV head's keys must be read for), and the recall@10 if every head of
the group took its top-k from that union. "shared/KV" = the recall@10 if the group's heads share ONE
scan of `scan` of the keys (lists by their best rank over the group's heads): keys read per KV head
= keys scanned. "far" = the same held-out queries turned to offsets drawn uniformly in [chunk,
model context) (a chunk placed earlier in a long prompt); exact top-k recomputed for them.

    python benchmarks/experiments/retrieval_recall_aware.py --layer-step 5
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from retrieval_recall import capture  # noqa: E402

from lazyrt.kernels.rope import RopeCache, apply_rope_ref  # noqa: E402
from lazyrt.retrieval.key_index import _probe, build_key_index, search_key_index  # noqa: E402


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    return (found[..., :, None] == exact[..., None, :]).any(-1).float().mean().item()


def evaluate(index, keys, q, scan, top_ks, group) -> dict:
    """keys [n, kv, d] local; q [m, heads, d] in the chunk's frame."""
    m, heads, d = q.shape
    head = torch.arange(heads) // group
    scores = torch.einsum("mhd,nhd->mhn", q, keys[index.sink :, head])  # [m, heads, indexed]
    groups = 0 if index.group_probes is None else index.group_probes.shape[1]
    out = {"lists": index.centroids.shape[1], "groups": groups, "extra": 0.0}
    for k in top_ks:
        found, share = search_key_index(index, keys, q, k, scan)
        out[f"r{k}"] = recall(found, scores.topk(k, -1).indices + index.sink)
        out["scan"] = share
    # union over each KV head's group of query heads
    union_share, union_hits, shared_hits = 0.0, 0.0, 0.0
    for h in range(keys.shape[1]):
        qh = q[:, h * group : (h + 1) * group].reshape(-1, d).float()
        probed, products = _probe(index, h, qh, scan)
        out["extra"] += products.mean().item() / index.num_indexed / keys.shape[1]
        probed = probed.view(m, group, -1).any(1)  # [m, lists]
        cand = probed[:, index.list_of[h]]  # [m, indexed]
        union_share += cand.float().mean().item() / keys.shape[1]
        s = scores[:, h * group : (h + 1) * group]
        got = s.masked_fill(~cand[:, None], float("-inf")).topk(top_ks[0], -1).indices
        union_hits += recall(got, s.topk(top_ks[0], -1).indices) / keys.shape[1]
        # one shared scan per KV head: lists by their best rank over the group's heads, until `scan`
        score = qh @ index.centroids[h].T
        if index.probes is not None:
            score = qh @ index.probes[h, :, :-1].T + index.probes[h, :, -1]
        best_rank = score.argsort(-1, descending=True).argsort(-1).view(m, group, -1).min(1).values
        order = best_rank.argsort(-1)
        sizes = index.offsets[h, 1:] - index.offsets[h, :-1]
        take = sizes[order].cumsum(-1) <= scan * index.num_indexed
        take[:, 0] = True
        shared = torch.zeros_like(take).scatter(1, order, take)[:, index.list_of[h]]  # [m, indexed]
        got = s.masked_fill(~shared[:, None], float("-inf")).topk(top_ks[0], -1).indices
        shared_hits += recall(got, s.topk(top_ks[0], -1).indices) / keys.shape[1]
    out["union"], out["union_r"], out["shared_r"] = union_share, union_hits, shared_hits
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="HF dir (default: the converted default model)")
    ap.add_argument(
        "--texts",
        nargs="+",
        default=["/usr/share/common-licenses/GPL-3", "README.md,docs/*.md"],
        help="texts; each a comma-separated list of file globs, concatenated",
    )
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=512, help="query positions after the chunk")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--scan", type=float, nargs="+", default=[0.05, 0.10])
    ap.add_argument("--layer-step", type=int, default=5, help="every Nth layer")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (build times)")
    ap.add_argument(
        "--aware-configs",
        nargs="*",
        default=[],
        help="more 2-level aware builds, each KEYS_PER_LIST/LISTS_PER_GROUP/GROUP_SCAN (e.g. 2/8/3)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = os.environ.get("LAZYRT_CACHE_DIR", os.path.expanduser("~/.cache/lazyrt"))
    model_dir = args.model_dir or sorted(glob.glob(f"{cache}/gguf/SmolLM2*"))[-1]
    L, top_ks = args.chunk, [10, 32]
    for spec in args.texts:
        files = [f for pat in spec.split(",") for f in sorted(glob.glob(pat))]
        text = "\n\n".join(open(f).read() for f in files)
        while len(text) < 8 * (L + args.queries):  # short texts: repeat (still real keys/queries)
            text += "\n\n" + text
        D = capture(model_dir, text, L + args.queries)
        H, KV = D["heads"], D["kv_heads"]
        d, G = D["q"].shape[-1] // H, H // KV
        max_pos = D["max_positions"] or 4 * L

        class Cfg:
            rope_theta, rope_scaling, rotary_dim = D["theta"], None, d

        rope = RopeCache.build(Cfg, max_pos)
        gen = torch.Generator().manual_seed(0)
        far_pos = torch.randint(L, max_pos, (args.queries,), generator=gen)
        acc: dict[tuple, dict] = {}
        layers = list(range(0, D["q"].shape[0], args.layer_step))
        for layer in layers:
            keys = apply_rope_ref(D["k"][layer, :L].view(L, KV, d), torch.arange(L), rope)
            own = apply_rope_ref(D["q"][layer, :L].view(L, H, d), torch.arange(L), rope)
            raw = D["q"][layer, L:].view(-1, H, d)
            tests = {"real": apply_rope_ref(raw, torch.arange(L, L + args.queries), rope),
                     "far": apply_rope_ref(raw, far_pos, rope)}  # fmt: skip
            aware = {"queries": own, "rope": rope}
            methods = [
                ("key-IVF", {"keys_per_list": 8}),
                ("aware flat", {**aware, "keys_per_list": 8, "lists_per_group": 1 << 30}),
                ("whitened only", None),  # ablation: the aware flat lists, probed by their means
                ("aware 2-level", aware),
            ]
            for cfg in args.aware_configs:
                kpl, lpg, gs = cfg.split("/")
                extra = {"keys_per_list": int(kpl), "lists_per_group": int(lpg), "group_scan": float(gs)}
                methods.append((f"aware 2-level {cfg}", {**aware, **extra}))
            index = None
            for method, kw in methods:
                if kw is None and index is not None:
                    index = dataclasses.replace(index, probes=None)
                else:
                    t0 = time.perf_counter()
                    index = build_key_index(keys, args.sink, **kw)
                    build_s = time.perf_counter() - t0
                for scan in args.scan:
                    for name, q in tests.items():
                        r = evaluate(index, keys, q, scan, top_ks, G)
                        r["build_s"] = build_s
                        a = acc.setdefault((method, scan, name), {})
                        for key, v in r.items():
                            a[key] = a.get(key, 0.0) + v / len(layers)
        print(f"\n### {spec}: {L}-token chunk, {args.queries} held-out queries, layers {layers}, "
              f"{KV} KV heads x {G} query heads, sink {args.sink}\n")  # fmt: skip
        cols = ["method", "lists / groups", "target scan", "keys scanned", "extra products", "recall@10",
                "recall@32", "union/KV: keys", "union/KV: recall@10", "shared/KV: recall@10", "far recall@10",
                "far recall@32", "build s / chunk-layer"]  # fmt: skip
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for (method, scan, name), r in sorted(acc.items(), key=lambda kv: kv[0][1]):
            if name != "real":
                continue
            f = acc[(method, scan, "far")]
            # fmt: off
            row = [method, f"{r['lists']:.0f} / {r['groups']:.0f}", f"{scan:.2f}", f"{r['scan']:.3f}",
                   f"{r['extra']:.3f}", f"{r['r10']:.3f}", f"{r['r32']:.3f}", f"{r['union']:.3f}",
                   f"{r['union_r']:.3f}", f"{r['shared_r']:.3f}", f"{f['r10']:.3f}", f"{f['r32']:.3f}",
                   f"{r['build_s']:.2f}"]
            # fmt: on
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
