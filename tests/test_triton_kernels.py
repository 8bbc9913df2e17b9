"""Triton kernels vs their torch references under the Triton CPU interpreter, on fresh random inputs."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton decides interpreted or compiled when a kernel module is imported: turned on here, in a
    # pytest process that also collects the GPU tests, it would run their kernels in the interpreter.
    pytest.skip("CPU interpreter tests: on a CUDA machine run them in a pytest process of their own "
                "with TRITON_INTERPRET=1", allow_module_level=True)  # fmt: skip
os.environ["TRITON_INTERPRET"] = "1"  # must precede the import of the modules that define kernels

import random  # noqa: E402

try:
    import triton  # noqa: F401, E402
except Exception as e:  # noqa: BLE001
    pytest.skip(f"triton is not importable ({e}); pip install 'triton>=3.8'", allow_module_level=True)

from lazyrt.kernels import triton_attention as ta  # noqa: E402
from lazyrt.kernels.attention_ref import (  # noqa: E402
    copy_rerotate_pages_ref,
    lazy_attention_ref,
    rerotate_pages_ref,
    store_kv_ref,
)
from lazyrt.kernels.metadata import AttentionMetadata  # noqa: E402
from lazyrt.kernels.rope import RopeCache, apply_rope_ref  # noqa: E402
from lazyrt.kernels.triton_kv import (  # noqa: E402
    apply_rope_triton,
    copy_rerotate_pages_triton,
    rerotate_pages_triton,
    store_kv_triton,
)
from lazyrt.models.config import ModelConfig  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
print(f"test_triton_kernels seed {SEED}")  # fresh inputs each run; rerun a failure with this seed
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def _seed(request):
    s = SEED + sum(map(ord, request.node.name))
    torch.manual_seed(s)
    random.seed(s)


def make_rope(head_dim: int, llama3: bool = False, rotary_dim: int | None = None, max_pos: int = 512):
    scaling = None
    if llama3:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    cfg = ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_layers=1,
        num_heads=1,
        num_kv_heads=1, head_dim=head_dim, rope_theta=10000.0, rope_scaling=scaling,
        partial_rotary_factor=(rotary_dim or head_dim) / head_dim,
    )
    return RopeCache.build(cfg, max_pos)


def make_batch(q_lens, page_size, kv_heads, head_dim, dtype, rotate_keys, max_pos=400, docs=3, prior=None,
               shuffle=True, full_pages=False):
    """Random ragged batch: each sequence sees a few chunks at arbitrary (gapped) positions, then the
    chunk holding its new tokens (whose K/V the model stored just before attending)."""
    qo, kvp, positions, pos_base, valid_len = [0], [0], [], [], []
    chunks = []
    for q_len in q_lens:
        pos = random.randint(0, 9)
        for _ in range(random.randint(0, docs)):  # documents: page-aligned chunks, tails partly filled
            n = page_size * random.randint(1, 3) if full_pages else random.randint(1, 3 * page_size)
            chunks.append((pos, n))
            pos += n + random.randint(0, 5)
        # own chunk: earlier tokens + the new ones
        n_prior = random.randint(0, 2 * page_size) if prior is None else prior
        chunks.append((pos, n_prior + q_len))
        positions += range(pos + n_prior, pos + n_prior + q_len)
        qo.append(qo[-1] + q_len)
        chunk_entries = []
        for start, n in chunks:
            for j in range(-(-n // page_size)):
                chunk_entries.append((start + j * page_size, min(page_size, n - j * page_size)))
        chunks.clear()
        if shuffle:
            random.shuffle(chunk_entries)  # entry order must not matter
        for base, vl in chunk_entries:
            pos_base.append(base)
            valid_len.append(vl)
        kvp.append(len(pos_base))
        assert pos + n_prior + q_len <= max_pos
    num_pages = len(pos_base) + 3
    perm = torch.randperm(num_pages)[: len(pos_base)]
    kv = torch.randn(num_pages, 2, page_size, kv_heads, head_dim).to(dtype)
    for e, p in enumerate(perm.tolist()):  # poison slots past valid_len: they must never be read
        kv[p, :, valid_len[e]:] = float("nan")
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        qo_indptr=torch.tensor(qo, **i32), positions=torch.tensor(positions, dtype=torch.long),
        kv_indptr=torch.tensor(kvp, **i32), kv_indices=perm.to(torch.int32),
        pos_base=torch.tensor(pos_base, **i32), valid_len=torch.tensor(valid_len, **i32),
        store_pages=torch.zeros(0, dtype=torch.long), store_slots=torch.zeros(0, dtype=torch.long),
        rotate_keys=rotate_keys,
    )
    return kv, meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in kernel output"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink the kernels' tiles so small test contexts still span many key blocks and query tiles."""
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    monkeypatch.setattr(ta, "DECODE_BLOCK_N_WIDE", 16)
    monkeypatch.setattr(ta, "EXTEND_BLOCK_N", 16)
    monkeypatch.setattr(ta, "EXTEND_ROWS", 16)


def random_entry_logits(meta: AttentionMetadata) -> None:
    """Random per-entry logit scales (temperatures 0.5-2) and log masses, some entries left at 1 / 0."""
    n = meta.kv_indices.numel()
    on = torch.rand(n) < 0.7
    meta.entry_logit_scale = torch.where(on, torch.empty(n).uniform_(0.5, 2.0), torch.ones(n))
    meta.entry_log_mass = torch.where(on, torch.empty(n).uniform_(-1.5, 1.5), torch.zeros(n))


def check_attention(q_lens, group, kv_heads, head_dim, page_size, dtype, rotate, llama3=False,
                    num_splits=None, rotary_dim=None, entry_logits=False, **batch):
    kv, meta = make_batch(q_lens, page_size, kv_heads, head_dim, dtype, rotate, **batch)
    if entry_logits:
        random_entry_logits(meta)
    rope = make_rope(head_dim, llama3, rotary_dim)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref = lazy_attention_ref(q, kv, meta, rope if rotate else None, scale)
    out = ta.lazy_attention_triton(q, kv, meta, rope if rotate else None, scale, num_splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e} (seed {SEED})"


# Decode: one new token per sequence; forced split counts cover empty splits and the merge.
@pytest.mark.parametrize(
    "group,kv_heads,head_dim,page_size,dtype,rotate,llama3,num_splits,small",
    [
        (4, 2, 64, 8, torch.float32, True, False, 3, True),
        (8, 1, 128, 16, torch.float16, True, True, 5, False),
        (8, 1, 64, 16, torch.float16, True, False, 4, True),
        (1, 2, 64, 4, torch.float16, False, False, 2, True),
        (4, 1, 128, 4, torch.float32, False, False, None, False),
        (8, 1, 64, 16, torch.float32, True, True, 1, True),
        (4, 1, 64, 32, torch.float32, True, False, 2, True),  # page larger than a key block
    ],
)
def test_decode(request, group, kv_heads, head_dim, page_size, dtype, rotate, llama3, num_splits, small):
    if small:
        request.getfixturevalue("small_blocks")
    q_lens = [1] * random.randint(2, 4)
    check_attention(q_lens, group, kv_heads, head_dim, page_size, dtype, rotate, llama3, num_splits)


def test_decode_split_merge(small_blocks):
    # Split-KV partials combined by the merge launch, several split counts in a row.
    for splits in (5, 3, 8):
        check_attention([1, 1, 1], 4, 2, 64, 4, torch.float32, True, num_splits=splits, docs=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_lowp(small_blocks, monkeypatch, dtype):
    # Decode with 16-bit rotation math (fp32 math for fp32 KV); partly filled and full pages,
    # shuffled and ordered entries.
    monkeypatch.setattr(ta, "DECODE_ROT_LOWP", True)
    check_attention([1, 1, 1], 4, 2, 64, 4, dtype, True, num_splits=3, docs=3)
    check_attention([1, 1], 4, 1, 64, 8, dtype, True, num_splits=None, docs=3, full_pages=True,
                    shuffle=False)
    check_attention([1, 1], 8, 1, 64, 16, dtype, True, llama3=True, num_splits=1, docs=3)


# Extend: several sequences, q lengths not multiples of BLOCK_M, mixed with decode-like rows.
@pytest.mark.parametrize(
    "group,head_dim,page_size,dtype,rotate,llama3,num_splits,small",
    [
        (4, 64, 8, torch.float32, True, True, None, True),
        (1, 128, 16, torch.float16, True, False, 2, False),
        (8, 64, 4, torch.float16, False, False, None, True),
        (4, 128, 16, torch.float32, False, False, 3, True),
        (8, 128, 16, torch.float16, True, True, None, False),
    ],
)
def test_extend(request, group, head_dim, page_size, dtype, rotate, llama3, num_splits, small):
    if small:
        request.getfixturevalue("small_blocks")
    q_lens = [random.randint(2, 23), 1, random.randint(17, 40)]
    check_attention(q_lens, group, 1, head_dim, page_size, dtype, rotate, llama3, num_splits)


@pytest.mark.parametrize(
    "q_lens,group,head_dim,page_size,dtype,num_splits,full_pages",
    [
        ([1, 1, 1], 4, 64, 8, torch.float32, 3, False),  # decode, split + merge
        ([1, 1], 8, 64, 16, torch.float16, 1, True),  # decode, whole pages
        ([9, 1, 23], 4, 64, 8, torch.float32, None, False),  # extend, masked blocks
        ([40, 1], 2, 64, 8, torch.float16, 3, True),  # extend, unmasked blocks and splits
    ],
)
def test_entry_logits(small_blocks, q_lens, group, head_dim, page_size, dtype, num_splits, full_pages):
    # Per-entry logit scale and log mass (APE-style document attention) in every code path of the kernel
    check_attention(q_lens, group, 2, head_dim, page_size, dtype, True, num_splits=num_splits, docs=4,
                    shuffle=not full_pages, full_pages=full_pages, entry_logits=True)


@pytest.mark.parametrize("q_lens", [[1, 1], [7, 12]])
def test_entry_logits_neutral_is_bit_identical(small_blocks, q_lens):
    # scale 1 and log mass 0 on every entry = no transform, bit for bit (kernel and reference)
    kv, meta = make_batch(q_lens, 8, 2, 64, torch.float32, True, docs=3)
    rope = make_rope(64)
    q = torch.randn(sum(q_lens), 8, 64)
    plain_ref = lazy_attention_ref(q, kv, meta, rope, 0.125)
    plain = ta.lazy_attention_triton(q, kv, meta, rope, 0.125)
    n = meta.kv_indices.numel()
    meta.entry_logit_scale, meta.entry_log_mass = torch.ones(n), torch.zeros(n)
    assert torch.equal(lazy_attention_ref(q, kv, meta, rope, 0.125), plain_ref)
    assert torch.equal(ta.lazy_attention_triton(q, kv, meta, rope, 0.125), plain)


def test_entry_logits_reference_is_a_merge_of_two_attentions():
    # Independent formulation: attention over the "document" entries at temperature T, and over the
    # rest at 1, merged by log-sum-exp with the documents' mass scaled by S, on materialized keys.
    page_size, kv_heads, group, d = 8, 2, 2, 32
    kv, meta = make_batch([5, 1], page_size, kv_heads, d, torch.float32, True, docs=3)
    rope = make_rope(d)
    sm = d**-0.5
    q = torch.randn(6, kv_heads * group, d)
    n = meta.kv_indices.numel()
    is_doc = torch.rand(n) < 0.6
    temp, mass_scale = 0.7, 1.8
    meta.entry_logit_scale = torch.where(is_doc, torch.full((n,), 1 / temp), torch.ones(n))
    meta.entry_log_mass = torch.where(is_doc, torch.full((n,), float(torch.tensor(mass_scale).log())),
                                      torch.zeros(n))
    out = lazy_attention_ref(q, kv, meta, rope, sm)
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    for b in range(meta.batch_size):
        parts = []  # (log-sum-exp [H, Q], output [Q, H, D]) of the doc keys and of the others
        for want_doc, t, s in ((True, temp, mass_scale), (False, 1.0, 1.0)):
            keys, vals, kpos = [], [], []
            for e in range(kvp[b], kvp[b + 1]):
                if bool(is_doc[e]) != want_doc:
                    continue
                vl, base, page = int(meta.valid_len[e]), int(meta.pos_base[e]), int(meta.kv_indices[e])
                pos = torch.arange(base, base + vl)
                keys.append(apply_rope_ref(kv[page, 0, :vl].float(), pos, rope))  # materialized rotation
                vals.append(kv[page, 1, :vl].float())
                kpos.append(pos)
            qb = q[qo[b] : qo[b + 1]]
            if not keys:
                parts.append((torch.full((qb.shape[1], qb.shape[0]), float("-inf")), torch.zeros_like(qb)))
                continue
            k = torch.cat(keys).repeat_interleave(group, dim=1)
            v = torch.cat(vals).repeat_interleave(group, dim=1)
            logits = torch.einsum("qhd,khd->hqk", qb, k) * sm / t
            visible = torch.cat(kpos)[None, :] <= meta.positions[qo[b] : qo[b + 1]][:, None]
            logits = logits.masked_fill(~visible[None], float("-inf"))
            lse = torch.logsumexp(logits, dim=-1) + torch.tensor(s).log()  # [H, Q]
            o = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1).nan_to_num(), v)
            parts.append((lse, o))
        (lse_d, o_d), (lse_o, o_o) = parts
        w = torch.softmax(torch.stack([lse_d, lse_o]), dim=0).transpose(1, 2)[..., None]  # [2, Q, H, 1]
        expect = w[0] * o_d + w[1] * o_o
        torch.testing.assert_close(out[qo[b] : qo[b + 1]], expect, rtol=1e-5, atol=1e-5)


def test_entry_logits_need_both_fields():
    kv, meta = make_batch([1], 8, 1, 32, torch.float32, True)
    meta.entry_logit_scale = torch.ones(meta.kv_indices.numel())
    with pytest.raises(ValueError, match="entry_log_mass"):
        lazy_attention_ref(torch.randn(1, 1, 32), kv, meta, make_rope(32), 0.1)


def test_extend_causal_block_edge(small_blocks):
    # A query tile whose only token sits at slot 0 of the next key block: that block must not be skipped.
    check_attention([17, 33], 1, 1, 64, 16, torch.float32, True, docs=0, prior=0, shuffle=False)


@pytest.mark.parametrize("split", [None, 3])
def test_extend_unmasked_blocks(small_blocks, split):
    # Full document pages in order before the question: most key blocks take the unmasked path, the
    # question's own pages the masked one; empty and partial splits included.
    check_attention([40, 1, 23], 2, 1, 64, 8, torch.float32, True, num_splits=split, docs=5, shuffle=False,
                    full_pages=True)
    check_attention([33], 4, 1, 64, 16, torch.float16, True, num_splits=split, docs=4, shuffle=False,
                    full_pages=True, prior=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_lowp_rotation(small_blocks, monkeypatch, dtype):
    # 16-bit rotation math on the unmasked and the masked path.
    monkeypatch.setattr(ta, "EXTEND_ROT_LOWP", True)
    check_attention([40, 1, 23], 2, 1, 64, 8, dtype, True, docs=5, shuffle=False, full_pages=True)
    check_attention([33, 5], 4, 1, 64, 16, dtype, True, num_splits=2, docs=4, shuffle=False, full_pages=True)


@pytest.mark.parametrize("angle,lowp", [(1, 0), (2, 0), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotation_angle_addition(small_blocks, monkeypatch, angle, lowp, dtype):
    # cos/sin(pos_base + slot) by angle addition: per-page rows + slot rows (hoisted when key blocks
    # hold whole pages: page 4 / 8 / 16 in 16-key blocks; re-read per block for angle 2 and for pages
    # larger than a block: page 32). Decode and extend, ragged batches, partly filled pages at
    # arbitrary offsets, GQA 1 / 4 / 8, head dims 64 / 128, llama3 scaling, partial rotary, splits.
    for name in ("DECODE_ROT_ANGLE", "EXTEND_ROT_ANGLE"):
        monkeypatch.setattr(ta, name, angle)
    for name in ("DECODE_ROT_LOWP", "EXTEND_ROT_LOWP"):
        monkeypatch.setattr(ta, name, lowp)
    check_attention([1, 1, 1], 4, 2, 64, 4, dtype, True, num_splits=3, docs=3)
    check_attention([1, 1], 8, 1, 128, 16, dtype, True, llama3=True, num_splits=None, docs=3)
    check_attention([1, 1], 1, 2, 64, 32, dtype, True, num_splits=2, docs=2)  # page > key block
    check_attention([17, 1, 30], 4, 1, 64, 8, dtype, True, llama3=True, docs=3)
    check_attention([40, 1, 23], 1, 1, 128, 16, dtype, True, num_splits=3, docs=4, shuffle=False,
                    full_pages=True)  # unmasked blocks
    check_attention([33], 8, 1, 64, 4, dtype, True, docs=4, shuffle=False, full_pages=True, prior=16)
    check_attention([9, 1], 2, 1, 64, 8, dtype, True, rotary_dim=32)  # partial rotary
    check_attention([5, 3], 2, 1, 16, 4, dtype, True)  # d=16: rotary halves padded to the dot minimum
    check_attention([9, 2], 3, 1, 32, 12, dtype, True)  # page size not a power of two: gather fallback


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_rotation_gather_and_grid_gate(small_blocks, monkeypatch, dtype):
    # Decode takes angle addition only up to DECODE_ANGLE_MAX_GRID (batch x kv heads) programs and the
    # per-key cos/sin gather above it (here: 2 programs -> angle, 3 and 4 -> gather), 16-bit math.
    monkeypatch.setattr(ta, "DECODE_ROT_ANGLE", 1)
    monkeypatch.setattr(ta, "DECODE_ROT_LOWP", 2)
    monkeypatch.setattr(ta, "DECODE_ANGLE_MAX_GRID", 2)
    check_attention([1, 1], 4, 1, 64, 8, dtype, True, num_splits=3, docs=3)
    check_attention([1, 1, 1], 8, 1, 128, 16, dtype, True, llama3=True, docs=3)
    check_attention([1, 1], 1, 2, 64, 4, dtype, True, num_splits=2, docs=3)
    monkeypatch.setattr(ta, "DECODE_ROT_ANGLE", 0)
    check_attention([1, 1], 4, 1, 64, 32, dtype, True, num_splits=2, docs=3)


def test_extend_large_tile(monkeypatch):
    # Enough query tiles for the large-grid tile choice.
    monkeypatch.setattr(ta, "EXTEND_LARGE", (32, 16, 4, 2))
    monkeypatch.setattr(ta, "EXTEND_ROWS", 16)
    monkeypatch.setattr(ta, "EXTEND_LARGE_MIN_PER_SM", 0)
    check_attention([40, 17], 2, 1, 64, 8, torch.float32, True, docs=2)


def test_odd_shapes():
    check_attention([1, 1], 4, 1, 64, 8, torch.float32, True, rotary_dim=32, num_splits=2)  # partial rotary
    check_attention([5, 3], 2, 1, 16, 4, torch.float32, True)  # d=16: halves padded to the dot minimum
    check_attention([1, 1, 1], 3, 2, 32, 8, torch.float16, True, num_splits=2)  # group of 3
    check_attention([9, 2], 3, 1, 32, 12, torch.float32, True)  # page size not a power of two


def test_split_heuristics():
    cpu = torch.device("cpu")  # the CPU path assumes an H100's 132 SMs
    assert ta.decode_tiles(64 * 8, 10368, cpu) == (ta.DECODE_BLOCK_N, 1)  # big batch: grid fills the GPU
    block_n, splits = ta.decode_tiles(8, 10368, cpu)  # batch 1, long context: one full wave of splits
    assert block_n == ta.DECODE_BLOCK_N_WIDE and 8 * splits <= 132 * ta.DECODE_SLOTS_WIDE and splits > 16
    assert ta.decode_tiles(8, 100, cpu)[1] == 1  # short context: not worth splitting
    assert ta.pick_num_splits(4096, 10368, cpu, 2) == 1


def test_decode_splits_the_wide_tiles_at_least_a_fixed_count_and_one_wave_where_it_is_more():
    cpu = torch.device("cpu")  # 132 SMs
    for heads in (2, 4, 8):
        for batch in range(1, 2 * 132 // heads + 8):
            base = batch * heads
            for keys in (300, 1500, 10368):
                block_n, splits = ta.decode_tiles(base, keys, cpu)
                by_len = max(1, keys // ta.MIN_SPLIT_TOKENS)
                if base > 132 * ta.DECODE_SLOTS_WIDE:  # narrow tiles: past one program per SM, unsplit
                    assert (block_n, splits) == (ta.DECODE_BLOCK_N, 1)
                    continue
                assert block_n == ta.DECODE_BLOCK_N_WIDE and 1 <= splits <= by_len  # no split under 256 keys
                assert splits >= min(ta.DECODE_WIDE_SPLITS, by_len)  # 17-33 sequences of 8 heads split too
                if splits > ta.DECODE_WIDE_SPLITS:  # more only while one wave (two programs an SM) holds them
                    wave = 132 * ta.DECODE_SLOTS_WIDE
                    assert base * splits <= wave
                    assert splits in (by_len, ta.MAX_SPLITS) or base * (splits + 1) > wave


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(dtype):
    kv_heads, head_dim, page_size, T = 3, 64, 8, 11
    kv = torch.randn(6, 2, page_size, kv_heads, head_dim).to(dtype)
    ref = kv.clone()
    flat = torch.randperm(6 * page_size)[:T]
    pages, slots = flat // page_size, flat % page_size
    kvs = torch.randn(T, 2 * kv_heads, head_dim)
    k, v = kvs[:, :kv_heads], kvs[:, kv_heads:]  # strided views, as from a fused projection
    store_kv_ref(ref, k, v, pages, slots)
    store_kv_triton(kv, k, v, pages, slots)
    assert torch.equal(kv, ref)


@pytest.mark.parametrize("dtype,head_dim,rotary_dim", [(torch.float32, 64, None), (torch.float16, 128, 64)])
def test_rerotate_pages(dtype, head_dim, rotary_dim):
    rope = make_rope(head_dim, llama3=True, rotary_dim=rotary_dim)
    kv = torch.randn(7, 2, 4, 2, head_dim).to(dtype)
    orig, ref = kv.clone(), kv.clone()
    pages = torch.randperm(7)[:4]
    delta = random.randint(1, 300)
    rerotate_pages_ref(ref, pages, delta, rope)
    rerotate_pages_triton(kv, pages, delta, rope)
    assert rel_err(kv, ref) < TOL[dtype] / 10
    assert torch.equal(kv[:, 1], ref[:, 1])
    rerotate_pages_triton(kv, pages, -delta, rope)  # a negative delta rotates back
    assert rel_err(kv, orig) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(
    "dtype,kv_heads,head_dim,rotary_dim", [(torch.float32, 2, 64, None), (torch.float16, 3, 128, 96)]
)
def test_copy_rerotate_pages(dtype, kv_heads, head_dim, rotary_dim):
    """Block-mode copies of a whole step in one launch (all layers, per-page deltas incl. 0 and
    negative) vs the reference, and the reference vs copy-then-rerotate_pages_ref per layer."""
    rope = make_rope(head_dim, llama3=True, rotary_dim=rotary_dim)
    layers, pages, page_size = 3, 24, 4
    kv_all = torch.randn(layers, pages, 2, page_size, kv_heads, head_dim).to(dtype)
    perm = torch.randperm(pages)
    src, dst = perm[:9].int(), perm[9:18].int()  # disjoint, like fresh copies of chunk pages
    delta = torch.tensor([random.randint(-300, 300) for _ in range(9)], dtype=torch.int32)
    delta[0], delta[1] = 0, -abs(int(delta[1])) - 1
    ref = kv_all.clone()
    copy_rerotate_pages_ref(ref, src, dst, delta, rope)
    got = kv_all.clone()
    copy_rerotate_pages_triton(got, src, dst, delta, rope)
    assert rel_err(got, ref) < TOL[dtype] / 10
    assert torch.equal(got[:, :, 1], ref[:, :, 1])  # values copied bit-exactly
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[dst.long()] = False
    assert torch.equal(got[:, untouched], kv_all[:, untouched])
    half = rope.rotary_dim // 2
    assert torch.equal(got[:, dst.long(), 0, ..., 2 * half :], kv_all[:, src.long(), 0, ..., 2 * half :])
    # independent check of the reference: per layer, copy then the in-place re-rotation (delta >= 0)
    pos = delta >= 0
    for layer in range(layers):
        old = kv_all[layer].clone()
        old[dst[pos].long()] = old[src[pos].long()]
        for i in torch.nonzero(pos).flatten().tolist():
            rerotate_pages_ref(old, dst[i : i + 1].long(), int(delta[i]), rope)
        assert rel_err(ref[layer, dst[pos].long()], old[dst[pos].long()]) < TOL[dtype] / 10
    # a negative delta undoes a positive one
    back = got.clone()
    copy_rerotate_pages_triton(back, dst, src, -delta, rope)
    assert rel_err(back[:, src.long()], kv_all[:, src.long()]) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(
    "dtype,heads,head_dim,rotary_dim", [(torch.float32, 4, 64, None), (torch.float16, 6, 128, 32)]
)
def test_apply_rope(dtype, heads, head_dim, rotary_dim):
    rope = make_rope(head_dim, llama3=True, rotary_dim=rotary_dim)
    x = torch.randn(9, heads + 2, head_dim).to(dtype)[:, 1 : heads + 1]  # non-contiguous view
    pos = torch.randint(0, 512, (9,))
    ref = apply_rope_ref(x, pos, rope)
    out = apply_rope_triton(x, pos, rope)
    assert out.dtype == x.dtype and rel_err(out, ref) < TOL[dtype] / 10


@pytest.mark.parametrize("kv_heads,group", [(8, 4), (4, 4), (1, 8), (2, 1), (16, 2)])
def test_warm_up_cases_launch_every_variant_a_step_can(kv_heads, group):
    # Serving must never wait for a Triton compile: every variant (attention tiles, split or not,
    # angle addition, the merge's bucket of splits) that a random step picks (splits by the engine's
    # rule) is among those the warm-up's steps pick, with the entries and splits warm_up gives them.
    dev = torch.device("cpu")
    rng = random.Random(kv_heads * 31 + group)
    warmed = set()
    for batch, q_len, entries, splits in ta.warm_up_cases(kv_heads, group, dev):
        warmed |= ta.launch_config(batch, q_len, entries, kv_heads, group, 16, True, dev, splits).variants()
    for _ in range(3000):
        batch = rng.choice([rng.randint(1, 8), rng.randint(1, 300)])
        q_len = 1 if rng.random() < 0.5 else rng.choice([rng.randint(2, 64), rng.randint(2, 4000)])
        entries = rng.choice([rng.randint(1, 8), rng.randint(1, 2000)])
        # the step's tokens: the longest sequence's, and 1..q_len for each other (decodes beside it)
        tokens = q_len + sum(rng.choice([1, rng.randint(1, q_len)]) for _ in range(batch - 1))
        for total in (None, tokens):
            cfg = ta.launch_config(batch, q_len, entries, kv_heads, group, 16, True, dev, total_tokens=total)
            assert cfg.variants() <= warmed, (batch, q_len, entries, total, cfg)


def test_working_q_blocks_counts_the_blocks_that_hold_tokens():
    # the bound from the step's tokens is never below the true count of blocks with tokens (so no
    # program at work goes uncounted) and never above the grid
    rng = random.Random(7)
    for _ in range(2000):
        lens = [rng.choice([1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 40))]
        bm = rng.choice([1, 16, 32, 64])
        true = sum(-(-n // bm) for n in lens)
        got = ta.working_q_blocks(len(lens), max(lens), bm, sum(lens))
        assert true <= got <= len(lens) * -(-max(lens) // bm)
    assert ta.working_q_blocks(5, 128, 32, 132) == 4 + 4  # a 128-token question beside 4 decodes
    assert ta.working_q_blocks(5, 128, 32, None) == 5 * 4


def test_a_mixed_step_split_by_its_working_programs_equals_the_reference(small_blocks, monkeypatch):
    # a 40-token sequence beside decodes on a device of 32 SMs: the grid (4 sequences x 10 query
    # blocks x 2 kv heads = 80 programs) takes the large tiles unsplit, its 26 programs at work the
    # small tiles and split keys; the kernel's output with the splits the launch picks equals the
    # reference
    monkeypatch.setattr(ta, "device_sms", lambda device: 32)
    monkeypatch.setattr(ta, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(ta, "EXTEND_LARGE", (32, 16, 4, 2))
    q_lens, group, kv_heads, page = [40, 1, 1, 1], 4, 2, 16
    kv, meta = make_batch(q_lens, page, kv_heads, 32, torch.float32, True)
    entries = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
    dev = torch.device("cpu")
    grid_cfg = ta.launch_config(4, 40, entries, kv_heads, group, page, True, dev)
    cfg = ta.launch_config(4, 40, entries, kv_heads, group, page, True, dev, total_tokens=sum(q_lens))
    assert (grid_cfg.rows, grid_cfg.num_splits) == (32, 1) and (cfg.rows, cfg.num_splits) == (16, 2)
    check_attention(q_lens, group, kv_heads, 32, page, torch.float32, True)


def test_a_question_beside_decodes_splits_the_keys_like_its_working_programs(monkeypatch):
    # 132 SMs, 8 kv heads, group 4: a 128-token question beside 4 decodes over 10,240 keys. The grid
    # has 5 x 4 query blocks x 8 heads = 160 programs (no split: >= the SMs), but only 8 x 8 = 64 hold
    # tokens, so the keys split as for 64 programs; a prefill step that fills its grid is unchanged
    monkeypatch.setattr(ta, "device_sms", lambda device: 132)
    dev = torch.device("cpu")
    whole = ta.launch_config(5, 128, 640, 8, 4, 16, True, dev)
    mixed = ta.launch_config(5, 128, 640, 8, 4, 16, True, dev, total_tokens=132)
    assert whole.num_splits == ta.extend_num_splits(160, 10240, dev)  # by whole waves (see below)
    assert mixed.num_splits == ta.pick_num_splits(64, 10240, dev, ta.EXTEND_SLOTS) > 1
    assert mixed.num_splits != whole.num_splits
    assert (mixed.rows, mixed.block_m) == (whole.rows, whole.block_m)
    full = ta.launch_config(4, 512, 640, 8, 4, 16, True, dev, total_tokens=2048)
    assert full == ta.launch_config(4, 512, 640, 8, 4, 16, True, dev)


def test_extend_splits_by_whole_waves_between_one_and_two_programs_a_sm(monkeypatch):
    # 132 SMs, 2 resident programs each: 136 programs at work (16 decodes beside a question) ran one
    # 10k-key program on most SMs unsplit; split s ways they take ceil(136 s / 264) waves of 1/s the
    # keys. The pick is never worse than unsplit by that count, within the slack of the best count up
    # to MAX_WAVE_SPLITS, and the fewest splits that are; a grid that fills the slots, or keys too
    # short to split, stay unsplit; under one program a SM the one-wave rule holds
    monkeypatch.setattr(ta, "device_sms", lambda device: 132)
    dev, slots = torch.device("cpu"), 132 * ta.EXTEND_SLOTS

    def waves(w: int, s: int) -> float:
        return -(-w * s // slots) / s

    assert ta.extend_num_splits(136, 10240, dev) > 1
    assert waves(136, ta.extend_num_splits(136, 10240, dev)) <= 0.7
    for w in range(132, slots + 40):
        for keys in (10240, 600, 100):
            s = ta.extend_num_splits(w, keys, dev)
            if w >= slots:
                assert s == 1
                continue
            top = max(1, min(ta.MAX_WAVE_SPLITS, keys // ta.MIN_SPLIT_TOKENS))
            best = min(waves(w, k) for k in range(1, top + 1))
            assert 1 <= s <= top and waves(w, s) <= best * (1 + ta.WAVE_SPLIT_SLACK), (w, keys, s)
            assert all(waves(w, k) > best * (1 + ta.WAVE_SPLIT_SLACK) for k in range(1, s)), (w, keys, s)
    for w in (1, 40, 131):
        assert ta.extend_num_splits(w, 10240, dev) == ta.pick_num_splits(w, 10240, dev, ta.EXTEND_SLOTS)


def test_a_step_split_by_whole_waves_equals_the_reference(small_blocks, monkeypatch):
    # a device of 4 SMs, tiles of 4 tokens x group 4: a 12-token sequence beside 3 decodes is 3 + 3 = 6
    # programs at work (4 to 8 a wave: the wave rule), which split the keys; the kernel's output with
    # those splits equals the reference, fp32 and fp16
    monkeypatch.setattr(ta, "device_sms", lambda device: 4)
    monkeypatch.setattr(ta, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr(ta, "EXTEND_LARGE_MIN_PER_SM", 100)
    q_lens, group, kv_heads, page = [12, 1, 1, 1], 4, 1, 8
    for dtype in (torch.float32, torch.float16):
        kv, meta = make_batch(q_lens, page, kv_heads, 32, dtype, True, docs=4, prior=64)
        entries = int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())
        cpu = torch.device("cpu")
        cfg = ta.launch_config(4, 12, entries, kv_heads, group, page, True, cpu, total_tokens=sum(q_lens))
        assert cfg.block_m == 4 and cfg.num_splits == ta.extend_num_splits(6, entries * page, cpu) > 1
        rope = make_rope(32, False, None)
        q = torch.randn(sum(q_lens), kv_heads * group, 32).to(dtype)
        ref = lazy_attention_ref(q, kv, meta, rope, 32**-0.5)
        out = ta.lazy_attention_triton(q, kv, meta, rope, 32**-0.5)
        assert rel_err(out, ref) < TOL[dtype], f"seed {SEED}"


def test_warm_up_runs_every_case_over_a_small_pool(monkeypatch):
    # the warm-up's synthetic steps are valid steps (document attention's too), none skipped where the
    # pool and the rotary tables hold the longest table (64 entries); with document attention the
    # warm-up runs the plain cases too, so one run covers both. A device of 8 SMs: the cases' grids
    # (sized by the SMs) stay small under the interpreter (~25 s a set at an H100's 132); which
    # variants they cover at 132 is the test above.
    monkeypatch.setattr(ta, "device_sms", lambda device: 8)
    entry_logits = True
    page, kv_heads, group, head_dim = 4, 2, 2, 16
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    rope = RopeCache.build(cfg, 64 * page + 8, "cpu")
    kv = torch.randn(70, 2, page, kv_heads, head_dim)
    n = ta.warm_up(kv, rope, kv_heads * group, True, head_dim**-0.5, entry_logits)
    assert n == len(ta.warm_up_cases(kv_heads, group, torch.device("cpu"))) * (2 if entry_logits else 1)
