"""Triton kernels vs torch references on CUDA in bf16 at realistic shapes (32 q / 8 kv heads, d=128).

Run: `pytest -m gpu tests/test_triton_gpu.py`, or standalone `python tests/test_triton_gpu.py [--bench]`;
--bench also times lazy decode at the RAG shape of docs/CUDA notes (5 x 2,048 + 128 tokens a request).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

if __name__ == "__main__":  # standalone: import lazyrt from this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
try:
    import triton  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"triton is not importable ({e})", allow_module_level=True)

from lazyrt.kernels import triton_attention as ta  # noqa: E402
from lazyrt.kernels.attention_ref import (  # noqa: E402
    copy_rerotate_pages_ref,
    lazy_attention_ref,
    rerotate_pages_ref,
    store_kv_ref,
)
from lazyrt.kernels.metadata import AttentionMetadata  # noqa: E402
from lazyrt.kernels.rope import RopeCache, apply_rope_ref  # noqa: E402
from lazyrt.kernels.triton_attention import lazy_attention_triton  # noqa: E402
from lazyrt.kernels.triton_kv import (  # noqa: E402
    apply_rope_triton,
    copy_rerotate_pages_triton,
    rerotate_pages_triton,
    store_kv_triton,
)
from lazyrt.models.config import ModelConfig  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
print(f"test_triton_gpu seed {SEED}")
DEV = "cuda"
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
BF16 = torch.bfloat16
MAX_POS = 1 << 15


@pytest.fixture(autouse=True)
def _seed(request):
    s = SEED + sum(map(ord, request.node.name))
    torch.manual_seed(s)
    random.seed(s)


def make_rope(llama3: bool = True) -> RopeCache:
    scaling = None
    if llama3:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    cfg = ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=8, num_layers=1,
        num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=500000.0,
        rope_scaling=scaling,
    )
    return RopeCache.build(cfg, MAX_POS, DEV)


def rag_batch(q_lens, docs, doc_len, rotate_keys, jitter=True, dtype=BF16):
    """Each request: `docs` chunks of ~doc_len tokens at gapped positions, then its own chunk whose last
    q_len tokens are the new ones. Pages are scattered over the pool."""
    qo, kvp, positions, pos_base, valid_len = [0], [0], [], [], []
    for q_len in q_lens:
        pos = random.randint(0, 50)
        chunks = []
        for _ in range(docs):
            n = doc_len - (random.randint(0, PAGE * 3) if jitter else 0)
            chunks.append((pos, n))
            pos += n + (random.randint(0, 7) if jitter else 0)
        prior = random.randint(0, 40) if jitter else 0
        chunks.append((pos, prior + q_len))
        positions += range(pos + prior, pos + prior + q_len)
        qo.append(qo[-1] + q_len)
        for start, n in chunks:
            for j in range(-(-n // PAGE)):
                pos_base.append(start + j * PAGE)
                valid_len.append(min(PAGE, n - j * PAGE))
        kvp.append(len(pos_base))
    num_pages = len(pos_base)
    kv = torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=dtype)
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731
    meta = AttentionMetadata(
        qo_indptr=t(qo), positions=t(positions, torch.long), kv_indptr=t(kvp),
        kv_indices=torch.randperm(num_pages, device=DEV).to(torch.int32), pos_base=t(pos_base),
        valid_len=t(valid_len), store_pages=t([], torch.long), store_slots=t([], torch.long),
        rotate_keys=rotate_keys,
    )
    return kv, meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite kernel output"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("batch,num_splits", [(1, None), (4, None), (3, 7), (16, 1)])
def test_decode_bf16(batch, num_splits, rotate):
    kv, meta = rag_batch([1] * batch, docs=5, doc_len=600, rotate_keys=rotate)
    rope = make_rope()
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
    out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=num_splits)
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize(
    "q_lens,num_splits", [([1] * 4, None), ([1] * 3, 7), ([1, 77, 513], None), ([129], 3)]
)
def test_entry_logits_bf16(q_lens, num_splits):
    # per-entry logit scale / log mass (document attention): decode and extend paths, splits
    kv, meta = rag_batch(q_lens, docs=4, doc_len=600, rotate_keys=True)
    n = meta.kv_indices.numel()
    on = torch.rand(n, device=DEV) < 0.7
    meta.entry_logit_scale = torch.where(on, torch.empty(n, device=DEV).uniform_(0.5, 2.0), 1.0)
    meta.entry_log_mass = torch.where(on, torch.empty(n, device=DEV).uniform_(-1.5, 1.5), 0.0)
    rope = make_rope()
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
    out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=num_splits)
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("q_lens,num_splits", [([300], None), ([1, 77, 513], None), ([129, 64], 3)])
def test_extend_bf16(q_lens, num_splits, rotate):
    kv, meta = rag_batch(q_lens, docs=4, doc_len=700, rotate_keys=rotate)
    rope = make_rope()
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
    out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=num_splits)
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("q_len", [16, 128])
def test_extend_bf16_question_beside_decodes_split_by_waves(q_len):
    # a question beside 16 decodes: 17 sequences x 8 kv heads = 136 programs at work, between one and
    # two a SM on an H100 / H200, so the launch splits the keys by whole waves; equals the reference
    q_lens = [q_len] + [1] * 16
    kv, meta = rag_batch(q_lens, docs=4, doc_len=700, rotate_keys=True)
    entries = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
    cfg = ta.launch_config(len(q_lens), q_len, entries, KV_HEADS, Q_HEADS // KV_HEADS, PAGE, True,
                           torch.device(DEV), total_tokens=sum(q_lens))  # fmt: skip
    sms = ta.device_sms(torch.device(DEV))
    if sms <= 17 * KV_HEADS < sms * ta.EXTEND_SLOTS:
        assert cfg.num_splits > 1
    rope = make_rope()
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
    assert rel_err(lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5), ref) <= 1e-2


def test_lazy_kernel_compiles_once_across_grid_sizes():
    # A step's q_blocks and num_splits are runtime ints: a value of 1 or a multiple of 16 must not pick
    # another compiled variant (a compile mid-serving stalls every request in flight for seconds).
    rope = make_rope()

    def run(q_len: int, splits: int) -> None:
        kv, meta = rag_batch([q_len], docs=4, doc_len=700, rotate_keys=True)
        q = torch.randn(q_len, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=splits)
        assert rel_err(out, lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)) <= 1e-2

    def variants() -> int:
        return len(ta._lazy_attn_kernel.device_caches[torch.cuda.current_device()][0])

    run(48, 3)  # 2 query blocks of 32 tokens, 3 splits: neither 1 nor a multiple of 16
    n = variants()
    for q_len, splits in ((16, 3), (512, 3), (48, 16), (16, 32)):  # 1 and 16 query blocks; 16, 32 splits
        run(q_len, splits)
    assert variants() == n


def test_warm_up_compiles_what_random_steps_launch():
    # After warm_up over a pool, steps of any shape (decode and extend, 1-300 sequences, splits by the
    # engine's rule) launch no attention or merge variant that was not compiled already.
    rope = make_rope()
    pool = torch.randn(200, 2, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    assert ta.warm_up(pool, rope, Q_HEADS, True, HEAD_DIM**-0.5) > 0
    dev = torch.cuda.current_device()
    variants = lambda: (len(ta._lazy_attn_kernel.device_caches[dev][0]),  # noqa: E731
                        len(ta._merge_kernel.device_caches[dev][0]))  # fmt: skip
    n = variants()
    for _ in range(12):
        batch = random.choice([1, 2, 3, random.randint(1, 80)])
        q_lens = [1] * batch if random.random() < 0.5 else [random.randint(1, 300) for _ in range(batch)]
        docs, doc_len = random.randint(1, 3), random.randint(20, 400)
        kv, meta = rag_batch(q_lens, docs=docs, doc_len=doc_len, rotate_keys=True)
        q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5)
    torch.cuda.synchronize()
    assert variants() == n


@pytest.mark.parametrize("large_min", [2, 0])
def test_extend_bf16_variants(monkeypatch, large_min):
    # 16-bit rotation math, with the default tile choice and with the large-grid tile on every grid.
    monkeypatch.setattr(ta, "EXTEND_ROT_LOWP", True)
    monkeypatch.setattr(ta, "EXTEND_LARGE_MIN_PER_SM", large_min)
    for q_lens, splits in (([300], None), ([1, 77, 513], None), ([129, 64], 3)):
        kv, meta = rag_batch(q_lens, docs=4, doc_len=704, rotate_keys=True, jitter=False)
        rope = make_rope()
        q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
        out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=splits)
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_merge_modes(monkeypatch, batch):
    # Split-KV merge launch with and without programmatic dependent launch (merge launched early,
    # waits on the split grid): repeated launches give bit-identical outputs (no merge reads early),
    # both modes agree, and match the reference.
    kv, meta = rag_batch([1] * batch, docs=5, doc_len=2048, rotate_keys=True)
    rope = make_rope()
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    max_e = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
    args = (q, kv, meta, rope, HEAD_DIM**-0.5)
    for splits in (None, 48, 99):
        outs = []
        for pdl in (False, True):
            monkeypatch.setattr(ta, "MERGE_PDL", pdl)
            first = lazy_attention_triton(*args, max_q_len=1, max_kv_entries=max_e, num_splits=splits)
            for _ in range(20):
                q.add_(0)  # an unrelated kernel between launches
                assert torch.equal(lazy_attention_triton(*args, max_q_len=1, max_kv_entries=max_e,
                                                         num_splits=splits), first)
            outs.append(first)
        assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], lazy_attention_ref(*args)) <= 1e-2


@pytest.mark.parametrize("lowp", [0, 1])
def test_decode_bf16_lowp(monkeypatch, lowp):
    # Decode with fp32 or 16-bit rotation math (the default, 2, is covered by test_decode_bf16).
    monkeypatch.setattr(ta, "DECODE_ROT_LOWP", lowp)
    rope = make_rope()
    for batch, splits, jitter in ((1, None, True), (3, 7, True), (4, None, False), (16, 1, True)):
        kv, meta = rag_batch([1] * batch, docs=5, doc_len=600, rotate_keys=True, jitter=jitter)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
        out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=splits)
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("angle,lowp", [(1, 0), (2, 0), (1, 1), (1, 2)])
def test_bf16_rotation_angle_addition(monkeypatch, angle, lowp):
    # cos/sin(pos_base + slot) by angle addition (per-page rows x slot rows), decode and extend,
    # both extend tiles (the large one forced on every grid for half the cases), with 16-bit math.
    for name in ("DECODE_ROT_ANGLE", "EXTEND_ROT_ANGLE"):
        monkeypatch.setattr(ta, name, angle)
    for name in ("DECODE_ROT_LOWP", "EXTEND_ROT_LOWP"):
        monkeypatch.setattr(ta, name, lowp)
    monkeypatch.setattr(ta, "DECODE_ANGLE_MAX_GRID", 1 << 30)  # decode: angle addition at any grid
    rope = make_rope()
    cases = [([1], None, 2), ([1] * 3, 7, 2), ([1] * 16, 1, 2), ([300], None, 2), ([1, 77, 513], None, 0),
             ([129, 64], 3, 2), ([129, 64], None, 0)]
    for q_lens, splits, large_min in cases:
        monkeypatch.setattr(ta, "EXTEND_LARGE_MIN_PER_SM", large_min)
        kv, meta = rag_batch(q_lens, docs=4, doc_len=700, rotate_keys=True)
        q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        ref = lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)
        out = lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, num_splits=splits)
        assert rel_err(out, ref) <= 1e-2, (q_lens, splits, large_min)


def test_decode_cuda_graph():
    # With the maxima given, the launch path has no host sync: capture once, replay on new inputs.
    kv, meta = rag_batch([1] * 3, docs=5, doc_len=600, rotate_keys=True)
    rope = make_rope()
    q = torch.randn(3, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    max_e = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
    run = lambda: lazy_attention_triton(q, kv, meta, rope, HEAD_DIM**-0.5, max_q_len=1, max_kv_entries=max_e)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q.copy_(torch.randn_like(q))
    kv.copy_(torch.randn_like(kv))
    graph.replay()
    assert rel_err(out, lazy_attention_ref(q, kv, meta, rope, HEAD_DIM**-0.5)) <= 1e-2


def test_kv_kernels_bf16():
    rope = make_rope()
    kv = torch.randn(300, 2, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    ref = kv.clone()
    flat = torch.randperm(300 * PAGE, device=DEV)[:2000]
    k, v = torch.randn(2, 2000, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    store_kv_ref(ref, k, v, flat // PAGE, flat % PAGE)
    store_kv_triton(kv, k, v, flat // PAGE, flat % PAGE)
    assert torch.equal(kv, ref)
    pages = torch.randperm(300, device=DEV)[:100]
    delta = random.randint(1, 20000)
    rerotate_pages_ref(ref, pages, delta, rope)
    rerotate_pages_triton(kv, pages, delta, rope)
    assert rel_err(kv, ref) <= 1e-2
    kv_all = torch.randn(4, 300, 2, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    perm = torch.randperm(300, device=DEV)
    src, dst = perm[:120].int(), perm[120:240].int()
    deltas = torch.randint(-20000, 20000, (120,), device=DEV, dtype=torch.int32)
    ref_all = kv_all.clone()
    copy_rerotate_pages_ref(ref_all, src, dst, deltas, rope)
    copy_rerotate_pages_triton(kv_all, src, dst, deltas, rope)
    assert rel_err(kv_all, ref_all) <= 1e-2
    assert torch.equal(kv_all[:, :, 1], ref_all[:, :, 1])
    x = torch.randn(3000, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    pos = torch.randint(0, MAX_POS, (3000,), device=DEV)
    assert rel_err(apply_rope_triton(x, pos, rope), apply_rope_ref(x.float(), pos, rope)) <= 1e-2


def graph_us(fn) -> float:
    """Median time of fn replayed from a CUDA graph (what a serving loop runs; no Python launch cost)."""
    from triton.testing import do_bench

    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def bench_decode() -> None:
    """Lazy decode at the RAG shape; FlashInfer plain decode on an H100 took 31 / 256 / 957 us at
    batch 1 / 16 / 64 (CUDA notes), the bar for this kernel."""
    rope = make_rope()
    print(f"{'batch':>5} {'lazy us':>8} {'plain us':>9} {'lazy GB/s':>10}")
    for batch in (1, 4, 16, 32, 64):
        kv, meta = rag_batch([1] * batch, docs=5, doc_len=2048, rotate_keys=True, jitter=False)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
        max_e = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
        us = {}
        for rotate in (True, False):
            meta.rotate_keys = rotate  # same pages, keys taken as stored: the plain-decode cost
            args = (q, kv, meta, rope, HEAD_DIM**-0.5)
            us[rotate] = graph_us(lambda a=args, e=max_e: lazy_attention_triton(*a, max_q_len=1,
                                                                                max_kv_entries=e))
        gbs = kv.numel() * kv.element_size() / us[True] / 1e3
        print(f"{batch:>5} {us[True]:>8.1f} {us[False]:>9.1f} {gbs:>10.0f}")


if __name__ == "__main__":
    rc = pytest.main([__file__, "-q", "-m", "gpu", "-p", "no:cacheprovider"])
    if "--bench" in sys.argv:
        bench_decode()
    sys.exit(rc)


def _shared_chunk_step(q_len: int):
    """A Zipf-like bf16 step, 32/8 heads: 16 requests share 6 chunks at their own offsets (q_len 1:
    decode; 4: question prefill rows)."""
    from lazyrt.kernels.shared_chunk import SharedChunkMeta

    rope = make_rope()
    chunks, next_page = [], 0
    for _ in range(6):
        n = random.randint(200, 700)
        chunks.append((list(range(next_page, next_page + -(-n // PAGE))), n))
        next_page += len(chunks[-1][0])
    kv = torch.randn(next_page, 2, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    uses, positions = [[] for _ in chunks], []
    for r in range(16):
        pos = random.randint(0, 50)
        for c in random.choices(range(6), weights=[8, 4, 2, 1, 1, 1], k=3):
            uses[c].append((r, pos))
            pos += chunks[c][1]
        positions += range(pos + 10, pos + 10 + q_len)
    segments = [(pages, n, [(r * q_len + i, s) for r, s in u for i in range(q_len)])
                for (pages, n), u in zip(chunks, uses) if u]  # fmt: skip
    meta = SharedChunkMeta.build(segments, PAGE, num_rows=len(positions), device=DEV)
    q = torch.randn(len(positions), Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    return q, kv, torch.tensor(positions, device=DEV), meta, rope


@pytest.mark.parametrize("key_tables", ["fp32", "half", "kv"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_shared_chunk_bf16(q_len, key_tables):
    """Shared-chunk attention on CUDA against the reference, with the launch's own settings."""
    from lazyrt.kernels.shared_chunk import merge_parts_ref, shared_chunk_attention_ref
    from lazyrt.kernels.triton_shared_chunk import merge_parts_triton, shared_chunk_attention_triton

    q, kv, pos_t, meta, rope = _shared_chunk_step(q_len)
    o_ref, lse_ref = shared_chunk_attention_ref(q, kv, pos_t, meta, rope, HEAD_DIM**-0.5)
    o, lse = shared_chunk_attention_triton(q, kv, pos_t, meta, rope, HEAD_DIM**-0.5, key_tables=key_tables)
    assert rel_err(o, o_ref) < 1e-2
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)
    assert rel_err(merge_parts_triton(o, lse, meta, BF16), merge_parts_ref(o_ref, lse_ref, meta)) < 1e-2


@pytest.mark.parametrize("stages, maxnreg", [(2, 0), (1, 168), (2, 168)])
@pytest.mark.parametrize("q_len", [1, 4])
def test_shared_chunk_bf16_launch_settings(q_len, stages, maxnreg):
    """Each setting launch_settings picks between (a register cap spills, fewer stages pipeline less)
    gives the reference's answer, whatever the launch's size."""
    from lazyrt.kernels.shared_chunk import shared_chunk_attention_ref
    from lazyrt.kernels.triton_shared_chunk import shared_chunk_attention_triton

    q, kv, pos_t, meta, rope = _shared_chunk_step(q_len)
    o_ref, lse_ref = shared_chunk_attention_ref(q, kv, pos_t, meta, rope, HEAD_DIM**-0.5)
    o, lse = shared_chunk_attention_triton(
        q, kv, pos_t, meta, rope, HEAD_DIM**-0.5, num_stages=stages, maxnreg=maxnreg
    )
    assert rel_err(o, o_ref) < 1e-2
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)
