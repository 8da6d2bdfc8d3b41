#pragma once
// A minGPT-style decoder: token + position embeddings, n_layer pre-norm transformer blocks
// (causal self-attention, GELU MLP), a final LayerNorm and a linear head. Built as a
// Sequential so that FSDP can wrap each Block as a unit (AutoWrapPolicy::byTypeName).

#include <ATen/Functions.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

namespace fsdp::examples {

struct GptConfig {
  std::int64_t vocabSize = 256;
  std::int64_t blockSize = 128;
  std::int64_t nLayer = 4;
  std::int64_t nHead = 4;
  std::int64_t nEmbd = 128;
};

class EmbeddingsImpl : public torch::nn::Module {
 public:
  explicit EmbeddingsImpl(const GptConfig& c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocabSize, c.nEmbd));
    pos = register_parameter("pos", at::zeros({1, c.blockSize, c.nEmbd}));
    torch::NoGradGuard noGrad;
    torch::nn::init::normal_(tok->weight, 0.0, 0.02);
    torch::nn::init::normal_(pos, 0.0, 0.02);
  }
  // idx: [B, T] token ids -> [B, T, C]
  torch::Tensor forward(torch::Tensor idx) {
    return tok(idx) + pos.narrow(1, 0, idx.size(1));
  }
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
};
TORCH_MODULE(Embeddings);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c) : nHead_(c.nHead) {
    using namespace torch::nn;
    ln1 = register_module("ln1", LayerNorm(LayerNormOptions({c.nEmbd})));
    qkv = register_module("qkv", Linear(c.nEmbd, 3 * c.nEmbd));
    proj = register_module("proj", Linear(c.nEmbd, c.nEmbd));
    ln2 = register_module("ln2", LayerNorm(LayerNormOptions({c.nEmbd})));
    fc = register_module("fc", Linear(c.nEmbd, 4 * c.nEmbd));
    fcProj = register_module("fc_proj", Linear(4 * c.nEmbd, c.nEmbd));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attention(ln1(x));
    return x + fcProj(torch::nn::functional::gelu(fc(ln2(x))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fcProj{nullptr};

 private:
  torch::Tensor attention(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2);
    const auto parts = qkv(x).split(c, 2);
    const auto heads = [&](const torch::Tensor& y) {
      return y.view({b, t, nHead_, c / nHead_}).transpose(1, 2);
    };
    const auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    auto att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(c / nHead_)));
    const auto future = at::ones({t, t}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    att = at::softmax(att.masked_fill(future, -INFINITY), -1);
    return proj(at::matmul(att, v).transpose(1, 2).contiguous().view({b, t, c}));
  }
  std::int64_t nHead_;
};
TORCH_MODULE(Block);

inline torch::nn::Sequential makeGpt(const GptConfig& c) {
  torch::nn::Sequential net;
  net->push_back("embed", Embeddings(c));
  for (std::int64_t i = 0; i < c.nLayer; ++i) net->push_back("block" + std::to_string(i), Block(c));
  net->push_back("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.nEmbd})));
  net->push_back("head", torch::nn::Linear(torch::nn::LinearOptions(c.nEmbd, c.vocabSize).bias(false)));
  return net;
}

}  // namespace fsdp::examples
