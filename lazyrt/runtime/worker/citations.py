"""Citations: how much attention each of a request's documents gets from the tokens it generates.

For a sampling row (the query whose output picks the next token), the share of attention mass that
document d receives at one layer and head is exp(lse_d - lse_all): lse_all is the log-sum-exp of the
row's attention logits over every key it sees, lse_d the same over document d's keys only. It is
averaged over heads and layers here, and over the generated tokens by the scheduler (Request).

`DocumentAttention` wraps the step's attention backend: after each layer's attention (which stores
the step's K/V) it reads the rows' keys from the KV pages by their segments, independently of the
kernels' page tables, and scores them as the reference attention does (lazy keys rotated by their
position, document attention's logit scale and mass applied to document keys). Only steps with a
request asking for citations pay for it, and they run eagerly (no CUDA graph).
"""

from __future__ import annotations

import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.runtime.scheduler.plan import ForwardItem


class DocumentAttention:
    def __init__(
        self,
        backend,
        rows: list[tuple[int, ForwardItem]],
        rope: RopeCache,
        rotate_keys: bool,
        sm_scale: float,
        num_layers: int,
    ):
        """rows: (row of the step's q, its item) for each request asking for citations."""
        self.backend, self.rows, self.rope = backend, rows, rope
        self.rotate_keys, self.sm_scale, self.num_layers = rotate_keys, sm_scale, num_layers
        self.kv_layers = backend.kv_layers
        self.num_docs = [1 + max((s.doc for s in it.segments), default=-1) for _, it in rows]
        dev = self.kv_layers[0].device
        self.mass = [torch.zeros(n, dtype=torch.float32, device=dev) for n in self.num_docs]  # over layers

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = self.backend.forward(layer, q, k, v, meta)  # stores this step's K/V first
        kv = self.kv_layers[layer]
        for j, (row, item) in enumerate(self.rows):
            if self.num_docs[j]:
                m = self._doc_mass(kv, q[row], int(meta.positions[row]), item, self.num_docs[j])
                self.mass[j] += m
        return out

    def _doc_mass(
        self, kv: torch.Tensor, q: torch.Tensor, qpos: int, item: ForwardItem, n: int
    ) -> torch.Tensor:
        """[n] this layer's share of the row's attention on each document, mean over heads."""
        keys, pos, doc = [], [], []
        for s in item.segments:
            if s.host or not s.num_tokens:  # host-tier keys are attended elsewhere (retrieval)
                continue
            pages = torch.tensor(s.pages, dtype=torch.long, device=kv.device)
            flat = kv[pages, 0].reshape(-1, kv.shape[3], kv.shape[4])[: s.num_tokens]
            keys.append(flat)
            pos.append(torch.arange(s.start_pos, s.start_pos + s.num_tokens, device=kv.device))
            doc.append(torch.full((s.num_tokens,), s.doc, dtype=torch.long, device=kv.device))
        k, kpos, kdoc = torch.cat(keys).float(), torch.cat(pos), torch.cat(doc)
        if self.rotate_keys:
            k = apply_rope_ref(k, kpos, self.rope)
        group = q.shape[0] // k.shape[1]
        logits = torch.einsum("hd,khd->hk", q.float(), k.repeat_interleave(group, dim=1)) * self.sm_scale
        if item.doc_logits is not None:  # document attention (APE-style): on document keys only
            scale, log_mass = item.doc_logits
            is_doc = kdoc >= 0
            logits = torch.where(is_doc[None], logits * scale + log_mass, logits)
        logits = logits.masked_fill((kpos > qpos)[None], float("-inf"))
        lse_all = torch.logsumexp(logits, dim=-1)  # [heads]
        out = torch.zeros(n, dtype=torch.float32, device=kv.device)
        for d in range(n):
            sel = kdoc == d
            if sel.any():
                out[d] = torch.exp(torch.logsumexp(logits[:, sel], dim=-1) - lse_all).mean()
        return out / self.num_layers

    def result(self) -> list[list[float]]:
        """Per row: each document's share of its attention, averaged over heads and layers."""
        return [m.tolist() for m in self.mass]
