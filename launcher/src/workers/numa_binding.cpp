#include "numa_binding.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "fsdp/common/env.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::launcher::detail {
namespace {

std::string readLine(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// "0-3,8" -> {0, 1, 2, 3, 8}; what does not parse is left out.
std::vector<int> parseCpuList(const std::string& text) {
  std::vector<int> out;
  std::size_t start = 0;
  while (start < text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    const auto dash = item.find('-');
    const auto lo = parseInt(item.substr(0, dash));
    const auto hi = dash == std::string::npos ? lo : parseInt(item.substr(dash + 1));
    if (!lo || !hi || *lo < 0 || *hi < *lo || *hi > 65535) continue;
    for (long long c = *lo; c <= *hi; ++c) out.push_back(static_cast<int>(c));
  }
  return out;
}

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& allowed) {
  std::vector<int> out;
  std::set_intersection(a.begin(), a.end(), allowed.begin(), allowed.end(), std::back_inserter(out));
  return out;
}

// Groups of CPUs keyed by `key(cpu)` (a package id, a cache's CPU list), ordered by their lowest CPU.
template <typename Key>
std::vector<std::vector<int>> groupBy(const std::vector<int>& cpus, Key key) {
  std::map<std::string, std::vector<int>> byKey;
  for (int c : cpus) {
    const std::string k = key(c);
    if (!k.empty()) byKey[k].push_back(c);
  }
  std::vector<std::vector<int>> groups;
  for (auto& [k, g] : byKey) groups.push_back(std::move(g));
  std::sort(groups.begin(), groups.end());
  return groups;
}

}  // namespace

std::string cpuListText(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

Topology readTopology(const std::string& root) {
  namespace fs = std::filesystem;
  Topology t;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) t.allowed.push_back(c);
    }
  }
  std::error_code ec;
  std::vector<std::pair<int, std::vector<int>>> nodes;
  for (const auto& entry : fs::directory_iterator(fs::path(root) / "devices/system/node", ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("node")) continue;
    const auto id = parseInt(name.substr(4));
    if (!id) continue;
    auto cpus = intersect(parseCpuList(readLine(entry.path() / "cpulist")), t.allowed);
    if (!cpus.empty()) nodes.emplace_back(static_cast<int>(*id), std::move(cpus));
  }
  std::sort(nodes.begin(), nodes.end());
  for (auto& [id, cpus] : nodes) {
    t.numaNodeIds.push_back(id);
    t.numaNodes.push_back(std::move(cpus));
  }
  const fs::path cpuDir = fs::path(root) / "devices/system/cpu";
  t.sockets = groupBy(t.allowed, [&](int c) {
    return readLine(cpuDir / ("cpu" + std::to_string(c)) / "topology/physical_package_id");
  });
  t.l3Groups = groupBy(t.allowed, [&](int c) {
    return readLine(cpuDir / ("cpu" + std::to_string(c)) / "cache/index3/shared_cpu_list");
  });
  // The PCI devices the nvidia driver holds, named by bus address: sorted, the PCI bus order.
  std::vector<std::string> gpus;
  for (const auto& entry : fs::directory_iterator(fs::path(root) / "bus/pci/drivers/nvidia", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.find(':') != std::string::npos) gpus.push_back(name);
  }
  std::sort(gpus.begin(), gpus.end());
  for (const auto& g : gpus) {
    const auto node = parseInt(readLine(fs::path(root) / "bus/pci/drivers/nvidia" / g / "numa_node"));
    t.gpuNodes.push_back(node && *node >= 0 ? static_cast<int>(*node) : -1);
  }
  return t;
}

std::vector<int> gpusOfWorkers(int localWorkers, int gpus, const std::optional<std::string>& visible) {
  if (gpus <= 0 || localWorkers > gpus) return {};  // a CPU job, or more workers than GPUs
  std::vector<int> listed;
  if (visible) {
    std::size_t start = 0;
    while (start <= visible->size()) {
      const auto end = std::min(visible->find(',', start), visible->size());
      const auto index = parseInt(visible->substr(start, end - start));
      if (!index) return {};  // UUIDs or MIG names: not placed by GPU
      listed.push_back(static_cast<int>(*index));
      start = end + 1;
    }
  }
  if (!listed.empty() && static_cast<int>(listed.size()) < localWorkers) return {};
  std::vector<int> out;
  for (int k = 0; k < localWorkers; ++k) {
    const int gpu = listed.empty() ? k : listed[static_cast<std::size_t>(k)];
    if (gpu < 0 || gpu >= gpus) return {};
    out.push_back(gpu);
  }
  return out;
}

namespace {

// Near each worker's GPU: its NUMA node's CPUs, split or grouped as `mode` says among the workers
// whose GPUs share that node. False when some worker's GPU node is unknown.
bool planNearGpus(const std::string& mode, const Topology& t, const std::vector<int>& gpuOfWorker,
                  std::vector<Binding>& out) {
  std::vector<std::size_t> nodeOf;  // index into t.numaNodes, per worker
  for (const int gpu : gpuOfWorker) {
    if (gpu < 0 || gpu >= static_cast<int>(t.gpuNodes.size())) return false;
    int node = t.gpuNodes[static_cast<std::size_t>(gpu)];
    if (node < 0 && t.numaNodeIds.size() == 1) node = t.numaNodeIds.front();  // -1: no NUMA to speak of
    const auto at = std::find(t.numaNodeIds.begin(), t.numaNodeIds.end(), node);
    if (at == t.numaNodeIds.end()) return false;
    nodeOf.push_back(static_cast<std::size_t>(at - t.numaNodeIds.begin()));
  }
  for (std::size_t k = 0; k < out.size(); ++k) {
    const auto& cpus = t.numaNodes[nodeOf[k]];
    // This worker's place among those on the same node.
    const auto sharing = static_cast<std::size_t>(std::count(nodeOf.begin(), nodeOf.end(), nodeOf[k]));
    const auto place = static_cast<std::size_t>(std::count(nodeOf.begin(), nodeOf.begin() + static_cast<std::ptrdiff_t>(k), nodeOf[k]));
    if (mode == "exclusive") {
      const auto n = cpus.size();
      out[k].cpus = n < sharing ? std::vector<int>{cpus[place % n]}
                                : std::vector<int>(cpus.begin() + static_cast<std::ptrdiff_t>(place * n / sharing),
                                                   cpus.begin() + static_cast<std::ptrdiff_t>((place + 1) * n / sharing));
    } else if (mode == "socket") {
      out[k].cpus = cpus;
      for (const auto& s : t.sockets) {
        if (std::binary_search(s.begin(), s.end(), cpus.front())) out[k].cpus = s;
      }
    } else if (mode == "core-complex") {
      std::vector<std::vector<int>> within;
      for (const auto& g : t.l3Groups) {
        if (!intersect(g, cpus).empty()) within.push_back(intersect(g, cpus));
      }
      out[k].cpus = within.empty() ? cpus : within[place % within.size()];
    } else {
      out[k].cpus = cpus;
    }
  }
  return true;
}

}  // namespace

namespace {

// By local rank: an even split of the allowed CPUs (exclusive), or the nodes, sockets or L3
// groups round robin. False when the kernel lists none of what `mode` needs.
bool planByLocalRank(const std::string& mode, const Topology& topology, std::string& note, std::vector<Binding>& out) {
  const auto& allowed = topology.allowed;
  if (mode == "exclusive") {
    const auto n = allowed.size();
    const auto w = out.size();
    if (n < w) {
      note = std::to_string(n) + (n == 1 ? " CPU for " : " CPUs for ") + std::to_string(w) +
             " workers: exclusive binding gives each worker one CPU, some shared";
    }
    for (std::size_t i = 0; i < w; ++i) {
      if (n < w) {
        out[i].cpus = {allowed[i % n]};
      } else {
        out[i].cpus.assign(allowed.begin() + static_cast<std::ptrdiff_t>(i * n / w),
                           allowed.begin() + static_cast<std::ptrdiff_t>((i + 1) * n / w));
      }
    }
    return true;
  }
  const std::vector<std::vector<int>>* groups = nullptr;
  std::string what;
  if (mode == "node") {
    groups = &topology.numaNodes;
    what = "NUMA nodes";
  } else if (mode == "socket") {
    groups = &topology.sockets;
    what = "sockets";
  } else {
    groups = topology.l3Groups.empty() ? &topology.sockets : &topology.l3Groups;
    what = topology.l3Groups.empty() ? "L3 caches (none listed: sockets instead)" : "L3 caches";
  }
  if (groups->empty()) {
    note = "the kernel lists no " + what + " (sysfs): workers are not bound";
    return false;
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i].cpus = (*groups)[i % groups->size()];
  return true;
}

}  // namespace

std::vector<Binding> planBindings(const std::string& mode, int localWorkers, const Topology& topology,
                                  std::string& note, const std::vector<int>& gpuOfWorker) {
  std::vector<Binding> out(static_cast<std::size_t>(std::max(localWorkers, 0)));
  if (topology.allowed.empty() || localWorkers <= 0) {
    note = "no CPUs to bind to could be read (sched_getaffinity): workers are not bound";
    return out;
  }
  const bool nearGpus =
      gpuOfWorker.size() == out.size() && planNearGpus(mode, topology, gpuOfWorker, out);
  if (!nearGpus) {
    if (!gpuOfWorker.empty()) note = "a GPU's NUMA node is unknown (sysfs): workers placed by local rank";
    if (!planByLocalRank(mode, topology, note, out)) return out;
  }
  // Memory follows the CPUs where there is more than one node to choose from.
  if (topology.numaNodes.size() > 1) {
    for (auto& b : out) {
      for (std::size_t k = 0; k < topology.numaNodes.size(); ++k) {
        if (!intersect(topology.numaNodes[k], b.cpus).empty()) b.memNodes.push_back(topology.numaNodeIds[k]);
      }
    }
  }
  return out;
}

std::vector<Binding> numaBindings(const LaunchOptions& options) {
  if (options.numaBinding.empty()) return {};
  std::string note;
  const auto topology = readTopology();
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const auto gpus = gpusOfWorkers(options.nprocPerNode, static_cast<int>(topology.gpuNodes.size()),
                                  visible ? std::optional<std::string>(visible) : std::nullopt);
  auto plan = planBindings(options.numaBinding, options.nprocPerNode, topology, note, gpus);
  if (!note.empty()) log::warn("--numa_binding {}: {}", options.numaBinding, note);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].cpus.empty()) continue;
    std::string nodes;
    for (int n : plan[i].memNodes) nodes += (nodes.empty() ? "" : ",") + std::to_string(n);
    log::info("--numa_binding {}: local rank {} on CPUs {}{}", options.numaBinding, i, cpuListText(plan[i].cpus),
              nodes.empty() ? "" : ", memory on NUMA node(s) " + nodes);
  }
  return plan;
}

}  // namespace fsdp::launcher::detail
