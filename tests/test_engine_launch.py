"""H-SADMM on 4 ranks as 2 nodes × 2 under real launchers, against the single-process reference.

The worker compares every rank's u, z_i, v, z, ρ, masks and BN buffers with `reference.reference_round`
after each round (different data per rank, adaptive ρ, a frozen round at the end). Here we check what it
reports: the checks ran, the model is identical everywhere and at the requested density after finalize(),
and the leaders' inter-node payload equals the compact sizes exactly while non-leaders send nothing across."""
import json
import math

import pytest
import torch

from launching import horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run, worker_results

pytestmark = pytest.mark.launch
ROUNDS = 4


def keep(k, n):
    return max(1, min(n, math.ceil(k * n - 1e-9)))


def check(proc, tmp_path, specs, mask_itemsize=1, couplings=None, streams=()):
    results = worker_results(proc, tmp_path, "engine")
    assert results[0]["couplings"] == (couplings or {})
    assert results[0]["streams"] == [list(map(list, s)) for s in streams]
    ref_rounds = results[0]["ref_rounds"]
    assert results[0]["checks"] == 4 * ROUNDS and len(ref_rounds) == ROUNDS
    assert [r["frozen_before"] for r in ref_rounds] == [False, False, False, True]  # freeze_round=3
    shapes, numels = results[0]["shapes"], results[0]["numels"]
    dense_numel = sum(n for name, n in numels.items() if name not in specs) + results[0]["buffer_numel"]
    mask_bytes = sum(shapes[n][0] + shapes[n][1] * shapes[n][2] * shapes[n][3] for n in specs) * mask_itemsize
    consensus = 4 * sum(dense_numel + sum(r * c for r, c in rr["compact"].values()) for rr in ref_rounds)
    unfrozen = sum(not rr["frozen_before"] for rr in ref_rounds)
    # per-layer residual sums (float64) + each rank's round, step count, inf/NaN flag + per-layer inf/NaN flags
    residuals = ROUNDS * (len(numels) * 3 + 4 * 3 + len(numels) + 1) * 8
    for res in results:
        rank, leader = res["rank"], res["topology"]["is_leader"]
        inter = res["ledger"]["inter"]
        if leader:
            by_op = {op: v["payload_bytes"] for op, v in inter["by_op"].items()}
            assert by_op == {"allreduce[consensus]": consensus, "bor[masks]": unfrozen * mask_bytes,
                             "allreduce[residuals]": residuals}, f"rank {rank}"
            assert inter["cross_node_bytes"] == inter["payload_bytes"]   # two nodes: all of it crosses once
            assert res["stats"]["inter_bytes"] == inter["payload_bytes"]
            assert res["stats"]["inter_consensus_bytes"] == consensus
            assert res["stats"]["dense_inter_bytes"] == ROUNDS * 4 * (sum(numels.values()) + res["buffer_numel"])
        else:
            assert inter["ops"] == 0 and res["stats"]["inter_bytes"] == 0, f"non-leader {rank} sent inter-node"
        assert res["ledger"]["total"]["cross_node_bytes"] == (inter["payload_bytes"] if leader else 0)
        assert res["ledger"]["world"]["ops"] == 0
        # after finalize(): exactly the requested structure
        for name, spec in specs.items():
            c_out, c_in, kh, kw = shapes[name]
            rows, channels, cols = res["final_support"][name]
            parts = dict(p.split(":") for p in spec.split("+"))
            want_rows = keep(float(parts["filter"]), c_out) if "filter" in parts else c_out
            consumer = {p: c for c, p in (couplings or {}).items()}.get(name)
            if consumer:   # coupled producer: one filter per channel its consumer kept
                want_rows = keep(float(specs[consumer].split(":")[1]), c_out)
            stream = next((s for s in streams if name in s[1]), None)
            if stream:     # a stream writer: one filter per channel the stream's readers kept
                want_rows = keep(float(specs[stream[0][0]].split(":")[1]), c_out)
            assert rows == want_rows, (name, rows)
            if "channel" in parts:
                assert channels == keep(float(parts["channel"]), c_in), (name, channels)
            if "shape" in parts:
                assert cols == keep(float(parts["shape"]), c_in * kh * kw), (name, cols)
        # after finalize(): every channel of a stream is read and written by all of its convs, or by none
        for s, live in zip(streams, res["stream_live"]):
            assert len(live) == len(s[0]) + len(s[1]) and all(m == live[0] for m in live), (s, live)
            assert len(live[0]) == keep(float(specs[s[0][0]].split(":")[1]), shapes[s[0][0]][1])
    # every rank reports the same final density
    assert len({json.dumps(r["stats"]["layer_density"], sort_keys=True) for r in results}) == 1


CHANNEL = {"0.weight": "channel:0.5", "3.weight": "channel:0.5"}
MIXED_ARG = json.dumps({"3.*": "filter:0.5+channel:0.5", "0.weight": "shape:0.5"})
MIXED = {"3.weight": "filter:0.5+channel:0.5", "0.weight": "shape:0.5"}


@needs_mpirun
def test_engine_mpirun_mpi(tmp_path):
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, CHANNEL)


@needs_mpirun
def test_engine_mpirun_gloo_composite_specs(tmp_path):
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "gloo", "--sparsity", MIXED_ARG,
                                    "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, MIXED)


@needs_mpirun
def test_engine_mpirun_coupled_channels(tmp_path):
    """coupled=True: conv 3's input channels and conv 0's filters are pruned as one group, every round
    checked against the reference's plain joint ranking; conv 0 ends with half its filters."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--coupled", "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, CHANNEL, couplings={"3.weight": "0.weight"})


RESIDUAL = {f"{n}.weight": "channel:0.5" for n in ("stem", "a", "b", "c", "d")}
STREAM = [(("a.weight", "c.weight", "d.weight"), ("b.weight", "stem.weight"))]


@needs_mpirun
def test_engine_mpirun_coupled_streams(tmp_path):
    """coupled="streams": the residual stream's readers (a, c, shortcut d) and writers (stem, b) share one
    channel set, and the pair a -> b ranks given it; every round checked against the reference's plain joint
    ranking, and after finalize() every stream channel is live in all five convs or in none."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--model", "residual",
                                    "--coupled-streams", "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, RESIDUAL, couplings={"b.weight": "a.weight"}, streams=STREAM)


@needs_horovod
def test_engine_horovodrun_horovod(tmp_path):
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2",
                          python_cmd("engine_worker.py", "--backend", "horovod", "--out", str(tmp_path))))
    check(proc, tmp_path, CHANNEL, mask_itemsize=4)   # Horovod ORs masks as int32


@needs_mpirun
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
def test_engine_nccl(tmp_path):
    if torch.cuda.device_count() >= 4:
        proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "nccl", "--device", "cuda",
                                        "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
        check(proc, tmp_path, CHANNEL)
    else:   # one GPU: the same round on CUDA tensors with the nccl groups of a single rank
        proc = run(mpirun(1, python_cmd("engine_worker.py", "--backend", "nccl", "--device", "cuda",
                                        "--out", str(tmp_path))))
        assert proc.returncode == 0 and "] ok checks=" in proc.stdout, proc.stdout[-6000:]


@needs_mpirun
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sparsity,specs,coupled", [(None, CHANNEL, False), (MIXED_ARG, MIXED, False),
                                                    (None, CHANNEL, True), (None, None, "streams")],
                         ids=["channel", "mixed", "coupled", "streams"])
def test_engine_cuda_tensors_on_2x2(tmp_path, sparsity, specs, coupled):
    """The round on CUDA tensors (one gather per layer and direction for every structure, single-element plans
    included) on 2 emulated nodes × 2, every round checked against the reference. Gloo stages the tensors
    through the host so that four ranks can share one GPU, which NCCL refuses."""
    args = ["--backend", "gloo", "--device", "cuda", "--out", str(tmp_path)]
    args += ["--sparsity", sparsity] if sparsity else []
    args += {False: [], True: ["--coupled"], "streams": ["--model", "residual", "--coupled-streams"]}[coupled]
    proc = run(mpirun(4, python_cmd("engine_worker.py", *args), ["PRUNEX_RANKS_PER_NODE=2"]))
    if coupled == "streams":
        check(proc, tmp_path, RESIDUAL, couplings={"b.weight": "a.weight"}, streams=STREAM)
    else:
        check(proc, tmp_path, specs, couplings={"3.weight": "0.weight"} if coupled else None)
