"""Data parallelism: `python -m lazyrt.router` in front of several lazyrt.launch replicas.

- policy.py: AffinityPolicy, which replica a request goes to (rendezvous hashing on its documents,
  bounded by the replicas' loads; the least-loaded one without documents).
- app.py: the router's HTTP app: forwards and streams answers back, skips a replica that fails before
  answering, health checks, the union of the replicas' /metrics and /cache_stats.
- __main__.py: the command line (`--worker URL` ..., or `--dp N` to start the replicas).

It talks to replicas over HTTP only: it never loads a model, a tokenizer or a cache; its views of the
replicas' caches use their eviction policies (lazyrt.cache.eviction).

May import: lazyrt.cache, lazyrt.api_key, lazyrt.process_name, lazyrt.documents (its checks of a
document request's fields).
"""
