"""Loads a full checkpoint of build/bin/mnist (fsdp-ckpt consolidate: a {name: tensor} pickle)
into the same network written in PyTorch, and prints its Fashion-MNIST test accuracy as JSON.

    python3 mnist_eval.py full.pt [--model shallow|deep] [--data DIR]
"""
import argparse
import gzip
import json
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530  # examples/mnist/fashion_mnist.cpp


def load_test(path):
    def read(name, offset):
        for candidate in (name, name + ".gz"):
            full = os.path.join(path, candidate)
            if os.path.exists(full):
                opener = gzip.open if full.endswith(".gz") else open
                with opener(full, "rb") as f:
                    return np.frombuffer(f.read(), np.uint8, offset=offset)
        raise FileNotFoundError(os.path.join(path, name))
    images = read("t10k-images-idx3-ubyte", 16).reshape(-1, 1, 28, 28).astype(np.float32)
    labels = read("t10k-labels-idx1-ubyte", 8).astype(np.int64)
    return (torch.from_numpy(images) / 255.0 - MEAN) / STD, torch.from_numpy(labels)


def net(deep):
    """examples/mnist/models.hpp, layer for layer and name for name."""
    layers = [("conv1", nn.Conv2d(1, 32, 3)), ("relu1", nn.ReLU()), ("conv2", nn.Conv2d(32, 64, 3)),
              ("relu2", nn.ReLU()), ("pool", nn.MaxPool2d(2)), ("dropout1", nn.Dropout(0.25)),
              ("flatten", nn.Flatten())]
    if deep:
        layers += [("fc1", nn.Linear(9216, 9000)), ("relu3", nn.ReLU()), ("dropout2", nn.Dropout(0.5)),
                   ("fc1a", nn.Linear(9000, 1000)), ("fc1b", nn.Linear(1000, 1000)),
                   ("fc1c", nn.Linear(1000, 1000)), ("fc1d", nn.Linear(1000, 128))]
    else:
        layers += [("fc1", nn.Linear(9216, 128)), ("relu3", nn.ReLU()), ("dropout2", nn.Dropout(0.5))]
    layers += [("fc2", nn.Linear(128, 10)), ("log_softmax", nn.LogSoftmax(1))]
    return nn.Sequential(OrderedDict(layers))


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
    model.eval()
    x, y = load_test(args.data)
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            correct += (model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
    print(json.dumps({"test_accuracy": correct / len(x), "parameters": len(state)}))


if __name__ == "__main__":
    main()
