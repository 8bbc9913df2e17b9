"""What a peer load costs (peer KV, --kv-peers): one document's pages copied out of another process's
KV pool on another GPU (CUDA IPC, peer access) by PeerPools.load, against the same copy within one
GPU's pool. Llama-3.1-8B page layout (32 layers, 8 KV heads x 128, bf16, 16-token pages: 2 MiB a page).

    python benchmarks/experiments/peer_copy.py --doc-tokens 2048 --docs 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from lazyrt.cache.chunk_table import Transfer  # noqa: E402
from lazyrt.cache.page_pool import PagePool  # noqa: E402
from lazyrt.runtime.ipc.messages import decode  # noqa: E402
from lazyrt.runtime.worker.peer_pools import PeerPools  # noqa: E402

LAYOUT = (32, 16, 8, 128)  # layers, page size, KV heads, head dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--docs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--pool-pages", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    layers, ps, heads, dim = LAYOUT
    code = textwrap.dedent(f"""
        import sys, torch
        from lazyrt.cache.page_pool import PagePool
        from lazyrt.runtime.ipc.messages import encode
        pool = PagePool({layers}, {args.pool_pages}, {ps}, {heads}, {dim}, torch.bfloat16, "cuda:1",
                        shared=True)
        pool.kv_all.normal_()
        torch.cuda.synchronize()
        print(encode(pool.export).hex(), flush=True)
        sys.stdin.readline()
    """)
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    child = subprocess.Popen([sys.executable, "-c", code], **pipes)
    try:
        export = decode(bytes.fromhex(child.stdout.readline().strip()))
        own = PagePool(layers, args.pool_pages, ps, heads, dim, torch.bfloat16, "cuda:0")
        peers = PeerPools(own)
        peers.map([[1, export]])
        per_doc = -(-args.doc_tokens // ps)
        rows = []
        for n in args.docs:
            pages = list(range(n * per_doc))
            dst = list(range(args.pool_pages - n * per_doc, args.pool_pages))
            for label, run in (
                ("peer GPU (CUDA IPC)", lambda s=pages, d=dst: peers.load([Transfer(None, s, d, peer=1)])),
                ("same GPU", lambda s=pages, d=dst: own.copy_pages(s, d)),
            ):
                run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    run()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / args.iters
                nbytes = len(pages) * own.kv_all[0, 0].numel() * 2 * layers
                rows.append({"docs": n, "tokens": n * args.doc_tokens, "copy": label, "ms": round(ms, 3),
                             "GB/s": round(nbytes / ms / 1e6, 1), "MiB": nbytes >> 20})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        got = own.kv_all[:, dst[:4]]
        peers.load([Transfer(None, pages[:4], dst[:4], peer=1)])
        torch.cuda.synchronize()
        want = peers.pools[1][:, pages[:4]]
        print("copy equals the peer's pages:", bool(torch.equal(own.kv_all[:, dst[:4]], want)), got.shape)
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(60)


if __name__ == "__main__":
    main()
