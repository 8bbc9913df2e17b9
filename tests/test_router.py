"""python -m lazyrt.router (issue 17, data parallelism): the affinity policy on its own, then two real CPU
replicas behind a real router on loopback: affinity (a document set always lands where its chunks are,
whatever the order), answers equal to the replica's own, streaming, bad input passed through, the
metrics union, and failover when a replica dies; `--dp` replicas stop with the router."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_util import DOCS, ServerProc, free_port, pid_alive

from lazyrt.cache import ChunkTable
from lazyrt.router.app import answer_prompt_tokens, label_metrics, request_chars, request_docs
from lazyrt.router.policy import AffinityPolicy, ReplicaView, doc_key, owner

R = ["http://a:1", "http://b:2", "http://c:3"]


def test_owner_is_stable_spread_and_moves_only_the_lost_replicas_keys():
    rng = random.Random()
    keys = [doc_key(f"doc {rng.random()}") for _ in range(3000)]
    owners = [owner(k, R) for k in keys]
    for r in R:  # about a third each
        assert 800 < owners.count(r) < 1200
    assert owners == [owner(k, list(reversed(R))) for k in keys]  # replica order does not matter
    after = [owner(k, R[:2]) for k in keys]  # c leaves: only c's keys move
    assert all(a == o for a, o in zip(after, owners) if o != R[2])


def test_choose_affinity_imbalance_and_no_documents():
    rng = random.Random()
    pol = AffinityPolicy(imbalance=0.5, slack=2)
    while True:  # documents one replica owns strictly the most of (no tie to break)
        keys = [doc_key(f"doc {rng.random()}") for _ in range(5)]
        top = sorted((sum(owner(k, R) == r for k in keys) for r in R), reverse=True)
        if top[0] > top[1]:
            break
    load = {r: 0 for r in R}
    c = pol.choose(keys, load)  # nothing held anywhere yet: the replica owning most of them
    counts = {r: sum(owner(k, R) == r for k in keys) for r in R}
    assert c.reason == "affinity" and c.held == 0 and counts[c.replica] == max(counts.values())
    assert pol.choose(list(reversed(keys)), load).replica == c.replica  # order of documents
    busy = {**load, c.replica: 10}  # past (1 + 0.5) * 0 + 2: the least-loaded one instead
    far = pol.choose(keys, busy)
    assert far.reason == "imbalance" and far.replica != c.replica and busy[far.replica] == 0
    assert pol.choose(keys, {**load, c.replica: 2}).replica == c.replica  # within the bound
    least = pol.choose([], {R[0]: 3, R[1]: 1, R[2]: 2})
    assert least.replica == R[1] and least.reason == "least_loaded"
    again, ranked = pol.ranked(keys, load)
    assert again == c and ranked[0] == c.replica and sorted(ranked) == sorted(R)
    rr = AffinityPolicy(mode="round_robin")
    assert [rr.choose(keys, load).replica for _ in range(6)] == sorted(R) * 2
    assert AffinityPolicy(mode="least_loaded").choose(keys, {R[0]: 1, R[1]: 0, R[2]: 0}).replica == R[1]
    with pytest.raises(ValueError, match="policy"):
        AffinityPolicy(mode="random")
    with pytest.raises(ValueError):
        pol.choose(keys, {})


def test_default_bound_keeps_a_few_more_in_flight_where_the_documents_are():
    """The default bound (1.5x the least load + 16): a replica holding the documents keeps them up to
    16 more requests in flight than an idle one, then up to 1.5x a busy one's + 16; past that the
    least-loaded one takes it. The CLI's defaults are the policy's."""
    from lazyrt.router.__main__ import build_parser

    rng = random.Random()
    pol = AffinityPolicy()
    keys = [doc_key(f"doc {rng.random()}") for _ in range(3)]
    pol.record(R[0], keys, [100] * 3)
    idle = {r: 0 for r in R}
    assert pol.choose(keys, {**idle, R[0]: 16}, [100] * 3).replica == R[0]
    far = pol.choose(keys, {**idle, R[0]: 17}, [100] * 3)
    assert far.reason == "imbalance" and far.replica != R[0]
    busy = {R[0]: 46, R[1]: 20, R[2]: 20}  # 46 <= 1.5 x 20 + 16
    assert pol.choose(keys, busy, [100] * 3).replica == R[0]
    assert pol.choose(keys, {**busy, R[0]: 47}, [100] * 3).reason == "imbalance"
    args = build_parser().parse_args(["--worker", "http://127.0.0.1:1"])
    assert (args.imbalance, args.slack) == (pol.imbalance, pol.slack)


def test_affinity_follows_what_each_replica_holds_within_its_capacity():
    rng = random.Random()
    pol, load = AffinityPolicy(), {r: 0 for r in R}
    docs = [doc_key(f"doc {rng.random()}") for _ in range(6)]
    sizes = [100] * 6
    pol.view(R[0]).capacity = 300
    pol.record(R[0], docs[:3], sizes[:3])
    # held tokens win over the owners of the rest: 3 of 4 held on R[0]
    c = pol.choose(docs[:3] + docs[5:], load, sizes[:4])
    assert c.replica == R[0] and c.held == 300 and c.reason == "affinity"
    assert AffinityPolicy(mode="hash").choose(docs[:3] + docs[5:], load, sizes[:4]).held == 0
    # past its capacity the view evicts like the replica's table (lru here): docs[0] leaves for docs[3]
    v = pol.view(R[0])
    v.reset(300, "lru", page_size=10)
    pol.record(R[0], docs[:3], sizes[:3])
    pol.record(R[0], docs[3:4], sizes[3:4])
    assert list(v.held) == docs[1:4] and v.tokens == 300
    assert pol.choose(docs[:1], load, sizes[:1]).held == 0  # docs[0]: back to its owner
    assert pol.choose(docs[1:2], load, sizes[1:2]).replica == R[0]
    # a request bigger than the capacity keeps all of its own documents
    pol.record(R[1], docs, sizes)
    assert len(pol.view(R[1]).held) == 6
    v.clear()
    assert v.tokens == 0 and not v.held
    busy = pol.choose(docs[1:3], {**load, R[1]: 50}, sizes[1:3])  # R[1] holds them too but is too busy
    assert busy.replica != R[1]


@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf"])
def test_view_holds_what_a_chunk_table_with_the_same_policy_holds(policy):
    """The reference: a real ChunkTable over a pool of `cap` pages, driven as the scheduler admits a
    request (its documents looked up, the hits pinned, room made for the new ones at once, then each
    used in order: a hit recorded or an insert; released when it ends), on a random Zipf stream of
    documents of random sizes."""
    rng = random.Random()
    page, cap = rng.choice([4, 16]), rng.randint(30, 80)
    # distinct documents: two equal ones are one chunk to the table but two keys to the view
    docs = [tuple(rng.randrange(1000) for _ in range(rng.randint(1, 6 * page))) for _ in range(60)]
    docs = list(dict.fromkeys(docs))[:40]
    table, free = ChunkTable("m", page, policy), list(range(cap))
    view = ReplicaView()
    view.reset(cap * page, policy, page)
    weights = [1 / (i + 1) ** 1.1 for i in range(len(docs))]
    compared = 0
    for _ in range(300):
        req = list(dict.fromkeys(rng.choices(range(len(docs)), weights, k=rng.randint(1, 4))))
        found = {i: table.lookup((), docs[i], record=False) for i in req}
        for c in found.values():
            if c is not None:
                table.acquire(c)
        need = sum(table.pages_needed(len(docs[i])) for i, c in found.items() if c is None)
        if len(free) < need:
            free += table.evict(need - len(free))
        if len(free) < need:  # the replica would keep it waiting (the view has no such state): stop
            break
        for i, c in found.items():
            table.record_use(c)
            if c is None:
                pages = [free.pop() for _ in range(table.pages_needed(len(docs[i])))]
                c = found[i] = table.insert((), docs[i], pages)
                c.ready = True
                table.acquire(c)
        view.add([bytes([i]) for i in req], [len(docs[i]) for i in req])
        for c in found.values():
            table.release(c)
        held = {i for i in range(len(docs)) if table.lookup((), docs[i], record=False) is not None}
        assert {k[0] for k in view.held} == held
        assert view.pages == table.num_pages
        compared += 1
    assert compared > 50


def test_chars_per_token_is_learnt_and_sizes_the_views():
    rng = random.Random()
    ratio = rng.uniform(2.0, 9.0)
    pol = AffinityPolicy()
    pol.observe(0, 10)  # nothing to learn from
    pol.observe(100, 0)
    assert pol.chars_per_token == 4.0
    for _ in range(200):
        tokens = rng.randint(50, 500)
        pol.observe(round(tokens * ratio * rng.uniform(0.9, 1.1)), tokens)
    assert pol.chars_per_token == pytest.approx(ratio, rel=0.1)
    first = pol.chars_per_token
    pol.observe(1000, 1000)  # after the first answers, one answer moves it only a little
    assert abs(pol.chars_per_token - first) <= 0.05 * abs(1.0 - first) + 1e-9


def test_request_keys_and_metric_labels():
    keys, sizes = request_docs({"documents": ["x" * 40, {"id": "d1"}, {"text": "x" * 40}]})
    assert keys == [doc_key("x" * 40), doc_key({"id": "d1"}), doc_key("x" * 40)] and sizes == [10, 512, 10]
    assert request_docs({"docs": ["y"]}) == ([doc_key("y")], [1])
    assert request_docs({"prompt": "p"}) == ([], [])
    assert request_docs({"docs": ["y" * 70]}, chars_per_token=7.0)[1] == [10]
    # what the router learns characters per token from
    msg = {"role": "user", "content": [{"type": "text", "text": "abc"}]}
    body = {"messages": [msg], "documents": ["x" * 40]}
    assert request_chars(body) == 43
    assert request_chars({"documents": [{"id": "d1"}], "prompt": "p"}) < 0  # unknown text: not learnt from
    assert request_chars({"docs": ["x"], "input_ids": [1, 2]}) < 0
    assert answer_prompt_tokens({"usage": {"prompt_tokens": 7}}) == 7
    assert answer_prompt_tokens({"meta": {"prompt_tokens": 5}}) == 5
    assert answer_prompt_tokens([{"meta": {"prompt_tokens": 5}}, {"meta": {"prompt_tokens": 2}}]) == 7
    assert answer_prompt_tokens({"error": {}}) == 0
    text = '# HELP m h\n# TYPE m counter\nm_total 3.0\nq{a="1"} 2\n'
    assert label_metrics(text, "u") == ["# HELP m h", "# TYPE m counter", 'm_total{replica="u"} 3.0',
                                        'q{replica="u",a="1"} 2']  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    args = ("--device", "cpu", "--kv-cache-tokens", "8192", "--log-level", "warning")
    store = tmp_path_factory.mktemp("stores")  # a registry each, as replicas on two hosts would have
    reps = [ServerProc(*args, "--document-store", str(store / f"r{i}.sqlite")) for i in range(2)]
    port = free_port()
    cmd = [sys.executable, "-m", "lazyrt.router", "--port", str(port), "--log-level", "warning"]
    for r in reps:
        cmd += ["--worker", r.url]
    router = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        for r in reps:
            r.wait_healthy()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both replicas seen healthy by the router
            try:
                if httpx.get(url + "/health", timeout=5).json().get("replicas_up") == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url, reps
    finally:
        router.terminate()
        for r in reps:  # side by side: each takes about a second to wind down
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        router.wait(30)
        for r in reps:
            r.stop()


def learn(pol: AffinityPolicy, docs: list[str], q: str, resp: httpx.Response) -> None:
    """What the router learns from an answer: the request's characters per prompt token."""
    body = {"messages": [{"role": "user", "content": q}], "documents": docs}
    pol.observe(request_chars(body), resp.json()["usage"]["prompt_tokens"])


def _chat(url: str, docs: list[str], q: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": q}], "documents": docs, "max_tokens": 8}
    body.update({"temperature": 0, **kw})
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.slow
def test_affinity_same_answers_streaming_and_bad_input(cluster):
    url, reps = cluster
    urls = [r.url for r in reps]
    pol = AffinityPolicy()  # replays the router's choices (one request at a time: no load)
    for docs in (DOCS, DOCS[:2], [DOCS[2], "The lorn was introduced in 1921."]):
        keys, sizes = request_docs({"documents": docs}, pol.chars_per_token)
        want = pol.choose(keys, {u: 0 for u in urls}, sizes).replica
        pol.record(want, keys, sizes)
        first = _chat(url, docs, "What is the capital of Arvania?")
        assert first.status_code == 200 and first.headers["x-lazyrt-replica"] == want
        learn(pol, docs, "What is the capital of Arvania?", first)
        again = _chat(url, docs[::-1], "How tall is Mount Feller?")
        assert again.headers["x-lazyrt-replica"] == want  # another order, another question: same replica
        learn(pol, docs[::-1], "How tall is Mount Feller?", again)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        direct = _chat(want, docs[::-1], "How tall is Mount Feller?")
        text = lambda resp: resp.json()["choices"][0]["message"]["content"]  # noqa: E731
        assert text(direct) == text(again)
    # streaming passes through, chunk by chunk
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of Arvania?"}], "documents": DOCS,
            "max_tokens": 8, "temperature": 0, "stream": True}) as r:  # fmt: skip
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    # bad input: the replica's 4xx, naming the field
    bad = _chat(url, DOCS, "q", max_tokens=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    broken = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "body"
    # every replica's metrics, labelled, and the router's own
    m = httpx.get(url + "/metrics", timeout=30).text
    assert all(f'replica="{u}"' in m for u in urls) and "lazyrt_router_requests_total" in m
    stats = httpx.get(url + "/cache_stats", timeout=30).json()
    assert len(stats["replicas"]) == 2
    assert stats["total"]["chunk_hits"] == sum(s["stats"]["chunk_hits"] for s in stats["replicas"])
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    card = httpx.get(url + "/v1/models/SmolLM2-135M-Instruct", timeout=30)
    assert card.status_code == 200 and card.json()["id"] == "SmolLM2-135M-Instruct"
    missing = httpx.get(url + "/v1/models/org/other-model", timeout=30)
    assert missing.status_code == 404 and "org/other-model" in missing.json()["error"]["message"]
    # the router learnt the tokenizer's characters per token from the answers, as the replay did
    assert stats["router"]["chars_per_token"] == pytest.approx(pol.chars_per_token)
    assert set(stats["router"]["views"]) == set(urls)


@pytest.mark.slow
def test_documents_through_the_router(cluster):
    url, reps = cluster
    urls = [r.url for r in reps]
    text = f"The lorn of Vell{random.randrange(10**6)} was introduced in 1921 by the Bank of Vell."
    doc = httpx.post(url + "/v1/documents", json={"text": text, "precompute": True}, timeout=120).json()
    assert doc["object"] == "document" and doc["precompute"]["chunk_misses"] == 1 and doc["replica"] in urls
    for u in urls:  # registered on every replica, with the same id and tokens
        got = httpx.get(f"{u}/v1/documents/{doc['id']}", timeout=30).json()
        assert got["id"] == doc["id"] and got["tokens"] == doc["tokens"]
    assert httpx.get(f"{url}/v1/documents/{doc['id']}", timeout=30).json()["tokens"] == doc["tokens"]
    # a request naming it goes where it was computed, and hits it
    by_id = _chat(url, [{"id": doc["id"]}], "When was the lorn introduced?")
    assert by_id.status_code == 200 and by_id.headers["x-lazyrt-replica"] == doc["replica"]
    assert by_id.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= doc["tokens"]
    by_text = _chat(doc["replica"], [text], "When was the lorn introduced?")
    text_of = lambda resp: resp.json()["choices"][0]["message"]["content"]  # noqa: E731
    assert text_of(by_id) == text_of(by_text)
    # the replicas' errors come back as they are, naming the field
    bad = httpx.post(url + "/v1/documents", json={"text": text, "colour": 1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "colour"
    clash = httpx.post(url + "/v1/documents", json={"text": text + "!", "id": doc["id"]}, timeout=30)
    assert clash.status_code == 409
    listed = httpx.get(url + "/v1/documents", params={"limit": 100}, timeout=30).json()
    assert doc["id"] in [d["id"] for d in listed["data"]]
    assert httpx.delete(f"{url}/v1/documents/{doc['id']}", timeout=30).status_code == 200
    for u in urls:
        assert httpx.get(f"{u}/v1/documents/{doc['id']}", timeout=30).status_code == 404
    gone = _chat(url, [{"id": doc["id"]}], "When was the lorn introduced?")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "documents[0].id"


@pytest.mark.slow
def test_failover_when_a_replica_dies(cluster):
    url, reps = cluster
    urls = [r.url for r in reps]
    pol = AffinityPolicy()
    dead = pol.choose([doc_key(d) for d in DOCS], {u: 0 for u in urls}).replica
    next(r for r in reps if r.url == dead).stop()
    r = _chat(url, DOCS, "What is the capital of Arvania?")  # its owner is gone: served by the other
    assert r.status_code == 200 and r.headers["x-lazyrt-replica"] != dead
    assert r.json()["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health", timeout=5).json()["replicas_up"] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/health", timeout=5).json()["replicas_up"] == 1
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'lazyrt_router_replica_up{replica="' + dead + '"} 0.0' in metrics


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc: no psutil in the test dependencies)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _wait_gone(pids: set[int], timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if pid_alive(p)}


def _stop_and_check(router: subprocess.Popen, sig: int, below: set[int], ports: list[int]) -> None:
    """Signals a `--dp` router: it exits (0 on SIGTERM), and every process below it stops, freeing the
    replicas' ports."""
    router.send_signal(sig)
    rc = router.wait(60)
    assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert _wait_gone(below) == set()
    for port in ports:
        with pytest.raises(httpx.TransportError):  # the replica's port is free again
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_dp_replicas_stop_with_the_router_killed_outright():
    """`--dp` replicas hold a GPU each: a router killed outright takes them and their processes with it
    (they are signalled when their parent dies). A SIGTERM to the router (uvicorn re-raises the
    SIGTERM it shut down on, which killed the router before it stopped them) is checked the same way
    at the end of test_dp_kv_peers_wires_the_replicas_as_peers, on the router it starts anyway."""
    port, base = free_port(), free_port()
    replica = ["--device", "cpu", "--kv-cache-tokens", "4096", "--log-level", "warning"]
    cmd = [sys.executable, "-m", "lazyrt.router", "--dp", "1", "--dp-base-port", str(base)]
    cmd += ["--port", str(port), "--log-level", "warning", "--", *replica]
    router = subprocess.Popen(cmd, env=dict(os.environ))
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert router.poll() is None, "the router exited while starting"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("replicas_up") == 1:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        below = _descendants(router.pid)
        assert len(below) >= 2, below  # the replica's HTTP process and its scheduler (the worker in it)
        _stop_and_check(router, signal.SIGKILL, below, [base])
    finally:
        for p in [router.pid, *below]:  # a failed run must not leave a server behind
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        router.wait()


@pytest.mark.slow
def test_dp_router_exits_naming_the_replica_when_none_is_left():
    """A `--dp` replica that cannot start (here a bad flag) is named with its exit code, and a router
    with no replica left exits with status 1 instead of answering 503 forever."""
    port = free_port()
    cmd = [sys.executable, "-m", "lazyrt.router", "--dp", "1", "--dp-base-port", str(free_port()),
           "--port", str(port), "--", "--device", "cpu", "--kv-cache-tokens", "-5"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "--kv-cache-tokens" in r.stderr  # the replica's own error
    assert "exited with code 2" in r.stderr and "no --dp replica is left" in r.stderr


@pytest.mark.slow
def test_dp_kv_peers_wires_the_replicas_as_peers():
    from lazyrt.cache.placement import owner as place

    """`--dp 2 --dp-kv-peers` starts replicas that read each other's documents (peer KV) and routes
    each request to the replica owning most of its documents. Then a SIGTERM to the router stops it
    (status 0) and both replicas with every process of theirs."""
    port, base = free_port(), free_port()
    cmd = [sys.executable, "-m", "lazyrt.router", "--dp", "2", "--dp-kv-peers", "--policy", "owner",
           "--dp-base-port", str(base),
           "--port", str(port), "--log-level", "warning", "--",
           "--device", "cpu", "--kv-cache-tokens", "4096", "--log-level", "warning"]  # fmt: skip
    router = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert router.poll() is None and time.monotonic() < deadline, "the replicas did not start"
            try:
                reps = httpx.get(url + "/cache_stats", timeout=5).json()["replicas"]
                up = httpx.get(url + "/health", timeout=5).json().get("replicas_up")
                if up == 2 and len(reps) == 2 and all(r["stats"].get("kv_peers_up") == 1 for r in reps):
                    break
            except (httpx.TransportError, KeyError, TypeError, AttributeError):
                pass
            time.sleep(0.5)
        below = _descendants(router.pid)
        # two documents owned by different replicas (as both the router and the replicas hash them): a
        # request with both reads one from the other replica wherever it goes
        names = [r["stats"]["kv_peer_addr"] for r in reps]
        facts = [f"Fact {i}: the Arvanian lorn was minted in {1900 + i}." for i in range(64)]
        by_owner = {n: [f for f in facts if place(doc_key(f), names) == n] for n in names}
        pair = [by_owner[names[0]][0], by_owner[names[1]][0]]
        for docs in (pair, pair[::-1], DOCS):
            got = _chat(url, docs, "When was the lorn minted?")
            assert got.status_code == 200, got.text
        stats = httpx.get(url + "/cache_stats", timeout=30).json()
        assert sum(r["stats"]["chunk_peer_fetches"] for r in stats["replicas"]) > 0
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'reason="owner"' in metrics and 'reason="affinity"' not in metrics
        for r in stats["replicas"]:  # each document cached by its owner only (and a prefix chunk)
            held = r["stats"]["chunks"] - 1
            assert held == sum(place(doc_key(d), names) == r["stats"]["kv_peer_addr"] for d in pair + DOCS)
        below = _descendants(router.pid)
        assert len(below) >= 4, below  # each replica's HTTP process and its scheduler (the worker in it)
        _stop_and_check(router, signal.SIGTERM, below, [base, base + 1])
    finally:
        for p in [router.pid, *below]:  # a failed run must not leave a server behind
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        router.wait()
    bad = subprocess.run([sys.executable, "-m", "lazyrt.router", "--dp", "1", "--dp-kv-peers"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--dp-kv-peers needs --dp 2" in bad.stderr


def test_owner_policy_routes_where_peer_kv_replicas_cache_the_documents():
    from lazyrt.cache.placement import owner as place

    pol = AffinityPolicy(mode="owner", slack=2)
    load = {"http://a": 0, "http://b": 0}
    keys = [doc_key(f"document {i}") for i in range(40)]
    assert pol.choose(keys[:3], load).reason == "least_loaded"  # no peer names learnt yet
    pol.peer_names = {"http://a": "ipc:///x/a", "http://b": "ipc:///x/b"}
    by_name = {v: k for k, v in pol.peer_names.items()}
    rng = random.Random(4)
    for _ in range(50):
        ks = rng.sample(keys, 3)
        sizes = [rng.randrange(1, 100) for _ in ks]
        owns = dict.fromkeys(load, 0)
        for k, n in zip(ks, sizes):  # what the replicas compute (PeerKV.owner)
            owns[by_name[place(k, list(pol.peer_names.values()))]] += n
        c = pol.choose(ks, load, sizes)
        assert c.reason == "owner" and c.held == owns[c.replica] == max(owns.values())
    # the load bound still applies
    c = pol.choose(keys[:1], {"http://a": 9, "http://b": 0} if by_name[place(keys[0], list(by_name))] == "http://a"
                   else {"http://a": 0, "http://b": 9})  # fmt: skip
    assert c.reason == "imbalance"


def test_affinity_with_peer_kv_places_each_document_once():
    """Replicas that read each other's KV (peer names known): a document another replica's view holds
    stays there (the request reads it from that replica); the rest go to the chosen one, and the
    placement sent with the request names each document's holder."""
    from lazyrt.router.app import DOC_OWNERS_HEADER
    from lazyrt.runtime.server.doc_owners import DOC_OWNERS_HEADER as SERVER_HEADER

    assert DOC_OWNERS_HEADER == SERVER_HEADER
    pol = AffinityPolicy(mode="affinity")
    urls = ["http://a", "http://b"]
    for u in urls:
        pol.view(u).reset(10_000, "lfu", 16)
    keys = [doc_key(f"doc {i}") for i in range(6)]
    assert pol.placement(keys[:2], urls[0]) is None  # no peer KV: nothing to place
    pol.peer_names = {"http://a": "ipc:///p/a", "http://b": "ipc:///p/b"}
    pol.record(urls[0], keys[:3], [100] * 3)  # a computes docs 0-2
    assert pol.placement(keys[1:5], urls[1]) == ["ipc:///p/a", "ipc:///p/a", "ipc:///p/b", "ipc:///p/b"]
    pol.record(urls[1], keys[1:5], [100] * 4)  # b reads 1, 2 from a and computes 3, 4
    held = {u: {k for k in keys if pol.views[u].holds(k)} for u in urls}
    assert held == {urls[0]: set(keys[:3]), urls[1]: set(keys[3:5])}  # nothing held twice
    assert pol.views[urls[0]].held[keys[1]].hits == 1  # b's use counted on a's copy
    # a request holding most of its tokens on b goes there
    assert pol.choose(keys[2:5], {u: 0 for u in urls}, [100] * 3).replica == urls[1]
