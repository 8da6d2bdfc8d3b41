#pragma once
// Everything done once when a model is wrapped: the shard groups, checks that every rank has
// the same model, auto-wrap (policy -> units), unit discovery, flattening and the gradient
// hooks. Private to libfsdp.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "state.hpp"

namespace fsdp::worker::detail {

// All-gathers this rank's model digest (4 words: 16 bytes of a hash of names, shapes and dtypes,
// the parameter count, the element count) and whether this rank is a survivor of an earlier
// round (re-forming in process), and throws ConfigError naming the first rank whose model
// differs. Construction, and its replay after a re-formation. Returns whether any rank of the
// group is such a survivor: the round's state then comes from a restore (reform.hpp), not from
// rank 0's weights.
enum class CheckedBy { kConstructor, kSurvivor };
bool compareModelDigests(Communicator& comm, const at::Tensor& mine, CheckedBy by);

class FsdpBuilder {
 public:
  FsdpBuilder(FsdpState& state, UnitImpl& root) : state_(state), root_(root) {}
  // Throws ConfigError for bad use, naming the module or parameter.
  void build();

 private:
  // A module the policy picked where FSDP cannot make a unit (a member of a module whose
  // forward it does not control): its parameters stay with the nearest enclosing unit.
  struct Lift {
    std::string path;
    std::string type;
    std::string parent;
    std::int64_t numParams = 0;
  };

  void chooseGroups();
  void recordOriginalOrder();
  void checkParameters();
  void checkSameModelEverywhere();
  void syncModuleStates();

  // Auto-wrap (auto_wrap.cpp): children of the Sequentials that units hold (the root's
  // included) become units as the policy says, bottom-up; picks FSDP cannot reach are lifted
  // to the enclosing unit, with one warning, or refused when that unit is the root.
  void autoWrap();
  void wrapUnitInner(UnitImpl& unit, const std::string& path);
  [[noreturn]] void refuseLifts(const std::vector<Lift>& lifts) const;
  std::int64_t visitMember(torch::nn::Module& module, const std::string& path,
                           std::vector<Lift>& lifts);
  std::string innerPrefix(const UnitImpl& unit, const std::string& path) const;

  void discover();
  int addUnit(UnitImpl& module, const std::string& path);
  void discover(torch::nn::Module& module, int owner, const std::string& prefix);
  void assign(int owner, const std::string& path, const at::Tensor& param);
  void flatten(int u);
  void buildFlat(UnitRecord& unit, FlatParam& flat);
  void registerHooks(int u);

  FsdpState& state_;
  UnitImpl& root_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> originalIndex_;
  std::vector<std::string> originalNames_;
  std::vector<at::Tensor> originals_;
  std::unordered_map<const c10::TensorImpl*, int> owner_;
  std::vector<std::vector<ParamSlot>> slotsByUnit_;
  // Units made by auto-wrap: their children keep their original paths (no ".module").
  std::unordered_set<const UnitImpl*> autoUnits_;
  bool planning_ = false;  // auto-wrap's first pass: decide and refuse, change nothing
  // The model check found a survivor of an earlier round in the group: syncModuleStates
  // broadcasts nothing (the round's restore writes every parameter and buffer).
  bool joinsSurvivors_ = false;
  // The unit made for a module, so that a module used twice becomes one unit.
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<UnitImpl>> wrapped_;
};

// "fsdp::examples::BlockImpl" -> "Block".
std::string shortTypeName(std::string name);
// A module's dotted path: "" + "0" -> "0", "0" + "fc" -> "0.fc".
std::string joinPath(const std::string& prefix, const std::string& name);

}  // namespace fsdp::worker::detail
