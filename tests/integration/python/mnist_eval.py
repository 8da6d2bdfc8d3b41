"""Loads a full checkpoint of build/bin/mnist (fsdp-ckpt consolidate: a {name: tensor} pickle)
into the same network written in PyTorch, and prints its Fashion-MNIST test accuracy as JSON.

    python3 mnist_eval.py full.pt [--model shallow|deep] [--data DIR]
"""
import argparse
import json
import os
import sys

import torch

# The PyTorch twin of examples/mnist, shared with the benchmarks.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench", "peer"))
from fashion_mnist import accuracy, load, net  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--model", default="shallow", choices=["shallow", "deep"])
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = net(args.model == "deep")
    state = torch.load(args.checkpoint)
    model.load_state_dict(state)  # strict: every name and shape must match
    x, y = load(args.data, False)
    print(json.dumps({"test_accuracy": accuracy(model, x, y), "parameters": len(state)}))


if __name__ == "__main__":
    main()
