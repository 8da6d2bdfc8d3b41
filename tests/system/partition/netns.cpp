// The namespace network of the partition test: building it with `ip`, cutting a node off,
// and the one teardown that both the destructor and the detached guard run.
#include "netns.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "run_command.hpp"

namespace fsdp::testing::netns {
namespace {

using namespace std::chrono_literals;

constexpr auto kCommandTimeout = 30s;

// Arguments: the bridge, then "NAMESPACE:VETH" per node. Kills (by pid) whatever runs in the
// namespaces, then deletes veths (both ends go), namespaces and bridge. Idempotent: whatever
// is already gone is skipped.
constexpr const char* kTearDown = R"sh(
br=$1; shift
pids=$(for pair in "$@"; do ip netns pids "${pair%%:*}" 2>/dev/null; done)
[ -z "$pids" ] || kill -KILL $pids 2>/dev/null
for pair in "$@"; do
  ip link del "${pair#*:}" 2>/dev/null
  ip netns del "${pair%%:*}" 2>/dev/null
done
ip link del "$br" 2>/dev/null
exit 0
)sh";

// The guard: waits for "disarm" (the test tore the network down itself) or the end of its
// stdin (the test died), then tears down.
const std::string kGuard = std::string(R"sh(
while IFS= read -r line; do [ "$line" = disarm ] && exit 0; done
)sh") + kTearDown;

std::string describe(const std::vector<std::string>& argv, const RunResult& r) {
  std::string text;
  for (const auto& a : argv) text += (text.empty() ? "" : " ") + a;
  return "`" + text + "` " + (r.timedOut ? "timed out" : "exited " + std::to_string(r.exitCode)) +
         ": " + r.err + r.out;
}

// Runs a command that must succeed; throws with its output otherwise.
void mustRun(const std::vector<std::string>& argv) {
  const auto r = runCommand(argv, kCommandTimeout);
  if (r.timedOut || r.exitCode != 0) throw Error("netns: " + describe(argv, r));
}

bool linkExists(const std::string& name) {
  return std::filesystem::exists("/sys/class/net/" + name);
}

}  // namespace

NamespaceNetwork::NamespaceNetwork(int nodes, int guardFd)
    : nodes_(nodes),
      tag_(std::to_string(::getpid())),
      subnet_("10.236." + std::to_string(::getpid() % 250 + 1)),
      bridge_("fpb" + tag_),
      guardFd_(guardFd) {}

std::string NamespaceNetwork::nodeNamespace(int node) const {
  return "fsdpp-" + tag_ + "-n" + std::to_string(node);
}

std::string NamespaceNetwork::address(int node) const {
  return subnet_ + "." + std::to_string(10 + node);
}

std::string NamespaceNetwork::hostVeth(int node) const {
  return "fpv" + tag_ + "n" + std::to_string(node);
}

std::vector<std::string> NamespaceNetwork::enter(int node) const {
  return {"nsenter", "--net=/run/netns/" + nodeNamespace(node), "--"};
}

NamespaceNetwork::Names NamespaceNetwork::names() const {
  Names n;
  n.links.push_back(bridge_);
  for (int i = 1; i <= nodes_; ++i) {
    n.namespaces.push_back(nodeNamespace(i));
    n.links.push_back(hostVeth(i));
  }
  return n;
}

std::vector<std::string> NamespaceNetwork::leftoversOf(const Names& names) {
  std::vector<std::string> left;
  for (const auto& ns : names.namespaces) {
    if (std::filesystem::exists("/run/netns/" + ns)) left.push_back("namespace " + ns);
  }
  for (const auto& link : names.links) {
    if (linkExists(link)) left.push_back("link " + link);
  }
  return left;
}

std::unique_ptr<NamespaceNetwork> NamespaceNetwork::create(const Options& options,
                                                           std::string* skipReason) {
  if (::geteuid() != 0) {
    *skipReason = "must run as root (network namespaces, a bridge)";
    return nullptr;
  }
  for (const char* tool : {"ip", "nsenter", "setsid"}) {
    std::string why;
    if (!findExecutable(tool, &why)) {
      *skipReason = std::string("`") + tool + "` is missing (" + why + ")";
      return nullptr;
    }
  }
  if (options.nodes < 1 || options.nodes > 9) throw Error("netns: nodes must be 1..9");

  // The guard first, so that whatever is created from here on is removed however this ends.
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
  const int readEnd = fds[0];
  std::unique_ptr<NamespaceNetwork> net(new NamespaceNetwork(options.nodes, fds[1]));
  {
    SpawnOptions spawn{.argv = {"setsid", "-f", "sh", "-c", kGuard, "netns-guard", net->bridge_},
                       .env = currentEnvironment()};
    for (int i = 1; i <= options.nodes; ++i) {
      spawn.argv.push_back(net->nodeNamespace(i) + ":" + net->hostVeth(i));
    }
    spawn.stdinFd = readEnd;
    // Not the test's stdout: once the test is gone a write there would kill the guard.
    spawn.stdoutPath = "/dev/null";
    spawn.stderrPath = "/dev/null";
    auto setsid = ChildProcess::spawn(spawn);
    ::close(readEnd);
    // setsid -f returns at once, leaving the guard to init.
    const auto status = setsid.waitFor(10s);
    if (!status || *status != 0) throw Error("netns: `setsid -f sh -c <guard>` failed");
  }

  // Permission probes: the first namespace and the bridge. Failing here means "cannot run
  // here" (a container without CAP_SYS_ADMIN/CAP_NET_ADMIN), not a broken test.
  const auto probe = [&](const std::vector<std::string>& argv) {
    const auto r = runCommand(argv, kCommandTimeout);
    if (r.timedOut || r.exitCode != 0) *skipReason = "not permitted here: " + describe(argv, r);
    return skipReason->empty();
  };
  skipReason->clear();
  if (!probe({"ip", "link", "add", net->bridge_, "type", "bridge"}) ||
      !probe({"ip", "netns", "add", net->nodeNamespace(1)})) {
    return nullptr;  // the destructor removes what the probe made
  }
  mustRun({"ip", "link", "set", net->bridge_, "up"});
  for (int i = 1; i <= options.nodes; ++i) {
    const std::string ns = net->nodeNamespace(i);
    if (i > 1) mustRun({"ip", "netns", "add", ns});
    // The node's end is born in its namespace as eth0: no name clash in the root namespace.
    mustRun({"ip", "link", "add", net->hostVeth(i), "type", "veth", "peer", "name", "eth0", "netns",
             ns});
    mustRun({"ip", "link", "set", net->hostVeth(i), "master", net->bridge_});
    mustRun({"ip", "link", "set", net->hostVeth(i), "up"});
    mustRun({"ip", "-n", ns, "link", "set", "lo", "up"});
    mustRun({"ip", "-n", ns, "addr", "add", net->address(i) + "/24", "dev", "eth0"});
    mustRun({"ip", "-n", ns, "link", "set", "eth0", "up"});
  }
  return net;
}

void NamespaceNetwork::cut(int node) { mustRun({"ip", "link", "set", hostVeth(node), "down"}); }

void NamespaceNetwork::tearDown() {
  std::vector<std::string> argv = {"sh", "-c", kTearDown, "netns-teardown", bridge_};
  for (int i = 1; i <= nodes_; ++i) argv.push_back(nodeNamespace(i) + ":" + hostVeth(i));
  const auto r = runCommand(argv, kCommandTimeout);
  if (r.timedOut || r.exitCode != 0) std::fprintf(stderr, "netns: %s\n", describe(argv, r).c_str());
}

NamespaceNetwork::~NamespaceNetwork() {
  tearDown();
  const auto left = leftoversOf(names());
  if (left.empty()) {
    static constexpr char kDisarm[] = "disarm\n";
    if (::write(guardFd_, kDisarm, sizeof kDisarm - 1) < 0) {
      std::fprintf(stderr, "netns guard: %s\n", std::strerror(errno));
    }
  } else {
    // Not disarmed: the guard tries once more when its pipe closes below.
    for (const auto& l : left)
      std::fprintf(stderr, "netns: still present after teardown: %s\n", l.c_str());
  }
  ::close(guardFd_);
}

}  // namespace fsdp::testing::netns
