"""A plain PyTorch DDP program, unchanged for fsdprun: env:// init, Gloo, CPU.

Trains a small seeded MLP with DistributedDataParallel for --steps steps, each rank on its own
shard of a seeded global batch, then checks what DDP promises:
  - every rank ends with the same parameters (all_gather of the flattened parameters);
  - those parameters are the ones one process gets training the same model on the whole global
    batch (rank 0 trains that reference itself), within --atol;
  - the loss went down.
Also checks the torchrun environment a DDP program reads (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prints one line per rank; exits non-zero naming
what was wrong.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(steps, world, per_rank):
    """The global batches, the same on every rank: inputs and the class a fixed linear teacher
    gives them (a task the model can learn, so that the loss goes down)."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(20, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(world * per_rank, 20, generator=g)
        out.append((x, (x @ teacher).argmax(dim=1)))
    return out


def train(net, data, lr, shard=None):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        if shard is not None:
            x, y = x[shard], y[shard]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per_rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args()
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT") if v not in os.environ]
    if missing:
        print(f"ddp_train: the environment lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.steps, world, args.per_rank)
    ddp = DDP(model())
    shard = slice(rank * args.per_rank, (rank + 1) * args.per_rank)
    losses = train(ddp, data, args.lr, shard)

    mine = flat(ddp.module)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    problems = []
    spread = max((p - mine).abs().max().item() for p in everyone)
    if spread != 0.0:
        problems.append(f"ranks differ by up to {spread:g} after {args.steps} steps")
    versus = ""
    if rank == 0:
        reference = model()
        ref_losses = train(reference, data, args.lr)
        diff = (flat(reference) - mine).abs().max().item()
        versus = f", one process on the whole batch: max |diff| {diff:.2e}"
        if not diff <= args.atol:
            problems.append(f"parameters differ from one process's by {diff:g} (atol {args.atol:g})")
        if not ref_losses[-1] < ref_losses[0]:
            problems.append(f"the reference loss did not go down: {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    if problems:
        print(f"rank {rank} of {world}: ddp FAILED: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(f"rank {rank} of {world}: ddp ok (torch {torch.__version__}, {args.steps} steps, "
          f"local rank {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']}, "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{versus})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
