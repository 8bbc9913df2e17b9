"""StepPlan <-> StepMsg: the scheduler's plan as plain ints for the model worker, and back.

The plan is small (token ids, positions, page ids), so shipping it every step is cheap; the worker
rebuilds ForwardItems that carry only what ModelRunner reads.
"""

from __future__ import annotations

from lazyrt.runtime.messages import StepItem, StepMsg
from lazyrt.runtime.request import Request, Segment
from lazyrt.runtime.scheduler import ForwardItem, PageCopy, StepPlan


def plan_to_msg(plan: StepPlan, release: list[int]) -> StepMsg:
    items = []
    for it in plan.items:
        segs = list(it.segments)
        target = next((i for i, s in enumerate(segs) if s is it.target), None)
        if target is None:
            segs.append(it.target)
            target = len(segs) - 1
        req = it.request
        items.append(
            StepItem(
                token_ids=list(it.token_ids),
                start_pos=it.start_pos,
                segments=[[list(s.pages), s.start_pos, s.num_tokens] for s in segs],
                target=target,
                rid=req.rid if req is not None else -1,
                sampling=req.params if req is not None else None,
                # only the prefill item (no output yet) holds the scored prompt tokens
                score_len=req.score_len if req is not None and not req.output_ids else 0,
            )
        )
    copies = [[list(c.src), list(c.dst), c.delta] for c in plan.copies]
    return StepMsg(items, copies, list(release))


def msg_to_plan(msg: StepMsg) -> StepPlan:
    """Rebuild a StepPlan; items to sample from get a stub Request (rid and params only)."""
    plan = StepPlan()
    for it in msg.items:
        segs = [Segment(list(p), s, n) for p, s, n in it.segments]
        req = Request(it.rid, it.sampling, score_len=it.score_len) if it.rid >= 0 else None
        plan.items.append(ForwardItem(list(it.token_ids), it.start_pos, segs, segs[it.target], request=req))
    plan.copies = [PageCopy(list(s), list(d), delta) for s, d, delta in msg.copies]
    return plan
