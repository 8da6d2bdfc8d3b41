#pragma once
// ShallowNet (1.2 M parameters) and DeepNet (94 M) from the seed notebook, as Sequentials:
// FSDP's auto-wrap policy reaches the children of a root Sequential (LibTorch modules have
// no forward hooks, so a unit boundary must be a call FSDP makes). Layer names, order and
// initialisation are the notebook's.

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

namespace fsdp::examples {

struct NetOptions {
  bool dropout = true;  // off for benchmarks that compare step times
};

namespace detail {
// conv1 -> relu -> conv2 -> relu -> maxpool -> dropout -> flatten: 9216 features.
inline void addFeatures(torch::nn::Sequential& net, const NetOptions& options) {
  using namespace torch::nn;
  net->push_back("conv1", Conv2d(Conv2dOptions(1, 32, 3)));
  net->push_back("relu1", ReLU());
  net->push_back("conv2", Conv2d(Conv2dOptions(32, 64, 3)));
  net->push_back("relu2", ReLU());
  net->push_back("pool", MaxPool2d(MaxPool2dOptions(2)));
  if (options.dropout) net->push_back("dropout1", Dropout(0.25));
  net->push_back("flatten", Flatten());
}
}  // namespace detail

inline torch::nn::Sequential makeShallowNet(const NetOptions& options = {}) {
  using namespace torch::nn;
  Sequential net;
  detail::addFeatures(net, options);
  net->push_back("fc1", Linear(9216, 128));
  net->push_back("relu3", ReLU());
  if (options.dropout) net->push_back("dropout2", Dropout(0.5));
  net->push_back("fc2", Linear(128, 10));
  net->push_back("log_softmax", LogSoftmax(1));
  return net;
}

inline torch::nn::Sequential makeDeepNet(const NetOptions& options = {}) {
  using namespace torch::nn;
  Sequential net;
  detail::addFeatures(net, options);
  net->push_back("fc1", Linear(9216, 9000));
  net->push_back("relu3", ReLU());
  if (options.dropout) net->push_back("dropout2", Dropout(0.5));
  net->push_back("fc1a", Linear(9000, 1000));
  net->push_back("fc1b", Linear(1000, 1000));
  net->push_back("fc1c", Linear(1000, 1000));
  net->push_back("fc1d", Linear(1000, 128));
  net->push_back("fc2", Linear(128, 10));
  net->push_back("log_softmax", LogSoftmax(1));
  return net;
}

}  // namespace fsdp::examples
