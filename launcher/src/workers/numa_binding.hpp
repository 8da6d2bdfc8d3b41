// --numa_binding: which CPUs (and, where the machine has several NUMA nodes, which memory nodes)
// each local worker is bound to, as torchrun 2.x's option of that name, from the kernel's
// topology in sysfs and the CPUs this agent may use (its own affinity: Slurm's and cgroups' limits
// hold). On a GPU node each worker is placed near its GPU (the NUMA node sysfs gives the PCI
// device the nvidia driver holds, in PCI bus order, the order CUDA_VISIBLE_DEVICES indexes with
// CUDA_DEVICE_ORDER=PCI_BUS_ID and nvidia-smi lists); elsewhere by local rank.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "fsdp/launcher/options.hpp"

namespace fsdp::launcher::detail {

struct Topology {
  std::vector<int> allowed;                 // CPUs this process may run on, ascending
  std::vector<std::vector<int>> numaNodes;  // each node's CPUs (node ids in `numaNodeIds`)
  std::vector<int> numaNodeIds;
  std::vector<std::vector<int>> sockets;    // each package's CPUs
  std::vector<std::vector<int>> l3Groups;   // CPUs sharing one last-level (L3) cache
  std::vector<int> gpuNodes;                // each GPU's NUMA node in PCI bus order (-1: unknown)
};

struct Binding {
  std::vector<int> cpus;      // empty: not bound
  std::vector<int> memNodes;  // NUMA nodes for the memory policy; empty: the kernel's default
};

// This machine's topology (sysfs under `root`, normally "/sys").
Topology readTopology(const std::string& root = "/sys");

// The binding of each of `localWorkers` workers for `mode` (node, socket, exclusive,
// core-complex); `note` gets one line where the machine cannot give what the mode means (fewer
// CPUs than workers for exclusive). `gpuOfWorker[k]`: worker k's GPU (an index into gpuNodes);
// empty, or a GPU whose node is unknown: placed by local rank. Pure: tested on made-up topologies.
std::vector<Binding> planBindings(const std::string& mode, int localWorkers, const Topology& topology,
                                  std::string& note, const std::vector<int>& gpuOfWorker = {});

// Worker k's GPU: the k-th entry of CUDA_VISIBLE_DEVICES where it lists indices, else k; empty
// (placed by local rank) when the machine shows no GPU, has fewer GPUs than workers (a CPU job on
// a GPU node) or the list names GPUs by UUID.
std::vector<int> gpusOfWorkers(int localWorkers, int gpus, const std::optional<std::string>& visible);

// The agent's bindings for options.numaBinding (none when empty), each logged in one line.
std::vector<Binding> numaBindings(const LaunchOptions& options);

// "0-3,8" for the CPUs 0 1 2 3 8.
std::string cpuListText(const std::vector<int>& cpus);

}  // namespace fsdp::launcher::detail
