"""Decode step time at batch 1..64 against the HBM roofline (issue 6).

Step time of the lazyrt Engine = (time of max_tokens=N - time of max_tokens=1) / (N - 1), for B random
prompts of --context tokens (plain prompts: every request reads its own KV). Roofline = (weight bytes +
B x context x KV bytes per token) / measured device-to-device copy bandwidth.

GPU:  python benchmarks/decode_roofline.py                      (llama-3.1-8b, dummy bf16, cuda)
CPU smoke:  python benchmarks/decode_roofline.py --model tiny-llama --device cpu --batches 1 2 \
              --context 32 --steps 4
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def copy_bandwidth(device: str, mb: int = 1024) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = mb * (1 << 20) // 2
    a = torch.empty(n, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * reps / (time.perf_counter() - t)


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=10368, help="prompt tokens a request (5 x 2048 + 128)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--copy-mb", type=int, default=1024)
    p.add_argument("--out", default=None, help="JSON lines, appended")
    args = p.parse_args(argv)

    from lazyrt import Engine, SamplingParams

    max_b = max(args.batches)
    eng = Engine(
        model=None if args.model == "default" else args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        cache_mode="none",
        max_running_requests=max_b,
        kv_cache_tokens=max_b * (args.context + args.steps + 16) + 64,
    )
    cfg = eng.model_config
    dev = str(next(iter(eng.model.parameters())).device) if hasattr(eng.model, "parameters") else args.device
    wbytes = (
        sum(t.numel() * t.element_size() for t in eng.model.parameters())
        if hasattr(eng.model, "parameters")
        else 0
    )
    dtype_bytes = next(iter(eng.model.parameters())).element_size() if wbytes else 2
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    bw = copy_bandwidth(dev, args.copy_mb)
    print(f"weights {wbytes / 1e9:.2f} GB, KV {kv_per_token} B/token, copy bandwidth {bw / 1e12:.3f} TB/s")
    gen = torch.Generator().manual_seed(0)
    vocab = min(cfg.vocab_size, 32000)

    def timed(b: int, n: int) -> float:
        prompts = [torch.randint(100, vocab, (args.context,), generator=gen).tolist() for _ in range(b)]
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        sync(dev)
        t = time.perf_counter()
        eng.generate(prompts, sp)
        sync(dev)
        return time.perf_counter() - t

    timed(min(args.batches), args.steps)  # warm-up (compiles, graphs)
    rows = []
    print("| batch | step (ms) | roofline (ms) | roofline / step | tok/s |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        t1, tn = timed(b, 1), timed(b, args.steps + 1)
        step = (tn - t1) / args.steps
        bytes_ = wbytes + b * (args.context + args.steps // 2) * kv_per_token
        roof = bytes_ / bw
        row = {
            "batch": b,
            "step_ms": step * 1e3,
            "roofline_ms": roof * 1e3,
            "efficiency": roof / step,
            "tokens_per_s": b / step,
            "context": args.context,
            "model": args.model,
            "device": dev,
            "copy_bw_tbs": bw / 1e12,
            "weight_gb": wbytes / 1e9,
        }
        rows.append(row)
        print(
            f"| {b} | {step * 1e3:.2f} | {roof * 1e3:.2f} | {roof / step:.2f} | {b / step:.0f} |", flush=True
        )
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
