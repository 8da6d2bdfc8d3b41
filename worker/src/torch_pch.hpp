// Precompiled for every target that sees LibTorch (reused with REUSE_FROM fsdp).
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>
