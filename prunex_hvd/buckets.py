"""Flat buckets: many tensors packed into a few flat buffers so a round issues one collective per bucket,
not one per layer (~``bucket_mb`` each; a tensor larger than that travels alone)."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


class BucketLayout:
    """Entry ``k`` of ``numels`` lives at ``views[k]``, a flat view into one of ``buffers``."""

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device, bucket_bytes: int):
        self.numels = [int(n) for n in numels]
        limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        spans: List[List[int]] = []   # entry indices per bucket
        fill = limit
        for k, n in enumerate(self.numels):
            if fill + n > limit and (not spans or fill > 0):
                spans.append([])
                fill = 0
            spans[-1].append(k)
            fill += n
        self.buffers: List[torch.Tensor] = []
        self.views: List[torch.Tensor] = [None] * len(self.numels)
        self.place: List[Tuple[int, int]] = [None] * len(self.numels)  # (bucket, offset)
        for b, members in enumerate(spans):
            buf = torch.empty(sum(self.numels[k] for k in members), dtype=dtype, device=device)
            offset = 0
            for k in members:
                self.views[k] = buf[offset: offset + self.numels[k]]
                self.place[k] = (b, offset)
                offset += self.numels[k]
            self.buffers.append(buf)

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    def __len__(self) -> int:
        return len(self.buffers)
