"""Flat buckets: many tensors packed into a few flat buffers so a round issues one collective per bucket,
not one per layer (~``bucket_mb`` each; a tensor larger than that travels alone)."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


class BucketLayout:
    """Entry ``k`` of ``numels`` lives at ``views[k]``, a flat view into one of ``buffers``.

    ``zero_tail``: every buffer is followed in memory by that many zeros that are never communicated (the
    buffers end before them). They give :meth:`chunk_rows` a zero row for recovering by one gather."""

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device, bucket_bytes: int, zero_tail: int = 0):
        self.numels = [int(n) for n in numels]
        self.dtype = dtype
        self.zero_tail = int(zero_tail)
        limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        spans: List[List[int]] = []   # entry indices per bucket
        fill = 0
        for k, n in enumerate(self.numels):
            if not spans or (fill + n > limit and fill > 0):
                spans.append([])
                fill = 0
            spans[-1].append(k)
            fill += n
        self.buffers: List[torch.Tensor] = []
        self.views: List[torch.Tensor] = [None] * len(self.numels)
        self.place: List[Tuple[int, int]] = [None] * len(self.numels)  # (bucket, offset)
        for b, members in enumerate(spans):
            size = sum(self.numels[k] for k in members)
            store = torch.empty(size + self.zero_tail, dtype=dtype, device=device)
            store[size:].zero_()
            buf = store[:size]
            offset = 0
            for k in members:
                self.views[k] = buf[offset: offset + self.numels[k]]
                self.place[k] = (b, offset)
                offset += self.numels[k]
            self.buffers.append(buf)

    def chunk_rows(self, k: int, chunk: int) -> Tuple[torch.Tensor, int]:
        """Entry ``k`` as rows of ``chunk`` elements running on into its buffer's zero tail, and the number of
        the first row lying wholly in the tail (all zeros). The rows in between belong to other entries: index
        only entry ``k``'s own rows and the zero row. Needs ``zero_tail >= 2 * chunk - 1``."""
        if self.numels[k] % chunk:
            raise ValueError(f"entry {k} has {self.numels[k]} elements, not a whole number of {chunk}-element rows")
        b, offset = self.place[k]
        buf = self.buffers[b]
        zero_row = -(-(buf.numel() - offset) // chunk)   # first row starting at or after the buffer's end
        if offset + (zero_row + 1) * chunk > buf.numel() + self.zero_tail:
            raise ValueError(f"a zero tail of {self.zero_tail} elements is too short for {chunk}-element rows")
        rows = torch.as_strided(buf, (zero_row + 1, chunk), (chunk, 1), buf.storage_offset() + offset)
        return rows, zero_row

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    def __len__(self) -> int:
        return len(self.buffers)
