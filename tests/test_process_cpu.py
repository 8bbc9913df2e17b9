"""Process names (lazyrt/process_name.py) and the benchmark's per-process CPU sampler and per-replica
split (benchmarks/process_cpu.py, rag_serving.replica_split)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")


def _child(name: str, body: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from lazyrt.process_name import set_process_name
        ok = set_process_name({name!r})
        print(ok, open("/proc/self/comm").read().strip(), flush=True)
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@linux
def test_a_process_takes_its_name_cut_to_the_kernels_15_bytes():
    name = "lazyrt-" + "".join(random.choice("abcdefghij") for _ in range(random.randint(3, 14)))
    p = _child(name, "")
    out, _ = p.communicate(timeout=60)
    assert out.split() == ["True", name[:15]]


@linux
def test_the_sampler_finds_named_processes_and_tells_a_busy_one_from_an_idle_one():
    from process_cpu import CLIENT, ProcessCpu, describe

    spin = _child("lazyrt-t-spin", "end = time.time() + 30\nwhile time.time() < end: pass\n")
    idle = _child("lazyrt-t-idle", "time.sleep(30)\n")
    try:
        for p in (spin, idle):
            p.stdout.readline()  # named
        cpu = ProcessCpu(0.1).start()
        time.sleep(1.5)
        got = cpu.stop()
    finally:
        for p in (spin, idle):
            p.kill()
            p.wait()
    assert {"lazyrt-t-spin", "lazyrt-t-idle", CLIENT} <= set(got), got
    assert got["lazyrt-t-spin"][0] > got["lazyrt-t-idle"][0], got
    assert "lazyrt-t-spin" in describe(got)


def test_summarize_groups_by_name_busiest_first():
    from process_cpu import summarize

    rng = random.Random()
    samples = [(rng.choice(["lazyrt-worker", "lazyrt-http"]), [rng.uniform(0, 200) for _ in range(5)])
               for _ in range(6)] + [("lazyrt-none", [])]  # fmt: skip
    got = summarize(samples)
    assert "lazyrt-none" not in got
    for name in {n for n, _ in samples if n != "lazyrt-none"}:
        want = sorted((round(sum(s) / len(s), 1) for n, s in samples if n == name), reverse=True)
        assert got[name] == pytest.approx(want, abs=0.051)


def test_replica_split_is_each_replicas_change_over_the_point():
    import rag_serving

    rng = random.Random()
    urls = [f"http://127.0.0.1:{30001 + i}" for i in range(3)]
    keys = ("steps", "chunk_hits", "chunk_misses")
    before = {"replicas": [{"url": u, "stats": {k: rng.randrange(100) for k in keys}} for u in urls[:2]]
              + [{"url": urls[2], "stats": None}], "total": {}}  # fmt: skip
    after = {"replicas": [{"url": r["url"], "stats": {k: v + rng.randrange(1, 50) for k, v in (r["stats"] or {
        "steps": 0, "chunk_hits": 0, "chunk_misses": 0}).items()}} for r in before["replicas"]], "total": {}}
    wall = rng.uniform(1, 10)
    got = rag_serving.replica_split(before, after, wall)
    assert [g["url"] for g in got] == urls
    for g, b, a in zip(got, before["replicas"], after["replicas"]):
        b = b["stats"] or {"steps": 0, "chunk_hits": 0, "chunk_misses": 0}
        steps = a["stats"]["steps"] - b["steps"]
        assert g["steps"] == steps
        assert g["doc_uses"] == (a["stats"]["chunk_hits"] - b["chunk_hits"]
                                 + a["stats"]["chunk_misses"] - b["chunk_misses"])  # fmt: skip
        assert g["wall_ms_per_step"] == pytest.approx(wall * 1e3 / steps, abs=1e-3)
    assert rag_serving.replica_split({}, {"steps": 5}, wall) == []  # a plain server
