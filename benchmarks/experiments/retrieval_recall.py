"""Issue 15 groundwork: how well does an inverted-file index over ONE chunk's keys find each query's
top-k keys, on the default model's real keys and queries?

A chunk's keys rotated at chunk-LOCAL positions, R(s) k_s, serve every request that uses the chunk:
a query at position p of a request where the chunk starts at pos_base b scores R(p - b) q . R(s) k.
So one index per (chunk, layer, KV head) is built once. Here: the first `--chunk` tokens of a text
are the chunk (pos_base 0, so the in-context keys are the chunk's own); the next tokens' queries are
the test queries. The first `--sink` keys (attention sinks) are left out of the index (always
attended exactly). Keys are clustered by lazyrt.retrieval.key_index.kmeans (the index's k-means) into
C lists; a query probes lists in order of its inner product with their centroids until the scanned
keys reach a target share; recall@k = share of the exact top-k among the top-k of the scanned keys.
Scan counts keys only; the C centroid products are reported beside it.

--shared adds a second table: per-query-head vs SHARED list choice per KV head (GQA group), on the
index the runtime builds (lazyrt.retrieval.build_key_index, plain: lists of KEYS_PER_LIST keys, by
centroid). "per-head": each query head ranks the lists by its own q . centroid and scans them best
first while they hold at most `scan` of the keys (at least one list): search_key_index. "shared max" /
"shared sum": the group's query heads of one token share ONE candidate set: lists ranked by the max
(RetrievalOptions.share_lists, lazyrt/retrieval/device_fill.py) or the sum over the group's heads of
q . centroid, taken best first while they hold at most `mult` x `scan` of the keys; each head then
keeps its own exact top-k of those candidates. Keys read / KV head / token: the key rows gathered
for one token of one KV head (per-head: each of the G heads gathers its own candidates, G x its
scan; shared: one set); distinct: the union of the group's candidates (both as counts and as a
share of the indexed keys). Default model, GPL-3 and Apache-2.0, 10 layers, 512 queries: at the
same budget sharing (max) loses 0.11-0.13 of recall@10 (per-head 0.87 -> 0.73-0.76 at 5%); the sum
ranks better than the max; shared sum at 2x the budget matches per-head recall@10 (0.87 at 5%, 0.94
at 10%) reading 0.68x the key rows, and at 3x (the group; the rows per-head gathers) beats it.

    python benchmarks/experiments/retrieval_recall.py --text /usr/share/common-licenses/GPL-3
    python benchmarks/experiments/retrieval_recall.py --shared --lists 256 --scan 0.05 0.10
"""

from __future__ import annotations

import argparse
import glob
import os

import torch

from lazyrt.retrieval.key_index import KEYS_PER_LIST, build_key_index, kmeans


def capture(model_dir: str, text: str, tokens: int) -> dict:
    """Pre-RoPE q and k of every layer (HF transformers forward hooks on q_proj / k_proj)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(text)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"--text has {len(ids)} tokens; need {tokens} (--chunk + --queries)")
    qs, ks = {}, {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: qs.__setitem__(i, out[0]))
        layer.self_attn.k_proj.register_forward_hook(lambda m, a, out, i=i: ks.__setitem__(i, out[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    c = model.config
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    return {
        "q": torch.stack([qs[i] for i in sorted(qs)]),
        "k": torch.stack([ks[i] for i in sorted(ks)]),
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "theta": float(theta),
        "max_positions": int(getattr(c, "max_position_embeddings", 0) or 0),
    }


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, rotate-half convention (Llama), x [n, d] at positions pos [n]."""
    d = x.shape[-1]
    f = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)[None]
    cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
    return x * cos + torch.cat([-x[:, d // 2 :], x[:, : d // 2]], -1) * sin


def shared_compare(keys: torch.Tensor, q: torch.Tensor, sink: int, scans, mults, top_ks) -> dict:
    """keys [L, kv, d] rotated at local positions; q [T, kv, G, d] in the chunk's frame. Per (mode,
    mult, scan, k): [recall@k, keys read / KV head / token, distinct keys / KV head / token], each the
    mean over KV heads (and tokens, query heads)."""
    index = build_key_index(keys, sink)  # the runtime's plain build: lists of KEYS_PER_LIST keys
    n, (T, KV, G, _) = index.num_indexed, q.shape
    out: dict[tuple, list[float]] = {}
    for h in range(KV):
        qh = q[:, h].float()  # [T, G, d]
        scores = qh @ keys[sink:, h].float().T  # [T, G, n]
        exact = {k: scores.topk(k, -1).indices for k in top_ks}
        cs = qh @ index.centroids[h].T  # [T, G, lists]
        sizes = index.offsets[h, 1:] - index.offsets[h, :-1]
        modes = [("per-head", cs, 1)] + [
            (f"shared {red}", cs.amax(1, keepdim=True) if red == "max" else cs.sum(1, keepdim=True), m)
            for red in ("max", "sum")
            for m in mults
        ]
        for mode, rank, mult in modes:  # rank [T, 1 or G, lists]
            order = rank.argsort(-1, descending=True)
            for frac in scans:
                take = sizes[order].cumsum(-1) <= mult * frac * n
                take[..., 0] = True
                probed = torch.zeros_like(take).scatter(-1, order, take)
                cand = probed[..., index.list_of[h]].expand(T, G, n)  # [T, G, n]
                read = cand.sum(-1).float().sum(-1) if rank.shape[1] == G else cand[:, 0].sum(-1).float()
                distinct = cand.any(1).sum(-1).float()
                masked = scores.masked_fill(~cand, float("-inf"))
                for k, ex in exact.items():
                    best = masked.topk(k, -1)
                    got = best.indices.masked_fill(best.values == float("-inf"), -1)  # fewer scanned than k
                    rec = (got[..., :, None] == ex[..., None, :]).any(-1).float().mean().item()
                    r = out.setdefault((mode, mult, frac, k), [0.0, 0.0, 0.0, n])
                    r[0] += rec / KV
                    r[1] += read.mean().item() / KV
                    r[2] += distinct.mean().item() / KV
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="HF dir (default: the converted default model)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=512, help="query positions after the chunk")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--lists", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--scan", type=float, nargs="+", default=[0.02, 0.05, 0.10])
    ap.add_argument("--top-k", type=int, nargs="+", default=[10, 32])
    ap.add_argument("--layer-step", type=int, default=3, help="every Nth layer")
    ap.add_argument("--shared", action="store_true", help="add per-head vs shared list choice per KV head")
    ap.add_argument(
        "--share-mult",
        nargs="+",
        default=["1", "2", "group"],
        help="shared scan budgets as multiples of --scan ('group': the GQA group size)",
    )
    args = ap.parse_args(argv)
    cache = os.environ.get("LAZYRT_CACHE_DIR", os.path.expanduser("~/.cache/lazyrt"))
    model_dir = args.model_dir or sorted(glob.glob(f"{cache}/gguf/SmolLM2*"))[-1]
    text = open(args.text).read()
    while len(text) < 8 * (args.chunk + args.queries):  # short texts: repeat (still real keys/queries)
        text += "\n\n" + text
    D = capture(model_dir, text, args.chunk + args.queries)
    H, KV, theta = D["heads"], D["kv_heads"], D["theta"]
    d, G, L = D["q"].shape[-1] // H, H // KV, args.chunk
    pos_k, pos_q = torch.arange(L), torch.arange(L, L + args.queries)
    acc: dict[tuple, list[float]] = {}
    shared: dict[tuple, list[float]] = {}
    mults = sorted({float(G if m == "group" else m) for m in args.share_mult})
    layers = list(range(0, D["q"].shape[0], args.layer_step))
    for layer in layers:
        if args.shared:
            kl, ql = D["k"][layer, :L].view(L, KV, d), D["q"][layer, L:].view(-1, H, d)
            keys_l = torch.stack([rotate(kl[:, h], pos_k, theta) for h in range(KV)], 1)  # [L, KV, d]
            q_l = torch.stack([rotate(ql[:, j], pos_q, theta) for j in range(H)], 1)  # [T, H, d]
            part = shared_compare(keys_l, q_l.view(-1, KV, G, d), args.sink, args.scan, mults, args.top_k)
            for key, v in part.items():
                r = shared.setdefault(key, [0.0, 0.0, 0.0, v[3]])
                for i in range(3):
                    r[i] += v[i] / len(layers)
        for h in range(KV):
            keys = rotate(D["k"][layer, :L, h * d : (h + 1) * d], pos_k, theta)[args.sink :]
            n = keys.shape[0]
            q = torch.cat([rotate(D["q"][layer, L:, (h * G + g) * d : (h * G + g + 1) * d], pos_q, theta)
                           for g in range(G)])  # fmt: skip
            scores = q @ keys.T
            exact = {k: scores.topk(k, -1).indices for k in args.top_k}
            for C in args.lists:
                assign, cent = kmeans(keys[None], C, seed=1, niter=25)
                assign, cent = assign[0], cent[0]
                sizes = torch.bincount(assign, minlength=C).float()
                order = (q @ cent.T).argsort(-1, descending=True)
                for frac in args.scan:
                    take = sizes[order].cumsum(-1) <= frac * n
                    take[:, 0] = True
                    probed = torch.zeros(q.shape[0], C, dtype=torch.bool).scatter(1, order, take)
                    scanned = probed[:, assign]
                    masked = scores.masked_fill(~scanned, float("-inf"))
                    for k, ex in exact.items():
                        got = masked.topk(k, -1).indices
                        recall = (got[:, :, None] == ex[:, None, :]).any(-1).float().mean().item()
                        r = acc.setdefault((C, frac, k), [0.0, 0.0, 0])
                        r[0] += recall
                        r[1] += scanned.float().mean().item()
                        r[2] += 1
    print("| lists | centroid products / keys | target scan | scanned keys | top-k | recall@k |")
    print("|---|---|---|---|---|---|")
    for (C, frac, k), (rec, scan, cnt) in sorted(acc.items()):
        print(f"| {C} | {C / n:.3f} | {frac:.2f} | {scan / cnt:.3f} | {k} | {rec / cnt:.3f} |")
    if not args.shared:
        return
    ks = sorted(args.top_k)
    print(
        f"\n### per-head vs shared list choice per KV head: {args.text}, {L}-token chunk, {args.queries} "
        f"queries, layers {layers}, {KV} KV heads x {G} query heads, plain index "
        f"(lists of {KEYS_PER_LIST} keys)\n"
    )
    cols = ["mode", "scan budget", *[f"recall@{k}" for k in ks],
            "keys read / KV head / token", "distinct keys / KV head / token"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    rank = {"per-head": 0, "shared max": 1, "shared sum": 2}
    for mode, mult, frac, k in sorted(shared, key=lambda t: (t[2], rank[t[0]], t[1])):
        if k != ks[0]:
            continue
        rows = [shared[(mode, mult, frac, kk)] for kk in ks]
        read, distinct, n_idx = rows[0][1:4]
        budget = f"{frac:.2f}" if mult == 1 else f"{mult:g} x {frac:.2f}"
        recs = " | ".join(f"{r[0]:.3f}" for r in rows)
        print(
            f"| {mode} | {budget} | {recs} | {read:.0f} ({read / n_idx:.3f}) | "
            f"{distinct:.0f} ({distinct / n_idx:.3f}) |"
        )


if __name__ == "__main__":
    main()
