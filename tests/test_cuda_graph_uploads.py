"""DecodeGraphs.run's buffer fills (cuda_graph.Uploads), on the CPU: graphs stubbed, buffers on the
host. Over decode steps patched from the last one (which share unchanged arrays: those are not
copied again), batch changes, padded graph sizes and a capture in between, what each replay sees in
the buffers equals the step's arrays, padded as before. stage=True runs the CUDA path's mirror logic
(two sets of host mirrors, copies out of them) minus pinning and events, which only the GPU engine
tests (test_engine_gpu.py) exercise."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_step_inputs_decode import Batch

from lazyrt.runtime.worker.cuda_graph import DecodeGraphs, Uploads
from lazyrt.runtime.worker.step_inputs import DecodeLayout, SharedGrouping, StepInputs, shared_arrays


class _Replay:
    def __init__(self, graphs: SnapshotGraphs, b: int):
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        g = self.graphs
        names = ("input_ids", "positions", "store_pages", "store_slots", "kv_indptr", "kv_indices",
                 "pos_base", "valid_len")  # fmt: skip
        g.seen = {k: getattr(g, k).clone() for k in names} | {k: v.clone() for k, v in g.sh.items()}
        g.seen_b = self.b


class SnapshotGraphs(DecodeGraphs):
    """Graphs whose replay records the buffers."""

    def _capture(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False):
        self._uploads.forget()
        self.kv_indptr.zero_()  # as a capture does: clobbers what was put
        self.store_pages.fill_(self.scratch_page)
        self.captures += 1
        return _Replay(self, b), torch.zeros(b, 4)


@pytest.mark.parametrize("stage", [False, True])
def test_buffer_fills_equal_the_step_arrays_padded(stage):
    """stage: through the two sets of host mirrors, as on CUDA (here unpinned, no events)."""
    rng = random.Random(0)
    ps = 4
    pool = SimpleNamespace(num_kv_heads=2)  # (which shared graph a step replays: work items x heads)
    runner = SimpleNamespace(device=torch.device("cpu"), rotate_keys=True, pool=pool)
    SnapshotGraphs.captures = 0
    graphs = SnapshotGraphs(runner, 16, 512, scratch_page=7, shared=(256 // ps, 2))
    if stage:  # the arena's mirrors, copies merged across gaps
        graphs._uploads = Uploads(runner.device, stage=True, arena=graphs.arena, buffers=graphs.views)
    else:
        graphs._uploads = Uploads(runner.device, stage=False)
    captures0 = graphs.captures
    b = Batch(rng, ps)
    for _ in range(5):
        b.join()
    layout, grouping = DecodeLayout(), SharedGrouping()
    skipped = puts = 0
    for step in range(60):
        if step in (20, 40):
            b.join()  # 6 then 7 requests: still the graph of 8
        if step == 30:
            del b.reqs[next(iter(b.reqs))]
        if step == 45:  # a capture (a graph first needed) clobbers the buffers in between
            graphs.doc_graphs.clear()
            graphs.run(StepInputs.from_plan(b.plan(doc_logits=0), ps))
        plan = b.plan()
        s = StepInputs.from_plan(plan, ps, layout)
        arrays = shared_arrays(plan, s, ps, 2, grouping, None, layout)
        assert arrays is not None and graphs.fits(s) and graphs.fits_shared(s, arrays)
        if step % 5 == 1 or 50 <= step < 54:  # a step replayed without sharing: the page tables
            arrays = None
        if step % 7 == 3:  # overlapped scheduling: row 0's token comes from the step in flight
            s.fill = (torch.tensor([0]), torch.tensor([1]), torch.tensor([5, 999]))
        last = dict(graphs._uploads._last)
        graphs.run(s, arrays)
        skipped += sum(1 for k, v in last.items() if graphs._uploads._last.get(k) is v)
        puts += sum(1 for k, v in graphs._uploads._last.items() if last.get(k) is not v)
        n, bs = len(s.input_ids), graphs.seen_b
        assert bs == next(x for x in graphs.sizes if x >= n)
        pad = bs - n
        e = len(s.kv_indices)
        ids = s.input_ids.copy()
        if s.fill is not None:
            ids[0] = 999
        want = {
            "input_ids": np.concatenate([ids, np.zeros(pad, np.int64)]),
            "positions": np.concatenate([s.positions, np.zeros(pad, np.int64)]),
            "store_pages": np.concatenate([s.store_pages, np.full(pad, 7, np.int64)]),
            "store_slots": np.concatenate([s.store_slots, np.zeros(pad, np.int64)]),
            "kv_indptr": np.concatenate([s.kv_indptr, np.full(pad, e, np.int32)]),
            "kv_indices": s.kv_indices,
            "pos_base": s.pos_base,
            "valid_len": s.valid_len,
        }
        for k, v in (arrays or {}).items():
            want[k] = np.concatenate([v, np.full(pad, v[-1], v.dtype)]) if k == "row_part_indptr" else v
        for k, v in want.items():
            if k in ("kv_indptr", "kv_indices", "pos_base", "valid_len") and arrays is not None:
                continue  # a shared step's graph reads the segments only: these are not put
            got = graphs.seen[k].numpy()[: len(v)]
            assert np.array_equal(got, v), (step, k)
        b.grow()
    assert graphs.captures == captures0 + 1
    assert skipped > 0  # unchanged arrays of patched steps were not copied again
    if stage:  # a step's puts went out in fewer copies than one each
        assert 0 < graphs._uploads.copies < puts / 2, (graphs._uploads.copies, puts)
    assert torch.equal(graphs.qo_indptr, torch.arange(len(graphs.qo_indptr), dtype=torch.int32))


def test_merged_copies_keep_the_buffers_between_them():
    """Uploads over an arena, through its two host mirrors: buffers A, B, C side by side. A put to A
    and C goes out as one copy only over a B whose device values are known: never put, B keeps what
    it was built with (two copies); once put and then left unchanged (not put again) over steps that
    alternate mirrors, the merged copies carry B's values, not a mirror's stale ones."""
    from lazyrt.runtime.worker.cuda_graph import arena_views

    rng = np.random.default_rng()
    specs = [("a", 40, torch.int32), ("b", 24, torch.long), ("c", 40, torch.int32)]
    arena, views = arena_views(specs, torch.device("cpu"))
    views["b"].fill_(-7)  # as built (store_pages holds the scratch page)
    up = Uploads(torch.device("cpu"), stage=True, arena=arena, buffers=views)

    def step(b_values=None) -> dict:
        want = {k: rng.integers(0, 1000, size=int(rng.integers(1, 40)), dtype=np.int32) for k in ("a", "c")}
        up.begin()
        up.put("a", views["a"], want["a"])
        if b_values is not None:
            up.put("b", views["b"], b_values)
        up.put("c", views["c"], want["c"])
        up.end()
        for k, v in want.items():
            assert np.array_equal(views[k].numpy()[: len(v)], v), k
        return want

    for _ in range(3):
        before = up.copies
        step()
        assert up.copies - before == 2 and (views["b"] == -7).all()  # B was never put: not copied over
    b_values = rng.integers(0, 1000, size=17).astype(np.int64)
    step(b_values)
    for _ in range(5):  # B unchanged: skipped, merged over from either mirror
        before = up.copies
        step(b_values)
        assert up.copies - before == 1
        assert np.array_equal(views["b"].numpy()[:17], b_values)
    up.forget("b")  # written by something else: unknown again, so not copied over
    views["b"][:17] = 5
    step()
    assert (views["b"][:17] == 5).all()
