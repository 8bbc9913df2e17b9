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

    python benchmarks/experiments/retrieval_recall.py --text /usr/share/common-licenses/GPL-3
"""

from __future__ import annotations

import argparse
import glob
import os

import torch

from lazyrt.retrieval.key_index import kmeans


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
    for layer in range(0, D["q"].shape[0], args.layer_step):
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


if __name__ == "__main__":
    main()
