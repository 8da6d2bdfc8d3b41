// A worker for launcher integration tests. It checks the torchrun environment fsdprun set,
// runs every collective with sizes that do not divide by the world size and compares the
// results with values computed locally, then exits 0. Any mismatch exits 10 with a message.
//
// Flags: --expect_world N --expect_role R --expect_restart K   what the environment must say
//        --expect_nodes N                N nodes of LOCAL_WORLD_SIZE workers (default 1)
//        --any_restart                   do not check TORCHELASTIC_RESTART_COUNT
//        --fail_rank R --exit_code C     rank R exits C right after the environment check
//        --fail_once_rank R              rank R exits 1 on restart 0 only
//        --pid_dir D                     write D/<rank>.pid, then sleep (signal tests)
//        --sleep S                       sleep S seconds before the collectives
//        --sleep_first_attempt S         the same, on TORCHELASTIC_RESTART_COUNT 0 only
//        --sleep_if_world N S            the same, while WORLD_SIZE is N
//        --timeout S                     bound on the store and every collective (default 60)
//        --error_message M               write M to TORCHELASTIC_ERROR_FILE and exit 1
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/Functions.h>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "fsdp/worker/runtime.hpp"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "env_check_worker: MISMATCH: " << what << std::endl;
    ++failures;
  }
}

std::string var(const char* name) {
  const char* v = std::getenv(name);
  expect(v != nullptr, std::string(name) + " is not set");
  return v != nullptr ? v : "";
}

void checkClose(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  expect(got.sizes() == want.sizes() && at::allclose(got, want), what + ": got " +
                                                                     at::toString(got.scalar_type()) +
                                                                     " values that differ from the expected ones");
}

void checkCollectives(fsdp::Runtime& rt) {
  const int r = rt.rank();
  const int w = rt.worldSize();
  auto& comm = rt.comm();
  // all-reduce: element i on rank r is r + i; sum is w*i + w(w-1)/2.
  for (const std::int64_t n : {1L, 7L, 1001L}) {
    auto t = at::arange(n, at::kFloat).add_(r);
    comm.allReduce(t).wait();
    checkClose(t, at::arange(n, at::kFloat).mul_(w).add_(w * (w - 1) / 2.0), "allReduce sum n=" + std::to_string(n));
    auto avg = at::full({n}, static_cast<double>(r), at::kDouble);
    comm.allReduce(avg, fsdp::ReduceOp::kAverage).wait();
    checkClose(avg, at::full({n}, (w - 1) / 2.0, at::kDouble), "allReduce average");
    auto mx = at::full({n}, static_cast<std::int64_t>(r), at::kLong);
    comm.allReduce(mx, fsdp::ReduceOp::kMax).wait();
    expect(at::equal(mx, at::full({n}, static_cast<std::int64_t>(w - 1), at::kLong)), "allReduce max");
  }
  // all-gather into one tensor; totals that do and do not divide by w.
  for (const std::int64_t total : {static_cast<std::int64_t>(4 * w), 10L, 13L}) {
    const auto counts = fsdp::worker::chunkSizes(total, w);
    std::int64_t offset = 0;
    for (int i = 0; i < r; ++i) offset += counts[i];
    auto input = at::arange(offset, offset + counts[r], at::kFloat);
    auto output = at::empty({total}, at::kFloat);
    comm.allGather(input, output).wait();
    checkClose(output, at::arange(total, at::kFloat), "allGather total=" + std::to_string(total));
  }
  // reduce-scatter from one tensor: input element i on rank r is i * (r + 1).
  for (const std::int64_t total : {static_cast<std::int64_t>(4 * w), 10L, 13L, 1001L}) {
    const auto counts = fsdp::worker::chunkSizes(total, w);
    std::int64_t offset = 0;
    for (int i = 0; i < r; ++i) offset += counts[i];
    auto input = at::arange(total, at::kFloat).mul_(r + 1);
    const auto before = input.clone();
    auto output = at::empty({counts[r]}, at::kFloat);
    comm.reduceScatter(input, output).wait();
    const double factor = w * (w + 1) / 2.0;
    checkClose(output, at::arange(offset, offset + counts[r], at::kFloat).mul_(factor),
               "reduceScatter total=" + std::to_string(total));
    expect(at::equal(input, before), "reduceScatter modified its input");
  }
  // broadcast from the last rank.
  auto b = at::full({5}, static_cast<double>(r), at::kDouble);
  comm.broadcast(b, w - 1).wait();
  checkClose(b, at::full({5}, static_cast<double>(w - 1), at::kDouble), "broadcast from last rank");
  comm.barrier().wait();
}

}  // namespace

int main(int argc, char** argv) {
  int expectWorld = -1, failRank = -1, exitCode = 0, failOnceRank = -1, expectRestart = 0;
  int expectNodes = 1, sleepIfWorld = -1;
  bool anyRestart = false;
  double sleepSeconds = 0, sleepFirstAttempt = 0, sleepWorldSeconds = 0, timeoutSeconds = 60;
  std::string expectRole = "default", pidDir, errorMessage;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--any_restart") {
      anyRestart = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) {
      std::cerr << "env_check_worker: " << flag << " needs a value" << std::endl;
      return 2;
    }
    const std::string value = argv[i + 1];
    if (flag == "--sleep_if_world") {
      if (i + 2 >= argc) return 2;
      sleepIfWorld = std::stoi(value);
      sleepWorldSeconds = std::stod(argv[i + 2]);
      ++i;
      continue;
    }
    if (flag == "--expect_world") expectWorld = std::stoi(value);
    else if (flag == "--expect_nodes") expectNodes = std::stoi(value);
    else if (flag == "--sleep_first_attempt") sleepFirstAttempt = std::stod(value);
    else if (flag == "--timeout") timeoutSeconds = std::stod(value);
    else if (flag == "--error_message") errorMessage = value;
    else if (flag == "--expect_role") expectRole = value;
    else if (flag == "--expect_restart") expectRestart = std::stoi(value);
    else if (flag == "--fail_rank") failRank = std::stoi(value);
    else if (flag == "--exit_code") exitCode = std::stoi(value);
    else if (flag == "--fail_once_rank") failOnceRank = std::stoi(value);
    else if (flag == "--pid_dir") pidDir = value;
    else if (flag == "--sleep") sleepSeconds = std::stod(value);
    else {
      std::cerr << "env_check_worker: unknown flag " << flag << std::endl;
      return 2;
    }
  }
  const int rank = std::stoi(var("RANK"));
  const std::string world = var("WORLD_SIZE");
  const int localWorld = std::stoi(var("LOCAL_WORLD_SIZE"));
  const int groupRank = std::stoi(var("GROUP_RANK"));
  expect(var("LOCAL_RANK") == std::to_string(rank - groupRank * localWorld),
         "LOCAL_RANK=" + var("LOCAL_RANK") + " does not fit RANK=" + var("RANK") +
             " on node " + var("GROUP_RANK"));
  if (expectWorld > 0) expect(world == std::to_string(expectWorld), "WORLD_SIZE=" + world);
  if (expectNodes > 0) {
    expect(var("GROUP_WORLD_SIZE") == std::to_string(expectNodes), "GROUP_WORLD_SIZE=" + var("GROUP_WORLD_SIZE"));
    expect(std::stoi(world) == localWorld * expectNodes, "WORLD_SIZE != LOCAL_WORLD_SIZE x nodes");
  }
  expect(groupRank >= 0 && groupRank < std::stoi(var("GROUP_WORLD_SIZE")), "GROUP_RANK");
  expect(var("ROLE_RANK") == std::to_string(rank), "ROLE_RANK");
  expect(var("ROLE_WORLD_SIZE") == world, "ROLE_WORLD_SIZE");
  expect(var("ROLE_NAME") == expectRole, "ROLE_NAME=" + var("ROLE_NAME"));
  expect(!var("MASTER_ADDR").empty(), "MASTER_ADDR empty");
  const int masterPort = std::atoi(var("MASTER_PORT").c_str());
  expect(masterPort > 0 && masterPort < 65536, "MASTER_PORT=" + var("MASTER_PORT"));
  expect(!var("TORCHELASTIC_RUN_ID").empty(), "TORCHELASTIC_RUN_ID empty");
  const std::string restart = var("TORCHELASTIC_RESTART_COUNT");
  if (!anyRestart) {
    expect(restart == std::to_string(expectRestart), "TORCHELASTIC_RESTART_COUNT=" + restart);
  }
  expect(!var("TORCHELASTIC_ERROR_FILE").empty(), "TORCHELASTIC_ERROR_FILE empty");
  expect(!var("TORCHELASTIC_MAX_RESTARTS").empty(), "TORCHELASTIC_MAX_RESTARTS empty");
  expect(var("OMP_NUM_THREADS") == "1", "OMP_NUM_THREADS=" + var("OMP_NUM_THREADS"));
  expect(!var("FSDPRUN_STORE_ADDR").empty() && !var("FSDPRUN_STORE_PORT").empty(), "store endpoint");
  if (const char* tokenFile = std::getenv("FSDPRUN_TOKEN_FILE")) {
    struct stat st {};
    expect(::stat(tokenFile, &st) == 0 && (st.st_mode & 0077) == 0,
           "FSDPRUN_TOKEN_FILE must exist and be private to the user");
  }
  if (failures > 0) return 10;
  if (!errorMessage.empty()) {
    std::ofstream(var("TORCHELASTIC_ERROR_FILE")) << "{\"message\": {\"message\": \"" << errorMessage
                                                 << "\", \"extraInfo\": {}}}";
    return 1;
  }

  if (rank == failRank) return exitCode;
  if (rank == failOnceRank && var("TORCHELASTIC_RESTART_COUNT") == "0") return 1;
  if (!pidDir.empty()) {
    std::ofstream(pidDir + "/" + std::to_string(rank) + ".pid") << ::getpid() << '\n';
  }
  if (restart == "0") sleepSeconds += sleepFirstAttempt;
  if (std::stoi(world) == sleepIfWorld) sleepSeconds += sleepWorldSeconds;
  if (sleepSeconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleepSeconds));

  auto rt = fsdp::init({.timeout = std::chrono::milliseconds(static_cast<long long>(timeoutSeconds * 1000))});
  checkCollectives(*rt);
  if (failures > 0) return 10;
  std::cout << "rank " << rank << " of " << world << ": environment ok, collectives ok (restart "
            << restart << ")" << std::endl;
  return 0;
}
