"""PowerSGD's low-rank gradient compression (Vogels et al. 2019) as pure tensor functions: no communication.

The synchronous phase (``sync_rounds``) can send the nodes' mean gradient across nodes at rank r
(``sync_powersgd_rank``) instead of whole. For each gradient matrix M (a weight's compact block in its GEMM view,
out × in·k·k) of node i, with its error memory e_i and a Q shared by every node:

 1. M_i ← M_i + e_i                                   (error feedback: what earlier steps did not send)
 2. P_i = M_i Q;  P = mean_i P_i  (across nodes);  P ← orthonormal columns of P
 3. Q_i = M_iᵀ P;  Q = mean_i Q_i (across nodes)
 4. M̂ = P Qᵀ = P Pᵀ mean_i M_i: the nodes' mean gradient projected onto P's columns; e_i ← M_i − M̂; Q is kept
    as the next step's start (one power iteration a step)

Every node gets the same M̂. A tensor that rank r would not shrink at least twofold (vectors, small matrices)
travels whole, as in PyTorch's ``powerSGD_hook`` (whose bucket/process-group plumbing is DDP's, not ours).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

MIN_COMPRESSION = 2.0   # PyTorch's powerSGD_hook default: a matrix is compressed only if it shrinks this much


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The GEMM view of a gradient of ``shape``: (rows, everything else)."""
    rows = int(shape[0]) if len(shape) else 1
    return rows, (math.prod(shape) // rows if rows else 0)


def compressible(rows: int, cols: int, rank: int) -> bool:
    """Whether rank ``rank`` sends a rows × cols matrix in at most 1/MIN_COMPRESSION of its elements."""
    return rank > 0 and min(rows, cols) > rank and (rows + cols) * rank * MIN_COMPRESSION <= rows * cols


def initial_q(cols: int, rank: int, seed: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
    """Q's start, cols × rank: standard normal from ``seed`` alone, so every node draws the same one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cols, rank, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """P's columns replaced, in place, by an orthonormal basis of their span (reduced QR; a zero column stays a
    column of zeros instead of NaN). Deterministic: every node, holding the same P, gets the same basis."""
    q, r = torch.linalg.qr(p, mode="reduced")
    q.mul_((r.diagonal().abs() > torch.finfo(p.dtype).eps * max(1.0, float(p.abs().max()))).to(p.dtype))
    return p.copy_(q)


def project(m: torch.Tensor, q: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 2's P_i = M_i Q (before the nodes' mean)."""
    return torch.mm(m, q, out=out) if out is not None else m @ q


def back_project(m: torch.Tensor, p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 3's Q_i = M_iᵀ P (before the nodes' mean)."""
    return torch.mm(m.t(), p, out=out) if out is not None else m.t() @ p


def reconstruct_(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Step 4, in place: ``error`` ← M_i − P Qᵀ and ``m`` ← P Qᵀ (the gradient every node steps on). Returns m."""
    approx = p @ q.t()
    torch.sub(m, approx, out=error)
    return m.copy_(approx)
