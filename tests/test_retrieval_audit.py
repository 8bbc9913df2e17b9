"""Retrieval attention's Python API (lazyrt.retrieval) with arguments of the wrong shape, dtype or
type: a ValueError naming the argument (before: unpacking errors, ZeroDivisionError, torch's shape
errors, a TypeError from topk, or a message naming another function's argument). And host parts of
tiny chunks (fewer keys than the sink, top-k or a page) attend exactly, in every fill."""

from __future__ import annotations

import pytest
import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.retrieval import build_key_index, retrieval_attention_ref, search_key_index
from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions
from lazyrt.retrieval.key_index import kmeans


class _Rope:
    rope_theta, rope_scaling, rotary_dim = 10000.0, None, 8


N, KVH, D = 40, 2, 8
ROPE = RopeCache.build(_Rope(), 256)
K, V = torch.randn(N, KVH, D), torch.randn(N, KVH, D)
Q = torch.randn(3, 2 * KVH, D)
INDEX = build_key_index(apply_rope_ref(K, torch.arange(N), ROPE), sink=2)


def attend(**kw):
    args = dict(q=Q, k=K, v=V, index=INDEX, rope=ROPE, sm_scale=D**-0.5, top_k=4)
    return retrieval_attention_ref(**{**args, **kw})


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(q=Q[0]), r"q must be \[m, q_heads, head_dim\]"),
        (dict(k=K[:, 0]), r"k must be \[n, kv_heads, head_dim\]"),
        (dict(q=Q.tolist()), "q must be a float tensor"),
        (dict(q=Q.int()), "q must be a float tensor"),
        (dict(v=V.long()), "v must be a float tensor"),
        (dict(k=K[:, :0], v=V[:, :0], index=None), "kv_heads"),
        (dict(q=torch.randn(3, 3, D)), "q_heads a multiple of kv_heads"),
        (dict(top_k=0, index=None), "top_k=0"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(top_k=True), "top_k=True"),
        (dict(scan=0.0, index=None), "scan=0.0"),
        (dict(k=K[:30], v=V[:30]), "index covers 40 keys"),
        (dict(k=torch.randn(N, 4, D), v=torch.randn(N, 4, D), q=torch.randn(3, 4, D)), "index covers"),
        (dict(k=torch.randn(300, KVH, D), v=torch.randn(300, KVH, D), index=None), "rope covers 256"),
        (dict(local=K[:5]), "local"),
    ],
)
def test_retrieval_attention_names_the_bad_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        attend(**kw)


@pytest.mark.parametrize(
    "args, match",
    [
        ((INDEX, K, torch.randn(3, 4, 4), 4, 0.5), r"q must be \[m, q_heads, 8\]"),
        ((INDEX, K, torch.randn(3, 3, D), 4, 0.5), "q_heads a multiple of 2"),
        ((INDEX, K, Q[0], 4, 0.5), r"q must be \[m, q_heads, head_dim\]"),
        ((INDEX, K[:10], Q, 4, 0.5), "index covers 40 keys"),
        ((INDEX, K[:, :1], Q, 4, 0.5), "index covers"),
        ((INDEX, K, Q, 2.5, 0.5), "top_k=2.5"),
        ((INDEX, K, Q, 4, "0.5"), "scan='0.5'"),
        ((None, K, Q, 4, 0.5), "index must be a KeyIndex"),
    ],
)
def test_search_names_the_bad_argument(args, match):
    with pytest.raises(ValueError, match=match):
        search_key_index(*args)


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((K.int(),), {}, "keys must be a float tensor"),
        ((K[:0],), {}, "keys must be"),
        ((K[:, :0],), {}, "keys must be"),
        ((K,), dict(sink=2.5), "sink=2.5"),
        ((K,), dict(sink=True), "sink=True"),
        ((K,), dict(keys_per_list=2.5), "keys_per_list=2.5"),
        ((K,), dict(seed="x"), "seed='x'"),
        ((K,), dict(queries=torch.randn(0, 4, D), rope=ROPE), "queries: no query rows"),
        ((K,), dict(queries=torch.randn(10, 4, D).int(), rope=ROPE), "queries must be a float tensor"),
        ((K,), dict(queries=torch.randn(10, 4, D), rope=ROPE, lists_per_group=2.5), "lists_per_group=2.5"),
        ((K,), dict(queries=torch.randn(10, 4, D), rope=ROPE, ridge=-1.0), "ridge=-1.0"),
    ],
)
def test_build_names_the_bad_argument(args, kw, match):
    with pytest.raises(ValueError, match=match):
        build_key_index(*args, **kw)


def test_kmeans_names_the_bad_argument():
    x = torch.randn(1, 10, 3)
    for kw, match in ((dict(k=2.5), "k=2.5"), (dict(k=True), "k=True"), (dict(k=2, niter=2.5), "niter=2.5")):
        with pytest.raises(ValueError, match=match):
            kmeans(x, **kw)


def test_options_and_parts_refuse_a_top_k_they_would_misread():
    """HostPart(top_k=0) meant the engine's top-k (`part.top_k or ...`); RetrievalOptions took any
    value and failed inside a step. Both now refuse it by name."""
    for kw, match in (
        (dict(top_k=0, sink=1, scan=0.1), "top_k=0"),
        (dict(top_k=4, sink=-1, scan=0.1), "sink=-1"),
        (dict(top_k=4, sink=1, scan=0.0), "scan=0.0"),
        (dict(top_k=4, sink=1, scan=0.1, build_threads=-1), "build_threads=-1"),
    ):
        with pytest.raises(ValueError, match=match):
            RetrievalOptions(**kw)
    with pytest.raises(ValueError, match="top_k=0"):
        HostPart(range(0, 1), (0,), 3, 0, 0, 0)


@pytest.mark.parametrize("fill", ["fill", "fill_reference", "fill_device"])
def test_tiny_chunks_attend_every_key(fill):
    """Chunks of 1-5 keys (no more than the sink (4) and the top-k (1); fewer than a page or the sink):
    every fill attends them exactly, as full attention over the chunk does."""
    ps, qh, layers = 4, 4, 1
    host = torch.randn(4, layers, 2, ps, KVH, D)
    for n in range(1, 6):
        for rows in (1, 3):
            q = torch.randn(rows, qh, D)
            part = HostPart(range(rows), tuple(range(-(-n // ps))), n, 50, 0, 1)
            opts = RetrievalOptions(1, 4, 0.05, exact_prefill=False)
            ha = HostAttention([part], host, ROPE, D**-0.5, opts, HostIndexCache(), device_rope=ROPE)
            k = host[:, 0, 0].reshape(-1, KVH, D)[:n]
            v = host[:, 0, 1].reshape(-1, KVH, D)[:n]
            q_at = apply_rope_ref(q, torch.full((rows,), 100), ROPE)  # the rows' queries, after the chunk
            o, lse = torch.zeros(rows, qh, D), torch.zeros(rows, qh)
            getattr(ha, fill)(0, q_at, o, lse)
            want_o, want_lse = _full(q_at, k, v, 50 + torch.arange(n))
            torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def _full(q, k, v, k_pos):
    """Attention of q (rotated at its positions) over keys stored unrotated, at k_pos: (o, lse)."""
    group = q.shape[1] // k.shape[1]
    ka = apply_rope_ref(k, k_pos, ROPE).repeat_interleave(group, 1)
    s = torch.einsum("mhd,nhd->mhn", q, ka) * D**-0.5
    return torch.einsum("mhn,nhd->mhd", s.softmax(-1), v.repeat_interleave(group, 1)), s.logsumexp(-1)
