"""lazyrt.retrieval.key_index.kmeans (batched Lloyd's k-means in torch) against independent checks on
fresh random inputs: torch.cdist for nearest centroids, per-cluster means by boolean masks, each
problem solved alone for the batched result. Seeds are drawn per run and printed (pytest -s, or in a
failure's captured output)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICES

from lazyrt.retrieval.key_index import _cluster_counts, _sorted_sums, kmeans


def _draw() -> tuple[random.Random, int]:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    torch.manual_seed(seed)
    return random.Random(seed), seed


def _check(x: torch.Tensor, k: int, assign: torch.Tensor, cents: torch.Tensor, nearest: bool = True) -> None:
    """assign [B, n] / cents [B, k, d]: every list non-empty, each centroid the mean of its points and
    (nearest) each point in a cluster whose centroid is as near as its nearest one (ties allowed)."""
    b, n, d = x.shape
    assert assign.shape == (b, n) and assign.dtype == torch.int64
    assert cents.shape == (b, k, d) and cents.dtype == torch.float32
    assert cents.device == x.device and assign.device == x.device
    x64, c64, a = x.double().cpu(), cents.double().cpu(), assign.cpu()
    scale = float(x64.abs().max()) + 1.0
    for p in range(b):
        for j in range(k):
            members = x64[p][a[p] == j]
            assert len(members) > 0, f"problem {p}: list {j} is empty"
            torch.testing.assert_close(c64[p, j], members.mean(0), rtol=0, atol=1e-5 * scale)
    if nearest:
        dist = torch.cdist(x64, c64).square()  # [B, n, k]
        own = dist.gather(2, a[..., None])[..., 0]
        assert (own <= dist.min(-1).values + 1e-6 * scale**2).all()


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_is_a_fixed_point_of_lloyd(device):
    """Run to convergence (many rounds allowed): assignments are nearest centroids, centroids are
    means, no list is empty, whatever B, n, d, k (k up to n)."""
    rng, seed = _draw()
    for _ in range(6):
        b, n, d = rng.randint(1, 5), rng.randint(1, 120), rng.randint(1, 24)
        k = rng.choice([1, n, rng.randint(1, n)])
        x = (torch.randn(b, n, d) * rng.uniform(0.1, 10)).to(device)
        assign, cents = kmeans(x, k, seed=rng.randrange(1000), niter=1000)
        _check(x, k, assign, cents)


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_default_rounds_keeps_lists_and_means(device):
    """At the default 20 rounds (may stop before converging): still no empty list and centroids are
    their points' means; the shape the retrieval index uses (lists of ~8 keys)."""
    rng, _ = _draw()
    b, n, d = rng.randint(1, 4), rng.randint(200, 600), rng.choice([16, 64, 128])
    x = torch.randn(b, n, d, device=device)
    k = n // 8
    assign, cents = kmeans(x, k, seed=rng.randrange(1000))
    _check(x, k, assign, cents, nearest=False)


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_fills_empty_clusters(device):
    """Few distinct points (many duplicates) and k above their number: centroids start on equal points,
    so clusters empty every round; each must still end with points, means right, ties allowed."""
    rng, _ = _draw()
    for _ in range(4):
        b, distinct, d = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 8)
        n = rng.randint(distinct * 3, 40)
        base = torch.randn(b, distinct, d)
        x = base.gather(1, torch.randint(0, distinct, (b, n, 1)).expand(b, n, d)).to(device)
        k, s = rng.randint(distinct, n), rng.randrange(1000)
        assign, cents = kmeans(x, k, seed=s, niter=1000)
        _check(x, k, assign, cents)
        assign, cents = kmeans(x, k, seed=s, niter=rng.randint(1, 3))  # maybe not converged yet
        _check(x, k, assign, cents, nearest=False)


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_in_float16_and_bfloat16(device):
    rng, _ = _draw()
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 90, 12, device=device).to(dtype)
        k = rng.randint(1, 90)
        assign, cents = kmeans(x, k, seed=rng.randrange(1000), niter=1000)
        _check(x.float(), k, assign, cents)


def test_kmeans_batched_equals_each_problem_alone_and_is_deterministic():
    """The initial points are one draw shared by every problem, and each problem's arithmetic is its
    own, so on the CPU a problem batched gets exactly its clusters alone; the same seed, the same
    result; another seed, (almost surely) another start."""
    rng, _ = _draw()
    for _ in range(3):
        b, n, d = rng.randint(2, 6), rng.randint(20, 300), rng.randint(2, 32)
        k, s = rng.randint(1, n), rng.randrange(1000)
        x = torch.randn(b, n, d)
        assign, cents = kmeans(x, k, seed=s)
        for p in range(b):
            a1, c1 = kmeans(x[p : p + 1], k, seed=s)
            assert torch.equal(a1[0], assign[p]) and torch.equal(c1[0], cents[p])
        again = kmeans(x, k, seed=s)
        assert torch.equal(again[0], assign) and torch.equal(again[1], cents)


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_deterministic_on_device(device):
    rng, _ = _draw()
    x = torch.randn(3, 500, 64, device=device)
    k, s = rng.randint(2, 120), rng.randrange(1000)
    a0, c0 = kmeans(x, k, seed=s)
    a1, c1 = kmeans(x, k, seed=s)
    assert torch.equal(a0, a1) and torch.equal(c0, c1)


def test_kmeans_rejects_bad_arguments():
    x = torch.randn(2, 10, 4)
    with pytest.raises(ValueError, match="k=11"):
        kmeans(x, 11)
    with pytest.raises(ValueError, match="k=0"):
        kmeans(x, 0)
    with pytest.raises(ValueError, match="x must be"):
        kmeans(x[0], 3)
    with pytest.raises(ValueError, match="x must be"):
        kmeans(x[None], 3)
    with pytest.raises(ValueError, match="x must be a float"):
        kmeans(torch.ones(2, 10, 4, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="niter=0"):
        kmeans(x, 3, niter=0)


def test_sorted_sums_equal_the_cpu_sums():
    """The non-CPU path's cluster sums (sorted float64 running sums) against plain per-cluster sums."""
    rng, _ = _draw()
    b, n, d = rng.randint(1, 5), rng.randint(1, 300), rng.randint(1, 64)
    k = rng.randint(1, n)
    x, assign = torch.randn(b, n, d) * 10, torch.randint(0, k, (b, n))  # some clusters empty
    sums = _sorted_sums(x, assign, _cluster_counts(assign, k))
    ref = [torch.stack([x[p][assign[p] == j].double().sum(0) for j in range(k)]) for p in range(b)]
    ref = torch.stack(ref)
    torch.testing.assert_close(sums, ref, rtol=1e-9, atol=1e-9)
