"""The PyTorch side of `fsdp-bench fsdp_train`: DeepNet/ShallowNet on Fashion-MNIST, one
process or DDP on Gloo (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment), the
same recipe as build/bin/mnist (Adam 1e-3, global batch split over ranks, dropout off).
Prints one JSON line from rank 0."""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist import load, net  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    x, y = load(args.data, True)
    torch.manual_seed(0)
    model = net(args.model == "deep", dropout=False)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(x.shape[0], generator=g)
    local = args.batch_size // world
    seconds, samples = 0.0, 0
    steady_seconds, steady_samples = 0.0, 0  # past the first 2 steps, as the Trainer counts
    for step in range(args.steps):
        start = time.perf_counter()
        idx = perm[step * args.batch_size + rank * local: step * args.batch_size + (rank + 1) * local]
        opt.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        took = time.perf_counter() - start
        seconds += took
        samples += args.batch_size
        if step >= 2:
            steady_seconds += took
            steady_samples += args.batch_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if world > 1:
        dist.barrier()
    if rank == 0:
        steady = steady_samples / steady_seconds if steady_samples else 0.0
        print(json.dumps({"train_samples_per_s": samples / seconds, "train_samples_per_s_steady": steady,
                          "peak_rss_mb": rss,
                          "loss": loss.item(), "world_size": world}), flush=True)


if __name__ == "__main__":
    main()
