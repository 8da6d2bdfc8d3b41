"""Fashion-MNIST and the seed notebook's networks in PyTorch, exactly as build/bin/mnist has
them (examples/mnist/models.hpp, fashion_mnist.cpp): the same normalisation, layers and layer
names, so that a state dict of either side loads into the other."""
import gzip
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530


def load(path, train):
    """(images [N, 1, 28, 28] float32 normalised, labels [N] int64) from the IDX files."""
    prefix = "train" if train else "t10k"

    def read(name, offset):
        for candidate in (name, name + ".gz"):
            full = os.path.join(path, candidate)
            if os.path.exists(full):
                opener = gzip.open if full.endswith(".gz") else open
                with opener(full, "rb") as f:
                    return np.frombuffer(f.read(), np.uint8, offset=offset)
        raise FileNotFoundError(os.path.join(path, name))

    images = read(f"{prefix}-images-idx3-ubyte", 16).reshape(-1, 1, 28, 28).astype(np.float32)
    labels = read(f"{prefix}-labels-idx1-ubyte", 8).astype(np.int64)
    return (torch.from_numpy(images) / 255.0 - MEAN) / STD, torch.from_numpy(labels)


def net(deep, dropout=True):
    """ShallowNet (1.2 M parameters) or DeepNet (94 M)."""
    layers = [("conv1", nn.Conv2d(1, 32, 3)), ("relu1", nn.ReLU()), ("conv2", nn.Conv2d(32, 64, 3)),
              ("relu2", nn.ReLU()), ("pool", nn.MaxPool2d(2))]
    if dropout:
        layers.append(("dropout1", nn.Dropout(0.25)))
    layers.append(("flatten", nn.Flatten()))
    if deep:
        layers += [("fc1", nn.Linear(9216, 9000)), ("relu3", nn.ReLU())]
        if dropout:
            layers.append(("dropout2", nn.Dropout(0.5)))
        layers += [("fc1a", nn.Linear(9000, 1000)), ("fc1b", nn.Linear(1000, 1000)),
                   ("fc1c", nn.Linear(1000, 1000)), ("fc1d", nn.Linear(1000, 128))]
    else:
        layers += [("fc1", nn.Linear(9216, 128)), ("relu3", nn.ReLU())]
        if dropout:
            layers.append(("dropout2", nn.Dropout(0.5)))
    layers += [("fc2", nn.Linear(128, 10)), ("log_softmax", nn.LogSoftmax(1))]
    return nn.Sequential(OrderedDict(layers))


def accuracy(model, x, y, batch=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    return correct / len(x)
