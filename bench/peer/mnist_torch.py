"""The PyTorch side of `fsdp-bench fsdp_train`: DeepNet/ShallowNet on Fashion-MNIST, one
process or DDP on Gloo (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment), the
same recipe as build/bin/mnist (Adam 1e-3, global batch split over ranks, dropout off).
Prints one JSON line from rank 0."""
import argparse
import gzip
import json
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530


def load(path, train):
    prefix = "train" if train else "t10k"
    with gzip.open(os.path.join(path, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(path, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - MEAN) / STD
    return x, torch.from_numpy(labels.astype(np.int64))


class Net(nn.Module):
    def __init__(self, deep):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        if deep:
            self.fcs = nn.ModuleList([nn.Linear(9216, 9000), nn.Linear(9000, 1000), nn.Linear(1000, 1000),
                                      nn.Linear(1000, 1000), nn.Linear(1000, 128)])
        else:
            self.fcs = nn.ModuleList([nn.Linear(9216, 128)])
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2).flatten(1)
        x = F.relu(self.fcs[0](x))
        for fc in self.fcs[1:]:
            x = fc(x)
        return F.log_softmax(self.fc2(x), 1)


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
    model = Net(args.model == "deep")
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(x.shape[0], generator=g)
    local = args.batch_size // world
    seconds, samples = 0.0, 0
    for step in range(args.steps):
        start = time.perf_counter()
        idx = perm[step * args.batch_size + rank * local: step * args.batch_size + (rank + 1) * local]
        opt.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        seconds += time.perf_counter() - start
        samples += args.batch_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if world > 1:
        dist.barrier()
    if rank == 0:
        print(json.dumps({"train_samples_per_s": samples / seconds, "peak_rss_mb": rss,
                          "loss": loss.item(), "world_size": world}), flush=True)


if __name__ == "__main__":
    main()
