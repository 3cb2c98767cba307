"""H-SADMM on 4 ranks as 2 nodes × 2 under real launchers, against the single-process reference.

The worker compares every rank's u, z_i, v, z, ρ, masks and BN buffers with `reference.reference_round`
after each round (different data per rank, adaptive ρ, a frozen round at the end). Here we check what it
reports: the checks ran, the model is identical everywhere and at the requested density after finalize(),
and the leaders' inter-node payload equals the compact sizes exactly while non-leaders send nothing across.
The same checks (tests/engine_cases.py) run on other layouts and cases (coupled pairs, residual streams), in
one process, in test_engine_threads.py; a launch is kept per launcher and transport for what only it shows."""
import json

import pytest
import torch

import engine_cases as cases
from engine_cases import CHANNEL, MIXED, MIXED_SPARSITY, PAIR, RESIDUAL, RESIDUAL_PAIR, STREAM, check_results
from launching import horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run, torchrun, worker_results

pytestmark = pytest.mark.launch
MIXED_ARG = json.dumps(MIXED_SPARSITY)


def check(proc, tmp_path, specs, mask_itemsize=1, couplings=None, streams=(), payload_bytes=4,
          freeze_round=cases.SETTINGS["freeze_round"]):
    check_results(worker_results(proc, tmp_path, "engine"), specs, mask_itemsize, couplings, streams, payload_bytes,
                  freeze_round=freeze_round)


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
def test_engine_mpirun_node_sync(tmp_path):
    """node_sync under a real launch: the ranks of each node hold one θ before every round (the worker checks),
    the rounds still match the reference, and nothing more crosses nodes (check_results' byte counts)."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--node-sync", "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, CHANNEL)


@needs_mpirun
@pytest.mark.parametrize("backend,model,payload", [("gloo", "vit", "bf16"), ("mpi", "mha", "fp32")])
def test_engine_mpirun_attention_heads_and_mlp_neurons(tmp_path, backend, model, payload):
    """Beyond convs under a real launch: a ViT block (separate q/k/v) and nn.MultiheadAttention (packed), half
    the heads and half of each MLP's hidden units (coupled), every round against the reference."""
    extra = ["--payload-dtype", payload] if payload != "fp32" else []
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", backend, "--model", model, "--sparsity",
                                    "head:0.5+neuron:0.5", "--coupled", *extra, "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]))
    specs, pairs = (cases.VIT_COUPLED, cases.VIT_PAIR) if model == "vit" else (cases.MHA_COUPLED, cases.MHA_PAIR)
    check(proc, tmp_path, specs, couplings=pairs, payload_bytes=2 if payload != "fp32" else 4)


@needs_mpirun
@pytest.mark.parametrize("payload", ["bf16", "fp16"])
def test_engine_mpirun_half_payload(tmp_path, payload):
    """A 2-byte payload across nodes under MPI (which has no half-precision types: our own reduction ops): the
    rounds match the reference of the rounded change with error feedback (the worker checks), and the leaders'
    consensus bytes are exactly half of float32's."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--payload-dtype", payload,
                                    "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, CHANNEL, payload_bytes=2)


@needs_mpirun
@pytest.mark.parametrize("backend,fold,freeze_round", [("mpi", [], 0), ("gloo", ["2"], 0), ("mpi", ["1"], 3)],
                         ids=["mpi", "gloo-2-steps", "mpi-after-freeze"])
def test_engine_mpirun_overlapped(tmp_path, backend, fold, freeze_round):
    """overlap under mpirun: the leaders' exchange runs on MPI's comm thread (mpi) or Gloo's own async op
    while the ranks step, with node_sync's per-step allreduces on the node group meanwhile; every round, once
    folded in (at the next round; with Gloo after 2 of its steps), matches the reference, and the flight's
    steps the delayed math (the worker checks). Rounds overlap once the masks are frozen: from the first with
    masks chosen at the start (freeze_round=0); with freeze_round=3 rounds 1-3 block and round 4 is in flight."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", backend, "--overlap", *fold, "--node-sync",
                                    "--payload-dtype", "bf16", "--freeze-round", str(freeze_round),
                                    "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
    check(proc, tmp_path, CHANNEL, payload_bytes=2, freeze_round=freeze_round)


@needs_horovod
def test_engine_horovodrun_overlapped(tmp_path):
    """overlap=True under horovodrun: the leaders' exchange is Horovod's own async allreduce (every round, the
    masks chosen at the start)."""
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2",
                          python_cmd("engine_worker.py", "--backend", "horovod", "--overlap", "--freeze-round", "0",
                                     "--out", str(tmp_path))))
    check(proc, tmp_path, CHANNEL, mask_itemsize=4, freeze_round=0)


@needs_horovod
def test_engine_horovodrun_horovod(tmp_path):
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2",
                          python_cmd("engine_worker.py", "--backend", "horovod", "--out", str(tmp_path))))
    check(proc, tmp_path, CHANNEL, mask_itemsize=4)   # Horovod ORs masks as int32


@needs_horovod
def test_engine_horovodrun_bf16_payload(tmp_path):
    """Horovod reduces no bfloat16: the payload travels widened to float32 (and is counted so), node
    broadcasts carry its bits as int16; the rounds still match the reference of the rounded change."""
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2",
                          python_cmd("engine_worker.py", "--backend", "horovod", "--payload-dtype", "bf16",
                                     "--out", str(tmp_path))))
    check(proc, tmp_path, CHANNEL, mask_itemsize=4, payload_bytes=4)


RACK_ENV = ["PRUNEX_RANKS_PER_NODE=2", "PRUNEX_NODES_PER_RACK=2"]


@needs_mpirun
@pytest.mark.parametrize("backend,extra", [("mpi", ["--payload-dtype", "bf16"]), ("gloo", ["--node-sync", "--coupled"])])
def test_engine_mpirun_three_tiers(tmp_path, backend, extra):
    """2 racks × 2 nodes × 2 ranks: every rank's u, z_i, v, w_r, t_r, z and ρ's (and a bf16 payload's rounding
    errors at both levels) against the three-tier reference each round (the worker checks), and every tier's
    bytes exactly (check_results: the spine alone crosses racks)."""
    proc = run(mpirun(8, python_cmd("engine_worker.py", "--backend", backend, *extra, "--out", str(tmp_path)),
                      RACK_ENV), timeout=300)
    check_results(worker_results(proc, tmp_path, "engine", ranks=8), CHANNEL,
                  couplings=PAIR if "--coupled" in extra else None, payload_bytes=2 if "bf16" in extra else 4)


@needs_horovod
def test_engine_horovodrun_three_tiers(tmp_path):
    proc = run(horovodrun(8, "localhost:4,127.0.0.1:4",
                          python_cmd("engine_worker.py", "--backend", "horovod", "--out", str(tmp_path))),
               env=dict(e.split("=") for e in RACK_ENV), timeout=300)
    check_results(worker_results(proc, tmp_path, "engine", ranks=8), CHANNEL, mask_itemsize=4)


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
    args += {False: [], True: ["--coupled"],
             "streams": ["--model", "residual", "--coupled", "streams"]}[coupled]
    proc = run(mpirun(4, python_cmd("engine_worker.py", *args), ["PRUNEX_RANKS_PER_NODE=2"]))
    if coupled == "streams":
        check(proc, tmp_path, RESIDUAL, couplings=RESIDUAL_PAIR, streams=STREAM)
    else:
        check(proc, tmp_path, specs, couplings=PAIR if coupled else None)


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
    check(proc, tmp_path, CHANNEL, payload_bytes=2, freeze_round=0)
