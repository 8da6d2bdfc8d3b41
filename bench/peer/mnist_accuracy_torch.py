"""The PyTorch side of `fsdp-bench accuracy`: build/bin/mnist's recipe in one PyTorch process
(Adam, global batch, dropout, a fresh shuffle per epoch, the test set after the last epoch).
Prints one JSON line."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist import accuracy, load, net  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--model", default="deep", choices=["shallow", "deep"])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x, y = load(args.data, True)
    tx, ty = load(args.data, False)
    model = net(args.model == "deep")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed + epoch + 1))
        for i in range(0, len(x), args.batch_size):
            idx = perm[i:i + args.batch_size]
            opt.zero_grad()
            F.nll_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - start
    print(json.dumps({"test_accuracy": accuracy(model, tx, ty), "train_seconds": seconds,
                      "train_samples_per_s": args.epochs * len(x) / seconds}), flush=True)


if __name__ == "__main__":
    main()
