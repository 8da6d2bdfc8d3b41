#pragma once
// ShallowNet (1.2 M parameters) and DeepNet (94 M) from the seed notebook.

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

namespace fsdp::examples {

class ShallowNetImpl : public torch::nn::Module {
 public:
  ShallowNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
    dropout1 = register_module("dropout1", torch::nn::Dropout(0.25));
    dropout2 = register_module("dropout2", torch::nn::Dropout(0.5));
    fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    namespace F = torch::nn::functional;
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    x = F::max_pool2d(x, F::MaxPool2dFuncOptions(2));
    x = dropout1(x).flatten(1);
    x = dropout2(torch::relu(fc1(x)));
    return torch::log_softmax(fc2(x), 1);
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout1{nullptr}, dropout2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ShallowNet);

class DeepNetImpl : public torch::nn::Module {
 public:
  DeepNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
    dropout1 = register_module("dropout1", torch::nn::Dropout(0.25));
    dropout2 = register_module("dropout2", torch::nn::Dropout(0.5));
    fc1 = register_module("fc1", torch::nn::Linear(9216, 9000));
    fc1a = register_module("fc1a", torch::nn::Linear(9000, 1000));
    fc1b = register_module("fc1b", torch::nn::Linear(1000, 1000));
    fc1c = register_module("fc1c", torch::nn::Linear(1000, 1000));
    fc1d = register_module("fc1d", torch::nn::Linear(1000, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    namespace F = torch::nn::functional;
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    x = F::max_pool2d(x, F::MaxPool2dFuncOptions(2));
    x = dropout1(x).flatten(1);
    x = dropout2(torch::relu(fc1(x)));
    x = fc1d(fc1c(fc1b(fc1a(x))));
    return torch::log_softmax(fc2(x), 1);
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout1{nullptr}, dropout2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc1a{nullptr}, fc1b{nullptr}, fc1c{nullptr}, fc1d{nullptr},
      fc2{nullptr};
};
TORCH_MODULE(DeepNet);

}  // namespace fsdp::examples
