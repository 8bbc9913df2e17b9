"""StepInputs: a StepPlan flattened to host-side int lists (token ids, page tables, store slots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lazyrt.runtime.scheduler import StepPlan


@dataclass
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    store_pages: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    qo_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indices: list[int] = field(default_factory=list)
    pos_base: list[int] = field(default_factory=list)
    valid_len: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # last token of each item with a request

    @property
    def max_q_len(self) -> int:
        return max(b - a for a, b in zip(self.qo_indptr, self.qo_indptr[1:]))

    @property
    def max_kv_entries(self) -> int:
        return max(b - a for a, b in zip(self.kv_indptr, self.kv_indptr[1:]))

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled: the shape CUDA graphs are captured for."""
        n = len(self.qo_indptr) - 1
        return self.max_q_len == 1 and len(self.sample_rows) == n

    def dense_pages(self, page_size: int) -> bool:
        """Each table maps positions 0.. onto its pages in order, every page but the last full."""
        for a, b in zip(self.kv_indptr, self.kv_indptr[1:]):
            for j, e in enumerate(range(a, b)):
                if self.pos_base[e] != j * page_size or (e < b - 1 and self.valid_len[e] != page_size):
                    return False
        return True

    @classmethod
    def from_plan(cls, plan: StepPlan, page_size: int) -> StepInputs:
        s = cls()
        for item in plan.items:
            n = len(item.token_ids)
            s.input_ids += item.token_ids
            s.qo_indptr.append(s.qo_indptr[-1] + n)
            if item.request is not None:
                s.sample_rows.append(s.qo_indptr[-1] - 1)
            for p in range(item.start_pos, item.start_pos + n):
                s.positions.append(p)
                off = p - item.target.start_pos
                s.store_pages.append(item.target.pages[off // page_size])
                s.store_slots.append(off % page_size)
            for seg in item.segments:
                for j in range(-(-seg.num_tokens // page_size)):
                    s.kv_indices.append(seg.pages[j])
                    s.pos_base.append(seg.start_pos + j * page_size)
                    s.valid_len.append(min(page_size, seg.num_tokens - j * page_size))
            s.kv_indptr.append(len(s.kv_indices))
        return s
