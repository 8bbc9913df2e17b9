"""Independent references built on Hugging Face transformers (no lazyrt code on the compute path)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=sorted(eos_ids) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def rag_layout(prefix: list[int], docs: list[list[int]], suffix: list[int]):
    """Token ids, position ids and a boolean [N, N] mask (True = may attend) for RagPrompt semantics.

    Each doc sees its own private copy of the prefix, placed so the copy ends right where the doc
    starts (a doc sees the prefix as if it came right after it); the suffix sees the real prefix, every
    doc at its contiguous position, and itself. Copies are invisible to everything else.
    """
    ids, pos, groups = [], [], []  # group: ("prefix",) | ("copy", i) | ("doc", i) | ("suffix",)
    P = len(prefix)
    ids += prefix
    pos += list(range(P))
    groups += [("prefix",)] * P
    start = P
    for i, d in enumerate(docs):
        ids += prefix
        pos += list(range(start - P, start))
        groups += [("copy", i)] * P
        ids += d
        pos += list(range(start, start + len(d)))
        groups += [("doc", i)] * len(d)
        start += len(d)
    ids += suffix
    pos += list(range(start, start + len(suffix)))
    groups += [("suffix",)] * len(suffix)
    n = len(ids)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        gq = groups[q]
        for k in range(q + 1):
            gk = groups[k]
            if gq[0] in ("prefix", "copy"):
                ok = gk == gq
            elif gq[0] == "doc":
                ok = gk == gq or gk == ("copy", gq[1])
            else:
                ok = gk[0] != "copy"
            mask[q, k] = ok
    return ids, pos, mask


@torch.inference_mode()
def hf_rag_greedy(model, prefix, docs, suffix, max_new: int, eos_ids: set[int]) -> list[int]:
    """Greedy tokens under RagPrompt semantics, by full re-forward with an explicit 4-D mask."""
    model.config._attn_implementation = "sdpa"
    out: list[int] = []
    for _ in range(max_new):
        ids, pos, mask = rag_layout(prefix, docs, suffix + out)
        logits = model(
            torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([pos])
        ).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos_ids:
            break
    return out
