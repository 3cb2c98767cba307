"""The consensus engine: one H-SADMM round (:mod:`.hsadmm`, Algorithm 1 as docs/algorithm.md writes it) and the
pure math it is made of, none of which communicates: the ADMM updates (:mod:`.admm`), structured sparsity
(:mod:`.sparsity`: specs, projection, packing with the native kernel), flat buffers (:mod:`.buckets`) and which
convs prune together (:mod:`.dependencies`). The round's transport is handed in as groups (:mod:`prunex_hvd.dist`).
"""
