// torchrun's behaviours a user relies on, end to end (issue 43): the interpreter (PYTHON_EXEC, a
// script without .py and without "#!"), OMP_NUM_THREADS only where several workers share a node,
// the flags and --rdzv_conf keys torchrun accepts and ignores, the launcher's own
// TORCHELASTIC_ERROR_FILE in torchrun's shape, --numa_binding.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "run_command.hpp"

namespace {

using fsdp::testing::countOccurrences;
using fsdp::testing::kSystemPython;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kFsdprun = kBin + "/fsdprun";

void writeFile(const std::string& path, const std::string& text, mode_t mode = 0644) {
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
}

// A PyTorch env:// script with neither ".py" nor "#!": torchrun runs it under PYTHON_EXEC, so
// must we. PYTHON_EXEC is a wrapper that leaves a mark, so the test knows it was the one used.
TEST(TorchrunCompat, AScriptWithoutSuffixOrShebangRunsUnderPythonExec) {
  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << kSystemPython << " has no torch.distributed";
  TempDir dir;
  const std::string script = dir.path() + "/train";
  writeFile(script,
            "import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "print(f\"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():.0f}, \"\n"
            "      f\"nccl_async={os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING')}\", flush=True)\n"
            "dist.destroy_process_group()\n");
  const std::string mark = dir.path() + "/used";
  writeFile(dir.path() + "/python", "#!/bin/sh\necho \"$$\" >> " + mark + "\nexec " + kSystemPython + " \"$@\"\n",
            0755);
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", script}, 120s,
                            {"PYTHON_EXEC=" + dir.path() + "/python"});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("rank 0 of 2: sum 3, nccl_async=1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 of 2: sum 3, nccl_async=1"), std::string::npos) << r.out;
  EXPECT_EQ(countOccurrences(readFile(mark), "\n"), 2) << "PYTHON_EXEC ran " << readFile(mark);

  // A PYTHON_EXEC that is not there: one line naming it, exit 2, nothing started.
  const auto missing = runCommand({kFsdprun, "--standalone", script}, 30s, {"PYTHON_EXEC=" + dir.path() + "/nope"});
  EXPECT_EQ(missing.exitCode, 2) << missing.err;
  EXPECT_EQ(countOccurrences(missing.err, "\n"), 1) << missing.err;
  EXPECT_NE(missing.err.find("PYTHON_EXEC '" + dir.path() + "/nope'"), std::string::npos) << missing.err;
}

// torchrun sets OMP_NUM_THREADS=1 (with its warning) only when several workers share the node
// and the user set none; ctest sets it for every test, hence `env -u`.
TEST(TorchrunCompat, OmpNumThreadsIsOneOnlyForSeveralWorkersWithTorchrunsWarning) {
  const std::string show = "echo omp=${OMP_NUM_THREADS-unset}";
  const std::string warning = "Setting OMP_NUM_THREADS environment variable for each process to be 1";
  const auto one = runCommand({"/usr/bin/env", "-u", "OMP_NUM_THREADS", kFsdprun, "--standalone", "/bin/sh", "-c", show},
                              60s);
  ASSERT_EQ(one.exitCode, 0) << one.err;
  EXPECT_NE(one.out.find("omp=unset"), std::string::npos) << one.out;
  EXPECT_EQ(one.err.find(warning), std::string::npos) << one.err;
  const auto two = runCommand({"/usr/bin/env", "-u", "OMP_NUM_THREADS", kFsdprun, "--standalone", "--nproc_per_node",
                               "2", "/bin/sh", "-c", show},
                              60s);
  ASSERT_EQ(two.exitCode, 0) << two.err;
  EXPECT_EQ(countOccurrences(two.out, "omp=1"), 2) << two.out;
  EXPECT_EQ(countOccurrences(two.err, warning), 1) << two.err;
  const auto mine = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", "/bin/sh", "-c", show}, 60s,
                               {"OMP_NUM_THREADS=3"});
  ASSERT_EQ(mine.exitCode, 0) << mine.err;
  EXPECT_EQ(countOccurrences(mine.out, "omp=3"), 2) << mine.out;
  EXPECT_EQ(mine.err.find(warning), std::string::npos) << mine.err;
}

// What torchrun accepts and ignores runs here too, each named once in a warning with the reason.
TEST(TorchrunCompat, FlagsAndRdzvConfKeysTorchrunIgnoresRunWithOneWarningEach) {
  const auto r = runCommand({kFsdprun, "--standalone", "--rdzv-conf", "timeout=900,read_timeout=60,store_type=tcp,my_key=1",
                             "--event-log-handler", "console", "--logs-specs", "my.Specs", "/bin/sh", "-c", "echo ran"},
                            60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("ran"), std::string::npos);
  for (const std::string item : {"--rdzv_conf timeout=900", "--rdzv_conf read_timeout=60", "--rdzv_conf store_type=tcp",
                                 "--rdzv_conf my_key=1: not a key fsdprun knows", "--event_log_handler 'console': ignored",
                                 "--logs_specs 'my.Specs': ignored"}) {
    EXPECT_EQ(countOccurrences(r.err, item), 1) << item << "\n" << r.err;
  }
  // A value of a key fsdprun does use stays an error.
  const auto bad = runCommand({kFsdprun, "--standalone", "--rdzv_conf", "join_timeout=soon", "/bin/true"}, 30s);
  EXPECT_EQ(bad.exitCode, 2) << bad.err;
}

// TorchX sets TORCHELASTIC_ERROR_FILE for the launcher and reads the root cause there: the first
// failure's error file as torchrun copies it (its "errorCode" added), or, where the worker wrote
// none, the same shape made from the failure report.
TEST(TorchrunCompat, TheLaunchersErrorFileHoldsTheRootCauseInTorchrunsShape) {
  TempDir dir;
  const auto check = [](const std::string& text, const std::string& message, int code, const std::string& stack) {
    const auto j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << text;
    const auto& m = j.at("message");
    EXPECT_NE(m.at("message").get<std::string>().find(message), std::string::npos) << text;
    EXPECT_EQ(m.at("errorCode").get<int>(), code) << text;
    EXPECT_NE(m.at("extraInfo").at("py_callstack").get<std::string>().find(stack), std::string::npos) << text;
    EXPECT_TRUE(std::regex_match(m.at("extraInfo").at("timestamp").get<std::string>(), std::regex("[0-9]{10,}")))
        << text;
  };
  const std::string shell = dir.path() + "/shell.json";
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", "/bin/sh", "-c",
                             "if [ $RANK = 1 ]; then echo 'disk full' >&2; exit 3; fi; sleep 30"},
                            60s, {"TORCHELASTIC_ERROR_FILE=" + shell});
  EXPECT_EQ(r.exitCode, 1) << r.err;
  check(readFile(shell), "rank 1 (local_rank 1", 3, "disk full");

  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << kSystemPython << " has no torch";
  // A worker with torchrun's @record writes its own error file: the launcher's is that one.
  const std::string script = dir.path() + "/fails.py";
  writeFile(script,
            "import os, sys, time\n"
            "from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\n"
            "def main():\n"
            "    if os.environ['RANK'] == '1':\n"
            "        raise ValueError('bad batch 17')\n"
            "    time.sleep(30)\n"
            "main()\n");
  const std::string python = dir.path() + "/python.json";
  const auto p = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", script}, 120s,
                            {"TORCHELASTIC_ERROR_FILE=" + python, std::string("PYTHON_EXEC=") + kSystemPython});
  EXPECT_EQ(p.exitCode, 1) << p.err;
  check(readFile(python), "bad batch 17", 1, "fails.py");
}

std::set<int> cpuList(const std::string& text) {
  std::set<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto dash = item.find('-');
    const int lo = std::stoi(item.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(item.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) out.insert(c);
  }
  return out;
}

// --numa_binding exclusive: each worker on CPUs of its own, all of them within the agent's.
TEST(TorchrunCompat, NumaBindingExclusiveGivesEachWorkerCpusOfItsOwn) {
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", "--numa-binding", "exclusive", "/bin/sh",
                             "-c", "echo \"cpus $LOCAL_RANK $(grep Cpus_allowed_list /proc/self/status | cut -f2)\""},
                            60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::string status = readFile("/proc/self/status");
  const auto line = status.find("Cpus_allowed_list:");
  ASSERT_NE(line, std::string::npos);
  const auto value = status.find_first_not_of(" \t", line + 18);
  const auto mine = cpuList(status.substr(value, status.find('\n', value) - value));
  std::set<int> seen;
  for (int local = 0; local < 2; ++local) {
    const std::string tag = "cpus " + std::to_string(local) + " ";
    const auto at = r.out.find(tag);
    ASSERT_NE(at, std::string::npos) << r.out;
    const auto cpus = cpuList(r.out.substr(at + tag.size(), r.out.find('\n', at) - at - tag.size()));
    ASSERT_FALSE(cpus.empty()) << r.out;
    for (int c : cpus) {
      EXPECT_TRUE(mine.contains(c)) << "CPU " << c << " is not the agent's: " << r.out;
      if (mine.size() >= 2) {
        EXPECT_TRUE(seen.insert(c).second) << "CPU " << c << " given twice: " << r.out;
      }
    }
  }
  const auto bad = runCommand({kFsdprun, "--numa_binding", "nearest", "/bin/true"}, 30s);
  EXPECT_EQ(bad.exitCode, 2) << bad.err;
  EXPECT_EQ(countOccurrences(bad.err, "\n"), 1) << bad.err;
  EXPECT_NE(bad.err.find("--numa_binding 'nearest': expected node, socket, exclusive or core-complex"), std::string::npos)
      << bad.err;
}

}  // namespace
