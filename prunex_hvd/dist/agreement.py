"""Checks that every rank must pass together, before any tensor collective starts.

A rank that stops alone leaves the others waiting in a collective it will never join, and a rank that goes
on with another model, spec or schedule silently computes something else. So construction checks are
collective here: each rank checks locally, the verdicts (and short digests of what must be equal) travel over
the launcher's control plane, and every rank raises the same ``ValueError`` naming the ranks concerned.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Tuple

import torch

from . import runtime


def model_signature(model: torch.nn.Module) -> List[Tuple[str, tuple, str]]:
    """(name, shape, dtype) of every parameter and buffer, in registration order."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in
            list(model.named_parameters()) + list(model.named_buffers())]


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


@contextmanager
def agreed(control):
    """Run a block of local checks on every rank; a ``ValueError`` on any rank is raised on all of them
    (with the rank numbers), so no rank walks into a collective alone."""
    error = None
    try:
        yield
    except ValueError as exc:
        error = str(exc)
    control.agree(error, ValueError)


def call_agreed(control, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` on every rank under :func:`agreed`: a ``ValueError`` on any rank is raised on
    all of them. Returns ``fn``'s result."""
    result = None
    with agreed(control):
        result = fn(*args, **kwargs)
    return result


def check_same_on_every_rank(control, fields: Dict[str, Any], what: str = "the wrapped optimizer") -> None:
    """Every value in ``fields`` must be equal on all ranks (compared by digest). ``fields["model"]``, when
    present, is a :func:`model_signature`; on a mismatch its first differing entry is named."""
    digests = control.allgather_object({k: _digest(v) for k, v in fields.items()})
    problems = []
    for key in fields:
        differ = [r for r, d in enumerate(digests) if d[key] != digests[0][key]]
        if differ:
            problems.append((key, differ))
    if not problems:
        return
    details = {}
    if any(k == "model" for k, _ in problems):   # every rank knows, so every rank joins this allgather
        sigs = control.allgather_object(fields["model"])
        r = next(r for k, rs in problems if k == "model" for r in rs[:1])
        first = next(((a, b) for a, b in zip(sigs[0], sigs[r]) if a != b), None)
        if first is None:
            details["model"] = f" (rank 0 has {len(sigs[0])} parameters and buffers, rank {r} {len(sigs[r])})"
        else:
            a, b = first
            details["model"] = f" (first difference: rank 0 has {a[0]} {a[1]} {a[2]}, rank {r} has {b[0]} {b[1]} {b[2]})"
    raise ValueError(f"ranks disagree on {what}: " + "; ".join(
        f"{key} differs from rank 0's on rank(s) {','.join(map(str, ranks))}{details.get(key, '')}"
        for key, ranks in problems) + ". Every rank must build the same model and pass the same settings")


def checked_construction(what: str, backend, model: torch.nn.Module, checks: Callable[[], Tuple[Any, dict]]):
    """The opening of every wrapper: initialise the runtime (collective) if needed, run ``checks()`` (this
    rank's validation, returning ``(result, settings)``) under :func:`agreed`, then require the model's
    signature and ``settings`` to be equal on every rank. Returns ``result``."""
    if not runtime.is_initialized():
        runtime.init(backend=backend or "auto")
    control = runtime.state()[1]
    result, settings = None, {}
    with agreed(control):
        result, settings = checks()
    check_same_on_every_rank(control, {"model": model_signature(model), **settings}, what)
    return result
