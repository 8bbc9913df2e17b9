"""Retrieval attention's host segments (Segment.host: pages in the host tier) taken out of a step's
items: the device part of the step runs without them; lazyrt/retrieval/host_attention.py attends them."""

from __future__ import annotations

from dataclasses import replace

from lazyrt.retrieval.host_attention import HostPart
from lazyrt.runtime.scheduler.plan import StepPlan


def has_host_segments(plan: StepPlan) -> bool:
    return any(g.host for it in plan.items for g in it.segments)


def split_host_segments(plan: StepPlan) -> tuple[StepPlan, list[list[HostPart]]]:
    """(the plan with every host segment taken out of its items, each item's host segments as
    HostParts with rows and pair ids unset: the caller knows the rows once the step is laid out)."""
    items, parts = [], []
    for it in plan.items:
        host = [g for g in it.segments if g.host]
        top_k = it.request.params.retrieval_top_k if it.request is not None else None
        parts.append([HostPart(range(0), tuple(g.pages), g.num_tokens, g.start_pos, 0, top_k) for g in host])
        items.append(replace(it, segments=[g for g in it.segments if not g.host]) if host else it)
    return replace(plan, items=items), parts
