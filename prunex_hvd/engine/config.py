"""The consensus's knobs in one frozen object (:class:`ConsensusConfig`), and what they resolve to on a model
(:class:`Structure`). Each knob is spelled once, here: the wrapper's keyword arguments, the cross-rank
agreement, the engine, the training config and the command line's flags all read these fields.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Dict, List, NamedTuple, Optional, Union

import torch

from ..dist.comm import check_backend_name
from . import dependencies
from .sparsity import DENSE, StructureSpec, check_layer_types, resolve_specs, stream_keep

COUPLING_MODES = (False, True, "pairs", "streams")
PAYLOAD_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESTARTS = ("none", "node", "global")
ACCELERATIONS = ("none", "fast-admm", "nesterov")
RETRAINS = ("admm", "average")
CHANNEL_BUDGETS = ("layer", "global")


def _knob(default, help: str, agree: Optional[str] = None):
    """A field with its one-line help (the command line's too); ``agree`` names the group a disagreement across
    ranks is reported under (default: the knob's own name)."""
    return field(default=default, metadata={"help": help, "agree": agree})


@dataclass(frozen=True)
class ConsensusConfig:
    """Every knob of the H-SADMM consensus, validated when it is made. The tuning guide (what each knob does to
    speed and accuracy). Its accuracies before 2026-11-29 score the consensus model with the BatchNorm statistics
    its round averaged; ``prunex-hvd train`` now measures them again for the consensus weights
    (``--bn-recalibrate``, :func:`prunex_hvd.recalibrate_batchnorm`), which raises every method's early epochs
    (benchmarks/README, "The consensus model's BatchNorm statistics"):

    * ``local_steps`` — wrapped steps between consensus rounds. Communication happens only in rounds, so
      traffic falls as 1/local_steps; too many steps let ranks drift apart (higher primal residual, slower
      agreement). The paper uses 5–10 local epochs per round on CIFAR; start with one epoch per round. Shorter
      rounds buy the first epochs with bytes: on ResNet-18 (digits at 8×8, the recipe) rounds of 2 steps instead
      of 11 gave +7.2 / +13.9 points at epochs 1 / 2 but −2.6 to −4.7 at epochs 3–6, level at the end, for 5.5×
      the bytes (4 seeds), and at 100 Mbit/s reached 0.80 in 1.64× the time (3 seeds; a round waits on its
      exchange whatever its length; benchmarks/README, "Where PacTrain's first epochs come from").
    * ``sync_rounds`` — post-local SGD (Lin et al. 2020; PyTorch's ``post_localSGD_hook``): the first N rounds
      average the gradients over the world every step, as Horovod does, with no proximal term; each such round
      only takes the ranks' one θ as the consensus, and ADMM starts from it at round N + 1 (docs/algorithm.md, "A
      synchronous start"). The rivals take the same phase from the same knob. It buys the first epochs with bytes:
      a gradient allreduce a step instead of one exchange a round, the compact one with the masks frozen. 0 (the
      default, and the CLI's). Measured over the two-epoch lr warm-up, paired by seed (benchmarks/README, "A
      synchronous start"): ResNet-18 on digits at 8×8 (4 rounds) +5.7 / +10.5 points at epochs 1 / 2, 70% after
      1.4 epochs against 2.25, +0.49 at epoch 16 (4 seeds), level with PacTrain from epoch 2 (3.75 below it at
      epoch 1, 9.44 without: the structure, PacTrain given PruneX's channels being 3.1 / 7.5 below its own at
      epochs 1 / 2 and level with PruneX's phase at epoch 1; masks chosen after the phase's first round instead
      of at the start did worse, −2.0 / −2.3); digits (2 rounds) −1.3 / +4.2 at epochs 1 / 2, within 0.9 after
      (8), while local SGD given the same phase gains more (+3.3 / +11.4). The inter-node bytes are 3.6× the run's
      (ResNet-18) and 4.5× (digits); on the emulated cluster at 100 Mbit/s 0.80 took 5.7× as long with it (one
      epoch of it: 3.3×; 3 seeds), reached little or no sooner in epochs. On slow links leave it off; on fast
      ones, where the bytes are cheap, it is the way to PacTrain's first epochs.
    * ``sync_powersgd_rank`` — with ``sync_rounds``: the phase's gradient crosses nodes as PowerSGD's P and Q at
      this rank, with error feedback (Vogels et al. 2019; docs/algorithm.md, "The phase at low rank"); a tensor
      the rank would not shrink twofold travels whole. 0 (the default): the whole gradient. The rank decides it:
      too low costs more than the phase buys. Measured (benchmarks/README, "The synchronous phase at low rank";
      paired with the recipe): ResNet-18 on digits at 8×8, 4 seeds, rank 32 (6.4× fewer bytes a step) +5.1 / +5.6
      points at epochs 1 / 2, within 1.5 of the whole phase at epochs 1 and 3 (−4.9 at 2), 1.3× the recipe's bytes a run
      against the whole phase's 3.6×, but at 100 Mbit/s 1.58× the recipe's time to 0.80 (3 seeds); rank 16 −4.9 /
      +4.9 at epochs 1 / 2 and 1.10× the time; rank 4 −8.1 / −13.0. digits (8 seeds) rank 8 −2.1 / +2.5 at epochs
      1 / 2, rank 4 −2.4 / +0.2; synthetic (4) rank 8 −1.7 / +1.4 at epochs 2 / 3, the same epochs to every
      target. Off; for a link where the whole phase is too dear and a sixth of the gradient a step is not.
    * the wrapped optimizer's ``lr`` (not a knob here) — between rounds each rank steps on its own batch, as in
      local SGD: the lr that works for local SGD works here (the accuracy-per-epoch measurements use one lr,
      0.05, for every method). Without ``restart`` (the paper's round) a lower lr helped: with ResNet-18, 2×2
      ranks and batch 16, lr 0.05 reached 0.80 test accuracy after 15.5 epochs, lr 0.0125 after 11. Warm it up
      linearly over the first two epochs (at most an eighth of the run; ``prunex-hvd train`` does for PruneX:
      ``--warmup-epochs auto``): at full lr from a random start each node's first rounds run apart on a node's
      batch, which diverges on a deep model. With the CLI's recipe, side by side (no warm-up / one epoch / two):
      ResNet-18 on digits at 8×8 97.22 / 98.57 / 98.81% at the end (7 seeds; two epochs against one higher on 4,
      level on 1, lower on 2), 80% after 4.6 / 4.4 / 4.3 epochs, 90% after 6.2 / 6.1 / 4.9; digits 98.44 /
      98.61 / 98.89% (5 seeds; 95% after 9.6 epochs with one, 10.6 with two); synthetic level. With the masks
      frozen after round 1, none against two: ResNet-18 95.56% against 98.70% (3 seeds), digits 99.00% against
      98.89% (10; 90% after 5.5 epochs against 6.3, as PacTrain's 5.4): digits does not need it, ResNet-18 does.
      The fourteenth sweep: ResNet-18 97.08% without against 98.82% (4 seeds); digits without it and with the
      kept fraction ramped over 3 rounds, every method's BatchNorm statistics recalibrated, within 2.4 points of
      local SGD at every epoch, 99.34% (8 seeds). Why (fifteenth sweep): at lr 0.05 a node's batch of 32 diverges
      on ResNet-18 without it (training loss 3.9–5.0 against a guess's 2.30) for hierarchical local SGD too, which
      given the same warm-up ends 0.90 points higher at the last epoch; half an epoch of warm-up ends 0.62 below
      two. The trainer warns when a round's loss says the lr diverges.
    * ``restart`` — where θ starts each round's local steps: ``"global"`` (the default) sets every rank's θ to
      the new consensus z after each round, as local SGD restarts from the average; ``"node"`` to its node's
      z_i; ``"none"`` leaves θ where its steps took it (the paper's round). Only the start of ADMM's inexact
      θ-step moves (docs/algorithm.md, "Accelerations"). Measured on digits (2×2 ranks, one round per epoch,
      3 seeds): epochs to 95% at channel:0.5 13.7 → 9.7 and with every layer dense 10.0 → 6.7 (local SGD 6.6);
      on the synthetic task epochs to 80% 7 → 5.5 (local SGD 3). ``"node"`` was worse than ``"global"`` (12.3).
    * ``relaxation`` — over-relaxation α of both tiers (Boyd et al. §3.4.3): the next tier and the duals see
      α·θ + (1 − α)·z_i and α·z_i + (1 − α)·z. With ``restart`` it acts as an outer learning rate on each
      round's progress. Measured (digits, with restart): α = 1.6 with adaptive ρ ends at 98.80% (α = 1:
      97.96%) but reaches 95% later (11.0 epochs); α = 1.3 on top of ``rho_growth`` 1.3: 99.06% (5 seeds),
      95% in 9.8. α = 1.6 with ``rho_growth`` 1.3 diverged for several rounds (95% after 17.7 epochs). With
      ``rho_growth`` 1.3 on ResNet-18 (digits at 8×8, 32 rounds) the pair ended at 42% (81% with
      ``node_sync``), against 96.25% without either: not in the recipe.
    * ``rho_growth`` — every ρ multiplied by this after each round (capped at ``rho_max``; ADMM pruning grows ρ
      1.3–2× a round), which drives the pruned weights to zero before the masks freeze. Use it with
      ``adaptive_rho=False``: both together ended at 97.0% on digits. Alone (restart, ρ from 0.01 / 0.001):
      95% in 9.3 epochs, 98.52%. Keep ``lr·rho_max`` well below 2: ρ keeps growing until the cap, and with
      many rounds it gets there while the lr is still high (ResNet-18, 32 rounds: see ``relaxation``).
    * ``keep_ramp_rounds`` — lower every keep ratio from 1 to its target over this many rounds (cubic, Zhu &
      Gupta 2017), masks freezing only after. The first rounds then train a nearly dense model, and the
      channels are chosen from weights that have learned something instead of from the initialisation. 0 (the
      default, and ``prunex-hvd train``'s since the lr warm-up joined its recipe) projects onto the target from
      round 1; ``--keep-ramp-rounds auto`` ramps over a quarter of the planned rounds. Measured
      with ``restart`` and ``node_sync`` (2×2 ranks): ResNet-18 on digits at 8×8, R = 8 of 32 rounds, 80%
      after 4.7 epochs instead of 5.8 and 98.06% at the end instead of 96.30% (3 seeds; R = 12: 4.5, 98.06%);
      the synthetic task (R = 4 of 16) 80% after 5.0 epochs instead of 6.0; digits (R = 6 of 24, 5 seeds) 95%
      after 8.8 epochs either way, 98.44% at the end instead of 98.89% (90% after 7.4 instead of 6.4). Without ``node_sync`` it did not help on
      digits (95% after 11.0 epochs, 98.43%). Since the lr warm-up joined the recipe it no longer gains: without
      the ramp, digits ends at 98.99% against 98.90 (20 seeds; 95% after 8.65 epochs against 9.35), ResNet-18
      at 98.68% against 98.54 (4 seeds; 80% after 4.0 against 4.12), synthetic level, with 5% fewer bytes, and on
      the emulated cluster (ResNet-18, 100 Mbit/s, 5 seeds) 0.80 in 0.91x the time. The recipe dropped it.
    * ``node_sync`` — average the gradients over the node's ranks before every step, over the node's fast links
      (NVLink, shared memory): the ranks of a node take the same step from the same θ, so each node trains as
      one data-parallel worker with the node's batch, and H-SADMM's rounds agree between nodes only (the intra
      tier then just projects). What travels between nodes is unchanged; the node's links carry one gradient
      allreduce a step, as under DDP, of the kept weights only once the masks freeze (ResNet-18 at
      ``channel:0.5``, frozen after a quarter of the rounds: 0.66× the node's bytes, the same steps bitwise).
      Hierarchical local SGD (PyTorch's ``HierarchicalModelAverager``)
      averages within nodes the same way. Measured (2×2 ranks, restart, adaptive ρ from 0.01 / 0.001):
      ResNet-18 on digits at 8×8, two rounds an epoch, reaches 80% after 6.0 epochs instead of 9 and ends at
      96.25% instead of 92.2% (hierarchical local SGD: 4.2 epochs, 98.06%); on digits with resnet_small, 95%
      after 8.8 epochs instead of 11.0 (5 and 2 seeds). On in ``prunex-hvd train``'s recipe; off by default here, as
      the paper's per-rank local steps need no collective between rounds and the per-step allreduce's cost
      on a GPU node (NVLink) is not measured yet.
    * ``payload_dtype`` — what the leaders' inter-node exchange carries. None (default): the model's dtype, z_i +
      v_i itself. ``"bf16"`` / ``"fp16"``: the change since the last global z, rounded to 2 bytes, its rounding
      error kept and sent again next round (error feedback, docs/algorithm.md): half the inter-node bytes of a
      float32 model. ``"fp32"``: float32 whatever the model. Masks, residuals and the intra-node tier are
      unchanged. Measured with the CLI's recipe (2×2 ranks): bf16 halves the inter-node bytes (ResNet-18 on
      digits at 8×8: 724 against 1,446 MiB a run) and ends level or better, within noise: 98.24% against
      98.06% (3 seeds; 98.39% over 5), digits 98.61% against 98.44% (5 seeds), synthetic 100% both; on the emulated
      cluster (ResNet-18, 100 Mbit/s) it took the time to 80% from 60 s to 33–38 s. On in ``prunex-hvd
      train``'s recipe; None by default here, the library's exchange as it was. Prefer bf16: fp16 overflows on a change above 65504 (the round is then
      refused, named). Horovod has no bf16 reduction and sends it as float32.
    * ``overlap`` — the leaders' inter-node exchange of a round runs while the next round's first local steps
      compute. Those steps go on from θ as it was sent, and after ``overlap_steps`` of them (default: a quarter
      of ``local_steps``) the exchange is folded in. That means z, the duals, ρ and freezing exactly as the
      blocking round computes them, then θ += z − θ_sent, which rebases the steps taken since onto the
      consensus. Deterministic and resumable (docs/algorithm.md, "Overlapped rounds"). ``overlap_steps`` trades
      hiding against freshness: steps ≥ the exchange's time / one step's time hide it all. With
      ``overlap_after_freeze`` (default True) only the rounds after the masks freeze are overlapped. Before
      that, a node's θ is far from z (35% of ‖z‖ at round 1 on ResNet-18, 2% after freezing), and steps taken
      from it count for almost nothing once rebased. Measured on ResNet-18, digits at 8×8, 2×2 ranks, 11 steps
      a round, the CLI's recipe, 4 steps in flight:
      - Over 3 seeds, 0.80 test accuracy came after 4.29 epochs overlapped once frozen, 5.35 overlapped every
        round and 4.17 blocking. The final accuracy was 98.24% once frozen and 97.22% every round, against
        98.24% blocking.
      - On the emulated cluster at 100 Mbit/s, 6 seeds side by side, with MPI's exchange as a polled ring
        (2026-11-26): a frozen round's wait fell from ~1.3 s to 0.016–0.049 s, training took 0.88× the wall
        time, and the targets came sooner in sum: 0.97× the time to 0.80 (the same math until the masks
        freeze), 0.99× to 0.90, 0.92× to 0.95, with final accuracy level (96.99% against 96.94%). Per epoch
        it trails by ~0.3 epochs: the margin at 0.80 and 0.90 is within seed noise. Before the ring (the
        blocking call spinning on the exchange's thread, 4 seeds on another machine) it was 0.97×, 1.03× and
        1.19×. Overlapping every round took 50.2 s to 0.80 against 34.8 s (seed 0).
      - At 1 Gbit/s the exchange is 0.21 s of a 5.1 s round. With ``overlap_steps=1`` (9 seeds) a frozen round
        took 0.975× blocking's; over 18 seeds the run took 0.981× the wall time and 0.80 / 0.90 / 0.95 came
        0.996× / 0.970× / 0.986× as late in sum, at level epochs (each margin inside seed noise: the exchange is
        ~4% of a round); final 97.24% against 97.33%. Four steps in flight took 0.999× the wall time there:
        fold after the fewest steps that cover the exchange.
      Off by default, here and in ``prunex-hvd train``: turn it on where a round's transfer is a large share
      of its time.
    * ``rho1`` — pull of each rank's θ toward its node consensus z_i, added to every gradient. Larger: ranks of
      a node stay together and the structure is reached sooner, at the cost of freedom to fit local data
      (accuracy). ``rho2`` — pull of each node toward the global z; keep it ~10× smaller than rho1 so nodes
      can differ while their masks settle. ``adaptive_rho`` balances primal and dual residuals per layer (×/÷2
      when one is 10× the other, capped at ``rho_max``), which makes the defaults safe across models. With
      ``restart`` every round's fresh local steps leave a large primal residual, so balancing keeps raising ρ:
      on digits ρ1 went 0.01 → 0.32 and ρ2 0.001 → 0.26 by round 8 (1.0 on some layers by round 13). A large
      ρ2 makes z_i lean on the last z and the global model move in smaller steps. That helped ResNet-18 on digits at 8×8 and hurt digits
      (resnet_small), 5 seeds each (benchmarks/README, "PacTrain with PruneX's structure"): ρ held at
      0.01 / 0.001 ended at 99.11% on digits against 98.61% balanced, but 97.56% on ResNet-18 against 98.39%
      (80% after 4.9 epochs against 4.1); ``rho_max=0.1`` lands between (98.89% / 98.00%). Balanced stays the
      recipe. ``balance_rho2=False`` balances ρ1 only and holds ρ2 (and ρ3): higher at the end on both tasks
      (99.00% / 98.50%, 5 seeds) but later to the targets (95% on digits after 9.0 epochs against 8.0, 80% on
      ResNet-18 after 4.8 against 4.1): for training to the end, not for time to a target. With the two-epoch
      lr warm-up it is the best PruneX on digits, 99.44% against 98.89% (5 seeds; PacTrain 99.17%), and costs
      ResNet-18 0.38 points (98.56% against 98.94% on the same 5 seeds; 80% after 4.8 epochs against 4.2). With
      the masks frozen after round 1: digits 99.08% against 98.89% (10 seeds; 90% after 7.4 epochs against 6.3),
      ResNet-18 98.89% against 98.82% (4; 90% after 6.2 against 4.9). With one channel budget too: digits
      99.19% against 99.14% (10; 97% after 9.0 epochs against 10.2, 90% after 6.2 against 5.6), ResNet-18
      98.85% against 98.51% (8; 90% after 5.5 against 4.2).
    * ``rho2_release_round`` — from the end of this round on ρ2 (and ρ3) leave residual balancing and halve each
      round back to the value the run started from, the scaled duals rescaled as for any change of ρ
      (docs/algorithm.md, "Releasing ρ2"). It keeps the balanced ρ2's damping where it helps, early (ResNet-18's
      70% and 80% come before it), and lets the global model follow the nodes once the lr has decayed. The same
      math up to that round. ``prunex-hvd train --rho2-release-round auto`` releases after a third of the
      planned rounds. Measured side by side with the recipe balanced to the end, the same seeds (2×2 ranks;
      benchmarks/README, "Releasing ρ2"): digits ends at 98.97% against 98.86% (10 seeds, higher on 5, lower on
      1; PacTrain 99.17%), ResNet-18 on digits at 8×8 at 98.47% both (4 seeds), synthetic 100% both; the
      targets before the release come at the same epochs. But the runs dip for some epochs after it (seed means:
      ResNet-18 by up to 4.9 points over epochs 5.5–9.5, digits by up to 1 over 9–16; single seeds by up to 11.7
      and 5.0), and ResNet-18's 97% comes after 9.8 epochs against 9.1. Released after a quarter: digits
      99.00%, ResNet-18 98.68% with its 90% after 6.4 epochs against 5.1; after half: digits level with the
      recipe. None (the default, here and in ``prunex-hvd
      train``): balanced to the end; set it to train to the end.
    * ``rho_max`` — the cap of the balanced ρ's. Between rounds the proximal term pulls θ back toward z_i − u, and
      the optimizer's momentum β amplifies it: a round of H steps at lr η pulls θ back H·η·ρ1/(1 − β) times its
      distance, and balancing raised ρ1 to where that is 2–7 on digits' layers (docs/algorithm.md, "A cap from
      the round's length"). ``prunex-hvd train --rho-max auto`` (its recipe) caps every ρ at (1 − β)/(η·H), a
      pull of 1: 0.091 on digits, 0.18 on ResNet-18 on digits at 8×8. Measured side by side (benchmarks/README,
      "A cap on ρ from the round's length"): digits 98.81% against 98.69% (10 seeds, higher on 5, lower on 3),
      97% after 11.6 epochs against 13.1; ResNet-18 98.54% against 98.47% (4 seeds), 90% after 5.3 epochs
      against 6.1; the early targets level. The default here, 10, never binds on these tasks: the library does
      not know the lr, so set it from the formula when you wrap an optimizer yourself.
    * ``acceleration`` / ``outer_momentum`` — momentum across rounds on the inter-node tier (docs/algorithm.md,
      "Momentum across rounds"): the next round leans on an extrapolated ẑ in place of z. ``"fast-admm"``: fast
      ADMM with restart (Goldstein et al. 2014), z and the duals v extrapolated by Nesterov's sequence while the
      combined residual falls; ``"nesterov"``: z alone, ẑ = z + β(z − z_last) with β = ``outer_momentum``
      (DiLoCo's outer Nesterov step in look-ahead form). Measured with the CLI's recipe, side by side (2×2
      ranks; digits and synthetic 5 seeds, ResNet-18 on digits at 8×8 3 seeds; benchmarks/README,
      "Momentum across rounds"): ``"nesterov"`` at β = 0.5 ended digits at 99.22% against 98.44% and reached
      95% after 8.0 epochs against 10.2, and the synthetic task's 80% after 4.8 against 5.2, but cost
      ResNet-18 2.7 points (95.09% against 97.78%) and most of an epoch to 80% (5.2 against 4.3); β = 0.3 and
      0.9 the same pattern. Longer rounds may suit it: with 22 steps a round instead of 11, ResNet-18 reached
      80% an epoch sooner than the recipe and ended 0.8 points lower (2 seeds: a lead). ``"fast-admm"`` learned
      as the recipe (95% on digits after 9.8 epochs, 80% on ResNet-18 after 4.3): residual balancing changes ρ2
      in most early rounds and each change restarts it, so its momentum builds only once ρ settles (ResNet-18:
      from round 10 of 32, after the freeze at round 8, γ rising to 0.8); it ended ResNet-18 1.2 points lower.
      Off by default, here and in ``prunex-hvd train``: the same trade as every lever on the recipe's consensus
      so far (digits gains, ResNet-18 loses). Not with ``overlap`` or racks yet.
    * ``rack_tier`` / ``rho3`` — with racks (``nodes_per_rack``, or Slurm's leaf switches) and more than one
      rack, a consensus w_r per rack sits between the nodes' z_i and the global z (docs/algorithm.md, "A third
      tier: racks"): nodes agree with their rack over the rack's switch (``rho2`` is then the pull toward w_r),
      and only the rack leaders cross the spine, each with one compact payload (``rho3`` their pull toward
      z; None: ``rho2``). ``rack_tier=False`` runs the two tiers over every node (the racks still count the
      traffic that crosses them). A narrow ``payload_dtype`` rounds both levels (into the rack, across the
      spine), each with its own error feedback. Not yet with ``overlap`` or ``relaxation`` ≠ 1. Measured
      (benchmarks/README.md, "Racks"; 2 racks × 2 hosts, ResNet-18, bf16): the spine carries 0.68× the
      bytes of two tiers (toward 0.5× with more nodes per rack), but a round does ~0.55 s more work on a
      2-core CPU host, so three tiers took 1.13× the wall time at a 100 Mbit/s spine, the same at 25 Mbit/s
      and 1.33× at 1 Gbit/s. Per epoch they learned faster on ResNet-18 (0.90 on 3 of 3 seeds against 1 of
      3; 1.29× sooner than local SGD) and slower on digits (95% after 13.7 epochs against 10.7). ``rho3`` is
      why: w_r keeps a weight ρ3/(N·ρ2 + ρ3) on the last z (1/3 with the default ρ3 = ρ2 and 2 nodes a rack),
      which damps the global model's moves. With ``rho3`` = ρ2/10 digits learned as with two tiers (95% after
      10.7 epochs, 97.78% final, 3 seeds) and ResNet-18 lost the gain (88.33% against 95.00%, two tiers
      88.06%, one seed): raise it on noisy tasks, lower it where the rounds' progress should pass through.
    * ``sparsity`` — the structure to keep: ``"filter:K"``, ``"channel:K"``, ``"shape:K"`` (K = fraction KEPT),
      joined with ``"+"`` (applied filter → channel → shape), or ``{name_glob: spec}`` per layer (``"dense"``
      excludes a layer). Conv weights take those; a transformer's linear layers take ``"head:K"`` (an
      attention module's heads, its q/k/v rows and output-projection columns as one group) and ``"neuron:K"``
      (an MLP's hidden units, fc1's rows; with ``coupled`` fc2's columns too), e.g. ``"head:0.5+neuron:0.5"``
      on a ViT, or ``"feature:K"`` (input columns) by glob; the rest joins the consensus densely.
      Inter-node traffic shrinks with the kept fraction. A ``ConvTranspose2d`` must be left dense, and a
      grouped conv may only lose output filters (``filter:K``): the error names the layer and the dict to
      write. A stage that can remove nothing from a layer (``channel:K`` on a 1-channel stem or a depthwise
      conv) is one warning on rank 0.
    * ``freeze_round`` / ``freeze_patience`` — masks stop moving after that round, or once the global mask is
      unchanged for that many rounds; then buffers are allocated once and projection is skipped, and with
      ``compact_compute`` every later round computes as the pruned model. With ``restart="global"`` the mask stops
      moving after round 1 (each round starts from z, zero off its support, so the projection keeps round 1's
      channels: drift 0 in rounds 2-4 of all 30 ResNet-18 runs measured), and the rounds before a later freeze only
      multiply the pruned channels too. The CLI's recipe (with its two-epoch lr warm-up) therefore froze after round
      1 (2026-11-28 to the sixteenth sweep). Against freezing a third of the way (digits) or at round 4 (ResNet-18
      at 8×8), paired by seed: ResNet-18 98.82% against 98.68% (4 seeds; 90% after 4.9 epochs against 5.4), digits
      98.90% against 98.99% (20; 90% after 6.6 epochs against 7.2), synthetic level (80% after 4.0 against 5.5);
      0.80 on the emulated cluster in 0.91× the time (5 seeds). Before the warm-up, round 1 at the full lr chose
      worse channels: ResNet-18 lost 1.3 points then, and without the warm-up it still loses 1.1 points against a
      third of the way (3 seeds; digits gains 0.3, 10). The digits ViT (heads and neurons) is level with round 8
      (87.31% against 87.82%, 6 seeds, its noise ±3). ``0`` chooses the masks from the initial weights when the
      engine is built (the same on every rank after the broadcast: no collective) and freezes them before the first
      step, so every round trains, computes and sends the pruned model (docs/algorithm.md, "Masks chosen at the
      start"). Round 1 of the warm-up hardly moves the weights: it chose the same layer widths, so ``0`` cuts the
      same kind of structure one epoch sooner. The CLI's recipe since the sixteenth sweep, against round 1 paired by
      seed (benchmarks/README, "Masks chosen at the start"): digits 24.3 / 59.3 / 82.9% at epochs 1–3 against 17.2 /
      51.4 / 76.5, level from epoch 5 and at the end (99.06% against 99.13, 8 seeds); ResNet-18 on digits at 8×8
      36.9% at epoch 0.5 against 23.1, then −1.32 to +1.46, +0.17 at epoch 16 (8 seeds); synthetic +3.7 / +6.9 /
      +1.0 / +1.0 at epochs 1–4, level after (4). Refused with ``keep_ramp_rounds``. The digits ViT: 86.06% against
      87.31% (6 seeds, its noise ±3). The library's default waits for the patience (three unchanged rounds).
    * ``keep_start_norm`` (off; only with ``freeze_round=0``) — each pruned weight whose output a normalisation
      takes alone (BatchNorm, InstanceNorm; GroupNorm or LayerNorm after a layer without bias) is scaled after the
      start's projection back to its initial norm: the same function and masks (docs/algorithm.md, "The start's
      norm"). Such a weight is scale-free and turns at an effective lr of lr/‖W‖²; the projection keeps 0.23–0.37
      of the squared norm of the convs one channel budget cuts on these ResNets, so unscaled they start at 3–4×
      the unpruned network's effective lr. Measured on the recipe, paired by seed (benchmarks/README, "The start's
      norm"): ResNet-18 on digits at 8×8 +5.35 points at epoch 1 [+2.26, +8.30] and +2.33 at epoch 2, 70% after 1.6
      epochs against 2.1, level at the end (98.92% against 98.75%, 8 seeds); but digits −8.4 at epochs 2 and 3
      (95% 1.1 epochs later, level at the end; 8) and the synthetic task −8.0 at epoch 2 (4). In effect a lower lr
      for the pruned convs in the first epochs: on for a deep model that needs a warm-up at its lr, off where the
      warm-up already costs the first epochs.
    * ``masked_retrain`` — after freezing, keep θ on the frozen structure (gradients and weights masked): the
      paper's retraining phase, so the model trained from then on is the pruned model itself. Freeze early
      enough to leave epochs for it (the recipe: every round, from the start).
    * ``compact_compute`` (default True) — with ``masked_retrain``, from the freeze until ``finalize`` every
      structured plain ``Conv2d`` / ``Linear`` multiplies only its kept input channels and output filters
      (:mod:`prunex_hvd.engine.compact_compute`): the same function and gradients as the masked dense layer,
      about half the multiply-adds at ``channel:0.5``. ResNet-18 at 8×8 on one CPU thread: a retraining step
      0.61× as long (large weights' blocks and gradients moved by the native packing kernel: 0.9× of the step
      with ATen's gathers). With ``node_sync`` the step also skips masking the gradients, which are then zero
      outside the structure in every term (3-4% of that step). The weights' gradients outside the kept blocks
      are 0 before the step, where dense layers give values the masked step drops: a ``clip_grad_norm_`` sees
      the pruned model's gradient alone. Off: the dense layers multiply the zeros too (only to compare).
    * ``retrain`` — how the rounds after the freeze run (docs/algorithm.md, "The retraining phase"). ``"admm"``
      (default): the same ADMM round on the frozen masks, duals and residual balancing going on (with
      ``restart`` ρ2 keeps rising and z moves a fraction of the nodes' progress each round: a damped, smoothed
      global model). ``"average"``: at the freeze ρ and the duals drop to 0, and each later round is the nodes'
      plain mean on the frozen structure, hierarchical local SGD of the pruned model (no proximal term in the
      steps; ``relaxation`` and ``acceleration="nesterov"`` still act on it as outer step and momentum). Measured
      on the CLI's recipe, side by side (2×2 ranks, 5 seeds, ResNet-18 7; benchmarks/README, "The retraining
      phase"): it ends higher on every task, digits 98.83% against 98.44% (test loss lower on 5 of 5 seeds; 97%
      after 11.6 epochs against 12.8), ResNet-18 on digits at 8×8 97.54% against 97.22% (loss 0.084 against
      0.099), synthetic 99.96% both (loss 0.018 against 0.022). But on ResNet-18 the undamped global model
      zigzags for the first rounds after the freeze (72% → 82% → 77% → 83% on one seed) and reaches 90% 1.0
      epoch later (7.2 against 6.2). With the two-epoch lr warm-up (the recipe now) the trade remains, on the
      same seeds: digits 98.97% against 98.69% (10 seeds, higher on 7), ResNet-18 98.61% against 98.81% (7
      seeds, higher on none; 90% after 6.1 epochs against 4.9); with the masks frozen after round 1, digits
      99.03% against 98.89% (10; 90% after 7.1 epochs against 6.3), ResNet-18 98.47% against 98.82% (4; 90%
      after 7.5 against 4.9). Off by default, here and in ``prunex-hvd
      train``: for training to the end on a task like digits, not for an early target. Needs
      ``weight_decay_z=0`` and no ``"fast-admm"``; resume with the same setting.
    * ``channel_budget`` / ``budget_floor`` — how ``channel:K`` (and ``feature:K``) is counted. ``"layer"``
      (the paper's): every layer keeps ⌈K·C_in⌉ of its input channels. ``"global"`` (``prunex-hvd train``'s
      recipe): the layers whose channels are their own (a plain ``channel:K`` / ``feature:K``, in no coupled
      pair or residual stream; the others keep their own count, one warning names them) share one budget,
      the weights the per-layer projection would keep, and the channels of largest mean squared weight take it,
      each layer keeping at least ``budget_floor`` of its channels (docs/algorithm.md, "One channel budget
      across the layers"). Same bytes or fewer; on a ResNet the last stage's wide convs, whose weights are
      smallest, give up channels to the early ones, whose maps are largest: the pruned model keeps half the
      weights but ~0.8 of the multiply-adds (export: ResNet-18 at 8×8 0.84×, resnet_small 0.79×; per layer
      0.47× / 0.44×), so each step of the retraining phase computes more. Measured on the recipe, paired by
      seed (benchmarks/README, "One channel budget across the layers"): digits 99.14% against 98.86% per layer
      (10 seeds; PacTrain 99.17%; 95% after 7.2 epochs against 8.8), ResNet-18 at 8×8 98.51% against 98.33% (8
      seeds; PacTrain 98.82%; 90% after 4.2 epochs against 5.3; over 16 seeds level with PacTrain, 98.77%
      both), synthetic level at the end with 70% after 3.0 epochs against 4.0 (2 seeds); on the emulated
      cluster 0.80 in 0.93× the time (5 seeds, 2.36× sooner than hierarchical local SGD). A floor at or above
      every layer's keep ratio is the per-layer count exactly. The floor of 0.1 binds on neither ResNet: their
      thinnest layers keep 22–28% (resnet_small, 10 seeds) and 27–31% (ResNet-18, 16 seeds) of their channels.
    * ``coupled`` — channel pruning with dependencies (Torch-Pruning's "group"): when conv B reads conv A's
      output through BatchNorm/activations only, B's input channel c and A's filter c are pruned together,
      ranked by their joint norm. ``channel:0.5`` then also halves A's filters: inter-node traffic falls from
      ~0.50× to ~0.3–0.4× of dense on ResNets, and the final model is that much smaller, at some accuracy
      (A is pruned on both sides). ``coupled="streams"`` also makes each residual stream one group: every
      conv reading it (input channel c) and writing into it (filter c) shares one channel set, keep ratio from
      the readers' ``channel:K`` (they must agree), so export can remove the whole pruned fraction. A stream
      with a reader or writer other than a plain conv (``groups=1``), e.g. the last one read by the linear
      head, keeps per-layer masks. On a transformer ``coupled`` makes each MLP hidden unit one group (fc1's
      row j with fc2's column j, from ``neuron:K``): export then removes them without folding constants, and
      ``neuron:0.5`` lost nothing against a dense consensus on the digits ViT (benchmarks/README.md, "Beyond
      convs"). Needs a ``torch.fx``-traceable model.
    * ``weight_decay_z`` — λ of the z-step (a ridge on the consensus itself); 0 leaves decay to the optimizer.
    * ``bucket_mb`` — size of the flat buffers packed for each collective (one collective per bucket).
    * ``backend`` — the transport: ``auto`` (nccl for CUDA tensors, mpi under MPI, gloo otherwise), ``mpi``,
      ``gloo``, ``nccl`` or ``horovod``.
    * ``hierarchical=False`` — the paper's "PruneX (AR)" ablation: one flat consensus over the world group
      (every rank allreduces its dense θ + u, the projection applies to the global variable). Same math with
      M = 1 node of all ranks; it shows what the hierarchy saves.

    Frozen: change a copy with :func:`dataclasses.replace`, which validates again.
    """
    sparsity: Any = _knob("channel:0.5", "channel:0.5, filter:0.5+channel:0.5, head:0.5+neuron:0.5 (a ViT), or "
                                         "JSON {glob: spec}; the number is the KEPT fraction")
    local_steps: int = _knob(100, "wrapped steps between consensus rounds")
    rho1: float = _knob(1.5e-3, "pull of each rank toward its node's consensus z_i", agree="rho")
    rho2: float = _knob(1.5e-4, "pull of each node toward the global consensus z", agree="rho")
    rho3: Optional[float] = _knob(None, "with racks: pull of each rack's consensus toward the global z (None: "
                                        "rho2)", agree="rho")
    rho_max: float = _knob(10.0, "cap of the adaptive rho's", agree="rho")
    adaptive_rho: bool = _knob(True, "balance primal and dual residuals per layer by rescaling rho", agree="rho")
    balance_rho2: bool = _knob(True, "with adaptive_rho: balance rho2 (and rho3) too; off holds them where they "
                                     "are and balances rho1 only", agree="rho")
    rho2_release_round: Optional[int] = _knob(None, "from the end of this round on rho2 (and rho3) stop being "
                                                    "balanced and halve each round back to where they started: "
                                                    "the global model's damping released (None: never)",
                                              agree="rho")
    weight_decay_z: float = _knob(0.0, "ridge on the consensus z (the z-step's lambda)", agree="rho")
    freeze_round: Optional[int] = _knob(None, "round after which masks freeze (0: chosen from the initial weights "
                                              "before the first step; None: only freeze_patience)",
                                        agree="freezing")
    freeze_patience: int = _knob(3, "rounds the global mask must hold before it freezes", agree="freezing")
    keep_start_norm: bool = _knob(False, "with freeze_round=0: each pruned layer whose output a normalisation takes "
                                         "alone is scaled, after the start's projection, back to its initial norm "
                                         "(the same function; the unpruned layer's effective lr)", agree="freezing")
    masked_retrain: bool = _knob(True, "after freezing, keep θ on the frozen structure (off: only z is masked)",
                                 agree="freezing")
    compact_compute: bool = _knob(True, "once frozen with masked_retrain: convs and linears multiply only their kept "
                                        "channels and filters (the same model and steps, less compute)",
                                  agree="freezing")
    coupled: Union[bool, str] = _knob(False, "channel pruning with dependencies: True (= 'pairs') or 'streams'")
    channel_budget: str = _knob("layer", "how channel:K is counted: layer (each layer keeps K of its input "
                                         "channels) or global (one budget of kept weights over all such layers, "
                                         "channels ranked by mean squared weight)", agree="freezing")
    budget_floor: float = _knob(0.1, "with channel_budget='global': the fraction of its input channels every "
                                     "layer keeps at least", agree="freezing")
    bucket_mb: float = _knob(32.0, "size of the flat buffers packed for one collective (MB)")
    backend: str = _knob("auto", "auto, mpi, gloo, nccl or horovod")
    hierarchical: bool = _knob(True, "False: one flat consensus over the world group (PruneX (AR))")
    restart: str = _knob("global", "where θ starts each round's local steps: none (where they left it), node (z_i) "
                                 "or global (z)", agree="round")
    relaxation: float = _knob(1.0, "over-relaxation alpha of both tiers, in (0, 2) (1: plain ADMM)", agree="round")
    rho_growth: float = _knob(1.0, "every rho multiplied by this each round, up to rho_max (1: no schedule)",
                              agree="rho")
    sync_rounds: int = _knob(0, "post-local SGD: the first N rounds average the gradients over the world every step "
                                "(no proximal term) and only take θ as the consensus; ADMM from round N + 1",
                             agree="round")
    sync_powersgd_rank: int = _knob(0, "the synchronous phase's inter-node gradient at this PowerSGD rank, with error "
                                       "feedback (0: whole)", agree="round")
    keep_ramp_rounds: int = _knob(0, "rounds over which every keep ratio falls from 1 to its target (cubic); "
                                     "masks freeze only after it (0: target from round 1)", agree="freezing")
    node_sync: bool = _knob(False, "average gradients over the node's ranks before every step (fast links): each "
                                   "node trains as one data-parallel worker, H-SADMM runs between nodes",
                            agree="round")
    payload_dtype: Optional[str] = _knob(None, "what the inter-node exchange carries: the model's dtype (None), "
                                               "fp32, or bf16 / fp16 (the change since the last z, with error "
                                               "feedback)", agree="round")
    overlap: bool = _knob(False, "leave each round's inter-node exchange in flight while the next round's local "
                                 "steps run; folded in at the next round", agree="round")
    overlap_steps: Optional[int] = _knob(None, "with overlap: fold the exchange in after this many of the next "
                                               "round's local steps (None: a quarter of local_steps)",
                                         agree="round")
    rack_tier: bool = _knob(True, "with racks (nodes_per_rack, more than one rack): a consensus per rack between the "
                                  "nodes' and the global one (three tiers); off: two tiers over all nodes",
                            agree="round")
    overlap_after_freeze: bool = _knob(True, "with overlap: overlap only the rounds after the masks freeze, those "
                                             "before blocking (off: every round from the first)",
                                       agree="round")
    acceleration: str = _knob("none", "momentum across rounds on the inter-node tier: none, fast-admm (z and its "
                                      "dual v extrapolated, restarted when the combined residual stops falling) "
                                      "or nesterov (z alone, by outer_momentum: DiLoCo's outer step)",
                              agree="round")
    outer_momentum: float = _knob(0.5, "with acceleration='nesterov': the weight beta of the last round's move of "
                                       "z added to the point the next round starts from, in [0, 1)",
                                  agree="round")
    retrain: str = _knob("admm", "how rounds run once the masks freeze: admm (the duals and rho go on) or average "
                                 "(penalties and duals dropped: each round is the nodes' plain mean, hierarchical "
                                 "local SGD of the pruned model)", agree="freezing")

    def __post_init__(self):
        def integer(name, minimum, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be {'None or ' if optional else ''}an integer >= {minimum}, "
                                 f"got {value!r}")
        integer("local_steps", 1)
        for name in ("rho1", "rho2", "rho_max") + (("rho3",) if self.rho3 is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.coupled not in COUPLING_MODES or type(self.coupled) not in (bool, str):
            raise ValueError(f"coupled must be False, True (= 'pairs') or 'streams', got {self.coupled!r}")
        if self.channel_budget not in CHANNEL_BUDGETS:
            raise ValueError(f"channel_budget must be one of {', '.join(CHANNEL_BUDGETS)}, got {self.channel_budget!r}")
        if isinstance(self.budget_floor, bool) or not (isinstance(self.budget_floor, Real)
                                                       and 0 < self.budget_floor <= 1):
            raise ValueError(f"budget_floor must be a fraction in (0, 1], got {self.budget_floor!r}")
        if self.weight_decay_z < 0:
            raise ValueError(f"weight_decay_z must be >= 0, got {self.weight_decay_z!r}")
        integer("freeze_round", 0, optional=True)
        integer("rho2_release_round", 1, optional=True)
        integer("freeze_patience", 1)
        integer("keep_ramp_rounds", 0)
        integer("sync_rounds", 0)
        integer("sync_powersgd_rank", 0)
        if self.sync_powersgd_rank and not self.sync_rounds:
            raise ValueError(f"sync_powersgd_rank={self.sync_powersgd_rank} compresses the synchronous phase's "
                             f"gradients, and sync_rounds=0 has no such phase: set sync_rounds >= 1, or leave the "
                             f"rank at 0")
        if self.sync_rounds and self.keep_ramp_rounds:
            raise ValueError(f"sync_rounds={self.sync_rounds} spends the first rounds synchronously, with no mask "
                             f"computed; keep_ramp_rounds={self.keep_ramp_rounds} would lower the keep ratios over "
                             f"those same rounds: set one of them")
        if not isinstance(self.keep_start_norm, bool):
            raise ValueError(f"keep_start_norm must be True or False, got {self.keep_start_norm!r}")
        if self.keep_start_norm and self.freeze_round != 0:
            raise ValueError(f"keep_start_norm scales the start's projection back to the initial norm, which needs the "
                             f"masks chosen at the start: freeze_round=0 (got {self.freeze_round!r})")
        if self.freeze_round == 0 and self.keep_ramp_rounds:
            raise ValueError(f"freeze_round=0 chooses the masks at the start, at their targets; "
                             f"keep_ramp_rounds={self.keep_ramp_rounds} lowers the keep ratios over the first rounds "
                             f"and freezes only after: set one of them (keep_ramp_rounds=0, or freeze_round >= 1)")
        if self.restart not in RESTARTS:
            raise ValueError(f"restart must be one of {', '.join(RESTARTS)}, got {self.restart!r}")
        if isinstance(self.relaxation, bool) or not (isinstance(self.relaxation, Real)
                                                     and 0 < self.relaxation < 2):
            raise ValueError(f"relaxation must be a number in (0, 2), got {self.relaxation!r}")
        if isinstance(self.rho_growth, bool) or not (isinstance(self.rho_growth, Real)
                                                     and math.isfinite(self.rho_growth) and self.rho_growth >= 1):
            raise ValueError(f"rho_growth must be a finite number >= 1, got {self.rho_growth!r}")
        if not isinstance(self.node_sync, bool):
            raise ValueError(f"node_sync must be True or False, got {self.node_sync!r}")
        if self.node_sync and not self.hierarchical:
            raise ValueError("node_sync=True needs hierarchical=True: with one flat consensus group the 'node' is "
                             "the whole world, and averaging gradients over it every step is dense data parallelism")
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise ValueError(f"payload_dtype must be None, 'fp32', 'bf16' or 'fp16', got {self.payload_dtype!r}")
        if self.payload_dtype is not None and not self.hierarchical:
            raise ValueError("payload_dtype applies to the hierarchical consensus's inter-node exchange; with "
                             "hierarchical=False every rank's dense θ + u is summed in the model's dtype")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
        if not isinstance(self.rack_tier, bool):
            raise ValueError(f"rack_tier must be True or False, got {self.rack_tier!r}")
        if not isinstance(self.compact_compute, bool):
            raise ValueError(f"compact_compute must be True or False, got {self.compact_compute!r}")
        if not isinstance(self.overlap_after_freeze, bool):
            raise ValueError(f"overlap_after_freeze must be True or False, got {self.overlap_after_freeze!r}")
        integer("overlap_steps", 1, optional=True)
        if self.overlap_steps is not None and not self.overlap:
            raise ValueError("overlap_steps is when an overlapped round is folded in: it needs overlap=True")
        if self.overlap and not self.hierarchical:
            raise ValueError("overlap=True overlaps the hierarchical consensus's inter-node exchange; with "
                             "hierarchical=False there is no such tier (every rank sums its dense θ + u)")
        if self.acceleration not in ACCELERATIONS:
            raise ValueError(f"acceleration must be one of {', '.join(ACCELERATIONS)}, got {self.acceleration!r}")
        if isinstance(self.outer_momentum, bool) or not (isinstance(self.outer_momentum, Real)
                                                         and 0 <= self.outer_momentum < 1):
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {self.outer_momentum!r}")
        if self.acceleration != "none" and not self.hierarchical:
            raise ValueError(f"acceleration={self.acceleration!r} acts on the inter-node tier; with "
                             f"hierarchical=False there is none (one flat consensus group)")
        if self.acceleration != "none" and self.overlap:
            raise ValueError(f"acceleration={self.acceleration!r} is not available with overlap=True yet (the "
                             f"overlapped fold would need the extrapolation's delayed form): turn one of them off")
        if self.retrain not in RETRAINS:
            raise ValueError(f"retrain must be one of {', '.join(RETRAINS)}, got {self.retrain!r}")
        if self.retrain == "average" and self.weight_decay_z > 0:
            raise ValueError(f"retrain='average' drops the z-step's penalties once the masks freeze, and with them "
                             f"weight_decay_z={self.weight_decay_z!r} (its ridge would pull the mean to 0): set "
                             f"weight_decay_z=0 (leave decay to the optimizer) or retrain='admm'")
        if self.retrain == "average" and self.acceleration == "fast-admm":
            raise ValueError("acceleration='fast-admm' extrapolates the duals, which retrain='average' drops once the "
                             "masks freeze (its momentum would start only then): use acceleration='nesterov' or "
                             "retrain='admm'")
        check_bucket_mb(self.bucket_mb)
        check_backend_name(self.backend)

    @classmethod
    def knob_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_knobs(cls, knobs: Dict[str, Any], base: Optional["ConsensusConfig"] = None,
                   who: str = "DistributedOptimizer") -> "ConsensusConfig":
        """``base`` (default: the defaults) with ``knobs`` in place. An unknown name is a ``ValueError`` (as a
        bad value is, so the wrapper's agreement raises it on every rank) that says which knob was meant."""
        names = cls.knob_names()
        for name in knobs:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                raise ValueError(f"{who}() got an unexpected keyword argument {name!r}"
                                + (f" (did you mean {near[0]!r}?)" if near else "")
                                + f"; its knobs are {', '.join(names)}")
        return dataclasses.replace(base, **knobs) if base is not None else cls(**knobs)

    def knobs(self) -> Dict[str, Any]:
        """``{name: value}`` of every knob (the values themselves, not copies)."""
        return {name: getattr(self, name) for name in self.knob_names()}

    def agreement(self, structure: "Structure") -> Dict[str, Any]:
        """What every rank must hold equal: every knob, with ``sparsity`` and ``coupled`` replaced by what they
        resolved to on this model (``structure``), grouped as a disagreement is reported (``rho`` for the
        ρ's, ``freezing``, ...; a knob without a group under its own name)."""
        resolved = {"sparsity": ({n: str(s) for n, s in structure.specs.items()}, [g.module for g in structure.heads]),
                    "coupled": (structure.couplings, [list(map(list, s)) for s in structure.streams])}
        out: Dict[str, list] = {}
        for f in dataclasses.fields(self):
            out.setdefault(f.metadata["agree"] or f.name, []).append(resolved.get(f.name, getattr(self, f.name)))
        return {k: v[0] if len(v) == 1 else tuple(v) for k, v in out.items()}


def check_bucket_mb(bucket_mb) -> None:
    if isinstance(bucket_mb, bool) or not (isinstance(bucket_mb, Real) and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")


class Structure(NamedTuple):
    """What ``sparsity`` and ``coupled`` mean on one model: the spec of every structured parameter, the pairs
    ``{consumer: producer}`` (convs, MLP linears) and residual streams pruned as one channel group each, and the
    attention modules whose heads are pruned (:class:`~prunex_hvd.engine.dependencies.HeadGroup`)."""
    specs: Dict[str, StructureSpec]
    couplings: Dict[str, str]
    streams: list
    heads: tuple = ()

    @classmethod
    def resolve(cls, model: torch.nn.Module, config: ConsensusConfig) -> "Structure":
        """Raises ``ValueError`` for a spec that does not fit the model (a glob matching nothing, a layer type
        the GEMM view does not fit, coupling that would change nothing, stream readers asking for different
        keep ratios, an attention module's weights asking for different heads)."""
        targets = dependencies.structure_targets(model)
        specs = resolve_specs(model.named_parameters(), config.sparsity, targets)
        check_layer_types(model, specs, config.sparsity)   # before anything uses specs
        couplings, streams = _couplings(model, specs, config.coupled) if config.coupled else ({}, [])
        heads = tuple(g for g in targets.heads if g.members[0] in specs)
        return cls(specs, couplings, streams, heads)


def _couplings(model, specs, coupled):
    """The pairs and (``coupled="streams"``) residual streams pruned as one channel group each; an error
    when coupling would change nothing, or when a stream's readers ask for different channel keep ratios.
    An MLP pair whose hidden layer has ``neuron:K`` and whose reader has no ``feature`` stage becomes one
    group of hidden units: the reader takes ``feature:K`` (in ``specs``, which this updates)."""
    pairs = {}
    for c, p in dependencies.channel_couplings(model).items():
        hidden = specs[p].keep("neuron") if p in specs else None
        if hidden is not None and specs.get(c, DENSE).keep("feature") is None:
            specs[c] = StructureSpec(specs.get(c, DENSE).parts + (("feature", hidden),))
        if c in specs and p in specs and any(k in ("channel", "feature") for k, _ in specs[c].parts):
            pairs[c] = p
    streams = []
    if coupled == "streams":
        for s in dependencies.channel_streams(model):
            # a member left dense, or a reader without a channel stage: that stream keeps per-layer masks
            if all(n in specs for n in s.readers + s.writers) and \
                    all(any(k == "channel" for k, _ in specs[n].parts) for n in s.readers):
                stream_keep(specs, s.readers, s.writers)   # readers' keep ratios must agree
                streams.append(s)
        if not streams:
            raise ValueError("coupled='streams', but no residual stream has only structured plain convs (groups=1) "
                             "reading and writing it, with a 'channel:K' spec on its readers: nothing to couple")
    if not pairs and not streams:
        raise ValueError("coupled=True, but no conv reads another structured conv's output alone through a "
                         "channel stage (needs a 'channel:K' spec on both, and no residual in between), and no "
                         "MLP has 'neuron:K' or 'feature:K': nothing to couple")
    return pairs, streams
