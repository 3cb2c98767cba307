"""The consensus engine: one H-SADMM round (:mod:`.hsadmm`, Algorithm 1 as docs/algorithm.md writes it, each phase a
call into one component) and what it is made of.

The round's components: the per-layer state (:mod:`.state`), every collective (:mod:`.exchange`, :mod:`.racks`),
the payload's coding (:mod:`.codec`), the masks (:mod:`.masks`), the checks that refuse a round (:mod:`.verdict`),
adaptive ρ (:mod:`.rho`), the per-step hooks (:mod:`.steps`), the overlapped round (:mod:`.overlap`) and the bytes
(:mod:`.report`). The pure math, none of which communicates: the ADMM updates (:mod:`.admm`), structured sparsity
(:mod:`.sparsity`: specs, projection, packing with the native kernel), flat buffers (:mod:`.buckets`), which convs
prune together (:mod:`.dependencies`) and layers computing on their kept block (:mod:`.compact_compute`). The
knobs: :mod:`.config`. The transport is handed in as groups (:mod:`prunex_hvd.dist`).
"""
