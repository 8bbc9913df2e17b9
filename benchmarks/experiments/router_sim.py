"""The router's chunk hit ratio in simulation (issue 17): routing policies over modelled caches, in
seconds instead of router_affinity.py's minutes of real replicas.

Each replica's chunk cache is modelled by the router's own view (lazyrt.router.policy.ReplicaView:
the replicas' eviction policy, whole pages), with the documents of its requests in flight pinned as
the replica's scheduler pins them. Requests come from rag_workload.py (the same streams as
router_affinity.py for the same flags), `--concurrency` in flight, each finishing in arrival order
(a closed loop of equal requests). What it leaves out: the prompt's shared prefix chunk (a hit for
nearly every request in the real runs), the in-flight requests' own pages, timing.

    python benchmarks/experiments/router_sim.py --num-docs 120 --docs-per-request 4 --topics 12 \
        --concurrency 2 8 --slack 4 16

Prints one row per (workload point, concurrency, imbalance, slack): one replica with 2C, then two with
C each under affinity / hash / round_robin / least_loaded: hit ratio and the share of requests the
imbalance bound moved off their choice ("spilled"); "affinity + peer KV" also counts as hits the
misses whose document the other replica held at the time (the bound for moving KV between
replicas instead of recomputing it); "partitioned + peer KV": each document cached only by its owner
replica (a hash), read from there by requests on the other (no document held twice); "+ copies,
POLICY": peer KV as built behind the router's POLICY (simulate_partitioned), with the replicas' mean
load difference and the share of documents read from the peer.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rag_workload import WorkloadConfig, build_workload, fallback_words  # noqa: E402

from lazyrt.cache.placement import owner  # noqa: E402
from lazyrt.router.policy import AffinityPolicy, ReplicaView  # noqa: E402


class ModelCache:
    """A replica's chunk table: the eviction policy of ReplicaView, in-flight documents pinned."""

    def __init__(self, capacity: int, eviction_policy: str, page_size: int):
        self.view = ReplicaView(capacity=capacity, eviction_policy=eviction_policy, page_size=page_size)
        self.pins: collections.Counter = collections.Counter()

    def admit(self, keys: list[bytes], sizes: list[int]) -> tuple[int, int]:
        """(hits, misses) of a request's documents; they are cached and pinned until release."""
        v = self.view
        hits = sum(1 for k in keys if v.holds(k))
        v.add([], [])  # (sets up its policy)
        need = sum(-(-n // v.page_size) for k, n in dict(zip(keys, sizes)).items() if not v.holds(k))
        v.make_room(need, set(keys) | {k for k, n in self.pins.items() if n > 0})
        v.add(keys, sizes)
        self.pins.update(keys)
        return hits, len(keys) - hits

    def release(self, keys: list[bytes]) -> None:
        self.pins.subtract(keys)

    def drop_unpinned(self, keys: list[bytes]) -> None:
        """Forget the keys no request in flight pins any more (a peer copy: dropped after use)."""
        v = self.view
        for k in keys:
            if self.pins[k] <= 0 and k in v.held:
                d = v.held.pop(k)
                v.tokens -= d.tokens
                v.pages -= len(d.pages)


def simulate(requests: list[list[int]], doc_tokens: int, capacity: int, replicas: int, concurrency: int,
             mode: str = "affinity", imbalance: float = 0.5, slack: int = 4, eviction_policy: str = "lfu",
             page_size: int = 16) -> dict:  # fmt: skip
    """Hit ratio and spilled share of the request stream (each a list of document ids)."""
    names = [f"r{i}" for i in range(replicas)]
    caches = {r: ModelCache(capacity, eviction_policy, page_size) for r in names}
    policy = AffinityPolicy(imbalance=imbalance, slack=slack, mode=mode)
    for r in names:
        policy.views[r] = ReplicaView(capacity=capacity, eviction_policy=eviction_policy, page_size=page_size)
    in_flight: collections.deque = collections.deque()
    load = dict.fromkeys(names, 0)
    hits = misses = spilled = peer = 0
    for docs in requests:
        if len(in_flight) >= concurrency:
            r, keys = in_flight.popleft()
            caches[r].release(keys)
            load[r] -= 1
        keys = [str(d).encode() for d in docs]
        sizes = [doc_tokens] * len(keys)
        choice = policy.choose(keys, dict(load), sizes)
        spilled += choice.reason == "imbalance"
        policy.record(choice.replica, keys, sizes)
        own = caches[choice.replica].view
        peer += sum(1 for k in set(keys) if not own.holds(k)
                    and any(caches[o].view.holds(k) for o in names if o != choice.replica))  # fmt: skip
        h, m = caches[choice.replica].admit(keys, sizes)
        hits, misses = hits + h, misses + m
        in_flight.append((choice.replica, keys))
        load[choice.replica] += 1
    total = max(hits + misses, 1)
    # peer: misses whose document another replica held then (what moving KV between replicas would
    # turn into hits; a document used twice in a request counts once)
    return {"hit_ratio": hits / total, "spilled": spilled / max(len(requests), 1),
            "with_peer": (hits + peer) / total}  # fmt: skip


def simulate_partitioned(requests: list[list[int]], doc_tokens: int, capacity: int, replicas: int,
                         concurrency: int, eviction_policy: str = "lfu", page_size: int = 16,
                         copies: str | None = None, imbalance: float = 0.5,
                         slack: int = 16) -> dict:  # fmt: skip
    """Hit ratio when each document is cached by one owner replica and a request anywhere reads the
    others' documents from them: the replicas' caches hold no document twice. copies=None: owners by
    hashing, read in place (no room taken); else the router policy (lazyrt.router.policy, with the
    replicas' peer names, imbalance and slack) that peer KV runs behind: "least_loaded", "owner" (the
    replica owning most of the request's tokens; owners by hashing) or "affinity" (the router's views,
    and its placement: a document another replica's view holds stays there, the rest are owned by the
    replica the request goes to). The request copies the documents it does not own into its replica's
    cache for its life (peer KV as built: pinned pages that make room like documents, shared by that
    replica's requests in flight, dropped when none holds them). Also: the mean difference of the two
    replicas' requests in flight at each routing (load unevenness: a throughput cost the model leaves
    out) and the share of document uses read from a peer."""
    names = [f"r{i}" for i in range(replicas)]
    peer_of = {r: f"peer-{r}" for r in names}
    by_peer = {n: r for r, n in peer_of.items()}
    caches = {r: ModelCache(capacity, eviction_policy, page_size) for r in names}
    policy = None
    if copies is not None:
        policy = AffinityPolicy(imbalance=imbalance, slack=slack, mode=copies, peer_names=dict(peer_of))
        for r in names:
            policy.views[r] = ReplicaView(capacity, eviction_policy, page_size)
    in_flight: collections.deque = collections.deque()
    load = dict.fromkeys(names, 0)
    hits = misses = uses = remote = 0
    uneven = 0.0
    for docs in requests:
        if len(in_flight) >= concurrency:
            reader, owned, copied = in_flight.popleft()
            for r, keys in owned:
                caches[r].release(keys)
            if reader is not None:
                load[reader] -= 1
                caches[reader].release(copied)
                caches[reader].drop_unpinned(copied)
        keys = list(dict.fromkeys(str(d).encode() for d in docs))
        sizes = [doc_tokens] * len(keys)
        reader = None
        if policy is None:
            owners = [owner(k, names) for k in keys]
        else:
            uneven += max(load.values()) - min(load.values())
            reader = policy.choose(keys, dict(load), sizes).replica
            placed = policy.placement(keys, reader)
            owners = ([by_peer[n] for n in placed] if placed is not None
                      else [by_peer[owner(k, list(peer_of.values()))] for k in keys])  # fmt: skip
            policy.record(reader, keys, sizes)
            load[reader] += 1
        by_owner = collections.defaultdict(list)
        for k, r in zip(keys, owners):
            by_owner[r].append(k)
        for r, ks in by_owner.items():
            h, m = caches[r].admit(ks, [doc_tokens] * len(ks))
            hits, misses = hits + h, misses + m
        copied = [b"copy:" + k for r, ks in by_owner.items() if r != reader for k in ks] if reader else []
        if copied:
            caches[reader].admit(copied, [doc_tokens] * len(copied))  # (not hits or misses: peer loads)
        uses, remote = uses + len(keys), remote + len(copied)
        in_flight.append((reader, list(by_owner.items()), copied))
    n = max(len(requests), 1)
    return {"hit_ratio": hits / max(hits + misses, 1), "uneven": uneven / n, "remote": remote / max(uses, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-docs", type=int, default=60)
    p.add_argument("--doc-tokens", type=int, default=128)
    p.add_argument("--docs-per-request", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--zipf-alpha", type=float, default=1.1)
    p.add_argument("--topics", type=int, default=0)
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--kv-cache-tokens", type=int, default=3072, help="C: each of the two replicas' KV")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--imbalance", type=float, nargs="+", default=[0.5])
    p.add_argument("--slack", type=int, nargs="+", default=[16])
    args = p.parse_args()
    peers = ("least_loaded", "owner", "affinity")
    print("| seed | in flight | imbalance | slack | one 2C | affinity (spilled) | affinity + peer KV "
          "| partitioned + peer KV | " + " | ".join(f"+ copies, {m} (uneven, remote)" for m in peers)
          + " | hash | round robin | least loaded | affinity vs one | vs round robin |")
    print("|---" * (12 + len(peers)) + "|")
    for seed in args.seed:
        cfg = WorkloadConfig(num_docs=args.num_docs, doc_tokens=args.doc_tokens, seed=seed,
                             docs_per_request=args.docs_per_request, num_requests=args.num_requests,
                             zipf_alpha=args.zipf_alpha, rate=float("inf"), topics=args.topics)  # fmt: skip
        requests = [r.doc_ids for r in build_workload(cfg, fallback_words()).requests]
        for conc, imb, slack in itertools.product(args.concurrency, args.imbalance, args.slack):
            one = simulate(requests, args.doc_tokens, 2 * args.kv_cache_tokens, 1, conc)["hit_ratio"]
            two = {
                m: simulate(requests, args.doc_tokens, args.kv_cache_tokens, 2, conc, m, imb, slack)
                for m in ("affinity", "hash", "round_robin", "least_loaded")
            }
            a, spilled = two["affinity"]["hit_ratio"], two["affinity"]["spilled"]
            part = simulate_partitioned(requests, args.doc_tokens, args.kv_cache_tokens, 2, conc)
            copied = [simulate_partitioned(requests, args.doc_tokens, args.kv_cache_tokens, 2, conc,
                                           copies=m, imbalance=imb, slack=slack) for m in peers]  # fmt: skip
            rr = two["round_robin"]["hit_ratio"]
            cells = " | ".join(f"{c['hit_ratio']:.3f} ({c['uneven']:.1f}, {c['remote']:.2f})" for c in copied)
            print(f"| {seed} | {conc} | {imb} | {slack} | {one:.3f} | {a:.3f} ({spilled:.3f}) "
                  f"| {two['affinity']['with_peer']:.3f} | {part['hit_ratio']:.3f} | {cells} "
                  f"| {two['hash']['hit_ratio']:.3f} | {rr:.3f} | {two['least_loaded']['hit_ratio']:.3f} "
                  f"| {100 * (a - one):+.1f} | {100 * (a - rr):+.1f} |")


if __name__ == "__main__":
    main()
