"""The methods PruneX is compared with, in one harness (same model, data, sampler and byte counters):
``dense`` (Horovod's DistributedOptimizer), ``topk`` (Top-K with error feedback), ``prunex-flat`` (flat
consensus ADMM, the paper's "PruneX (AR)") and ``pactrain`` (prune, then compact allreduce). Pick one with
``prunex-hvd train --method``; see :mod:`prunex_hvd.app.methods`."""
