"""What the benchmark client itself adds to a measured TTFT: the same requests, one at a time, through
httpx's AsyncClient and through aiohttp (both on uvloop, as rag_serving.py runs them), against one
running server. Every request reuses the same cached documents, so the server's work is the same each
time; the server's own split (meta.timings_ms) is printed beside the client's figure.

    python -m lazyrt.launch --model tiny-llama --load-format dummy --device cpu --port 18123 &
    python benchmarks/experiments/client_overhead.py --endpoint http://127.0.0.1:18123

"client - server" is the client's TTFT minus the server's (HTTP receipt -> first token back at
HTTP): the client's own encode, send and parse, plus the server's HTTP framing. A slow client also
shows in the server's "tokenize" interval: it starts when the handler runs, before the body is in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rag_serving import load_tokenizer, request_body  # noqa: E402
from rag_workload import WorkloadConfig, build_workload, single_token_words  # noqa: E402

SPLIT = ("tokenize", "queue", "prefill", "ttft")


async def lines_httpx(client, url: str, b: dict):
    async with client.stream("POST", url, json=b) as resp:
        async for line in resp.aiter_lines():
            yield line


async def lines_aiohttp(client, url: str, b: dict):
    async with client.post(url, json=b) as resp:
        async for raw in resp.content:
            yield raw.decode()


async def one(lines, client, url: str, b: dict) -> tuple[float, dict]:
    start, first, meta = time.perf_counter(), None, {}
    async for line in lines(client, url, b):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        first = first or time.perf_counter()
        meta = json.loads(line[5:]).get("meta") or meta
    return (first - start) * 1e3, meta.get("timings_ms", {})


async def run(args) -> None:
    import aiohttp
    import httpx

    tok = load_tokenizer(args.tokenizer_dir, None, "dummy")
    wl = build_workload(
        # as many documents as a request takes: every request uses all of them (cached after the first)
        WorkloadConfig(num_docs=args.docs, docs_per_request=args.docs, doc_tokens=args.doc_tokens,
                       num_requests=args.requests),  # fmt: skip
        single_token_words(tok),
    )
    url = args.endpoint + "/generate"
    clients = [("httpx", httpx.AsyncClient(timeout=120), lines_httpx),
               ("aiohttp", aiohttp.ClientSession(), lines_aiohttp)]  # fmt: skip
    rows: dict[str, list] = {name: [] for name, _, _ in clients}
    for i in range(len(wl.requests)):
        for name, client, lines in clients if i % 2 else clients[::-1]:  # alternate who goes first
            rows[name].append(await one(lines, client, url, request_body(wl, i, args.max_tokens)))
            await asyncio.sleep(args.gap)
    for _, client, _ in clients:
        await (client.aclose() if hasattr(client, "aclose") else client.close())
    med = lambda xs: statistics.median(xs)  # noqa: E731
    n = len(wl.requests) - args.skip
    print(f"{n} requests each, {args.docs} cached docs x {args.doc_tokens} tokens, "
          f"max_tokens={args.max_tokens}; medians in ms")  # fmt: skip
    print("| client | client TTFT | server TTFT | client - server | server tokenize / queue / prefill |")
    print("|---|---:|---:|---:|---|")
    for name, rs in rows.items():
        rs = rs[args.skip :]
        c, s = med([r[0] for r in rs]), med([r[1]["ttft"] for r in rs])
        split = " / ".join(f"{med([r[1][k] for r in rs]):.2f}" for k in SPLIT[:3])
        print(f"| {name} | {c:.2f} | {s:.2f} | {med([r[0] - r[1]['ttft'] for r in rs]):.2f} | {split} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="a running lazyrt server, e.g. http://127.0.0.1:18123")
    p.add_argument("--requests", type=int, default=40, help="requests per client")
    p.add_argument("--skip", type=int, default=3, help="first requests per client left out (warm-up)")
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=380)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--gap", type=float, default=0.2, help="seconds between requests")
    p.add_argument("--tokenizer-dir", default=None)
    args = p.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(run(args))
    else:
        uvloop.run(run(args))


if __name__ == "__main__":
    main()
