"""What an idle process's wait costs a request's hop (issue 14's TTFT at 1 req/s): a TokenizedReq-sized
message (5 documents' token arrays, ~80 KB) sent over ZMQ ipc after --idle-s of quiet to a process
that either blocks in zmq's poll (the scheduler's idle wait) or spins on poll(0), then decodes it.

Timed per message on the system-wide monotonic clock, median of --iters: send -> received, received ->
decoded, and the reply's way back to the sender (which blocks). A spinning receiver keeps its core
awake and its caches warm at the price of a core kept busy while idle.

    python benchmarks/experiments/idle_poll.py [--idle-s 0.2] [--iters 20] [--modes block spin]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from array import array

import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from lazyrt.runtime.ipc.messages import TokenizedReq, decode, encode  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402


def receiver(addr_in: str, addr_out: str, mode: str, count: int) -> None:
    """Serves `count` messages: wait (block or spin), recv, decode, answer the times."""
    ctx = zmq.Context()
    inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(addr_in)
    out.connect(addr_out)
    out.send_pyobj("ready")
    for _ in range(count):
        if mode == "spin":
            while not inbox.poll(0):
                pass
        else:
            while not inbox.poll(1000):  # the scheduler's idle wait polls in PARENT_CHECK_MS slices
                pass
        data = inbox.recv()
        got = time.monotonic()
        msg = decode(data)
        done = time.monotonic()
        out.send_pyobj((got, done, len(msg.docs)))
    inbox.close(0)
    out.close(0)
    ctx.term()


def run_mode(mode: str, wire: bytes, idle_s: float, iters: int) -> dict[str, float]:
    """Median ms of each part over iters messages sent to a fresh receiver in `mode`."""
    tmp = tempfile.mkdtemp(prefix="lazyrt-idle-poll-")
    addr_in, addr_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx = zmq.Context()
    back = ctx.socket(zmq.PULL)
    back.bind(addr_out)
    proc = mp.get_context("spawn").Process(target=receiver, args=(addr_in, addr_out, mode, iters + 1))
    proc.start()
    assert back.recv_pyobj() == "ready"
    to = ctx.socket(zmq.PUSH)
    to.connect(addr_in)
    parts: dict[str, list[float]] = {"to received": [], "decode": [], "answer back": [], "round trip": []}
    for i in range(iters + 1):  # the first message warms the connection: not counted
        time.sleep(idle_s)
        sent = time.monotonic()
        to.send(wire)
        got, done, _ = back.recv_pyobj()
        end = time.monotonic()
        if i:
            for k, v in zip(parts, (got - sent, done - got, end - done, end - sent)):
                parts[k].append(v * 1e3)
    proc.join(10)
    to.close(0)
    back.close(0)
    ctx.term()
    return {k: statistics.median(v) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle-s", type=float, default=0.2, help="quiet before each message")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=["block", "spin"], choices=["block", "spin"])
    p.add_argument("--doc-tokens", type=int, default=2048)
    args = p.parse_args(argv)

    rng = random.Random(0)
    docs = [array("i", (rng.randrange(100, 49000) for _ in range(args.doc_tokens))) for _ in range(5)]
    req = TokenizedReq(1, SamplingParams(max_tokens=1), 1, prefix=list(range(30)), docs=docs,
                       suffix=list(range(16)))  # fmt: skip
    wire = encode(req)
    print(f"message: {len(wire)} bytes; {os.cpu_count()} CPUs; idle {args.idle_s} s before each")
    print("| receiver waits by | send -> received (ms) | decode (ms) | answer back (ms) | round trip (ms) |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes:
        r = run_mode(mode, wire, args.idle_s, args.iters)
        print(f"| {mode} | " + " | ".join(f"{v:.3f}" for v in r.values()) + " |")


if __name__ == "__main__":
    main()
