"""The narrow inter-node payload's pieces that need no cluster: MPI's half-precision reduction arithmetic
against torch's, the knob's validation, and the error-feedback state in state_dict (the rounds themselves are
checked against the reference in test_engine_threads.py and, under mpirun, test_engine_launch.py)."""
import numpy as np
import pytest
import torch

from prunex_hvd.dist.comm import mpi
from prunex_hvd.engine.config import ConsensusConfig


def _values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-30, 30, 20000).float()
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.4e38, 65504.0,
                             65520.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11])   # ties
    return torch.cat([x, specials, -specials])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mpi_half_words_round_and_add_as_torch_does(dtype):
    """What the MPI reduction op does to two 2-byte words: widen, add in float32, round to nearest even once:
    bit for bit what torch does to two half tensors (the thread backend's and the reference's arithmetic)."""
    x = _values()
    words = mpi._from_float32(x.numpy(), dtype)
    want = x.to(dtype)
    nan = want.isnan().numpy()
    assert np.array_equal(words[~nan], want.view(torch.int16).numpy()[~nan])
    assert np.isnan(mpi._to_float32(words, dtype)[nan]).all()   # NaN stays NaN, never rounds to inf
    a, b = x.to(dtype), x.flip(0).to(dtype)
    added = mpi._from_float32(mpi._to_float32(a.view(torch.int16).numpy(), dtype)
                              + mpi._to_float32(b.view(torch.int16).numpy(), dtype), dtype)
    s = a + b
    ok = ~s.isnan().numpy()
    assert np.array_equal(added[ok], s.view(torch.int16).numpy()[ok])


def test_payload_dtype_is_validated():
    assert ConsensusConfig(payload_dtype="fp16").payload_dtype == "fp16"
    with pytest.raises(ValueError, match="payload_dtype must be None, 'fp32', 'bf16' or 'fp16'"):
        ConsensusConfig(payload_dtype="int8")
    # one flat consensus has no inter-node exchange to narrow
    with pytest.raises(ValueError, match="hierarchical=False is one flat consensus over the world, with no node tier "
                                         "for payload_dtype='bf16' to act on: turn it off"):
        ConsensusConfig.paper(payload_dtype="bf16", hierarchical=False)
