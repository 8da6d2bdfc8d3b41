// --numa_binding's plan on made-up topologies (launcher/src/workers/numa_binding.hpp), and the
// launcher's error file in torchrun's shape (torchrunErrorJson).
#include "workers/numa_binding.hpp"

#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>
#include <set>

#include "fsdp/launcher/agent.hpp"

namespace {

using fsdp::launcher::detail::cpuListText;
using fsdp::launcher::detail::planBindings;
using fsdp::launcher::detail::Topology;

std::vector<int> range(int lo, int hi) {
  std::vector<int> out;
  for (int c = lo; c < hi; ++c) out.push_back(c);
  return out;
}

// Two sockets of 8 CPUs, one NUMA node each, two L3 complexes of 4 per socket.
Topology twoSockets() {
  Topology t;
  t.allowed = range(0, 16);
  t.numaNodes = {range(0, 8), range(8, 16)};
  t.numaNodeIds = {0, 1};
  t.sockets = t.numaNodes;
  t.l3Groups = {range(0, 4), range(4, 8), range(8, 12), range(12, 16)};
  return t;
}

TEST(NumaBinding, ExclusiveSplitsTheAllowedCpusEvenlyAndDisjointly) {
  std::string note;
  for (int workers = 1; workers <= 16; ++workers) {
    const auto plan = planBindings("exclusive", workers, twoSockets(), note);
    ASSERT_EQ(plan.size(), static_cast<std::size_t>(workers));
    std::set<int> seen;
    for (const auto& b : plan) {
      EXPECT_GE(b.cpus.size(), static_cast<std::size_t>(16 / workers)) << workers;
      EXPECT_LE(b.cpus.size(), static_cast<std::size_t>((16 + workers - 1) / workers)) << workers;
      for (int c : b.cpus) EXPECT_TRUE(seen.insert(c).second) << "CPU " << c << " twice, " << workers << " workers";
      EXPECT_FALSE(b.memNodes.empty());
    }
    EXPECT_EQ(seen.size(), 16u) << workers;
  }
  EXPECT_TRUE(note.empty()) << note;
  // 4 workers: each within one socket, its memory there.
  const auto four = planBindings("exclusive", 4, twoSockets(), note);
  EXPECT_EQ(four[1].cpus, range(4, 8));
  EXPECT_EQ(four[2].memNodes, std::vector<int>{1});
}

TEST(NumaBinding, FewerCpusThanWorkersSharesThemAndSaysSo) {
  Topology t;
  t.allowed = {2, 3};
  std::string note;
  const auto plan = planBindings("exclusive", 3, t, note);
  EXPECT_EQ(plan[0].cpus, std::vector<int>{2});
  EXPECT_EQ(plan[2].cpus, std::vector<int>{2});
  EXPECT_NE(note.find("2 CPUs for 3 workers"), std::string::npos) << note;
}

TEST(NumaBinding, NodeSocketAndCoreComplexSpreadWorkersByLocalRank) {
  std::string note;
  const auto nodes = planBindings("node", 3, twoSockets(), note);
  EXPECT_EQ(nodes[0].cpus, range(0, 8));
  EXPECT_EQ(nodes[1].cpus, range(8, 16));
  EXPECT_EQ(nodes[2].cpus, range(0, 8));
  EXPECT_EQ(nodes[1].memNodes, std::vector<int>{1});
  const auto complexes = planBindings("core-complex", 5, twoSockets(), note);
  EXPECT_EQ(complexes[3].cpus, range(12, 16));
  EXPECT_EQ(complexes[4].cpus, range(0, 4));
  // No L3 listed: the sockets.
  auto t = twoSockets();
  t.l3Groups.clear();
  EXPECT_EQ(planBindings("core-complex", 2, t, note)[1].cpus, range(8, 16));
  // One NUMA node: no memory policy.
  t.numaNodes = {range(0, 16)};
  t.numaNodeIds = {0};
  EXPECT_TRUE(planBindings("socket", 2, t, note)[0].memNodes.empty());
  // Nothing listed: not bound, said.
  Topology bare;
  bare.allowed = range(0, 4);
  note.clear();
  EXPECT_TRUE(planBindings("node", 2, bare, note)[0].cpus.empty());
  EXPECT_NE(note.find("lists no NUMA nodes"), std::string::npos) << note;
}

TEST(NumaBinding, ThisMachinesTopologyGivesEveryWorkerCpusItMayUse) {
  const auto t = fsdp::launcher::detail::readTopology();
  ASSERT_FALSE(t.allowed.empty());
  for (const std::string mode : {"node", "socket", "exclusive", "core-complex"}) {
    std::string note;
    for (const auto& b : planBindings(mode, 2, t, note)) {
      for (int c : b.cpus) EXPECT_TRUE(std::binary_search(t.allowed.begin(), t.allowed.end(), c)) << mode << " " << c;
    }
  }
}

// On a GPU node each worker goes near its GPU: GPUs 0, 1 on node 0 and 2, 3 on node 1.
TEST(NumaBinding, OnAGpuNodeEachWorkerIsPlacedNearItsGpu) {
  auto t = twoSockets();
  t.gpuNodes = {0, 0, 1, 1};
  std::string note;
  const auto exclusive = planBindings("exclusive", 4, t, note, {0, 1, 2, 3});
  EXPECT_EQ(exclusive[0].cpus, range(0, 4));
  EXPECT_EQ(exclusive[1].cpus, range(4, 8));
  EXPECT_EQ(exclusive[2].cpus, range(8, 12));
  EXPECT_EQ(exclusive[3].memNodes, std::vector<int>{1});
  EXPECT_TRUE(note.empty()) << note;
  // CUDA_VISIBLE_DEVICES=2,3: both workers' GPUs are on node 1.
  const auto gpus = fsdp::launcher::detail::gpusOfWorkers(2, 4, std::string("2,3"));
  EXPECT_EQ(gpus, (std::vector<int>{2, 3}));
  const auto node = planBindings("node", 2, t, note, gpus);
  EXPECT_EQ(node[0].cpus, range(8, 16));
  EXPECT_EQ(node[1].cpus, range(8, 16));
  const auto complexes = planBindings("core-complex", 2, t, note, gpus);
  EXPECT_EQ(complexes[0].cpus, range(8, 12));
  EXPECT_EQ(complexes[1].cpus, range(12, 16));
  EXPECT_EQ(planBindings("socket", 2, t, note, gpus)[0].cpus, range(8, 16));
  // GPUs named by UUID, or none: by local rank; a GPU's node unknown on a 2-node machine: said.
  EXPECT_TRUE(fsdp::launcher::detail::gpusOfWorkers(2, 4, std::string("GPU-8f3a")).empty());
  EXPECT_TRUE(fsdp::launcher::detail::gpusOfWorkers(2, 0, std::nullopt).empty());
  t.gpuNodes = {-1, -1, -1, -1};
  note.clear();
  EXPECT_EQ(planBindings("node", 2, t, note, {0, 1})[1].cpus, range(8, 16));  // by local rank
  EXPECT_NE(note.find("NUMA node is unknown"), std::string::npos) << note;
  // One NUMA node (sysfs says -1): the GPUs are on it.
  t.numaNodes = {range(0, 16)};
  t.numaNodeIds = {0};
  note.clear();
  EXPECT_EQ(planBindings("exclusive", 2, t, note, {0, 1})[1].cpus, range(8, 16));
  EXPECT_TRUE(note.empty()) << note;
}

TEST(NumaBinding, CpuListsReadAsTheKernelWritesThem) {
  EXPECT_EQ(cpuListText({0, 1, 2, 3, 8}), "0-3,8");
  EXPECT_EQ(cpuListText({5}), "5");
  EXPECT_EQ(cpuListText({}), "");
}

TEST(LauncherErrorFile, TorchrunsShapeFromAWorkersErrorOrFromTheReport) {
  fsdp::launcher::Failure f;
  f.rank = 1;
  f.localRank = 1;
  f.node = "n1";
  f.pid = 42;
  f.waitStatus = 3 << 8;  // exit code 3
  f.error = "ValueError: bad batch\nTraceback (most recent call last):\n  File \"t.py\", line 3";
  auto j = nlohmann::json::parse(fsdp::launcher::torchrunErrorJson(f, 1795800000));
  EXPECT_EQ(j["message"]["message"], "ValueError: bad batch");
  EXPECT_EQ(j["message"]["errorCode"], 3);
  EXPECT_EQ(j["message"]["extraInfo"]["timestamp"], "1795800000");
  EXPECT_NE(j["message"]["extraInfo"]["py_callstack"].get<std::string>().find("t.py"), std::string::npos);
  f.error.clear();
  f.stderrTail = "killed\n";
  f.waitStatus = SIGKILL;  // ended by signal 9: torchrun's -9
  j = nlohmann::json::parse(fsdp::launcher::torchrunErrorJson(f, 1));
  EXPECT_EQ(j["message"]["errorCode"], -9);
  EXPECT_NE(j["message"]["message"].get<std::string>().find("rank 1 (local_rank 1 on n1, pid 42) failed"),
            std::string::npos);
  EXPECT_EQ(j["message"]["extraInfo"]["py_callstack"], "killed\n");
  // A hang: no exit ended it (wait status 0); the report's headline, and an error code that is not 0.
  f.waitStatus = 0;
  f.hang = "the job is hung (declared by n1 (node 0)): no rank on n1 completed a collective\n  rank 1 ...";
  j = nlohmann::json::parse(fsdp::launcher::torchrunErrorJson(f, 1));
  EXPECT_EQ(j["message"]["message"], "the job is hung (declared by n1 (node 0)): no rank on n1 completed a collective");
  EXPECT_EQ(j["message"]["errorCode"], 1);
  EXPECT_EQ(j["message"]["extraInfo"]["py_callstack"], "  rank 1 ...");
}

}  // namespace
