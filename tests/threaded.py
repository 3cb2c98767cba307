"""Run a function on every rank of an M×P thread cluster (:mod:`prunex_hvd.dist.comm.threads`) in one process.

    results = run_ranks(2, 2, lambda rank: rank.groups.intra.allreduce_(torch.ones(3)).tolist())

torch's global RNG is shared by the threads: build models (and draw anything random) before ``run_ranks``,
and give each rank its own ``torch.Generator`` for data."""
from __future__ import annotations

import threading
import time
from typing import Callable, List

from prunex_hvd.dist.comm.threads import DEFAULT_TIMEOUT_S, ClusterAborted, ThreadCluster, ThreadRank, thread_cluster


class RankFailed(RuntimeError):
    """A rank's function raised; ``rank`` names it and ``__cause__`` is its exception."""

    def __init__(self, rank: int, exc: BaseException):
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        self.rank = rank


def run_ranks(num_nodes: int, local_size: int, fn: Callable[[ThreadRank], object],
              timeout: float = DEFAULT_TIMEOUT_S, cluster: ThreadCluster = None) -> List[object]:
    """``[fn(cluster[r]) for every rank r]``, each call in a thread of its own. If any rank raises, the cluster
    is aborted (the others' collectives fail at once) and :class:`RankFailed` names the first rank that failed
    of its own accord (not merely because the cluster was aborted). Ranks still running after ``timeout``
    seconds are aborted too, and named in a ``TimeoutError``. Pass ``cluster`` to choose its settings (e.g.
    ``keep_records``); it must have ``num_nodes × local_size`` ranks."""
    cluster = cluster or thread_cluster(num_nodes, local_size, timeout=timeout)
    if len(cluster) != num_nodes * local_size:
        raise ValueError(f"the cluster has {len(cluster)} ranks, not {num_nodes} × {local_size}")
    results: List[object] = [None] * len(cluster)
    failures: List[tuple] = []   # (rank, exception) in the order they happened

    def body(rank: int) -> None:
        try:
            results[rank] = fn(cluster[rank])
        except BaseException as exc:   # noqa: BLE001 - handed to the main thread
            failures.append((rank, exc))
            cluster.abort(f"rank {rank} failed ({type(exc).__name__})")

    threads = [threading.Thread(target=body, args=(r,), name=f"rank {r}", daemon=True) for r in range(len(cluster))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:   # a rank outside any collective (in a loop of its own): abort the rest and give up on it
        cluster.abort(f"ranks {stuck} ran past {timeout:g} s")
        for t in threads:
            t.join(5.0)
    own = [f for f in failures if not isinstance(f[1], ClusterAborted)]   # the others only saw the abort
    if own or (failures and not stuck):
        rank, exc = (own or failures)[0]
        raise RankFailed(rank, exc) from exc
    if stuck:
        raise TimeoutError(f"ranks {stuck} of {num_nodes}×{local_size} still running after {timeout:g} s")
    return results
