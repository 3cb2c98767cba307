"""H-SADMM on 4 ranks as 2 nodes × 2 under real launchers, against the single-process reference.

The worker compares every rank's u, z_i, v, z, ρ, masks and BN buffers with `reference.reference_round`
after each round (different data per rank, adaptive ρ, a frozen round at the end). Here we check what it
reports: the checks ran, the model is identical everywhere and at the requested density after finalize(),
and the leaders' inter-node payload equals the compact sizes exactly while non-leaders send nothing across.
The same checks (tests/engine_cases.py) run on other layouts and cases (coupled pairs, residual streams), in
one process, in test_engine_threads.py; a launch is kept per launcher and transport for what only it shows.

The cases of one launcher and layout share a job (tests/shared_launches.py): each test checks its own case."""
import json

import pytest
import torch

import engine_cases as cases
from engine_cases import (CHANNEL, LOCAL_STEPS, MIXED, MIXED_SPARSITY, PAIR, RESIDUAL, RESIDUAL_PAIR, ROUNDS,
                          STREAM, check_results)
from launching import mpirun, needs_horovod, needs_mpirun, python_cmd, run, torchrun, worker_results
from shared_launches import register

pytestmark = pytest.mark.launch
MIXED_ARG = json.dumps(MIXED_SPARSITY)
OVERLAPPED = ["--node-sync", "--payload-dtype", "bf16"]
HEADS_AND_NEURONS = ["--sparsity", "head:0.5+neuron:0.5", "--coupled"]
AMP = ["--backend", "mpi", "--amp-inf", "1:4,2:7"]


def engine(group, name, *args):
    return register(group, f"engine-{name}", "engine_worker", *args)


# mpirun, 4 ranks as 2 nodes × 2
MPIRUN = {name: engine("mpirun-2x2", name, *args) for name, args in {
    "mpi": ["--backend", "mpi"],
    "node-sync": ["--backend", "mpi", "--node-sync"],
    "mpi-mha-fp32": ["--backend", "mpi", "--model", "mha", *HEADS_AND_NEURONS],
    "half-bf16": ["--backend", "mpi", "--payload-dtype", "bf16"],
    "half-fp16": ["--backend", "mpi", "--payload-dtype", "fp16"],
    "overlapped-mpi": ["--backend", "mpi", "--overlap", *OVERLAPPED, "--freeze-round", "0"],
    "overlapped-mpi-after-freeze": ["--backend", "mpi", "--overlap", "1", *OVERLAPPED, "--freeze-round", "3"],
    "amp-scaler.step": AMP,
    "amp-node-sync": [*AMP, "--node-sync"],
    "amp-node-sync-horovod-pattern": [*AMP, "--node-sync", "--amp-pattern", "horovod"],
    "amp-node-sync-unscale-first": [*AMP, "--node-sync", "--amp-pattern", "unscale-first"],
    "gloo-composite-specs": ["--backend", "gloo", "--sparsity", MIXED_ARG],
    "gloo-vit-bf16": ["--backend", "gloo", "--model", "vit", *HEADS_AND_NEURONS, "--payload-dtype", "bf16"],
    "overlapped-gloo-2-steps": ["--backend", "gloo", "--overlap", "2", *OVERLAPPED, "--freeze-round", "0"],
}.items()}
# 8 ranks as 2 racks × 2 nodes × 2
THREE_TIERS = {"mpi": ["--backend", "mpi", "--payload-dtype", "bf16"],
               "gloo": ["--backend", "gloo", "--node-sync", "--coupled"]}
for _backend, _args in THREE_TIERS.items():
    engine("mpirun-racks", f"three-tiers-{_backend}", *_args)


def results_of(launched, case, ranks=4):
    proc, out = launched
    return worker_results(proc, out, "engine", ranks=ranks, case=case)


def check(launched, case, specs, mask_itemsize=1, couplings=None, streams=(), payload_bytes=4,
          freeze_round=cases.SETTINGS["freeze_round"]):
    check_results(results_of(launched, case), specs, mask_itemsize, couplings, streams, payload_bytes,
                  freeze_round=freeze_round)


@pytest.fixture
def mpirun_cases(shared_launch):
    return shared_launch("mpirun-2x2")


@needs_mpirun
def test_engine_mpirun_mpi(mpirun_cases):
    check(mpirun_cases, MPIRUN["mpi"], CHANNEL)


@needs_mpirun
def test_engine_mpirun_gloo_composite_specs(mpirun_cases):
    check(mpirun_cases, MPIRUN["gloo-composite-specs"], MIXED)


@needs_mpirun
def test_engine_mpirun_node_sync(mpirun_cases):
    """node_sync under a real launch: the ranks of each node hold one θ before every round (the worker checks),
    the rounds still match the reference, and nothing more crosses nodes (check_results' byte counts)."""
    check(mpirun_cases, MPIRUN["node-sync"], CHANNEL)


@needs_mpirun
@pytest.mark.parametrize("backend,model,payload", [("gloo", "vit", "bf16"), ("mpi", "mha", "fp32")])
def test_engine_mpirun_attention_heads_and_mlp_neurons(mpirun_cases, backend, model, payload):
    """Beyond convs under a real launch: a ViT block (separate q/k/v) and nn.MultiheadAttention (packed), half
    the heads and half of each MLP's hidden units (coupled), every round against the reference."""
    specs, pairs = (cases.VIT_COUPLED, cases.VIT_PAIR) if model == "vit" else (cases.MHA_COUPLED, cases.MHA_PAIR)
    check(mpirun_cases, MPIRUN[f"{backend}-{model}-{payload}"], specs, couplings=pairs,
          payload_bytes=2 if payload != "fp32" else 4)


@needs_mpirun
@pytest.mark.parametrize("payload", ["bf16", "fp16"])
def test_engine_mpirun_half_payload(mpirun_cases, payload):
    """A 2-byte payload across nodes under MPI (which has no half-precision types: our own reduction ops): the
    rounds match the reference of the rounded change with error feedback (the worker checks), and the leaders'
    consensus bytes are exactly half of float32's."""
    check(mpirun_cases, MPIRUN[f"half-{payload}"], CHANNEL, payload_bytes=2)


@needs_mpirun
@pytest.mark.parametrize("case,freeze_round", [("overlapped-mpi", 0), ("overlapped-gloo-2-steps", 0),
                                               ("overlapped-mpi-after-freeze", 3)],
                         ids=["mpi", "gloo-2-steps", "mpi-after-freeze"])
def test_engine_mpirun_overlapped(mpirun_cases, case, freeze_round):
    """overlap under mpirun: the leaders' exchange runs on MPI's comm thread (mpi) or Gloo's own async op
    while the ranks step, with node_sync's per-step allreduces on the node group meanwhile; every round, once
    folded in (at the next round; with Gloo after 2 of its steps), matches the reference, and the flight's
    steps the delayed math (the worker checks). Rounds overlap once the masks are frozen: from the first with
    masks chosen at the start (freeze_round=0); with freeze_round=3 rounds 1-3 block and round 4 is in flight."""
    check(mpirun_cases, MPIRUN[case], CHANNEL, payload_bytes=2, freeze_round=freeze_round)


SCALE = 65536.0   # GradScaler's initial scale; an inf halves it on the scaler that saw it


@needs_mpirun
@pytest.mark.parametrize("skipped, halved", [
    ({1: {4}, 2: {7}}, {1: 1, 2: 1}),
    # node_sync: the inf reaches the node's mean, so its node skips together; only rank 1's scaler saw it
    ({0: {4}, 1: {4}, 2: {7}, 3: {7}}, {1: 1, 2: 1}),
    # Horovod's pattern: synchronize() averages first, so both scalers of the node see the inf
    ({0: {4}, 1: {4}, 2: {7}, 3: {7}}, dict.fromkeys(range(4), 1)),
    # unscale_ before synchronize(): each scaler judged its own gradients, the node's mean still decides
    ({0: {4}, 1: {4}, 2: {7}, 3: {7}}, {1: 1, 2: 1}),
], ids=["scaler.step", "node-sync", "node-sync-horovod-pattern", "node-sync-unscale-first"])
def test_amp_inf_on_one_rank_skips_its_step_and_the_rounds_stay_aligned(mpirun_cases, request, skipped, halved):
    """CPU autocast (bf16) with a GradScaler; rank 1 finds an inf at step 4 and rank 2 at step 7. Each skips that
    step but counts it, so every round lines up; the worker checks every round against the reference.
    ``halved``: how often each rank's scaler halved its scale."""
    results = results_of(mpirun_cases, MPIRUN["amp-" + request.node.callspec.id])
    check_results(results, CHANNEL)
    for r in results:
        assert r["moved"] == [j not in skipped.get(r["rank"], ()) for j in range(ROUNDS * LOCAL_STEPS)], r["rank"]
        assert r["scale"] == SCALE / 2 ** halved.get(r["rank"], 0), r["rank"]


HOROVODRUN = engine("horovodrun-2x2", "recipe-exchange", "--backend", "horovod", "--overlap", "--freeze-round", "0",
                    "--node-sync", "--payload-dtype", "bf16")


@needs_horovod
def test_engine_horovodrun_overlapped_bf16_payload(shared_launch):
    """The recipe's exchange on the horovod backend under horovodrun: overlapped (the masks chosen at the start,
    every round in flight on Horovod's own async allreduce) with a bf16 payload, which Horovod does not reduce:
    it travels widened to float32 (and is counted so), node broadcasts carry its bits as int16, masks travel as
    int32. Every round, once folded in, matches the reference of the rounded change; the horovod backend's
    blocking collectives carry the masks, the residuals and the guard."""
    check_results(results_of(shared_launch("horovodrun-2x2"), HOROVODRUN), CHANNEL, mask_itemsize=4,
                  payload_bytes=4, freeze_round=0)


@needs_mpirun
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_engine_mpirun_three_tiers(shared_launch, backend):
    """2 racks × 2 nodes × 2 ranks: every rank's u, z_i, v, w_r, t_r, z and ρ's (and a bf16 payload's rounding
    errors at both levels) against the three-tier reference each round (the worker checks), and every tier's
    bytes exactly (check_results: the spine alone crosses racks)."""
    extra = THREE_TIERS[backend]
    check_results(results_of(shared_launch("mpirun-racks"), f"engine-three-tiers-{backend}", ranks=8), CHANNEL,
                  couplings=PAIR if "--coupled" in extra else None, payload_bytes=2 if "bf16" in extra else 4)


def check_one(proc, tmp_path, specs, **kw):
    """The checks of one case run alone (the GPU tests: one launch each)."""
    check_results(worker_results(proc, tmp_path, "engine"), specs, **kw)


@needs_mpirun
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
def test_engine_nccl(tmp_path):
    if torch.cuda.device_count() >= 4:
        proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "nccl", "--device", "cuda",
                                        "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
        check_one(proc, tmp_path, CHANNEL)
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
    args += {False: [], True: ["--coupled"],
             "streams": ["--model", "residual", "--coupled", "streams"]}[coupled]
    proc = run(mpirun(4, python_cmd("engine_worker.py", *args), ["PRUNEX_RANKS_PER_NODE=2"]))
    if coupled == "streams":
        check_one(proc, tmp_path, RESIDUAL, couplings=RESIDUAL_PAIR, streams=STREAM)
    else:
        check_one(proc, tmp_path, specs, couplings=PAIR if coupled else None)


# NCCL refuses two ranks on one GPU of one host; a host id of its own per rank makes each rank a "host" of its
# own, so one GPU carries an emulated 2 × 2 over NCCL's socket transport (the PRUNEX_RANKS_PER_NODE grouping)
FAKE_HOSTS = ["bash", "-c", 'NCCL_HOSTID=prunex-rank$RANK exec "$@"', "fake-host"]
NCCL_ON_ONE_GPU = {"PRUNEX_RANKS_PER_NODE": "2", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
                   "NCCL_SHM_DISABLE": "1"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_engine_overlapped_cuda(tmp_path, backend):
    """overlap=True on CUDA tensors, 2 emulated nodes × 2 under torchrun: NCCL's async allreduce on its own
    stream (the fold orders the compute stream after it), or Gloo's on CUDA tensors; every round (the masks
    chosen at the start), once folded in, matches the reference, and the flight's steps the delayed math."""
    cmd = FAKE_HOSTS + python_cmd("engine_worker.py", "--backend", backend, "--device", "cuda", "--overlap",
                                  "--freeze-round", "0", "--node-sync", "--payload-dtype", "bf16",
                                  "--out", str(tmp_path))
    proc = run(torchrun(4, cmd), env=NCCL_ON_ONE_GPU, timeout=600)
    check_one(proc, tmp_path, CHANNEL, payload_bytes=2, freeze_round=0)
