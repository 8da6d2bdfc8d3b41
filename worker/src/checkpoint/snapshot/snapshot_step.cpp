// An optimizer step that writes its results into new memory (snapshot.hpp, detail::stepInto):
// Adam's and AdamW's operations as LibTorch's step() performs them, with each first write to a
// tensor made out of place. The kernels are the same (an in-place ATen op is its out= variant
// with out = self), so the values are the same bits; the memory traffic is the same too, so a
// snapshot whose tensors are the step's outputs costs no copy. The operations and their order
// are those of torch/csrc/api/src/optim/adam.cpp and adamw.cpp in 1.13 and in 2.x alike (2.x
// changed only the state's key: torch_compat.hpp). snapshot_step_test compares against the
// step() of the LibTorch it is built with, so a later change of arithmetic fails there.
#include <ATen/ScalarOps.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>

#include "checkpoint/checkpoint_internal.hpp"
#include "fsdp/worker/snapshot.hpp"
#include "fsdp/worker/torch_compat.hpp"

namespace fsdp::worker::detail {

namespace {

bool steppable(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && !t.is_sparse() && t.is_contiguous() && t.sizes() == like.sizes() &&
         t.scalar_type() == like.scalar_type() && t.device() == like.device();
}

// `out` = `self` * `factor`, as self.mul_(factor) computes it (a wrapped scalar, so the result
// keeps self's dtype).
void scaleInto(at::Tensor& out, const at::Tensor& self, double factor) {
  at::mul_out(out, self, at::native::wrapped_scalar_tensor(factor));
}

struct Moved {
  at::Tensor param, expAvg, expAvgSq, maxExpAvgSq;
};

template <typename State, typename Options>
bool adamLike(at::Tensor& scratch, torch::optim::Optimizer& o, bool decoupled, const PlaceFn& place) {
  // Everything is checked before anything changes: all or nothing.
  for (auto& group : o.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto it = o.state().find(compat::optimizerStateKey(o.state(), p));
      if (it == o.state().end()) return false;  // the first step creates the state in place
      const auto& s = static_cast<const State&>(*it->second);
      if (!p.is_contiguous() || !steppable(p.grad(), p) || !steppable(s.exp_avg(), p) ||
          !steppable(s.exp_avg_sq(), p) || (options.amsgrad() && !steppable(s.max_exp_avg_sq(), p))) {
        return false;
      }
    }
  }
  at::NoGradGuard noGrad;
  for (auto& group : o.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& s = static_cast<State&>(*o.state().at(compat::optimizerStateKey(o.state(), p)));
      Moved to{place(p, "param"), place(p, "exp_avg"), place(p, "exp_avg_sq"),
               options.amsgrad() ? place(p, "max_exp_avg_sq") : at::Tensor()};
      at::Tensor grad = p.grad();
      s.step(s.step() + 1);
      const double beta1 = std::get<0>(options.betas());
      const double beta2 = std::get<1>(options.betas());
      const double biasCorrection1 = 1 - std::pow(beta1, s.step());
      const double biasCorrection2 = 1 - std::pow(beta2, s.step());
      at::Tensor source = p;  // where the parameter's current values are
      if (decoupled) {
        if (options.weight_decay() != 0) {
          scaleInto(to.param, p, 1 - options.lr() * options.weight_decay());
          source = to.param;
        }
      } else if (options.weight_decay() != 0) {
        grad = grad.add(p, options.weight_decay());
      }
      scaleInto(to.expAvg, s.exp_avg(), beta1);
      to.expAvg.add_(grad, 1 - beta1);
      scaleInto(to.expAvgSq, s.exp_avg_sq(), beta2);
      to.expAvgSq.addcmul_(grad, grad, 1 - beta2);
      // The denominator in reused memory: LibTorch's step allocates two temporaries of the
      // parameter's size here, which the kernel zeroes again every step.
      if (scratch.numel() < p.numel() || scratch.device() != p.device() || scratch.scalar_type() != p.scalar_type()) {
        scratch = at::empty({p.numel()}, p.options().requires_grad(false));
      }
      at::Tensor denom = scratch.narrow(0, 0, p.numel()).view(p.sizes());
      if (options.amsgrad()) {
        at::max_out(to.maxExpAvgSq, to.expAvgSq, s.max_exp_avg_sq());
        at::sqrt_out(denom, to.maxExpAvgSq);
      } else {
        at::sqrt_out(denom, to.expAvgSq);
      }
      denom.div_(std::sqrt(biasCorrection2)).add_(options.eps());
      const double stepSize = options.lr() / biasCorrection1;
      at::addcdiv_out(to.param, source, to.expAvg, denom, -stepSize);
      // Every holder of these tensors (the module, the optimizer, FSDP) sees the new memory.
      p.set_(to.param);
      s.exp_avg().set_(to.expAvg);
      s.exp_avg_sq().set_(to.expAvgSq);
      if (options.amsgrad()) s.max_exp_avg_sq().set_(to.maxExpAvgSq);
    }
  }
  return true;
}

}  // namespace

bool stepInto(torch::optim::Optimizer& optimizer, const PlaceFn& place) {
  thread_local at::Tensor scratch;  // the largest parameter's denominator, kept for the next step
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    return adamLike<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(scratch, optimizer, true, place);
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    return adamLike<torch::optim::AdamParamState, torch::optim::AdamOptions>(scratch, optimizer, false, place);
  }
  return false;
}

}  // namespace fsdp::worker::detail
