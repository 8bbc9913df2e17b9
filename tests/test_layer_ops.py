"""Layer ops (RMSNorm, residual add + norm, SiLU-and-mul, query RoPE) and fused projections.

CPU: the torch ops against plain formulas; a model with fused q/k/v and gate/up gives the same greedy
tokens as the unfused one. GPU (marked): FlashInfer / Triton ops against the torch ops in bf16, and a
bf16 engine on CUDA (fused, FlashInfer ops) against the same weights run by the torch ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazyrt import Engine, SamplingParams
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.models.config import ModelConfig
from lazyrt.models.dummy import PRESETS
from lazyrt.models.layer_ops import TorchLayerOps, layer_ops_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def test_torch_ops_match_formulas():
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    x, r = torch.randn(7, 48, generator=g), torch.randn(7, 48, generator=g)
    w = torch.rand(48, generator=g) + 0.5
    ops = TorchLayerOps()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), _norm(x, w, 1e-5))
    normed, h = ops.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(normed, _norm(x + r, w, 1e-6))
    gu = torch.randn(5, 2 * 24, generator=g)
    torch.testing.assert_close(ops.silu_and_mul(gu), F.silu(gu[:, :24]) * gu[:, 24:])
    assert isinstance(layer_ops_for(torch.device("cpu"), torch.float32), TorchLayerOps)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projections_same_tokens(family, tiny_model_dir):
    """Fusing q/k/v (+ biases: qwen2) and gate/up changes no greedy token (fp32, CPU)."""
    eng = Engine(tiny_model_dir(family), device="cpu", kv_cache_tokens=4096)
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (4,))]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = [o["token_ids"] for o in eng.generate(prompts, sp)]
    model = eng.worker.model
    w = model.w
    q = w["model.layers.0.self_attn.q_proj.weight"].clone()
    model._fuse_projections()
    assert "model.layers.0.self_attn.q_proj.weight" not in w and "model.layers.0.mlp.up_proj.weight" not in w
    assert torch.equal(w["model.layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], q)
    assert ("model.layers.0.self_attn.qkv_proj.bias" in w) == model.config.attention_bias
    eng.flush_cache()
    after = [o["token_ids"] for o in eng.generate(prompts, sp)]
    assert after == before


@pytest.mark.gpu
@cuda
def test_cuda_ops_match_torch_bf16():
    from lazyrt.models.layer_ops import CudaLayerOps

    dev = torch.device("cuda")
    ops = layer_ops_for(dev, torch.bfloat16)
    assert isinstance(ops, CudaLayerOps) and ops._fi is not None, "FlashInfer should serve bf16 norms"
    ref = TorchLayerOps()
    g = torch.Generator(device=dev).manual_seed(torch.seed() % (1 << 31))
    x = torch.randn(37, 4096, generator=g, device=dev, dtype=torch.bfloat16)
    r = torch.randn(37, 4096, generator=g, device=dev, dtype=torch.bfloat16)
    w = (torch.rand(4096, generator=g, device=dev) + 0.5).to(torch.bfloat16)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x.float(), w.float(), 1e-5)) <= 1e-2
    n_ref, h_ref = ref.add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
    n, h = ops.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert rel(h, h_ref) <= 1e-2 and rel(n, n_ref) <= 1e-2
    gu = torch.randn(37, 2 * 1024, generator=g, device=dev, dtype=torch.bfloat16)
    assert rel(ops.silu_and_mul(gu), ref.silu_and_mul(gu.float())) <= 1e-2
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, 4096, dev)
    q = torch.randn(37, 32, 128, generator=g, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (37,), device=dev)
    assert rel(ops.rope(q, pos, rope), apply_rope_ref(q.float(), pos, rope)) <= 1e-2


@pytest.mark.gpu
@cuda
def test_bf16_cuda_engine_close_to_torch_ops():
    """Same dummy weights: the CUDA engine (fused projections, FlashInfer/Triton ops) and the same
    engine with the torch ops swapped in score continuations within bf16 noise of each other."""
    eng = Engine(model="tiny-llama", load_format="dummy", device="cuda", dtype="bfloat16",
                 kv_cache_tokens=4096, cuda_graph_max_batch=0, seed=3)
    model = eng.worker.model
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.w
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    prompt = torch.randint(5, 500, (40,), generator=g).tolist()
    conts = [" the answer is 42", " a small town by the sea", " nothing at all"]
    fast = eng.score(prompt, conts)
    model.ops = TorchLayerOps()
    eng.flush_cache()
    slow = eng.score(prompt, conts)
    for a, b in zip(fast, slow):
        assert abs(a - b) <= 0.02 * abs(b) + 0.05, (fast, slow)
