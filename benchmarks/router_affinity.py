"""Issue 17's router goals, side by side in one run: the chunk hit ratio and the throughput of the same
RAG workload (rag_workload.py, Zipf popularity) on
  one    one replica with 2C tokens of KV,
  affinity / hash / round_robin / least_loaded   two replicas with C each behind python -m lazyrt.router;
  with --kv-peers also two replicas with C each that keep each document once between them and read
  each other's pages (lazyrt.launch --kv-peers), behind the router with --peer-policies.
Goals: affinity's hit ratio within 2 points of `one`'s and >= 10 points above round robin's;
saturation throughput >= 1.8x one replica's (on separate devices: --devices 0,1).

    python benchmarks/router_affinity.py --device cpu --kv-cache-tokens 3072 --num-requests 150
    python benchmarks/router_affinity.py --device cuda --devices 0,1 --model dummy:llama3-8b ...

Hit ratio = chunk hits / (hits + misses) summed over the replicas' /cache_stats. All requests are
sent at once (--concurrency in flight), with --output-tokens each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rag_serving import free_port, launch_server, load_tokenizer, wait_healthy  # noqa: E402
from rag_workload import WorkloadConfig, build_workload, fallback_words, single_token_words  # noqa: E402


def routing_reasons(url: str) -> dict[str, int]:
    """How many requests the router sent for each reason (affinity, imbalance, ...), from /metrics."""
    out: dict[str, int] = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("lazyrt_router_requests_total{"):
            labels, _, value = line.partition("} ")
            reason = labels.split('reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0) + int(float(value))
    return out


class Router:
    def __init__(self, urls: list[str], policy: str, extra: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lazyrt.router", "--port", str(self.port), "--policy", policy,
               "--log-level", "warning"] + [x for u in urls for x in ("--worker", u)]  # fmt: skip
        cmd += shlex.split(extra)
        self.proc = subprocess.Popen(cmd)

    def wait(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).json().get("replicas_up") == n:
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError("the router never saw every replica healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def run_point(url: str, wl, args) -> float:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(r) -> None:
            body = {"text": r.question, "docs": [wl.docs[d] for d in r.doc_ids],
                    "sampling_params": {"max_tokens": args.output_tokens, "ignore_eos": True}}  # fmt: skip
            async with sem:
                resp = await client.post(url + "/generate", json=body)
                resp.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in wl.requests))
        return time.perf_counter() - t0


def hit_ratio(urls: list[str]) -> tuple[float, int, int]:
    hits = misses = 0
    for u in urls:
        s = httpx.get(u + "/cache_stats", timeout=30).json()
        hits, misses = hits + s["chunk_hits"], misses + s["chunk_misses"]
    return hits / max(hits + misses, 1), hits, misses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--devices", default=None, help="CUDA devices for the two replicas, e.g. 0,1")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-tokens", type=int, default=3072, help="C: each of the two replicas' KV")
    p.add_argument("--num-docs", type=int, default=60)
    p.add_argument("--doc-tokens", type=int, default=128)
    p.add_argument("--docs-per-request", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--zipf-alpha", type=float, default=1.1)
    p.add_argument("--topics", type=int, default=0,
                   help="> 0: documents in this many topics, a request's documents from one topic")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=1)
    p.add_argument("--server-args", default="")
    p.add_argument("--router-args", default="", help="more lazyrt.router flags, e.g. '--imbalance 2'")
    policies = ["affinity", "hash", "round_robin", "least_loaded", "owner"]
    p.add_argument("--policies", nargs="+", default=policies[:4], choices=policies,
                   help="router policies to run")
    p.add_argument("--slack", type=int, nargs="+", default=None,
                   help="run affinity and hash once per router --slack (default: the router's)")
    p.add_argument("--kv-peers", action="store_true",
                   help="also run two replicas with peer KV (each document cached once between them)")
    p.add_argument("--peer-policies", nargs="+", default=["least_loaded"], choices=policies,
                   help="--kv-peers: router policies to run over the peer replicas")
    p.add_argument("--peer-bounds", nargs="+", default=None, metavar="IMBALANCE:SLACK",
                   help="--kv-peers: run owner and affinity once per router load bound (default: the "
                        "router's), e.g. 0.5:16 0:2")  # fmt: skip
    p.add_argument("--no-plain", action="store_true", help="skip the replicas without peer KV")
    p.add_argument("--skip-one", action="store_true", help="skip the one replica with 2C")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer_dir, args.model, args.load_format)
    words = single_token_words(tok) if tok is not None else fallback_words()
    cfg = WorkloadConfig(num_docs=args.num_docs, doc_tokens=args.doc_tokens, seed=args.seed,
                         docs_per_request=args.docs_per_request, num_requests=args.num_requests,
                         zipf_alpha=args.zipf_alpha, rate=float("inf"), topics=args.topics)  # fmt: skip
    wl = build_workload(cfg, words)
    if args.device == "cpu" and "--worker-cpu-threads" not in args.server_args:
        # two replicas on one box: torch's default (every core) in each worker oversubscribes it, and
        # a run took 20-40x longer (2 cores: 154-440 s a policy against ~9 s with one thread each)
        args.server_args = (args.server_args + " --worker-cpu-threads 1").strip()
    devs = args.devices.split(",") if args.devices else [None, None]
    rows = []

    def launch(kv: int, dev: str | None, wait: bool = True):
        if dev is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = dev
        try:
            return launch_server(args, "lazy", kv, wait=wait)
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)

    if not args.skip_one:
        one = launch(2 * args.kv_cache_tokens, devs[0])
        try:
            wall = asyncio.run(run_point(one.url, wl, args))
            ratio, h, m = hit_ratio([one.url])
            rows.append({"setup": "one replica, 2C", "hit_ratio": ratio, "hits": h, "misses": m,
                         "wall_s": wall})  # fmt: skip
        finally:
            one.stop()
    runs = [(pol, sl) for pol in args.policies
            for sl in (args.slack if args.slack and pol in ("affinity", "hash") else [None])]  # fmt: skip
    if not args.no_plain:
        reps = healthy([launch(args.kv_cache_tokens, d, wait=False) for d in devs], args)
        run_policies(args, wl, reps, runs, "", rows)
    if args.kv_peers:
        reps = launch_peers(args, devs)
        bounds = [tuple(b.split(":")) for b in args.peer_bounds or []] or [None]
        runs = [(pol, b) for pol in args.peer_policies
                for b in (bounds if pol in ("owner", "affinity") else [None])]  # fmt: skip
        run_policies(args, wl, reps, runs, ", peer KV", rows)
    print("\n| setup | chunk hit ratio | hits | misses | wall s | req/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['hit_ratio']:.3f} | {r['hits']} | {r['misses']} | {r['wall_s']:.1f} | "
              f"{args.num_requests / r['wall_s']:.2f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


def healthy(reps: list, args) -> list:
    """Waits until every replica (started side by side) is healthy; stops them all if one is not."""
    try:
        for r in reps:
            wait_healthy(r, args.startup_timeout)
    except BaseException:
        for r in reps:
            r.stop()
        raise
    return reps


def launch_peers(args, devs: list[str | None]) -> list:
    """Two replicas with peer KV: each sees every device and takes its own with --device cuda:N."""
    d = tempfile.mkdtemp(prefix="lazyrt-bench-peers-")
    addrs = [f"ipc://{os.path.join(d, f'r{i}')}" for i in range(2)]
    reps = []
    try:
        for i, dev in enumerate(devs):
            extra = ["--kv-peer-addr", addrs[i], "--kv-peers", addrs[1 - i]]
            extra += ["--device", f"cuda:{dev}"] if dev is not None else []
            reps.append(launch_server(args, "lazy", args.kv_cache_tokens, extra, wait=False))
        for r in reps:
            wait_healthy(r, args.startup_timeout)
        deadline = time.monotonic() + 120
        while not all(httpx.get(r.url + "/cache_stats", timeout=30).json().get("kv_peers_up") for r in reps):
            if time.monotonic() > deadline:
                raise TimeoutError("the peer replicas never saw each other")
            time.sleep(0.3)
    except BaseException:
        for r in reps:
            r.stop()
        raise
    return reps


def run_policies(args, wl, reps: list, runs: list, tag: str, rows: list) -> None:
    """Each (policy, slack) over the replicas, their caches flushed first; the replicas are stopped after."""
    try:
        for policy, slack in runs:
            for r in reps:
                httpx.post(r.url + "/flush_cache", timeout=60)
            before = hit_ratio([r.url for r in reps])
            # slack: the router's --slack, or (imbalance, slack) for both
            bound = slack if isinstance(slack, tuple) else (None, slack)
            extra = args.router_args + (f" --imbalance {bound[0]}" if bound[0] is not None else "")
            extra += f" --slack {bound[1]}" if bound[1] is not None else ""
            router = Router([r.url for r in reps], policy, extra)
            try:
                router.wait(len(reps))
                wall = asyncio.run(run_point(router.url, wl, args))
                reasons = routing_reasons(router.url)
                views = httpx.get(router.url + "/cache_stats", timeout=60).json()["router"]["views"]
            finally:
                router.stop()
            _, h, m = hit_ratio([r.url for r in reps])
            h, m = h - before[1], m - before[2]
            held = [httpx.get(r.url + "/cache_stats", timeout=60).json()["chunks"] for r in reps]
            label = f"2 x C{tag}, {policy}"
            label += f", imbalance {bound[0]}" if bound[0] is not None else ""
            label += f", slack {bound[1]}" if bound[1] is not None else ""
            rows.append({"setup": label, "hit_ratio": h / max(h + m, 1), "hits": h, "misses": m,
                         "wall_s": wall, "reasons": reasons, "replica_chunks": held,
                         "view_documents": [v["documents"] for v in views.values()]})  # fmt: skip
            if tag:
                stats = [httpx.get(r.url + "/cache_stats", timeout=60).json() for r in reps]
                rows[-1]["peer"] = [{k: v for k, v in st.items() if "peer" in k} for st in stats]
            print(rows[-1])
    finally:
        for r in reps:
            r.stop()


if __name__ == "__main__":
    sys.exit(main())
