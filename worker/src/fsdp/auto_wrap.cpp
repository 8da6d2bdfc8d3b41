// Auto-wrap: which modules become units, from the policy, bottom-up as PyTorch's
// auto_wrap_policy does. LibTorch modules have no forward hooks, so FSDP can only put a unit
// where it controls the call: a child of a Sequential that a unit holds (the root's own
// Sequential, or an fsdp::Unit's). A pick anywhere else is lifted to the nearest enclosing
// unit, and refused with the fix when that unit is the root (auto-wrap would do nothing).
#include <torch/nn/modules/container/any.h>

#include <sstream>

#include "builder.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::worker::detail {
namespace {

std::int64_t ownParams(const torch::nn::Module& module) {
  std::int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/false)) n += p.numel();
  return n;
}

}  // namespace

std::string FsdpBuilder::innerPrefix(const UnitImpl& unit, const std::string& path) const {
  if (&unit == &root_ || autoUnits_.count(&unit) != 0) return path;
  return joinPath(path, "module");
}

void FsdpBuilder::autoWrap() {
  planning_ = true;  // a first pass changes nothing: a refusal leaves the user's model as it was
  wrapUnitInner(root_, "");
  planning_ = false;
  wrapUnitInner(root_, "");
}

// The children of the Sequential a unit holds can become units: the Sequential is rebuilt
// with them wrapped. A unit holding another module: its members are visited, never wrapped.
void FsdpBuilder::wrapUnitInner(UnitImpl& unit, const std::string& path) {
  const std::string prefix = innerPrefix(unit, path);
  std::vector<Lift> lifts;  // picks whose parameters stay in this unit
  std::vector<Lift> heldBelow;  // picks whose parameters a unit made below holds
  const auto names = unit.sequential_ ? unit.sequential_->named_children()
                                      : torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>();
  // A Sequential with modules registered besides its list cannot be rebuilt name for name.
  if (!unit.sequential_ || names.size() != unit.sequential_->size()) {
    visitMember(*unit.inner_ptr_, prefix, lifts);
  } else {
    const auto& policy = state_.options_.autoWrap.predicate;
    torch::nn::Sequential rebuilt;
    std::size_t i = 0;
    for (const auto& child : *unit.sequential_) {
      const std::string& name = names[i++].key();
      const std::string childPath = joinPath(prefix, name);
      const auto ptr = child.ptr();
      if (auto existing = wrapped_.find(ptr.get()); existing != wrapped_.end()) {
        rebuilt->push_back(name, torch::nn::AnyModule(Unit(existing->second)));  // used twice
        continue;
      }
      if (auto childUnit = std::dynamic_pointer_cast<UnitImpl>(ptr)) {
        wrapUnitInner(*childUnit, childPath);
        rebuilt->push_back(name, child);
        continue;
      }
      std::vector<Lift> inside;
      const std::int64_t count = visitMember(*ptr, childPath, inside);
      auto& into = count > 0 && policy(*ptr, childPath, count) ? heldBelow : lifts;
      into.insert(into.end(), inside.begin(), inside.end());
      if (planning_) continue;
      if (&into == &heldBelow) {
        auto made = std::make_shared<UnitImpl>(child);
        autoUnits_.insert(made.get());
        wrapped_.emplace(ptr.get(), made);
        rebuilt->push_back(name, torch::nn::AnyModule(Unit(made)));
      } else {
        rebuilt->push_back(name, child);
      }
    }
    if (!planning_) {
      // What is registered on the Sequential itself (a mask, a scale) goes with it, the same tensors.
      for (const auto& p : unit.sequential_->named_parameters(/*recurse=*/false)) {
        rebuilt->register_parameter(p.key(), p.value(), p.value().requires_grad());
      }
      for (const auto& b : unit.sequential_->named_buffers(/*recurse=*/false)) {
        rebuilt->register_buffer(b.key(), b.value());
      }
      unit.sequential_ = rebuilt;
      unit.inner_ptr_ = unit.replace_module("module", rebuilt.ptr());
    }
  }
  if (&unit == &root_ && !lifts.empty()) refuseLifts(lifts);
  heldBelow.insert(heldBelow.end(), lifts.begin(), lifts.end());
  if (!heldBelow.empty() && !planning_) {
    std::ostringstream paths;
    for (std::size_t k = 0; k < heldBelow.size() && k < 4; ++k) {
      paths << (k > 0 ? ", '" : "'") << heldBelow[k].path << "'";
    }
    if (heldBelow.size() > 4) paths << " and " << heldBelow.size() - 4 << " more";
    log::warn("fsdp: the auto-wrap policy picks {} module(s) FSDP cannot make units of (members "
              "of modules whose forward it does not control): {}; the enclosing units hold them",
              heldBelow.size(), paths.str());
  }
}

void FsdpBuilder::refuseLifts(const std::vector<Lift>& lifts) const {
  const Lift& first = lifts.front();
  const std::string parent =
      first.parent.empty() ? "the root module (" + shortTypeName(root_.inner_ptr_->name()) + ")"
                           : "'" + first.parent + "'";
  const std::string member = first.path.substr(first.path.rfind('.') + 1);
  throw ConfigError(
      "fsdp: the auto-wrap policy picks '" + first.path + "' (" + first.type + ", " +
      std::to_string(first.numParams) + " parameters)" +
      (lifts.size() > 1 ? " and " + std::to_string(lifts.size() - 1) + " more" : "") +
      ", a member of " + parent +
      ", whose forward FSDP cannot intercept (LibTorch modules have no forward hooks): declare it "
      "an fsdp::Unit member (" + member + " = register_module(\"" + member +
      "\", fsdp::Unit(...))) or build the model as a torch::nn::Sequential of its blocks");
}

// A module whose forward FSDP does not control: returns its parameters that are in no unit
// below it, and records the picks among its members as lifts.
std::int64_t FsdpBuilder::visitMember(torch::nn::Module& module, const std::string& path,
                                      std::vector<Lift>& lifts) {
  const auto& policy = state_.options_.autoWrap.predicate;
  std::int64_t count = ownParams(module);
  for (const auto& child : module.named_children()) {
    const std::string childPath = joinPath(path, child.key());
    if (auto* unit = dynamic_cast<UnitImpl*>(child.value().get())) {
      wrapUnitInner(*unit, childPath);
      continue;
    }
    const std::int64_t inner = visitMember(*child.value(), childPath, lifts);
    if (inner > 0 && policy(*child.value(), childPath, inner)) {
      lifts.push_back({childPath, shortTypeName(child.value()->name()), path, inner});
    }
    count += inner;
  }
  return count;
}

}  // namespace fsdp::worker::detail
