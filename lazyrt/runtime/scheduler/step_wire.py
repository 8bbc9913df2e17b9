"""StepPlan <-> StepMsg: the scheduler's plan as plain ints for the model worker, and back.

A request's page table is hundreds of pages (5 documents x 2,048 tokens = 640 pages) and does not
change after admission except for its own run growing by one token a step. So both ends keep state:
StepEncoder sends a request's segments, sampling params and document attention once, with its first
item; its decode items then carry only the new token and the target run's length, and StepDecoder
rebuilds the ForwardItem from what it kept. Finished rids (StepMsg.release) are dropped on both sides.
"""

from __future__ import annotations

from lazyrt.cache.chunk_table import Transfer
from lazyrt.runtime.ipc.messages import StepItem, StepMsg
from lazyrt.runtime.scheduler.plan import ForwardItem, PageCopy, StepPlan
from lazyrt.runtime.scheduler.request import Request, Segment


class StepEncoder:
    """Scheduler side: turns plans into messages, sending each request's segments once."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # rid -> its target's index in the segments sent

    def encode(self, plan: StepPlan, release: list[int], defer: bool = False) -> StepMsg:
        for rid in release:
            self._sent.pop(rid, None)
        items = [self._item(it) for it in plan.items]
        copies = [[list(c.src), list(c.dst), c.delta] for c in plan.copies]
        probes = [self._item(it) for it in plan.probes]  # no request: segments always sent
        offloads = [[list(t.src), list(t.dst), t.num_tokens] for t in plan.offloads]
        loads = [[list(t.src), list(t.dst)] for t in plan.loads]
        peer_loads = [[t.peer, list(t.src), list(t.dst)] for t in plan.peer_loads]
        pools = plan.peer_pools
        return StepMsg(items, copies, list(release), probes, defer, offloads, loads, peer_loads, pools)

    def _item(self, it: ForwardItem) -> StepItem:
        req = it.request
        if req is not None and len(it.token_ids) == 1 and req.rid in self._sent:
            target = self._sent[req.rid]  # where it was (no scan of 6 segments a request each step)
            segs = it.segments
            if not (target < len(segs) and segs[target] is it.target):
                target = next((i for i, s in enumerate(segs) if s is it.target), len(segs))
            return StepItem(
                list(it.token_ids),
                it.start_pos,
                None,
                target,
                rid=req.rid,
                target_tokens=it.target.num_tokens,
            )
        segs = list(it.segments)
        target = next((i for i, s in enumerate(segs) if s is it.target), None)
        if target is None:
            segs.append(it.target)
            target = len(segs) - 1
        doc_logits = list(it.doc_logits) if it.doc_logits is not None else None
        if req is not None:
            self._sent[req.rid] = target
        return StepItem(
            token_ids=list(it.token_ids),
            start_pos=it.start_pos,
            segments=[[list(s.pages), s.start_pos, s.num_tokens, s.is_doc, s.host, s.doc] for s in segs],
            target=target,
            rid=req.rid if req is not None else -1,
            sampling=req.params if req is not None else None,
            # only the prefill item (no output yet) holds the scored prompt tokens
            score_len=req.score_len if req is not None and not req.output_ids else 0,
            doc_logits=doc_logits,
            context_ids=req.prompt_ids if req is not None and req.params.repetition_penalty != 1 else None,
        )


class StepDecoder:
    """Worker side: rebuilds StepPlans; items to sample from get a stub Request (rid and params)."""

    def __init__(self) -> None:
        # rid -> (segments, the stub Request its items sample for, its document attention)
        self._known: dict[int, tuple[list[Segment], Request, tuple | None]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def decode(self, msg: StepMsg) -> StepPlan:
        for rid in msg.release:
            self._known.pop(rid, None)
        plan = StepPlan()
        for it in msg.probes:
            segs, doc_logits = _segments(it), _doc_logits(it)
            item = ForwardItem(list(it.token_ids), it.start_pos, segs, segs[it.target], doc_logits=doc_logits)
            plan.probes.append(item)
        for it in msg.items:
            if it.segments is None:
                if it.rid not in self._known:
                    raise ValueError(f"step item for request {it.rid} without segments, and none kept")
                segs, req, doc_logits = self._known[it.rid]
                segs[it.target].num_tokens = it.target_tokens
            else:
                segs, doc_logits = _segments(it), _doc_logits(it)
                req = None
                if it.rid >= 0:
                    # the stub's prompt is what its logits processing needs (repetition penalty)
                    context = list(it.context_ids or [])
                    req = Request(it.rid, it.sampling, suffix=context, score_len=it.score_len)
                    # decodes score nothing
                    self._known[it.rid] = (segs, Request(it.rid, it.sampling, suffix=context), doc_logits)
            plan.items.append(
                ForwardItem(
                    list(it.token_ids),
                    it.start_pos,
                    segs,
                    segs[it.target],
                    request=req,
                    doc_logits=doc_logits,
                )
            )
        plan.copies = [PageCopy(list(s), list(d), delta) for s, d, delta in msg.copies]
        plan.offloads = [Transfer(None, list(s), list(d), n) for s, d, n in msg.offloads]
        plan.loads = [Transfer(None, list(s), list(d)) for s, d in msg.loads]
        plan.peer_loads = [Transfer(None, list(s), list(d), peer=p) for p, s, d in msg.peer_loads]
        plan.peer_pools = [list(x) for x in msg.peer_pools]
        return plan


def _segments(it: StepItem) -> list[Segment]:
    return [Segment(list(p), s, n, bool(d), bool(h), doc) for p, s, n, d, h, doc in it.segments]


def _doc_logits(it: StepItem) -> tuple[float, float] | None:
    return tuple(it.doc_logits) if it.doc_logits is not None else None


def plan_to_msg(plan: StepPlan, release: list[int]) -> StepMsg:
    """Stateless encoding: every item carries its segments (tests, one-off steps)."""
    return StepEncoder().encode(plan, release)


def msg_to_plan(msg: StepMsg) -> StepPlan:
    return StepDecoder().decode(msg)
