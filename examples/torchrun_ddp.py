"""A torchrun / DistributedDataParallel training script converted to PruneX. Every line that differs from the DDP
script is marked ``# PruneX``: DDP's wrap is gone (it would allreduce every gradient every step), and the
optimizer is wrapped instead. Mixed precision (``--amp``) and ``torch.compile`` (``--compile``) stay as they were.

    torchrun --nproc_per_node=4 examples/torchrun_ddp.py --epochs 3                      # one node
    PRUNEX_RANKS_PER_NODE=2 torchrun --nproc_per_node=4 examples/torchrun_ddp.py          # 2 emulated nodes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-endpoint=HOST:29500 examples/torchrun_ddp.py --amp

The data is the handwritten digits set that ships with the package, so the script runs without a download.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import prunex_hvd as px                                                      # PruneX
from prunex_hvd.app.data import load_dataset
from prunex_hvd.app.models import build

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="resnet_small")
ap.add_argument("--epochs", type=int, default=10)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--lr", type=float, default=0.05)
ap.add_argument("--amp", action="store_true", help="autocast + GradScaler")
ap.add_argument("--compile", action="store_true", help="torch.compile the model")
ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: no C++ build)")
ap.add_argument("--sparsity", default="channel:0.5")                         # PruneX
ap.add_argument("--save", default=None, help="write the final model's state_dict here (rank 0)")
args = ap.parse_args()

use_cuda = torch.cuda.is_available()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if use_cuda:
    torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
dist.init_process_group("nccl" if use_cuda else "gloo")
px.init()                                                                    # PruneX: nodes, leaders, groups
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)

data = load_dataset("digits", image_size=16)
norm = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
train_set = TensorDataset((data.train_x.float() / 255 - norm[0]) / norm[1], data.train_y)
test_set = TensorDataset((data.test_x.float() / 255 - norm[0]) / norm[1], data.test_y)
sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=0)
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(0)
model = build(args.model, num_classes=data.num_classes, in_channels=data.in_channels).to(device)
# DDP: model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)    # PruneX: removed
if args.compile:
    model = torch.compile(model, backend=args.compile_backend)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
optimizer = px.DistributedOptimizer(optimizer, model, sparsity=args.sparsity,  # PruneX: the recipe, one round
                                    local_steps=len(loader), coupled=True)      # an epoch, coupled channels
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
scaler = torch.amp.GradScaler(device.type, enabled=args.amp)
amp_dtype = torch.float16 if use_cuda else torch.bfloat16


def evaluate():
    model.eval()
    correct = total = 0
    with optimizer.consensus_weights(), torch.no_grad():                    # PruneX: the pruned model so far
        for x, y in DataLoader(test_set, batch_size=256):
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
            total += len(y)
    model.train()
    return correct / total


for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        optimizer.synchronize()   # PruneX: the node's mean gradient first, so the clip sees what DDP's did
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
    scheduler.step()
    accuracy = evaluate()
    if rank == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}, test accuracy {accuracy:.4f}", flush=True)

optimizer.finalize()                                                          # PruneX: the pruned model
if rank == 0:
    stats = optimizer.stats()                                                 # PruneX
    print(f"PruneX: density {stats['density']:.3f}, {stats['rounds']} rounds, "
          f"{stats['inter_bytes'] / 2**20:.2f} MiB across nodes (dense: {stats['dense_inter_bytes'] / 2**20:.2f})")
    if args.save:
        torch.save(getattr(model, "_orig_mod", model).state_dict(), args.save)
dist.destroy_process_group()
