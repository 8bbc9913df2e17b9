"""Typed messages between the processes, and their wire format (msgpack, one type tag per class).

No pickle: a message is a plain dataclass of ints, floats, strings, lists and dicts (and nested
message dataclasses). Each dataclass travels as a msgpack ext value holding [tag, field values...],
so decoding rebuilds exactly the registered classes and nothing else.

A list of ints may be sent as an `array.array` (a document's cached token ids): it travels as its raw
bytes (one copy, not one msgpack int each: ~0.3 ms less for 10k tokens on each side) and arrives as
a plain list. The processes share one host, so its byte order too.
"""

from __future__ import annotations

import dataclasses
import functools
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack

from lazyrt.sampling_params import SamplingParams

_EXT = 1
_ARRAY_EXT = 2  # an array.array: its one-letter typecode, then its bytes
_INT_TYPECODES = frozenset("bBhHiIlLqQ")  # token ids are ints: nothing else decodes
_CLASSES: dict[str, type] = {}


def message(cls: type) -> type:
    """Register a dataclass as a wire message under its class name."""
    _CLASSES[cls.__name__] = cls
    return cls


message(SamplingParams)


# ---- HTTP -> tokenizer -------------------------------------------------------------------------
@message
@dataclass(slots=True)
class GenerateReq:
    """A validated request. Exactly one of text / input_ids / messages is set."""

    rid: int
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat: [{"role", "content"}], rendered with the chat template
    docs: list[str | dict] | None = None  # texts, or {"id": ...} of registered documents
    system: str | None = None
    # "raw": text is the whole prompt; "rag": text is a question wrapped in the chat template
    text_mode: str = "raw"
    param: str = "prompt"  # the request field errors about the prompt should name
    # messages only: docs go into messages[doc_turn] (default: the last user message); with
    # continue_final the last (assistant) message is continued rather than closed.
    doc_turn: int | None = None
    continue_final: bool = False
    continuation: str | None = None  # scoring: appended to the prompt; its token logprobs reported
    continuation_param: str = "continuations"  # the field errors about the continuation name
    echo: bool = False  # /v1/completions echo: with logprobs, the prompt's tokens are scored too
    tools: list[dict] | None = None  # chat: OpenAI tool definitions, rendered by the chat template
    received_at: float = 0.0  # wall clock (time.time) when HTTP got it: per-request timings in meta
    # peer KV: each doc's owner as the router placed it (a replica's peer address; "" = none given),
    # from the router's x-lazyrt-doc-owners header
    doc_owners: list[str] | None = None
    # the request field that set max_tokens (None: the endpoint's default, capped at the context
    # left); a prompt + max_tokens past the context is then an error naming it, not a silent cap
    max_tokens_param: str | None = None


@message
@dataclass(slots=True)
class AbortReq:
    rid: int
    reason: str = "abort"


@message
@dataclass(slots=True)
class ControlReq:
    """Cache management and stats; answered by a ControlResp with the same rid."""

    rid: int
    op: str  # "stats" | "flush"


@message
@dataclass(slots=True)
class DocumentReq:
    """An operation on the document store, which the tokenizer process owns (it tokenizes what is
    registered); answered by a DocumentResp with the same rid."""

    rid: int
    op: str  # "add" | "get" | "list" | "delete"
    id: str | None = None  # add: the client's id (None = content addressed); get, delete: which
    text: str | None = None  # add
    metadata: dict | None = None  # add
    include_text: bool = False  # get, list
    limit: int = 20  # list
    after: str | None = None  # list: the id of the last document of the previous page


@message
@dataclass(slots=True)
class DocumentResp:
    rid: int
    data: dict | None = None  # the API object (a document, a list, a deletion)
    status: int = 200  # else an error: `message` names `param`
    message: str = ""
    param: str | None = None
    created: bool = False  # add: the document is new


# ---- tokenizer -> scheduler --------------------------------------------------------------------
@message
@dataclass(slots=True)
class TokenizedReq:
    rid: int
    sampling: SamplingParams
    max_new_tokens: int
    prefix: list[int] = field(default_factory=list)
    docs: list[list[int]] = field(default_factory=list)  # (sent as array.array by the tokenizer process)
    suffix: list[int] = field(default_factory=list)
    score_len: int = 0  # the last score_len prompt tokens are scored (see Request.score_len)
    # one per doc: its placement key (cache/placement.py: of its text, or registry id), or empty
    doc_keys: list[bytes] = field(default_factory=list)
    doc_owners: list[str] = field(default_factory=list)  # one per doc, or empty (GenerateReq.doc_owners)
    received_at: float = 0.0  # wall clock: HTTP got it / the tokenizer process got it / finished it
    tokenizing_at: float = 0.0
    tokenized_at: float = 0.0


# ---- scheduler <-> model worker ----------------------------------------------------------------
@message
@dataclass(slots=True)
class StepItem:
    """One sequence's new tokens; segments are [pages, start_pos, num_tokens, is_doc, host, doc index]
    in position order.

    A request's segments and sampling params travel with its first item only; later decode items
    have segments=None and the worker reuses what it kept, with the target run `target_tokens` long.
    """

    token_ids: list[int]
    start_pos: int
    segments: list[list] | None
    target: int  # index into segments of the run the new tokens are written to
    rid: int = -1  # >= 0: sample a token for this request from the last position
    sampling: SamplingParams | None = None
    target_tokens: int = 0  # with segments=None: the target run's length including the new token
    score_len: int = 0  # report logprobs of this item's last score_len tokens (a scoring prefill)
    doc_logits: list[float] | None = None  # [logit scale, log mass] on document keys; None = plain
    # with sampling, when it has a repetition penalty: the request's prompt token ids
    context_ids: list[int] | None = None


@message
@dataclass(slots=True)
class StepMsg:
    items: list[StepItem]
    copies: list[list] = field(default_factory=list)  # [src pages, dst pages, delta] (block mode)
    release: list[int] = field(default_factory=list)  # finished rids: drop their sampling state
    probes: list[StepItem] = field(default_factory=list)  # deviation probes (segments always sent)
    # Overlapped scheduling: launch this step and answer with the previous deferred step's tokens
    # (an empty message without defer collects the last one). A token id of plan.PENDING_TOKEN =
    # the token the previous step samples for that item's request, filled in on the device.
    defer: bool = False
    # Host KV tier, run before `copies` and the kernels: [device pages, host pages, chunk tokens]
    # offloads, then [host pages, device pages] loads.
    offloads: list[list] = field(default_factory=list)
    loads: list[list] = field(default_factory=list)
    # Peer KV, run after the host loads and before `copies`: [peer, the peer's pages, device pages];
    # peer_pools: [peer, its KV pool's export] for a peer this worker has not mapped yet (or again)
    peer_loads: list[list] = field(default_factory=list)
    peer_pools: list[list] = field(default_factory=list)


@message
@dataclass(slots=True)
class StepResult:
    tokens: list[int]  # one per item with rid >= 0, in order
    scores: dict | None = None  # rid -> logprobs of its scored tokens (items with score_len > 0)
    probe_scores: list[list[float]] | None = None  # per probe: each page's K/V deviation
    shared_chunk_steps: int = 0  # steps the worker has run with shared-chunk attention so far
    graph_steps: int = 0  # steps the worker has replayed from CUDA graphs so far
    ragged_prefill_steps: int = 0  # steps (or parts) through FlashInfer's ragged prefill so far
    decode_split_steps: int = 0  # steps (or parts) whose decodes launched apart (decode_split) so far
    # per token (same order), for requests asking logprobs: [logprob, [top ids], [top logprobs]]
    logprobs: list[list | None] | None = None
    # rid -> [top ids, top logprobs] per scored token, for scoring requests asking top logprobs
    score_top: dict | None = None
    citations: dict | None = None  # rid -> each document's share of its sampling row's attention
    # rid -> why the request cannot go on (its structured-output matcher failed: a parser limit); the
    # worker ended it with EOS, which must not read as a complete answer
    failed: dict | None = None
    # Overlapped scheduling, for late planning (scheduler/late_planning.py): the device time of the
    # step whose tokens these are (CUDA events; None on CPU, where a step runs before its answer), and
    # the worker's host time to launch the step this message answers (receipt to kernels queued).
    device_ms: float | None = None
    launch_ms: float | None = None
    # wall clock when these tokens reached the worker's host memory (the served TTFT split)
    ready_at: float = 0.0


@message
@dataclass(slots=True)
class StepFailed:
    """The worker's answer instead of a StepResult when the step raised: it has dropped the step
    (and any deferred one) and serves on; the scheduler fails the requests that were in them."""

    error: str  # "ExceptionType: message", for the log and the clients' error message
    kind: str = "error"  # "oom" (device out of memory) | "error" | "tp_broken" (the worker then exits)


@message
@dataclass(slots=True)
class WorkerReady:
    model_id: str
    tokenizer_path: str
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int
    eos_ids: list[int]
    device: str
    host_pages: int = 0  # pages of the host KV tier (0 = off)
    page_bytes: int = 0  # bytes of one KV page, all layers (host tier traffic in /cache_stats)
    tool_format: str | None = None  # set by the tokenizer process: its chat template's tool calls
    kv_export: list | None = None  # the KV pool, mappable by peer replicas (kv_peers; cache/kv_share.py)


# ---- scheduler <-> the schedulers of peer replicas (kv_peers: runtime/scheduler/peer_kv.py) ------
@message
@dataclass(slots=True)
class PeerHello:
    """A replica asks a peer for its KV pool (sent at start-up, and again while it has no answer)."""

    sender: str  # the sender's peer address: where the answer goes
    model_id: str


@message
@dataclass(slots=True)
class PeerWelcome:
    sender: str
    model_id: str
    cache_mode: str
    page_size: int
    kv_export: list  # its KV pool, for the worker to map


@message
@dataclass(slots=True)
class PeerEnsure:
    """Hold these documents' chunks (computed after `prefix`) for the sender, computing the missing
    ones, and answer with their pages once their KV is on the device."""

    sender: str
    fetch_id: int
    prefix: list[int]
    docs: list[list[int]]


@message
@dataclass(slots=True)
class PeerPages:
    """The answer to a PeerEnsure: each document's pages, or None where the owner could not hold it
    (no room: the sender computes that one itself). They stay held until the sender's PeerRelease."""

    sender: str
    fetch_id: int
    pages: list[list[int] | None]


@message
@dataclass(slots=True)
class PeerRelease:
    """The sender has copied the pages of its fetch (or no longer needs them): the owner may evict them."""

    sender: str
    fetch_id: int


# ---- scheduler -> detokenizer -> HTTP ----------------------------------------------------------
@message
@dataclass(slots=True)
class TokenOut:
    rid: int
    token_ids: list[int]
    finish_reason: str | None = None
    meta: dict | None = None  # prompt_tokens, cached_tokens, chunk_hits, chunk_misses (first and last)
    logprobs: list[list] | None = None  # per token: [logprob, [top ids], [top logprobs]]


@message
@dataclass(slots=True)
class TokenBatch:
    outs: list[TokenOut]


@message
@dataclass(slots=True)
class TextOut:
    rid: int
    text: str  # new text, safe to show (whole characters, never part of a stop string)
    num_tokens: int  # new tokens this message accounts for
    finish_reason: str | None = None
    meta: dict | None = None
    token_ids: list[int] | None = None  # all output ids, on the final message
    # per token this message accounts for: {"token", "logprob", "bytes", "top": [[token, logprob, bytes]]}
    logprobs: list[dict] | None = None


@message
@dataclass(slots=True)
class TextBatch:
    outs: list[TextOut]


@message
@dataclass(slots=True)
class ErrorOut:
    """A request that cannot run; the HTTP layer turns it into a 4xx naming `param`."""

    rid: int
    message: str
    param: str | None = None
    status: int = 400
    type: str = "invalid_request_error"


@message
@dataclass(slots=True)
class ControlResp:
    rid: int
    data: dict


@message
@dataclass(slots=True)
class Ready:
    """The pipeline is up: sent by the scheduler, forwarded by the tokenizer once it has loaded."""

    model_id: str
    num_pages: int
    page_size: int
    max_context: int
    device: str


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _default(obj: Any) -> Any:
    name = type(obj).__name__
    if _CLASSES.get(name) is type(obj):
        values = [getattr(obj, f) for f in _field_names(type(obj))]
        return msgpack.ExtType(_EXT, msgpack.packb([name, *values], default=_default, use_bin_type=True))
    if isinstance(obj, array):
        return msgpack.ExtType(_ARRAY_EXT, obj.typecode.encode() + obj.tobytes())
    raise TypeError(f"cannot serialize {name}: not a registered message")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _ARRAY_EXT:
        typecode = data[:1].decode("ascii", "replace")
        if typecode not in _INT_TYPECODES:
            raise ValueError(f"array ext: {typecode!r} is not an integer array type")
        values = array(typecode)
        values.frombytes(data[1:])  # a length that is not a multiple of the item size: ValueError
        return values.tolist()
    if code != _EXT:
        raise ValueError(f"unknown msgpack ext code {code}")
    name, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(*values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
