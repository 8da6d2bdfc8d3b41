// fsdprun end to end on loopback: the real launcher, real worker processes, real Gloo.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"

namespace {

using fsdp::testing::countOccurrences;
using fsdp::testing::runCommand;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kFsdprun = kBin + "/fsdprun";
const std::string kWorker = kBin + "/env_check_worker";

TEST(Launcher, FourWorkersSeeTheTorchrunEnvironmentAndCorrectCollectives) {
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "4", "--role", "trainer",
                             kWorker, "--expect_world", "4", "--expect_role", "trainer"},
                            120s);
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(r.out.find("rank " + std::to_string(rank) + " of 4: environment ok, collectives ok"),
              std::string::npos)
        << r.out << r.err;
  }
}

// torchrun's recipe for several single-node jobs on one machine (issue 43, item 3): each takes a
// free port of its own; for several nodes the port 0 is refused, naming the flag.
TEST(Launcher, SingleNodeJobsWithEndpointPortZeroRunSideBySide) {
  const std::vector<std::string> job = {kBin + "/fsdprun", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                                        "--nproc_per_node", "2", "/bin/sh", "-c",
                                        "echo port=$MASTER_PORT; sleep 1"};
  fsdp::testing::RunResult results[2];
  std::thread other([&] { results[1] = runCommand(job, 60s); });
  results[0] = runCommand(job, 60s);
  other.join();
  std::string ports[2];
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(results[i].exitCode, 0) << results[i].err;
    const auto at = results[i].out.find("port=");
    ASSERT_NE(at, std::string::npos) << results[i].out;
    ports[i] = results[i].out.substr(at, results[i].out.find('\n', at) - at);
  }
  EXPECT_NE(ports[0], ports[1]);
  const auto refused = runCommand({kBin + "/fsdprun", "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                   "localhost:0", "/bin/true"},
                                  30s);
  EXPECT_EQ(refused.exitCode, 2);
  EXPECT_NE(refused.err.find("--rdzv_endpoint 'localhost:0': port 0 (a free port) works for one node only"),
            std::string::npos)
      << refused.err;
}

TEST(Launcher, WorldSizesOneToThreeAlsoPass) {
  for (const int n : {1, 2, 3}) {
    const auto r = runCommand({kFsdprun, "--standalone", "--nproc-per-node", std::to_string(n),
                               kWorker, "--expect_world", std::to_string(n)},
                              120s);
    ASSERT_FALSE(r.timedOut) << r.err;
    EXPECT_EQ(r.exitCode, 0) << "world " << n << ": " << r.out << r.err;
    EXPECT_EQ(countOccurrences(r.out, "collectives ok"), n) << r.out;
  }
}

TEST(Launcher, RankTwoExitingThreeFailsTheJobAndIsNamed) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "4", kWorker,
                             "--fail_rank", "2", "--exit_code", "3"},
                            120s);
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("rank 2 (local_rank 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exit code 3"), std::string::npos) << r.err;
  // The survivors were blocked in the rendezvous; they must be stopped, not waited for.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

TEST(Launcher, AWorkerKilledBySignalIsReportedWithTheSignalName) {
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", "/bin/sh", "-c",
                             "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 30"},
                            60s);
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("SIGKILL"), std::string::npos) << r.err;
}

TEST(Launcher, MaxRestartsRestartsTheGroupWithTheNextRestartCount) {
  // Rank 1 fails on attempt 0 only; attempt 1 must see TORCHELASTIC_RESTART_COUNT=1.
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", "--max_restarts",
                             "1", "/bin/sh", "-c",
                             "test $TORCHELASTIC_RESTART_COUNT = 0 && test $RANK = 1 && exit 1; "
                             "echo rank $RANK restart $TORCHELASTIC_RESTART_COUNT max "
                             "$TORCHELASTIC_MAX_RESTARTS; exit 0"},
                            60s);
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("rank 1 restart 1 max 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0 restart 1 max 1"), std::string::npos) << r.out;
}

TEST(Launcher, RestartedWorkersRendezvousAgainInANewRound) {
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "3", "--max_restarts",
                             "2", kWorker, "--fail_once_rank", "1", "--expect_restart", "1"},
                            120s);
  // Attempt 0 fails the environment check on purpose (restart count 0 != 1) or by rank 1's
  // exit; attempt 1 must connect through the store again and pass.
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.out, "collectives ok"), 3) << r.out;
}

TEST(Launcher, ExhaustedRestartsExitOneAndCountThem) {
  const auto r = runCommand(
      {kFsdprun, "--standalone", "--nproc_per_node", "2", "--max_restarts", "2", "/bin/false"},
      60s);
  ASSERT_FALSE(r.timedOut);
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_NE(r.err.find("(restart 2 of 2)"), std::string::npos) << r.err;
}

std::vector<int> waitForPids(const std::string& dir, int n) {
  std::vector<std::string> names;
  for (int rank = 0; rank < n; ++rank) names.push_back(std::to_string(rank));
  return fsdp::testing::waitForPidFiles(dir, names, 30s);
}

using fsdp::testing::processGone;

void stopLauncherAndCheckNoWorkerSurvives(int sig, int expectedExit) {
  fsdp::testing::TempDir dir;
  fsdp::SpawnOptions options{.argv = {kFsdprun, "--standalone", "--nproc_per_node", "3",
                                      "--shutdown_timeout", "5", kWorker, "--pid_dir", dir.path(),
                                      "--sleep", "60"},
                             .env = fsdp::currentEnvironment(),
                             .deathSignal = 0};
  options.stdoutPath = dir.path() + "/out";
  options.stderrPath = dir.path() + "/err";
  auto launcher = fsdp::ChildProcess::spawn(options);
  const auto pids = waitForPids(dir.path(), 3);
  ASSERT_EQ(pids.size(), 3u) << fsdp::testing::readFile(dir.path() + "/err");
  ::kill(launcher.pid(), sig);  // the launcher only, not its group: workers have their own
  const auto status = launcher.waitFor(20s);
  ASSERT_TRUE(status.has_value());
  if (expectedExit >= 0) {
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == expectedExit)
        << fsdp::describeWaitStatus(*status);
  }
  for (const int pid : pids) EXPECT_TRUE(processGone(pid, 10s)) << "worker pid " << pid << " survived";
}

TEST(Launcher, SigtermStopsEveryWorkerAndExits143) {
  stopLauncherAndCheckNoWorkerSurvives(SIGTERM, 128 + SIGTERM);
}

TEST(Launcher, SigintStopsEveryWorkerAndExits130) {
  stopLauncherAndCheckNoWorkerSurvives(SIGINT, 128 + SIGINT);
}

TEST(Launcher, Sigkill9OfTheLauncherLeavesNoOrphan) {
  stopLauncherAndCheckNoWorkerSurvives(SIGKILL, -1);
}

// A worker frozen with SIGSTOP cannot be told from a slow one; what fsdprun does about it:
// it logs the stop at once, its peers fail when their collective timeout expires, and the
// stop signal that follows comes with SIGCONT so that the frozen worker can act on it.
TEST(Launcher, AFrozenWorkerIsLoggedAndItsPeersFailAfterTheirCollectiveTimeout) {
  fsdp::testing::TempDir dir;
  fsdp::SpawnOptions options{.argv = {kFsdprun, "--standalone", "--nproc_per_node", "2", kWorker,
                                      "--pid_dir", dir.path(), "--sleep", "2", "--timeout", "3"},
                             .env = fsdp::currentEnvironment(),
                             .deathSignal = 0};
  options.stdoutPath = dir.path() + "/out";
  options.stderrPath = dir.path() + "/err";
  auto launcher = fsdp::ChildProcess::spawn(options);
  // The workers sleep 2 s after writing their pid files before their collectives: the stop
  // comes first unless this thread is held that long.
  const auto pids = waitForPids(dir.path(), 2);
  ASSERT_EQ(pids.size(), 2u);
  const auto start = std::chrono::steady_clock::now();
  ::kill(pids[1], SIGSTOP);
  const auto status = launcher.waitFor(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << fsdp::describeWaitStatus(*status);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  const std::string err = fsdp::testing::readFile(dir.path() + "/err");
  EXPECT_NE(err.find("rank 1 (pid " + std::to_string(pids[1]) + ") was stopped by SIGSTOP"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("rank 0 (local_rank 0"), std::string::npos) << err;
  EXPECT_TRUE(processGone(pids[1], 10s));
}

struct BadInput {
  std::vector<std::string> args;
  std::string mustMention;
};

void PrintTo(const BadInput& input, std::ostream* os) {
  for (const auto& a : input.args) *os << a << ' ';
}

class LauncherBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(LauncherBadInput, ExitsTwoWithOneLineNamingIt) {
  std::vector<std::string> argv = {kFsdprun};
  argv.insert(argv.end(), GetParam().args.begin(), GetParam().args.end());
  const auto r = runCommand(argv, 30s);
  ASSERT_FALSE(r.timedOut);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(countOccurrences(r.err, "\n"), 1) << "expected one line, got: " << r.err;
  EXPECT_NE(r.err.find(GetParam().mustMention), std::string::npos) << r.err;
}

INSTANTIATE_TEST_SUITE_P(
    Flags, LauncherBadInput,
    ::testing::Values(
        BadInput{{"--standalone", "--nproc_per_node", "0", "/bin/true"}, "--nproc_per_node '0'"},
        BadInput{{"--standalone", "--nproc_per_node", "two", "/bin/true"}, "--nproc_per_node 'two'"},
        BadInput{{"--standalone", "--nproc_per_node", "-1", "/bin/true"}, "--nproc_per_node"},
        BadInput{{"--standalone", "--nnodes", "0", "/bin/true"}, "--nnodes '0'"},
        BadInput{{"--standalone", "--nnodes", "3:2", "/bin/true"}, "--nnodes '3:2'"},
        BadInput{{"--standalone", "--max_restarts", "x", "/bin/true"}, "--max_restarts 'x'"},
        BadInput{{"--standalone", "--no-such-flag", "/bin/true"}, "--no-such-flag"},
        BadInput{{"--standalone", "/nonexistent/program"}, "/nonexistent/program"},
        BadInput{{"--standalone", "/etc/ld.so.cache"}, "/etc/ld.so.cache"},  // data: neither run nor Python
        BadInput{{"--standalone"}, "PROGRAM"},
        BadInput{{"--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "host:notaport", "/bin/true"},
                 "--rdzv_endpoint 'host:notaport': port 'notaport'"},
        BadInput{{"--nnodes", "2", "--rdzv_backend", "c10d", "/bin/true"}, "needs --rdzv_endpoint"},
        BadInput{{"--rdzv_conf", "join_timeout=soon", "/bin/true"}, "join_timeout=soon"},
        BadInput{{"--tee", "5", "/bin/true"}, "--tee '5'"}));

TEST(Launcher, ABusyMasterPortIsNamedWithItsHolderAndAFreeAlternative) {
  const fsdp::testing::SilentListener holder;
  const std::string port = std::to_string(holder.port());
  const auto r = runCommand({kFsdprun, "--standalone", "--master_port", port, "/bin/true"}, 30s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(countOccurrences(r.err, "\n"), 1) << r.err;
  EXPECT_NE(r.err.find("--master_port " + port + ": the port is in use"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pid " + std::to_string(::getpid())), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is free now"), std::string::npos) << r.err;
}

TEST(Launcher, TeePrefixesConsoleLinesAndLogDirKeepsEveryRanksFiles) {
  fsdp::testing::TempDir dir;
  const auto r = runCommand({kFsdprun, "--nproc_per_node", "2", "--tee", "3", "--log_dir", dir.path(),
                             "--rdzv_id", "teejob", "/bin/sh", "-c",
                             "echo out-$RANK; echo err-$RANK >&2"},
                            60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]:out-0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]:out-1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("[rank1]:err-1\n"), std::string::npos) << r.err;
  for (const char* rank : {"0", "1"}) {
    const std::string base = dir.path() + "/teejob/attempt_0/" + rank;
    EXPECT_EQ(fsdp::testing::readFile(base + "/stdout.log"), std::string("out-") + rank + "\n");
    EXPECT_EQ(fsdp::testing::readFile(base + "/stderr.log"), std::string("err-") + rank + "\n");
  }
}

TEST(Launcher, RedirectsKeepOutputOffTheConsoleAndTheFilterPicksRanks) {
  fsdp::testing::TempDir dir;
  const auto r = runCommand({kFsdprun, "--nproc_per_node", "3", "--redirects", "1", "--log_dir",
                             dir.path(), "--rdzv_id", "redir", "--local_ranks_filter", "0,2",
                             "/bin/sh", "-c", "echo out-$RANK; echo err-$RANK >&2"},
                            60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(r.out.find("out-"), std::string::npos) << r.out;       // stdout went to files only
  EXPECT_NE(r.err.find("err-0"), std::string::npos) << r.err;      // stderr of ranks 0 and 2
  EXPECT_NE(r.err.find("err-2"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("err-1"), std::string::npos) << r.err;      // filtered out
  EXPECT_EQ(fsdp::testing::readFile(dir.path() + "/redir/attempt_0/1/stdout.log"), "out-1\n");
}

TEST(Mnist, MissingDataFailsOnEveryRankNamingThePath) {
  // Each rank checks --data before it waits for any peer, so every rank fails on its own.
  for (const char* rank : {"0", "1"}) {
    const auto r = runCommand({kBin + "/mnist", "--data", "/nonexistent/fashion"}, 60s,
                              {std::string("RANK=") + rank, "WORLD_SIZE=2", "LOCAL_RANK=" + std::string(rank),
                               "LOCAL_WORLD_SIZE=2"});
    ASSERT_FALSE(r.timedOut);
    EXPECT_EQ(r.exitCode, 2) << r.err;
    EXPECT_EQ(countOccurrences(r.err, "mnist: error: --data '/nonexistent/fashion'"), 1) << r.err;
  }
  // Under fsdprun the job fails and names the rank that failed first, with its exit code; the
  // other rank may be stopped before it prints.
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", kBin + "/mnist",
                             "--data", "/nonexistent/fashion"},
                            60s);
  ASSERT_FALSE(r.timedOut);
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_GE(countOccurrences(r.err, "mnist: error: --data '/nonexistent/fashion'"), 1) << r.err;
  EXPECT_NE(r.err.find("exit code 2"), std::string::npos) << r.err;
}

TEST(Mnist, TwoRanksTrainAndRankZeroPrintsTheSummaryLine) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", kBin + "/mnist",
                             "--max_steps", "20", "--log_every", "0"},
                            300s);
  ASSERT_FALSE(r.timedOut) << r.err;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  const auto lastLine = r.out.substr(r.out.rfind('{'));
  for (const char* key : {"\"test_accuracy\"", "\"test_loss\"", "\"steps\":20", "\"train_samples_per_s\"",
                          "\"train_samples_per_s_steady\"",
                          "\"peak_rss_mb\"", "\"params_sha256\""}) {
    EXPECT_NE(lastLine.find(key), std::string::npos) << key << " missing in " << lastLine;
  }
  // 20 Adam steps of ShallowNet reach well above chance (0.1).
  const auto acc = std::stod(lastLine.substr(lastLine.find("\"test_accuracy\":") + 16));
  EXPECT_GT(acc, 0.5) << lastLine;
}

}  // namespace
