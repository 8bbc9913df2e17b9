"""Do a fresh server's first requests wait for Triton to compile kernels? (issue 14's serving tables:
the first run of a workload on a fresh machine had a TTFT tail the same run on a warm one did not.)

Starts `python -m lazyrt.launch` with an empty Triton cache (TRITON_CACHE_DIR), sends one request
(rag_serving's warm-up request and a one-request point), then runs the same rag_serving point
--points times, and after each lists the Triton kernels compiled meanwhile (the cache's new entries,
by kernel name) beside the point's TTFT row, and the worker's warnings of kernels compiled after
start-up (runtime/worker/compile_watch.py). A kernel compiled during a point stalls the engine, so
every request in flight waits for it.

    python benchmarks/experiments/compile_stalls.py [--points 2] [--server-args "..."] -- RAG_SERVING_ARGS
    e.g. -- --tokenizer-dir DIR --popularity zipf --docs 200 --doc-tokens 512 --docs-per-request 10 \
            --rates 4 --num-requests 60

H100, 2026-11-27, f61cf44, the workload above: the first point compiled one `_lazy_attn_kernel`
variant mid-run (a step's grid size of 1 or a multiple of 16 was a Triton specialization): TTFT mean /
p99 549.8 / 2,927.1 ms; the same point again, nothing compiled: 42.9 / 134.1 ms.
At 5eabe54 (the grid sizes runtime ints) a variant still compiled during the first point (328.0 /
2,127.9 ms against 42.9 / 134.5): one picked by the step's shape (tiles, split or not).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kernels(cache: Path) -> dict[str, str]:
    """Triton cache entry -> the kernel it holds (its metadata file's name)."""
    out = {}
    for d in cache.iterdir():
        names = [f.name for f in d.glob("*.json") if not f.name.startswith("__grp__")]
        if names:
            out[d.name] = names[0].removesuffix(".json")
    return out


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError("server not healthy in time")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, default=2, help="times the measured point runs")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--server-args", default="--load-format dummy --model llama-3.1-8b --device cuda "
                   "--cache-mode lazy", help="lazyrt.launch arguments (one string)")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: rag_serving.py arguments")
    args = p.parse_args(argv)
    bench = [a for a in args.bench_args if a != "--"]
    cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    url = f"http://127.0.0.1:{args.port}"
    log_path = cache.parent / f"compile-stalls-server-{args.port}.log"
    log = open(log_path, "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "lazyrt.launch", "--port", str(args.port), *args.server_args.split()]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        t0 = time.monotonic()
        wait_healthy(url, server, args.startup_timeout)
        seen = kernels(cache)
        print(f"server up in {time.monotonic() - t0:.0f} s: {len(seen)} Triton kernels compiled", flush=True)
        for i in range(args.points + 1):
            first = i == 0  # the warm-up request, then one request alone
            plot = str(cache.parent / "compile_stalls.png")
            run = [sys.executable, str(ROOT / "benchmarks" / "rag_serving.py"), "--endpoint", url,
                   "--modes", "lazy", "--plot", plot, "--out", os.devnull, *bench,
                   "--warmup", "1" if first else "0"]  # fmt: skip
            run += ["--num-requests", "1"] if first else []
            res = subprocess.run(run, env=env, capture_output=True, text=True, cwd=ROOT)
            rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| lazy")]
            now = kernels(cache)
            new = Counter(now[k] for k in now.keys() - seen.keys())
            seen = now
            what = "warm-up + 1 request" if first else f"point {i}"
            late = sum("mid-serving" in ln for ln in log_path.read_text(errors="replace").splitlines())
            print(f"== {what}: rc {res.returncode}; compiled meanwhile: {dict(new) or 'nothing'}; "
                  f"the worker's late-compile warnings so far: {late}")
            print("\n".join(rows) or res.stderr[-2000:], flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    main()
