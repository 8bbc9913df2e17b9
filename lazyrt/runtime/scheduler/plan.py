"""The step plan: what the scheduler asks the model worker to run in one forward step.

A StepPlan is the contract between the scheduler (which builds it) and the model worker (which runs
it): token ids and the KV segments each item attends to, plus block mode's page copies and the host
tier's page moves. It crosses the process boundary as a StepMsg (step_wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazyrt.cache.chunk_table import Chunk, Transfer
from lazyrt.runtime.scheduler.request import Request, Segment

# A decode item's input token while the step that samples it is still running (overlapped
# scheduling): the worker fills in that step's token for the request on the device.
PENDING_TOKEN = -1


@dataclass
class ChunkJob:
    """A chunk whose KV the step computes."""

    chunk: Chunk
    cond: Chunk | None  # the prefix chunk it is conditioned on


@dataclass
class ForwardItem:
    """New tokens of one sequence: they go into `target` and attend to `segments`."""

    token_ids: list[int]
    start_pos: int
    segments: list[Segment]
    target: Segment
    request: Request | None = None  # sample a token for it from the last position
    job: ChunkJob | None = None  # a chunk prefill: mark the chunk ready when the step is done
    # Document attention of this item's queries: (logit scale, log mass) on keys of document
    # segments (= 1 / temperature, log scale); None = plain attention.
    doc_logits: tuple[float, float] | None = None


@dataclass
class PageCopy:
    """Block mode: copy a chunk's pages and re-rotate their keys by `delta` positions."""

    src: list[int]
    dst: list[int]
    delta: int


@dataclass
class StepPlan:
    items: list[ForwardItem] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    # Host KV tier (ChunkTable.take_transfers): evicted chunks' pages device -> host, then reused
    # chunks' pages host -> device; the worker runs both before the block copies and the kernels.
    offloads: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
    # Peer KV: chunks copied from peer replicas' pools (Transfer.peer), after the host loads; and
    # [peer, pool export] for the peers the worker must map first
    peer_loads: list[Transfer] = field(default_factory=list)
    peer_pools: list[list] = field(default_factory=list)
    # Deviation recompute probes (recompute.py): documents run in context through the first layers,
    # writing no KV; the worker returns each one's per-page K/V deviation. Run after the items.
    probes: list[ForwardItem] = field(default_factory=list)
    probe_for: list[tuple[Request, int]] = field(default_factory=list)  # scheduler side: (request, doc)
    # Scheduler side, for meta["timings_ms"] (wall clock; EngineCore stamps them): the step was sent
    # to the worker, its launch answered (a deferred step), the call that brings its tokens back sent.
    seq: int = 0  # the scheduler's count of steps planned (peer KV: which steps have completed)
    sent_at: float = 0.0
    launched_at: float = 0.0
    collect_sent_at: float = 0.0

    @property
    def has_copies(self) -> bool:
        return bool(self.copies or self.offloads or self.loads or self.peer_loads)

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)
