"""RAG serving benchmark (issue 6): TTFT / TPOT / ITL / E2E and throughput of a real lazyrt server
per cache mode, request rate and document popularity, plus chunk hit ratio and KV pages.

Workload: benchmarks/rag_workload.py (N docs of L tokens, 5 a request + a question, Zipf or uniform
popularity, Poisson arrivals, fixed output length with ignore_eos). Requests go to POST /generate
with `docs`, `system` and stream=True; times are taken client-side from the SSE stream.

Either give `--endpoint URL` (a running server; --modes is then only a label) or let the harness
launch `python -m lazyrt.launch --load-format dummy --model llama-3.1-8b --cache-mode MODE ...` per
mode. The cache is flushed (POST /flush_cache) before every point.

Outputs: JSON lines (--out, one per point), a markdown table on stdout (and appended to --md),
a PNG of TTFT p50 vs rate (--plot), one line per mode and one panel per popularity.

`--sweep-kv-budget T1 T2 ...`: chunk hit ratio vs --kv-cache-tokens (Zipf, closed loop with
--concurrency clients); `--eviction-policy P` is passed through when the server's --help lists it.
`--report-only`: rebuild the table and plot from --out without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from process_cpu import ProcessCpu, describe  # noqa: E402
from rag_workload import (  # noqa: E402
    SYSTEM_PROMPT,
    Workload,
    WorkloadConfig,
    build_workload,
    fallback_words,
    single_token_words,
)

MODES = ("none", "prefix", "block", "lazy")


# ---- tokenizer (client side: to build documents of a known token length) ----------------------------
def load_tokenizer(tokenizer_dir: str | None, model: str | None, load_format: str):
    """The tokenizer the server will use: --tokenizer-dir, an HF model dir, or the default model's."""
    from transformers import AutoTokenizer

    if tokenizer_dir:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    if model and os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return AutoTokenizer.from_pretrained(model)
    from lazyrt.models import gguf_convert
    from lazyrt.models.loader import _gguf_file, default_model_path

    gguf = (
        _gguf_file(os.path.expanduser(model)) if model and os.path.exists(os.path.expanduser(model)) else None
    )
    # A dummy preset (or no model) uses the default model's tokenizer, as the server does.
    return AutoTokenizer.from_pretrained(gguf_convert.ensure_converted(gguf or default_model_path()))


# ---- server management ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen | None = None
    log_path: str | None = None
    cmd: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def server_supports(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "lazyrt.launch", "--help"], capture_output=True, text=True, timeout=120
    )
    return flag in out.stdout


def launch_server(
    args, mode: str, kv_cache_tokens: int | None = None, extra: list[str] | None = None, wait: bool = True
) -> Server:
    """Starts `python -m lazyrt.launch` for the mode; waits until it is healthy unless wait=False (the
    caller then calls wait_healthy: replicas that start side by side)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lazyrt.launch", "--port", str(port), "--cache-mode", mode]
    cmd += ["--load-format", args.load_format, "--device", args.device, "--seed", str(args.seed)]
    if args.model and args.model != "default":
        cmd += ["--model", args.model]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if kv_cache_tokens or args.kv_cache_tokens:
        cmd += ["--kv-cache-tokens", str(kv_cache_tokens or args.kv_cache_tokens)]
    cmd += shlex.split(args.server_args or "") + (extra or [])
    env = dict(os.environ)
    if args.tokenizer_dir:
        env["LAZYRT_TOKENIZER_DIR"] = os.path.abspath(args.tokenizer_dir)  # dummy presets use it
    log = tempfile.NamedTemporaryFile("w", prefix=f"lazyrt-bench-{mode}-", suffix=".log", delete=False)
    print(f"[bench] launching: {shlex.join(cmd)}  (log {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log.name, cmd)
    if not wait:
        return srv
    try:
        wait_healthy(srv, args.startup_timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def wait_healthy(srv: Server, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc is not None and srv.proc.poll() is not None:
            raise RuntimeError(f"server exited with {srv.proc.returncode}:\n{srv.log_tail()}")
        try:
            if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{srv.log_tail()}")


# ---- client ---------------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    ok: bool
    error: str = ""
    send_s: float = 0.0  # relative to the point's start
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    timings_ms: dict = field(default_factory=dict)  # the server's TTFT split (meta["timings_ms"])


def request_body(wl: Workload, i: int, output_tokens: int) -> dict:
    r = wl.requests[i]
    return {
        "text": r.question,
        "docs": [wl.docs[d] for d in r.doc_ids],
        "system": SYSTEM_PROMPT,
        "stream": True,
        "sampling_params": {"max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True},
    }


async def one_request(client, url: str, body: dict, index: int, t0: float, timeout: float) -> Result:
    """client: an aiohttp.ClientSession. (httpx's AsyncClient, used before 2026-11-26, cost ~2 ms more
    per request on the 2-core CPU box, in the measured TTFT: benchmarks/experiments/client_overhead.py.)"""
    res = Result(index, ok=False)
    start = time.perf_counter()
    res.send_s = start - t0
    last = None
    meta: dict = {}
    try:
        async with asyncio.timeout(timeout) if hasattr(asyncio, "timeout") else _nullctx():
            async with client.post(url + "/generate", json=body) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                    return res
                async for raw in resp.content:  # one SSE line at a time
                    line = raw.decode()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"])[:300]
                        return res
                    now = time.perf_counter()
                    if obj.get("text") or obj.get("finish_reason") is None or last is None:
                        if last is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    if obj.get("meta"):
                        meta = obj["meta"]
    except (asyncio.TimeoutError, TimeoutError):
        res.error = f"timeout after {timeout}s"
        return res
    except Exception as e:  # transport errors: record, don't kill the point
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e_s = time.perf_counter() - start
    for k in ("completion_tokens", "prompt_tokens", "cached_tokens", "chunk_hits", "chunk_misses"):
        setattr(res, k, int(meta.get(k) or 0))
    res.timings_ms = meta.get("timings_ms") or {}
    res.ok = last is not None
    if not res.ok:
        res.error = "no tokens streamed"
    return res


class _nullctx:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *a):
        return False


def _control_timeout():
    import aiohttp

    return aiohttp.ClientTimeout(total=30)


async def get_json(client, url: str) -> dict:
    try:
        async with client.get(url, timeout=_control_timeout()) as r:
            return await r.json() if r.status == 200 else {}
    except Exception:
        return {}


def stats_total(s: dict) -> dict:
    """A server's /cache_stats; behind lazyrt.router, the sums over its replicas (its "total")."""
    return s["total"] if "replicas" in s and "total" in s else s


async def cache_stats(client, url: str) -> dict:
    return stats_total(await get_json(client, url + "/cache_stats"))


def replica_split(before: dict, after: dict, wall_s: float) -> list[dict]:
    """Behind lazyrt.router (its raw /cache_stats before and after a point): what each replica did,
    its steps, document uses (chunk hits + misses) and the point's wall per step (the step time when
    it was busy throughout); [] for a plain server."""
    was = {r["url"]: r.get("stats") or {} for r in before.get("replicas", [])}
    out = []
    for r in after.get("replicas", []):
        a, b = r.get("stats") or {}, was.get(r["url"], {})

        def delta(k: str, a: dict = a, b: dict = b) -> int:
            return int(a.get(k, 0) - b.get(k, 0))

        steps = delta("steps")
        uses = delta("chunk_hits") + delta("chunk_misses")
        out.append({"url": r["url"], "steps": steps, "doc_uses": uses,
                    "wall_ms_per_step": round(wall_s * 1e3 / steps, 3) if steps else None})  # fmt: skip
    return out


def prom_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


async def run_point(url: str, wl: Workload, args, concurrency: int | None = None) -> dict:
    """Send the workload (open loop at its arrival times, or closed loop with `concurrency` clients)."""
    try:
        import aiohttp
    except ImportError as e:
        raise SystemExit("rag_serving.py streams through aiohttp: pip install -e '.[bench]'") from e

    # no cap on connections (an open-loop point may have hundreds of answers streaming at once)
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, connect=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as client:
        async with client.post(url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=60)) as flush:
            if flush.status != 200:
                print(f"[bench] warning: /flush_cache -> {flush.status}", flush=True)
        before_raw = await get_json(client, url + "/cache_stats")
        before = stats_total(before_raw)
        cpu = ProcessCpu(args.poll_interval).start() if getattr(args, "sample_cpu", False) else None
        peak = {"used": 0, "chunk": 0}
        stop = asyncio.Event()

        async def poll_pages():
            while not stop.is_set():
                s = await cache_stats(client, url)
                if s:
                    peak["used"] = max(peak["used"], s.get("total_pages", 0) - s.get("free_pages", 0))
                    peak["chunk"] = max(peak["chunk"], s.get("chunk_pages", 0))
                try:
                    await asyncio.wait_for(stop.wait(), args.poll_interval)
                except asyncio.TimeoutError:
                    pass

        poller = asyncio.create_task(poll_pages())
        n = len(wl.requests)
        t0 = time.perf_counter()
        if concurrency:
            queue = list(range(n))[::-1]
            results: list[Result] = []

            async def worker():
                while queue:
                    i = queue.pop()
                    results.append(
                        await one_request(
                            client, url, request_body(wl, i, args.output_tokens), i, t0, args.request_timeout
                        )
                    )

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def delayed(i: int) -> Result:
                await asyncio.sleep(max(0.0, wl.requests[i].arrival_s - (time.perf_counter() - t0)))
                return await one_request(
                    client, url, request_body(wl, i, args.output_tokens), i, t0, args.request_timeout
                )

            results = list(await asyncio.gather(*(delayed(i) for i in range(n))))
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        process_cpu = cpu.stop() if cpu is not None else None
        after_raw = await get_json(client, url + "/cache_stats")
        after = stats_total(after_raw)
        try:
            async with client.get(url + "/metrics", timeout=_control_timeout()) as r:
                prom = await r.text()
        except Exception:
            prom = ""
    res = summarize(results, wall, before, after, peak, prom)
    if "replicas" in after_raw:
        res["replicas"] = replica_split(before_raw, after_raw, wall)
    if process_cpu is not None:
        res["process_cpu"] = process_cpu
    return res


def run_async(coro):
    """asyncio.run, on uvloop when it is installed (a dependency of lazyrt): at saturation the client
    streams every token of hundreds of answers and its own event loop is part of what is measured."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


SPLIT = ("tokenize", "queue", "prefill", "ttft")
# the finer split (servers since the stamps were added): tokenize = to_tokenizer + tokenizing, queue =
# to_scheduler + admission, ttft = tokenize + queue + prefill + to_http; prefill = to_step + launch +
# next_plan + tokens_ready + to_core (engine_core.request_timings), device: the step's device time
FINE_SPLIT = ("to_tokenizer", "tokenizing", "to_scheduler", "admission", "to_http")
STEP_SPLIT = ("to_step", "launch", "next_plan", "tokens_ready", "to_core", "device")


def _split(results: list) -> dict:
    """The server's TTFT split (meta["timings_ms"]: tokenize / queue for admission / prefill incl. any
    step in flight / ttft = HTTP receipt to first output back at HTTP, then FINE_SPLIT where the server
    reports it), medians over results, ms."""
    out = {}
    for k in SPLIT + FINE_SPLIT + STEP_SPLIT:
        xs = [r.timings_ms[k] for r in results if r.timings_ms.get(k) is not None]
        if xs or k in SPLIT:
            out[k] = _stats(xs, scale=1.0)["p50"]
    return out


def _stats(xs: list[float], scale: float = 1000.0) -> dict:
    a = np.asarray([x for x in xs if not math.isnan(x)], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": float(a.mean() * scale),
        "p50": float(np.percentile(a, 50) * scale),
        "p99": float(np.percentile(a, 99) * scale),
    }


def middle_half_throughput(results: list[Result]) -> float | None:
    """Output tokens a second while the middle half of a point's tokens came out (from the time a
    quarter of them had been streamed to the time three quarters had): the rate with the start (cold
    caches, documents computed for the first time, batches filling) and the drain at the end left out,
    which weigh more in a shorter run (two replicas finish the same requests in about half the time).
    Each streamed event carries an equal share of its request's tokens."""
    events: list[tuple[float, float]] = []
    for r in results:
        if not r.ok or r.completion_tokens <= 0:
            continue
        times = [r.send_s + r.ttft_s]
        for gap in r.itl_s:
            times.append(times[-1] + gap)
        share = r.completion_tokens / len(times)
        events += [(t, share) for t in times]
    if not events:
        return None
    events.sort()
    total = sum(w for _, w in events)
    marks, done, at = [total / 4, 3 * total / 4], 0.0, []
    for t, w in events:
        done += w
        while marks and done >= marks[0] - 1e-9:
            marks.pop(0)
            at.append(t)
    return total / 2 / (at[1] - at[0]) if at[1] > at[0] else None


def others_in_flight(results: list[Result]) -> list[int]:
    """For each result, how many of the point's other completed requests were in flight (sent, not yet
    finished) when it was sent: at 1 req/s a request sent beside another's decode joins a step already
    running (its TTFT includes up to a step more) where one sent alone finds the server idle."""
    done = [r for r in results if r.ok]
    starts = sorted(r.send_s for r in done)
    ends = sorted(r.send_s + r.e2e_s for r in done)
    # in flight at t: sent at or before t and not finished by t (the request itself when it completed)
    return [bisect.bisect_right(starts, r.send_s) - bisect.bisect_right(ends, r.send_s) - r.ok
            for r in results]  # fmt: skip


def summarize(results: list[Result], wall: float, before: dict, after: dict, peak: dict, prom: str) -> dict:
    ok = [r for r in results if r.ok]
    busy = dict(zip((r.index for r in results), others_in_flight(results)))
    all_hit = [r for r in ok if r.chunk_misses == 0 and r.chunk_hits > 0]
    alone = [r for r in all_hit if busy[r.index] == 0]
    beside = [r for r in all_hit if busy[r.index] > 0]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itl = [x for r in ok for x in r.itl_s]
    # Throughput over the span from the first send to the last finish.
    span = max((r.send_s + r.e2e_s for r in ok), default=wall) - min((r.send_s for r in ok), default=0.0)
    out_tokens = sum(r.completion_tokens for r in ok)
    hits, misses = sum(r.chunk_hits for r in ok), sum(r.chunk_misses for r in ok)

    def delta(k: str):
        if k in after and k in before:
            return after[k] - before[k]
        return None

    s_hits, s_misses = delta("chunk_hits"), delta("chunk_misses")
    server_ratio = None
    if s_hits is not None and s_misses is not None and s_hits + s_misses > 0:
        server_ratio = s_hits / (s_hits + s_misses)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": wall,
        "ttft_ms": _stats([r.ttft_s for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats([r.e2e_s for r in ok]),
        # requests whose documents were all cached when admitted (the question-prefill path alone)
        "ttft_all_hit_ms": _stats([r.ttft_s for r in all_hit]),
        "all_hit_requests": len(all_hit),
        # server-side split of TTFT (tokenize / queue for admission / prefill incl. any step in flight
        # / ttft = HTTP receipt to first output back at HTTP), medians over requests, ms
        "server_ttft_split_ms": _split(ok),
        "server_ttft_split_all_hit_ms": _split(all_hit),
        # the all-hit requests sent while no other request was in flight, and those sent beside others
        "ttft_all_hit_alone_ms": _stats([r.ttft_s for r in alone]),
        "all_hit_alone_requests": len(alone),
        "server_ttft_split_all_hit_alone_ms": _split(alone),
        "ttft_all_hit_beside_ms": _stats([r.ttft_s for r in beside]),
        "server_ttft_split_all_hit_beside_ms": _split(beside),
        "request_throughput": len(ok) / span if span > 0 else None,
        "output_throughput": out_tokens / span if span > 0 else None,
        "output_throughput_middle_half": middle_half_throughput(ok),
        "total_output_tokens": out_tokens,
        "prompt_tokens_mean": prompt_tokens / len(ok) if ok else None,
        "cached_token_ratio": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else None,
        "chunk_hits": hits,
        "chunk_misses": misses,
        "chunk_hit_ratio": hits / (hits + misses) if hits + misses else None,
        "server_chunk_hit_ratio": server_ratio,
        "chunk_evictions": delta("chunk_evictions"),
        "radix_hit_tokens": delta("radix_hit_tokens"),
        "kv_pages_total": after.get("total_pages"),
        "kv_pages_used_peak": peak["used"] or None,
        "kv_pages_chunk_peak": peak["chunk"] or None,
        "kv_pages_used_after": after["total_pages"] - after["free_pages"] if "total_pages" in after else None,
        "prom_kv_pages_used": prom_value(prom, "lazyrt_kv_pages_used"),
        "prom_requests_aborted": prom_value(prom, "lazyrt_requests_aborted_total"),
        "steps": delta("steps"),
        "ragged_prefill_steps": delta("ragged_prefill_steps"),  # --lazy-flashinfer-prefill
        "decode_split_steps": delta("decode_split_steps"),  # decodes launched apart in mixed steps
        "shared_chunk_steps": delta("shared_chunk_steps"),
        "graph_steps": delta("graph_steps"),
        # late planning (server, overlap on): waits before decode-only steps, their total, how many an
        # arriving request ended, and the last step-time and margin estimates; None when it is off
        "late_plan": {
            **{k: delta(k) for k in ("late_plan_waits", "late_plan_wait_ms", "late_plan_arrivals")},
            **{k: after.get(k) for k in ("late_plan_step_ms", "late_plan_margin_ms")},
        },
    }


def warmup(url: str, args, words: list[str]) -> None:
    """Compile kernels / capture graphs outside the measured points: RAG requests on throwaway docs."""
    wcfg = WorkloadConfig(
        num_docs=args.docs_per_request,
        doc_tokens=args.doc_tokens,
        docs_per_request=args.docs_per_request,
        num_requests=max(args.warmup, 1),
        popularity="uniform",
        rate=math.inf,
        seed=args.seed + 99991,
    )
    wl = build_workload(wcfg, words)
    ns = argparse.Namespace(**{**vars(args), "output_tokens": min(args.output_tokens, 8)})
    res = run_async(run_point(url, wl, ns))
    if res["failed"]:
        raise RuntimeError(f"warm-up failed: {res['errors']}")


# ---- reporting -----------------------------------------------------------------------------------
def _f(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown_table(rows: list[dict]) -> str:
    hdr = (
        "| mode | popularity | rate (req/s) | TTFT mean / p50 / p99 (ms) | TPOT mean (ms) "
        "| ITL p50 / p99 (ms) | E2E mean / p50 / p99 (ms) | req/s | out tok/s | chunk hit ratio "
        "| KV pages used (peak / total) "
        "| failed |"
    )
    lines = [hdr, "|" + "---|" * 12]
    key = lambda r: (
        r.get("sweep", ""),
        r["popularity"],
        r["rate"],
        MODES.index(r["mode"]) if r["mode"] in MODES else 9,
    )
    for r in sorted(rows, key=key):
        t, e, i = r["ttft_ms"], r["e2e_ms"], r["itl_ms"]
        lines.append(
            f"| {r['mode']} | {r['popularity']} | {_f(r['rate'], 2)} | {_f(t['mean'])} / {_f(t['p50'])} / "
            f"{_f(t['p99'])} | {_f(r['tpot_ms']['mean'], 2)} | {_f(i['p50'], 2)} / {_f(i['p99'], 2)} | "
            f"{_f(e['mean'])} / {_f(e['p50'])} / {_f(e['p99'])} | {_f(r['request_throughput'], 3)} | "
            f"{_f(r['output_throughput'])} | {_f(r['chunk_hit_ratio'], 3)} | "
            f"{_f(r['kv_pages_used_peak'])} / {_f(r['kv_pages_total'])} | {r['failed']} |"
        )
    return "\n".join(lines)


def goals_table(rows: list[dict]) -> str:
    """The goals per (popularity, rate): TTFT p50 prefix/lazy (>= 4x) and block/lazy (>= 1.5x) (issue
    6); output throughput lazy/block (>= 2x) and lazy/prefix (>= 4x) at saturation (issue 14)."""
    by = {(_shape(r), r["rate"], r["mode"]): r for r in rows if not r.get("sweep")}
    pts = sorted({(p, rt) for p, rt, _ in by})
    out = [
        "| workload | rate | TTFT p50 prefix / lazy (goal >= 4) | TTFT p50 block / lazy (goal >= 1.5) "
        "| out tok/s lazy / block (saturation goal >= 2) | out tok/s lazy / prefix (saturation goal >= 4) |",
        "|---|---|---|---|---|---|",
    ]
    any_row = False

    def ratio(a, b):
        return a / b if a is not None and b else None

    for p, rt in pts:
        lazy = by.get((p, rt, "lazy"))
        if lazy is None:
            continue
        pre, blk = by.get((p, rt, "prefix")), by.get((p, rt, "block"))
        r1 = ratio(pre["ttft_ms"]["p50"], lazy["ttft_ms"]["p50"]) if pre else None
        r2 = ratio(blk["ttft_ms"]["p50"], lazy["ttft_ms"]["p50"]) if blk else None
        r3 = ratio(lazy["output_throughput"], blk["output_throughput"]) if blk else None
        r4 = ratio(lazy["output_throughput"], pre["output_throughput"]) if pre else None
        out.append(f"| {p} | {_f(rt, 2)} | {_f(r1, 2)} | {_f(r2, 2)} | {_f(r3, 2)} | {_f(r4, 2)} |")
        any_row = True
    return "\n".join(out) if any_row else ""


def _shape(r: dict) -> str:
    """A row's workload (rows of several shapes compare only within their own)."""
    pop = r["popularity"] + (f" {r['zipf_alpha']}" if r["popularity"] == "zipf" and "zipf_alpha" in r else "")
    if "docs_per_request" in r and "doc_tokens" in r:
        return f"{pop}, {r['docs_per_request']} x {r['doc_tokens']} tokens"
    return pop


def sweep_table(rows: list[dict]) -> str:
    sw = [r for r in rows if r.get("sweep") == "kv_budget"]
    if not sw:
        return ""
    out = [
        "| mode | eviction policy | KV cache tokens | chunk hit ratio | evictions | TTFT p50 (ms) | req/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(sw, key=lambda r: (r["mode"], str(r.get("eviction_policy")), r["kv_cache_tokens"])):
        out.append(
            f"| {r['mode']} | {r.get('eviction_policy') or 'default'} | {r['kv_cache_tokens']} | "
            f"{_f(r['chunk_hit_ratio'], 3)} | {_f(r['chunk_evictions'])} | {_f(r['ttft_ms']['p50'])} | "
            f"{_f(r['request_throughput'], 3)} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib not installed: no plot (pip install -e '.[bench]')", flush=True)
        return False
    rows = [r for r in rows if not r.get("sweep")]
    pops = sorted({r["popularity"] for r in rows})
    if not pops:
        return False
    fig, axes = plt.subplots(1, len(pops), figsize=(5.5 * len(pops), 4), squeeze=False)
    finite = [r["rate"] for r in rows if math.isfinite(r["rate"])]
    inf_x = (max(finite) * 2) if finite else 1.0
    for ax, pop in zip(axes[0], pops):
        for mode in [m for m in MODES if any(r["mode"] == m for r in rows)] + sorted(
            {r["mode"] for r in rows} - set(MODES)
        ):
            pts = sorted(
                (r["rate"] if math.isfinite(r["rate"]) else inf_x, r["ttft_ms"]["p50"])
                for r in rows
                if r["popularity"] == pop and r["mode"] == mode and r["ttft_ms"]["p50"] is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"popularity: {pop}")
        ax.set_xlabel(
            "request rate (req/s)"
            + (
                f"; {inf_x:g} = all at once"
                if not finite or any(not math.isfinite(r["rate"]) for r in rows)
                else ""
            )
        )
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    meta = rows[0]
    fig.suptitle(
        f"RAG serving: {meta.get('model')} on {meta.get('device_name')}, {meta.get('num_docs')} docs x "
        f"{meta.get('doc_tokens')} tok, {meta.get('docs_per_request')}/req",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(rows: list[dict], args) -> str:
    parts = (
        [markdown_table([r for r in rows if not r.get("sweep")])]
        if any(not r.get("sweep") for r in rows)
        else []
    )
    g = goals_table(rows)
    if g:
        parts.append(g)
    s = sweep_table(rows)
    if s:
        parts.append(s)
    text = "\n\n".join(parts)
    print("\n" + text + "\n", flush=True)
    if args.md:
        with open(args.md, "a") as f:
            f.write(f"\n<!-- {time.strftime('%Y-%m-%d %H:%M')}: {shlex.join(sys.argv)} -->\n{text}\n")
    if args.plot and plot(rows, args.plot):
        print(f"[bench] plot: {args.plot}", flush=True)
    return text


# ---- driver ------------------------------------------------------------------------------------------
def device_name(device: str) -> str:
    try:
        import torch

        if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "cpu"


def point_row(args, mode: str, pop: str, rate: float, res: dict, srv: Server, **extra) -> dict:
    return {
        "mode": mode,
        "popularity": pop,
        "zipf_alpha": args.zipf_alpha if pop == "zipf" else None,
        "rate": rate,
        "num_requests": args.num_requests,
        "num_docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "docs_per_request": args.docs_per_request,
        "output_tokens": args.output_tokens,
        "seed": args.seed,
        "server_args": args.server_args,
        "model": args.model,
        "device": args.device,
        "device_name": args.device_name,
        "server_cmd": shlex.join(srv.cmd) if srv.cmd else srv.url,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "client": "aiohttp",  # rows without it were measured with httpx (~2 ms more a request: one_request)
        **extra,
        **res,
    }


def _split_text(split: dict) -> str:
    return " ".join(f"{k}={_f(v)}" for k, v in split.items())


def write_row(args, row: dict) -> None:
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    t = row["ttft_ms"]
    print(
        f"[bench] {row['mode']:6s} {row['popularity']:7s} rate={row['rate']:<5g} ok={row['completed']} "
        f"failed={row['failed']} TTFT mean={_f(t['mean'])}ms p50={_f(t['p50'])}ms p99={_f(t['p99'])}ms "
        f"TPOT mean={_f(row['tpot_ms']['mean'])}ms "
        f"(all docs cached: p50={_f(row['ttft_all_hit_ms']['p50'])}ms n={row['all_hit_requests']}) "
        f"out tok/s={_f(row['output_throughput'])} "
        f"(middle half: {_f(row.get('output_throughput_middle_half'))}) "
        f"hit={_f(row['chunk_hit_ratio'], 3)} "
        f"pages peak={row['kv_pages_used_peak']} "
        + (f"ragged steps={row['ragged_prefill_steps']} " if row.get("ragged_prefill_steps") else "")
        + (f"decode splits={row['decode_split_steps']} " if row.get("decode_split_steps") else "")
        + (f"shared steps={row['shared_chunk_steps']} " if row.get("shared_chunk_steps") else "")
        + "server TTFT split p50 ms: "
        + _split_text(row["server_ttft_split_ms"])
        + " (all docs cached: " + _split_text(row["server_ttft_split_all_hit_ms"]) + ")"
        + (f" errors={row['errors']}" if row["failed"] else ""),
        flush=True,
    )
    if row["all_hit_requests"]:
        n_alone = row["all_hit_alone_requests"]
        print(f"[bench]   all docs cached, sent alone: TTFT p50={_f(row['ttft_all_hit_alone_ms']['p50'])}ms "
              f"n={n_alone}, server split {_split_text(row['server_ttft_split_all_hit_alone_ms'])}; "
              f"beside others: TTFT p50={_f(row['ttft_all_hit_beside_ms']['p50'])}ms "
              f"n={row['all_hit_requests'] - n_alone}, server split "
              f"{_split_text(row['server_ttft_split_all_hit_beside_ms'])}", flush=True)  # fmt: skip
    for r in row.get("replicas", []):
        print(f"[bench]   replica {r['url']}: {r['steps']} steps, {r['doc_uses']} document uses, "
              f"{_f(r['wall_ms_per_step'])} ms of the point's wall a step", flush=True)  # fmt: skip
    if row.get("process_cpu"):
        print(f"[bench]   CPU % (mean, a process each): {describe(row['process_cpu'])}", flush=True)


def run_mode(args, words, mode: str, rows: list[dict]) -> None:
    srv = Server(args.endpoint) if args.endpoint else launch_server(args, mode)
    try:
        if args.warmup:
            warmup(srv.url, args, words)
        for pop in args.popularity:
            for rate in args.rates:
                cfg = WorkloadConfig(
                    num_docs=args.docs,
                    doc_tokens=args.doc_tokens,
                    docs_per_request=args.docs_per_request,
                    question_tokens=args.question_tokens,
                    num_requests=args.num_requests,
                    popularity=pop,
                    zipf_alpha=args.zipf_alpha,
                    rate=rate,
                    seed=args.seed,
                )
                res = run_async(run_point(srv.url, build_workload(cfg, words), args))
                row = point_row(args, mode, pop, rate, res, srv)
                write_row(args, row)
                rows.append(row)
    finally:
        if srv.proc is not None:
            srv.stop()


def run_kv_sweep(args, words, rows: list[dict]) -> None:
    policies: list[str | None] = [None]
    if args.eviction_policy:
        if args.endpoint or server_supports("--eviction-policy"):
            policies = list(args.eviction_policy)
        else:
            print(
                "[bench] the server has no --eviction-policy option: sweeping the default policy only",
                flush=True,
            )
    n = args.sweep_num_requests
    for mode in args.modes:
        for policy in policies:
            for budget in args.sweep_kv_budget:
                extra = ["--eviction-policy", policy] if policy else []
                srv = Server(args.endpoint) if args.endpoint else launch_server(args, mode, budget, extra)
                try:
                    cfg = WorkloadConfig(
                        num_docs=args.docs,
                        doc_tokens=args.doc_tokens,
                        docs_per_request=args.docs_per_request,
                        question_tokens=args.question_tokens,
                        num_requests=n,
                        popularity="zipf",
                        zipf_alpha=args.zipf_alpha,
                        rate=math.inf,
                        seed=args.seed,
                    )
                    res = run_async(run_point(srv.url, build_workload(cfg, words), args, args.concurrency))
                finally:
                    if srv.proc is not None:
                        srv.stop()
                row = point_row(
                    args,
                    mode,
                    "zipf",
                    math.inf,
                    res,
                    srv,
                    sweep="kv_budget",
                    kv_cache_tokens=budget,
                    eviction_policy=policy,
                    concurrency=args.concurrency,
                    num_requests=n,
                )
                write_row(args, row)
                rows.append(row)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--docs", type=int, default=100, help="documents in the pool")
    w.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (single-token words)")
    w.add_argument("--docs-per-request", type=int, default=5)
    w.add_argument("--question-tokens", type=int, default=16)
    w.add_argument("--num-requests", type=int, default=120, help="requests per point")
    w.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4], help="req/s; inf = all at once")
    w.add_argument("--popularity", nargs="+", default=["zipf", "uniform"], choices=["zipf", "uniform"])
    w.add_argument("--zipf-alpha", type=float, default=2.1)
    w.add_argument("--output-tokens", type=int, default=64, help="max_tokens with ignore_eos")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("server")
    s.add_argument("--endpoint", default=None, help="a running server (skips launching)")
    s.add_argument("--modes", nargs="+", default=list(MODES), help="cache modes, one server each")
    s.add_argument("--model", default="llama-3.1-8b", help="dummy preset, HF dir, .gguf, or 'default'")
    s.add_argument("--load-format", default="dummy")
    s.add_argument("--device", default="cuda")
    s.add_argument("--dtype", default=None)
    s.add_argument(
        "--tokenizer-dir",
        default=None,
        help="tokenizer (config+tokenizer files) for dummy presets; sets LAZYRT_TOKENIZER_DIR",
    )
    s.add_argument("--kv-cache-tokens", type=int, default=None)
    s.add_argument("--server-args", default="", help="extra lazyrt.launch arguments (one string)")
    s.add_argument("--startup-timeout", type=float, default=600)
    s.add_argument("--request-timeout", type=float, default=600)
    s.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (0: none)")
    s.add_argument("--poll-interval", type=float, default=0.5, help="/cache_stats polling for peak pages")
    s.add_argument(
        "--sample-cpu",
        action="store_true",
        help="record each lazyrt process's CPU %% on this host over each point (needs psutil)",
    )
    k = p.add_argument_group("KV budget sweep")
    k.add_argument(
        "--sweep-kv-budget",
        type=int,
        nargs="*",
        default=None,
        help="KV cache sizes in tokens: hit ratio vs budget (Zipf, closed loop)",
    )
    k.add_argument("--sweep-num-requests", type=int, default=200)
    k.add_argument("--concurrency", type=int, default=16)
    k.add_argument(
        "--eviction-policy",
        nargs="+",
        default=None,
        help="policies to compare (passed as --eviction-policy when the server has it)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default="rag_serving.jsonl", help="JSON lines, appended")
    o.add_argument("--md", default=None, help="append the markdown table to this file")
    o.add_argument("--plot", default="rag_serving_ttft.png")
    o.add_argument("--report-only", action="store_true", help="table + plot from --out, run nothing")
    args = p.parse_args(argv)
    if args.model in ("", "none"):
        args.model = "default"
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        report(rows, args)
        return rows
    args.device_name = device_name(args.device)
    t = time.time()
    try:
        tok = load_tokenizer(
            args.tokenizer_dir, None if args.model == "default" else args.model, args.load_format
        )
        words = single_token_words(tok)
        print(f"[bench] tokenizer {type(tok).__name__}: {len(words)} single-token words", flush=True)
    except Exception as e:  # no tokenizer on this box: pseudo-words (documents ~2-3x longer in tokens)
        print(f"[bench] warning: no tokenizer ({e}); using pseudo-words", flush=True)
        words = fallback_words()
    rows: list[dict] = []
    if args.sweep_kv_budget:
        run_kv_sweep(args, words, rows)
    else:
        for mode in args.modes:
            run_mode(args, words, mode, rows)
    report(rows, args)
    print(f"[bench] done in {time.time() - t:.0f}s; rows appended to {args.out}", flush=True)
    return rows


if __name__ == "__main__":
    # the servers run in their own sessions (Ctrl-C raises KeyboardInterrupt here and unwinds); a SIGTERM
    # to this process alone (`timeout`, a job runner) unwinds through run_mode's finally, which stops them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
