// Several fsdprun agents on loopback (each a "node" with its own 127.0.0.x address) running one
// job: the real launcher, the real rendezvous, real worker processes and real Gloo.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"

namespace {

using fsdp::testing::countOccurrences;
using fsdp::testing::processGone;
using fsdp::testing::readFile;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kFsdprun = kBin + "/fsdprun";
const std::string kWorker = kBin + "/env_check_worker";
const std::string kPythonWorker = std::string(FSDP_SOURCE_DIR) + "/tests/integration/python/ddp_worker.py";

// One agent ("node") of a job, its output in files. Killed and reaped by the destructor.
class Agent {
 public:
  Agent(const TempDir& dir, const std::string& name, std::vector<std::string> args,
        std::vector<std::string> extraEnv = {})
      : out_(dir.path() + "/" + name + ".out"), err_(dir.path() + "/" + name + ".err") {
    std::vector<std::string> argv = {kFsdprun};
    argv.insert(argv.end(), args.begin(), args.end());
    fsdp::SpawnOptions options{.argv = argv, .env = fsdp::currentEnvironment(), .deathSignal = 0};
    options.env.insert(options.env.end(), extraEnv.begin(), extraEnv.end());
    options.stdoutPath = out_;
    options.stderrPath = err_;
    process_.emplace(fsdp::ChildProcess::spawn(options));
  }
  int pid() const { return process_->pid(); }
  void signal(int sig) { ::kill(process_->pid(), sig); }  // the agent alone, not its group
  // The exit code, or -1 for "killed by a signal", or nullopt when it is still running.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto status = process_->waitFor(timeout);
    if (!status) return std::nullopt;
    return WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  }
  std::string out() const { return readFile(out_); }
  std::string err() const { return readFile(err_); }
  std::string output() const { return "--- stdout:\n" + out() + "--- stderr:\n" + err(); }

 private:
  std::string out_;
  std::string err_;
  std::optional<fsdp::ChildProcess> process_;
};

// The flags every agent of a loopback job shares, plus its own address.
std::vector<std::string> jobArgs(const std::string& nnodes, int port, const std::string& runId,
                                 int node, std::vector<std::string> more) {
  std::vector<std::string> args = {"--nnodes", nnodes, "--rdzv_backend", "c10d",
                                   "--rdzv_endpoint", "127.0.0.1:" + std::to_string(port),
                                   "--rdzv_id", runId, "--local_addr",
                                   "127.0.0." + std::to_string(node + 2)};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::vector<std::string> withCommand(std::vector<std::string> args, std::vector<std::string> command) {
  args.insert(args.end(), command.begin(), command.end());
  return args;
}

// Three agents of an elastic 2:3 job; node 0 hosts the rendezvous, so that the node a test kills
// or freezes (1 or 2) does not take the server with it.
std::vector<std::unique_ptr<Agent>> startThreeNodes(const TempDir& dir, int port, const std::string& runId,
                                                    const std::string& conf, const std::vector<std::string>& command,
                                                    const std::vector<std::string>& extraEnv = {}) {
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 3; ++node) {
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        withCommand(jobArgs("2:3", port, runId, node,
                            {"--nproc_per_node", "1", "--rdzv_conf",
                             std::string(node == 0 ? "is_host=true," : "is_host=false,") + conf}),
                    command),
        extraEnv));
  }
  return agents;
}

TEST(MultiNode, TwoAgentsOfTwoWorkersTrainMnistAsOneJob) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 2; ++node) {
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        // Node 0 hosts: with both on loopback, either could bind the endpoint first otherwise.
        withCommand(jobArgs("2", port, "mnist2x2", node,
                            {"--nproc_per_node", "2", "--rdzv_conf", node == 0 ? "is_host=true" : "is_host=false"}),
                    {kBin + "/mnist", "--max_steps", "20", "--no_eval"}),
        std::vector<std::string>{"FSDP_LOG_LEVEL=info"}));
  }
  for (auto& a : agents) {
    const auto code = a->wait(300s);
    ASSERT_TRUE(code.has_value()) << a->output();
    EXPECT_EQ(*code, 0) << a->output();
  }
  // Rank 0 (node 0's first worker) prints the summary; the world has 4 ranks.
  const std::string out = agents[0]->out() + agents[1]->out();
  const auto brace = out.rfind("{\"");
  ASSERT_NE(brace, std::string::npos) << out;
  const auto summary = nlohmann::json::parse(out.substr(brace, out.find('\n', brace) - brace));
  EXPECT_EQ(summary.at("world_size").get<int>(), 4);
  EXPECT_EQ(summary.at("steps").get<int>(), 20);
  // Node 1's workers reached the store through their agent's proxy; node 0 hosts the server.
  EXPECT_NE(agents[1]->output().find("through this node's proxy"), std::string::npos) << agents[1]->output();
  EXPECT_EQ(agents[0]->output().find("through this node's proxy"), std::string::npos);
}

TEST(MultiNode, AWorkerKilledWithSigkillRestartsAllFourAndTheyFinish) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 2; ++node) {
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        withCommand(jobArgs("2", port, "kill-worker", node, {"--nproc_per_node", "2", "--max_restarts", "1"}),
                    {kWorker, "--expect_nodes", "2", "--any_restart", "--pid_dir", dir.path(),
                     "--sleep_first_attempt", "120"})));
  }
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1", "2", "3"}, 60s);
  ASSERT_EQ(pids.size(), 4u) << agents[0]->output() << agents[1]->output();
  ::kill(pids[3], SIGKILL);  // rank 3 lives on node 1
  for (auto& a : agents) {
    const auto code = a->wait(120s);
    ASSERT_TRUE(code.has_value()) << a->output();
    EXPECT_EQ(*code, 0) << a->output();
  }
  const std::string out = agents[0]->out() + agents[1]->out();
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(out.find("rank " + std::to_string(rank) + " of 4: environment ok, collectives ok (restart 1)"),
              std::string::npos)
        << out;
  }
  // Both agents saw the failure: the one whose worker died names it, and the other restarted.
  EXPECT_NE(agents[1]->err().find("rank 3 (local_rank 1"), std::string::npos) << agents[1]->err();
  EXPECT_NE(agents[0]->err().find("restarting the workers"), std::string::npos) << agents[0]->err();
  for (const int pid : pids) EXPECT_TRUE(processGone(pid, 5s)) << pid;
}

TEST(MultiNode, AnAgentKilledOutOfThreeLeavesTwoThatContinueWithASmallerWorld) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  auto agents = startThreeNodes(dir, port, "lose-node", "last_call_timeout=30",
                                {kWorker, "--expect_nodes", "0", "--pid_dir", dir.path(), "--sleep_if_world", "3", "120"});
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1", "2"}, 60s);
  ASSERT_EQ(pids.size(), 3u) << agents[0]->output() << agents[2]->output();
  const int victim = 2;  // not the host
  agents[victim]->signal(SIGKILL);
  EXPECT_EQ(agents[victim]->wait(10s), -1);
  for (std::size_t i = 0; i < agents.size(); ++i) {
    if (static_cast<int>(i) == victim) continue;
    const auto code = agents[i]->wait(120s);
    ASSERT_TRUE(code.has_value()) << agents[i]->output();
    EXPECT_EQ(*code, 0) << agents[i]->output();
  }
  const std::string out = agents[0]->out() + agents[1]->out() + agents[2]->out();
  EXPECT_EQ(countOccurrences(out, " of 2: environment ok, collectives ok (restart 0)"), 2) << out;
  // The killed agent's worker did not outlive it.
  for (const int pid : pids) EXPECT_TRUE(processGone(pid, 5s)) << pid;
}

TEST(MultiNode, AFrozenAgentIsDroppedAfterTheHeartbeatTimeoutAndTheOthersGoOn) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  auto agents = startThreeNodes(dir, port, "freeze-node", "heartbeat_interval=0.2,heartbeat_timeout=1,last_call_timeout=30",
                                {kWorker, "--expect_nodes", "0", "--pid_dir", dir.path(), "--sleep_if_world", "3", "120"});
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1", "2"}, 60s);
  ASSERT_EQ(pids.size(), 3u) << agents[0]->output();
  const auto start = std::chrono::steady_clock::now();
  agents[2]->signal(SIGSTOP);  // alive but silent: only missed heartbeats tell
  for (int i = 0; i < 2; ++i) {
    const auto code = agents[i]->wait(60s);
    ASSERT_TRUE(code.has_value()) << agents[i]->output();
    EXPECT_EQ(*code, 0) << agents[i]->output();
  }
  // Noticed after about the heartbeat timeout, not after a collective or join timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  EXPECT_EQ(countOccurrences(agents[0]->out() + agents[1]->out(), " of 2: environment ok"), 2);
  agents[2]->signal(SIGKILL);
  agents[2]->wait(10s);
  for (const int pid : pids) EXPECT_TRUE(processGone(pid, 5s)) << pid;
}

TEST(MultiNode, ARemoteFailureIsReportedByEveryAgentWithTheWorkersOwnError) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 2; ++node) {
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        withCommand(jobArgs("2", port, "report", node, {"--nproc_per_node", "2"}),
                    {kWorker, "--expect_nodes", "2", "--sleep", "0.2", "--fail_rank", "2",
                     "--exit_code", "7"})));
  }
  for (auto& a : agents) {
    const auto code = a->wait(60s);
    ASSERT_TRUE(code.has_value()) << a->output();
    EXPECT_EQ(*code, 1) << a->output();
    // Every node's report names the failed rank, its node (127.0.0.3) and how it ended.
    EXPECT_NE(a->err().find("rank 2 (local_rank 0 on 127.0.0.3"), std::string::npos) << a->output();
    EXPECT_NE(a->err().find("exit code 7"), std::string::npos) << a->output();
    EXPECT_EQ(a->err().find("<N/A>"), std::string::npos);
  }
}

TEST(MultiNode, TheWorkersErrorFileAndStderrTailAreQuoted) {
  const auto r = fsdp::testing::runCommand(
      {kFsdprun, "--nproc_per_node", "2", kWorker, "--error_message", "ValueError: the data is gone"},
      60s);
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("ValueError: the data is gone"), std::string::npos) << r.err;
  const auto shell = fsdp::testing::runCommand(
      {kFsdprun, "--nproc_per_node", "1", "/bin/sh", "-c", "echo 'cannot open /data/x' >&2; exit 4"}, 60s);
  EXPECT_EQ(shell.exitCode, 1);
  EXPECT_NE(shell.err.find("| cannot open /data/x"), std::string::npos) << shell.err;
}

// SIGTERM or SIGKILL to the agent that hosts the rendezvous: no process of the job survives,
// grandchildren of workers included (checked by process group and by a /proc scan).
void stopHostAndCheckNothingSurvives(int sig) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  const std::string runId = "stop-" + std::to_string(::getpid()) + "-" + std::to_string(sig);
  // A worker that is a shell script with a child of its own, started before the pid file says
  // the worker is there (the count of 8 below reads both).
  const std::string script = "sleep 300 & echo $$ > " + dir.path() + "/$RANK.pid; wait";
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 2; ++node) {
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        withCommand(jobArgs("2", port, runId, node,
                            {"--nproc_per_node", "2", "--shutdown_timeout", "5", "--rdzv_conf",
                             std::string(node == 0 ? "is_host=true" : "is_host=false") + ",join_timeout=4"}),
                    {"/bin/sh", "-c", script})));
  }
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1", "2", "3"}, 60s);
  ASSERT_EQ(pids.size(), 4u) << agents[0]->output();
  ASSERT_EQ(fsdp::testing::processesWithEnvironment("TORCHELASTIC_RUN_ID=" + runId).size(), 8u);
  agents[0]->signal(sig);
  const auto hostCode = agents[0]->wait(20s);
  ASSERT_TRUE(hostCode.has_value());
  if (sig == SIGTERM) {
    EXPECT_EQ(*hostCode, 128 + SIGTERM) << agents[0]->output();
  }
  // SIGTERM closes the run. After SIGKILL the survivor moves the rendezvous to itself (the
  // last round's successor) and, alone below --nnodes 2, forms no round: it gives up after the
  // join timeout, saying why.
  const auto otherCode = agents[1]->wait(40s);
  ASSERT_TRUE(otherCode.has_value());
  EXPECT_EQ(*otherCode, 1) << agents[1]->output();
  if (sig == SIGKILL) {
    EXPECT_NE(agents[1]->output().find("serving the rendezvous of run"), std::string::npos) << agents[1]->output();
    EXPECT_NE(agents[1]->output().find("forms no round"), std::string::npos) << agents[1]->output();
  }
  for (const int pid : pids) {
    EXPECT_TRUE(processGone(pid, 5s)) << "worker " << pid << " survived";
    EXPECT_TRUE(fsdp::testing::processGroupMembers(pid).empty()) << "process group " << pid << " survived";
  }
  EXPECT_TRUE(fsdp::testing::processesWithEnvironment("TORCHELASTIC_RUN_ID=" + runId).empty());
}

TEST(MultiNode, SigtermToTheHostingAgentLeavesNoProcessOfTheJob) { stopHostAndCheckNothingSurvives(SIGTERM); }

TEST(MultiNode, SigkillToTheHostingAgentLeavesNoProcessOfTheJob) { stopHostAndCheckNothingSurvives(SIGKILL); }

TEST(MultiNode, AnUnreachableEndpointExitsTwoAfterTheJoinTimeoutNamingIt) {
  const int port = fsdp::testing::freeLoopbackPort();  // nobody listens there
  const auto start = std::chrono::steady_clock::now();
  const auto r = fsdp::testing::runCommand(
      {kFsdprun, "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
       "127.0.0.1:" + std::to_string(port), "--rdzv_conf", "join_timeout=1,is_host=false", "/bin/true"},
      30s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(countOccurrences(r.err, "\n"), 1) << r.err;
  EXPECT_NE(r.err.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unreachable after"), std::string::npos) << r.err;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(MultiNode, AForeignServiceOnTheEndpointIsNamedNotWaitedOnForever) {
  // Something that accepts connections and never answers (what hangs torchrun for good).
  const fsdp::testing::SilentListener foreign;
  const int port = foreign.port();
  const auto r = fsdp::testing::runCommand(
      {kFsdprun, "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
       "127.0.0.1:" + std::to_string(port), "--rdzv_conf", "join_timeout=4", "/bin/true"},
      30s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not answer fsdprun's handshake"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the port is held by pid " + std::to_string(::getpid())), std::string::npos) << r.err;
}

TEST(MultiNode, AgentsThatDisagreeOnTheNodeCountAreRefused) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  // The first JOIN fixes the run's node count; whichever agent comes second is refused.
  Agent first(dir, "a", withCommand(jobArgs("2", port, "disagree", 0, {"--rdzv_conf", "is_host=true,join_timeout=20"}),
                                    {"/bin/true"}));
  Agent second(dir, "b", withCommand(jobArgs("3", port, "disagree", 1, {"--rdzv_conf", "is_host=false,join_timeout=20"}),
                                     {"/bin/true"}));
  std::optional<int> code;
  for (int i = 0; i < 300 && !code; ++i) {
    code = second.wait(100ms);
    if (!code) code = first.wait(100ms);
  }
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 1);
  const auto refusalIn = [](const std::string& text) {
    return text.find("asks for 3:3 nodes but the run has 2:2") != std::string::npos ||
           text.find("asks for 2:2 nodes but the run has 3:3") != std::string::npos;
  };
  std::string err = first.err() + second.err();
  if (!refusalIn(err)) {
    // The host was the one refused: its server went first, so the other agent may have ended
    // before the host printed why. The host's own exit says it has.
    first.wait(10s);
    err = first.err() + second.err();
  }
  EXPECT_TRUE(err.find("asks for 3:3 nodes but the run has 2:2") != std::string::npos ||
              err.find("asks for 2:2 nodes but the run has 3:3") != std::string::npos)
      << err;
  first.signal(SIGTERM);
  second.signal(SIGTERM);
  EXPECT_TRUE(first.wait(10s).has_value());
  EXPECT_TRUE(second.wait(10s).has_value());
}

// A plain PyTorch program (env:// init, Gloo) under fsdprun, 2 agents x 2 workers.
void runPytorchJob(const std::string& runId, std::vector<std::string> extraFlags,
                   const std::string& expectAgentStore) {
  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<std::unique_ptr<Agent>> agents;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> flags = {"--nproc_per_node", "2"};
    flags.insert(flags.end(), extraFlags.begin(), extraFlags.end());
    agents.push_back(std::make_unique<Agent>(
        dir, "agent" + std::to_string(node),
        withCommand(jobArgs("2", port, runId, node, flags), {kPythonWorker}),
        std::vector<std::string>{std::string("PYTHON_EXEC=") + fsdp::testing::kSystemPython}));
  }
  for (auto& a : agents) {
    const auto code = a->wait(120s);
    ASSERT_TRUE(code.has_value()) << a->output();
    EXPECT_EQ(*code, 0) << a->output();
  }
  const std::string out = agents[0]->out() + agents[1]->out();
  EXPECT_EQ(countOccurrences(out, " of 4: all_reduce ok"), 4) << out;
  EXPECT_EQ(countOccurrences(out, "agent store " + expectAgentStore), 4) << out;
}

TEST(PytorchPrograms, EnvInitWorksUnchangedAgainstTheAgentsStore) {
  runPytorchJob("py-agent-store", {}, "True");
}

TEST(PytorchPrograms, WithAJobTokenRankZeroHostsItsOwnStoreOnAFreePort) {
  TempDir tokenDir;
  const std::string token = tokenDir.path() + "/token";
  {
    std::ofstream(token) << "0123456789abcdef0123456789abcdef\n";
    std::filesystem::permissions(token, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  runPytorchJob("py-token", {"--rdzv_conf", "token_file=" + token}, "False");
}

TEST(PytorchPrograms, ARoundAfterALostNodeStartsCleanInTheAgentsStore) {
  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  // The round after a lost node keeps TORCHELASTIC_RESTART_COUNT 0, so PyTorch keys the same
  // /worker/attempt_0 prefix: the server must have dropped the first round's keys (the
  // first round's workers initialised their process group before they hung), or the second
  // round's store-based barrier counts 3 + 2 arrivals and never sees 2.
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  auto agents = startThreeNodes(dir, port, "py-lost-node", "last_call_timeout=30",
                                {kPythonWorker, "--pid_dir", dir.path(), "--hang_if_world", "3", "120"},
                                {std::string("PYTHON_EXEC=") + fsdp::testing::kSystemPython});
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1", "2"}, 60s);
  ASSERT_EQ(pids.size(), 3u) << agents[0]->output();
  agents[2]->signal(SIGKILL);
  agents[2]->wait(10s);
  for (int i = 0; i < 2; ++i) {
    const auto code = agents[i]->wait(120s);
    ASSERT_TRUE(code.has_value()) << agents[i]->output();
    EXPECT_EQ(*code, 0) << agents[i]->output();
  }
  EXPECT_EQ(countOccurrences(agents[0]->out() + agents[1]->out(), " of 2: all_reduce ok"), 2);
}

}  // namespace
