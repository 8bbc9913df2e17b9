"""Offline batch throughput: lazyrt Engine.generate vs HF transformers `generate` (issue 6).

Same prompts (random token ids), same model shape, same dtype and device, fixed output length
(ignore_eos / min_new_tokens). Dummy presets: HF gets a randomly initialised model of the same config
(speed does not depend on the values); an HF dir / .gguf / 'default': both load the same weights.

GPU:  python benchmarks/offline_vs_hf.py              (llama-3.1-8b, bf16, batch 16, 2048 + 64 tokens)
CPU smoke:  python benchmarks/offline_vs_hf.py --model tiny-llama --device cpu --batch 2 \
              --prompt-tokens 16 --output-tokens 4

Physical floor (issue 14): prefill FLOPs (2 x matmul parameters x prompt tokens, plus causal
attention's 2 x L^2 x hidden a layer) at the matmul rate measured here on a prefill-sized GEMM, plus
the decode steps' bytes (weights + each request's KV at its mean length) at the measured copy
bandwidth. lazyrt's time / floor is the fraction of the floor it reaches.

--profile (after the timed run, untimed): each engine step's wall time by kind (prefill steps, by
the prompt tokens they carry, and pure decode steps), then one more run under torch.profiler: the
device kernel time by kind (GEMM, attention, other) and the idle gaps, i.e. where the time above
the floor goes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def matmul_flops(device: str, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """FLOP/s of one (m x k) @ (k x n) GEMM, the shape of a prefill's MLP projection."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * m * k * n * reps / (time.perf_counter() - t)


def physical_floor(eng, args, dtype: torch.dtype) -> dict:
    """Seconds the batch needs at least: prefill FLOPs at the matmul rate + decode bytes at the copy
    bandwidth (see the module docstring)."""
    from decode_roofline import copy_bandwidth

    cfg, w = eng.model_config, eng.model.w
    # matmul weights: every 2-D weight but the embedding table (a lookup); the lm_head runs on one
    # row a prompt in prefill, so it is left out of the FLOPs and counted in the decode bytes
    mm_params = sum(t.numel() for n, t in w.items() if t.dim() == 2 and "embed_tokens" not in n
                    and n != "lm_head.weight")  # fmt: skip
    step_tensors = {id(t): t for n, t in w.items() if "embed_tokens" not in n}
    step_tensors[id(eng.model.lm_head)] = eng.model.lm_head
    weight_bytes = sum(t.numel() * t.element_size() for t in step_tensors.values())
    L, B, T = args.prompt_tokens, args.batch, args.output_tokens
    prefill = 2 * mm_params * B * L + 2 * cfg.num_layers * cfg.hidden_size * L * L * B
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (
        torch.finfo(dtype).bits // 8)  # fmt: skip
    decode_bytes = (T - 1) * (weight_bytes + B * (L + T // 2) * kv_per_token)
    flops = matmul_flops(args.device, dtype, min(B * L, 16384), cfg.hidden_size, cfg.intermediate_size)
    bw = copy_bandwidth(args.device)
    floor = prefill / flops + decode_bytes / bw
    return {"matmul_tflops": flops / 1e12, "copy_gbs": bw / 1e9, "prefill_floor_s": prefill / flops,
            "decode_floor_s": decode_bytes / bw, "floor_s": floor}


def step_walls(eng, prompts: list[list[int]], sp) -> dict:
    """Runs the batch once more, timing each engine step (wall, host + device) by what it planned:
    'prefill' steps carry prompt tokens (decodes may ride along), 'decode' steps only decodes.
    With overlapped scheduling a step's wall is the time until the engine could plan the next one."""
    core = eng.core
    plans: list[tuple[int, int]] = []
    schedule = core.scheduler.schedule

    def timed_schedule():
        plan = schedule()
        # a decode item starts past its request's prompt; anything else carries prompt (or chunk) tokens
        dec = [it.request is not None and it.start_pos >= it.request.prompt_len for it in plan.items]
        new = sum(len(it.token_ids) for it, d in zip(plan.items, dec) if not d)
        plans.append((new, sum(dec)))
        return plan

    core.scheduler.schedule = timed_schedule
    walls: list[float] = []
    step = core.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - t)
        return out

    core.step = timed_step
    try:
        eng.flush_cache()  # lazy / block / prefix cached the prompts in the timed run
        eng.generate(prompts, sp)
    finally:
        core.step, core.scheduler.schedule = step, schedule
    kinds: dict[str, list[float]] = {"prefill": [0, 0.0, 0], "decode": [0, 0.0, 0]}
    for (new, _dec), wall in zip(plans, walls):
        k = kinds["prefill" if new else "decode"]
        k[0] += 1
        k[1] += wall
        k[2] += new
    return {k: {"steps": n, "wall_s": w, "prompt_tokens": tok} for k, (n, w, tok) in kinds.items()}


GEMM_NAMES = ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul", "addmm", "aten::mm", "linear")
ATTENTION_NAMES = ("attn", "attention", "flashinfer", "prefill", "decode", "merge")


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in GEMM_NAMES):
        return "gemm"
    if any(s in n for s in ATTENTION_NAMES):
        return "attention"
    return "other"


def engine_profile(eng, prompts: list[list[int]], sp, device: str) -> dict:
    """Step walls by kind, then the device's kernel time by kind over one more run (see the module
    docstring); prints a short table and the top kernels."""
    from decode_profile import device_gaps, kernel_times
    from torch.profiler import ProfilerActivity, profile

    out: dict = {"steps": step_walls(eng, prompts, sp)}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    eng.flush_cache()
    with profile(activities=acts) as prof:
        eng.generate(prompts, sp)
        sync(device)
    times = kernel_times(prof, "cuda" if device.startswith("cuda") else "cpu")
    by_kind: dict[str, float] = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, us in times.items():
        by_kind[kernel_kind(name)] += us / 1e6
    span, short, long = device_gaps(prof) if device.startswith("cuda") else (0.0, 0.0, 0.0)
    out.update(kernel_s=by_kind, device_span_s=span / 1e6, short_gaps_s=short / 1e6, long_gaps_s=long / 1e6,
               top_kernels=[(n, us / 1e6) for n, us in sorted(times.items(), key=lambda kv: -kv[1])[:15]])
    print("| step kind | steps | prompt tokens | wall s |\n|---|---:|---:|---:|")
    for k, v in out["steps"].items():
        print(f"| {k} | {v['steps']} | {v['prompt_tokens']} | {v['wall_s']:.3f} |")
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in by_kind.items())
    print(f"device kernels (s): {kinds}; span {span / 1e6:.3f}, "
          f"gaps < 20 us {short / 1e6:.3f}, longer gaps {long / 1e6:.3f} (profiled run)")
    for name, s in out["top_kernels"]:
        print(f"  {s:8.4f} s  {name[:110]}")
    return out


def hf_model(args, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazyrt.models import dummy
    from lazyrt.models.loader import load_model

    if args.load_format == "dummy" and args.model in dummy.PRESETS:
        cfg = dict(dummy.preset_config(args.model))
        hf_cfg = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in dtype, on the device: no fp32 host copy of 8B
        try:
            with torch.device(args.device):
                return AutoModelForCausalLM.from_config(hf_cfg).eval()
        finally:
            torch.set_default_dtype(prev)
    path = load_model(None if args.model == "default" else args.model, load_format="auto").path
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--cache-mode", default="none", choices=("none", "prefix", "lazy", "block"),
                   help="the engine's cache mode (the prompts share nothing; the cache is flushed before "
                   "each timed run)")
    p.add_argument("--max-step-tokens", type=int, default=None, help="the engine's prefill tokens a step")
    p.add_argument("--profile", action="store_true", help="print where the engine's time goes (see above)")
    p.add_argument("--out", default=None, help="JSON lines, appended")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = getattr(torch, args.dtype)

    from lazyrt import Engine, SamplingParams

    eng = Engine(
        model=None if args.model == "default" else args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        cache_mode=args.cache_mode,
        max_running_requests=args.batch,
        kv_cache_tokens=args.batch * (args.prompt_tokens + args.output_tokens + 16) + 64,
        **({} if args.max_step_tokens is None else {"max_step_tokens": args.max_step_tokens}),
    )
    vocab = min(eng.model_config.vocab_size, 32000)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.batch)
    ]
    sp = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    eng.flush_cache()
    sync(args.device)
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    sync(args.device)
    t_eng = time.perf_counter() - t
    n_out = sum(len(o["token_ids"]) for o in outs)
    row = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "lazyrt_s": t_eng,
        "lazyrt_out_tok_s": n_out / t_eng,
        "max_step_tokens": eng.config.max_step_tokens,
        "cache_mode": args.cache_mode,
    }
    row.update(physical_floor(eng, args, dtype))
    row["floor_fraction"] = row["floor_s"] / t_eng
    if args.profile:
        row["profile"] = engine_profile(eng, prompts, sp, args.device)
    del eng
    if not args.skip_hf:
        model = hf_model(args, dtype)
        ids = torch.tensor(prompts, device=args.device)
        kw = dict(
            max_new_tokens=args.output_tokens,
            min_new_tokens=args.output_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        with torch.inference_mode():
            w = ids[:1]
            model.generate(
                w, attention_mask=torch.ones_like(w), **{**kw, "max_new_tokens": 2, "min_new_tokens": 2}
            )
            sync(args.device)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            sync(args.device)
        t_hf = time.perf_counter() - t
        n_hf = (out.shape[1] - ids.shape[1]) * out.shape[0]
        row.update(hf_s=t_hf, hf_out_tok_s=n_hf / t_hf, speedup=(n_out / t_eng) / (n_hf / t_hf))
    print(json.dumps(row))
    print("| engine | batch | prompt | output | s | output tok/s |\n|---|---|---|---|---|---|")
    print(
        f"| lazyrt | {args.batch} | {args.prompt_tokens} | {args.output_tokens} | {t_eng:.2f} | "
        f"{row['lazyrt_out_tok_s']:.1f} |"
    )
    r = row
    print(
        f"| physical floor | {args.batch} | {args.prompt_tokens} | {args.output_tokens} | "
        f"{r['floor_s']:.2f} | {n_out / r['floor_s']:.1f} |  (prefill {r['prefill_floor_s']:.2f} s at "
        f"{r['matmul_tflops']:.0f} TFLOP/s + decode {r['decode_floor_s']:.2f} s at {r['copy_gbs']:.0f} GB/s; "
        f"lazyrt: {r['floor_fraction']:.0%})"
    )
    if "hf_s" in row:
        print(
            f"| HF generate | {args.batch} | {args.prompt_tokens} | {args.output_tokens} | "
            f"{row['hf_s']:.2f} | "
            f"{row['hf_out_tok_s']:.1f} |  (lazyrt / HF = {row['speedup']:.2f}x)"
        )
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main()
