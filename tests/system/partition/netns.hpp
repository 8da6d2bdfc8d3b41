#pragma once
// System-test harness: N "hosts" on this one machine, each a network namespace with its own
// address on a bridge, and the means to cut one of them off the network (a pulled cable).
//
//   bridge fpb<pid>            in the root namespace, no address of its own
//   netns  fsdpp-<pid>-nI      lo up; eth0 = 10.236.S.(10+I)/24, S derived from the pid
//   veth   fpv<pid>nI          eth0's other end, a port of the bridge
//
// Names carry this process's pid, so two tests (two build trees) never share anything; the
// subnet 10.236/16 is used by nothing else here (the Slurm harness uses 10.231 and 10.233).
// Nodes have no route beyond their /24.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::testing::netns {

// The namespaces, veths and bridge, from create() until destruction. Not copyable.
//
// Teardown happens whatever happens: the destructor SIGKILLs every process still in the
// namespaces (by pid) and deletes namespaces, veths and bridge; and before the first of them
// exists a detached guard (setsid, so a ctest timeout that kills this process's tree spares
// it) does the same if this process dies without doing it (crash, SIGKILL).
class NamespaceNetwork {
 public:
  struct Options {
    int nodes = 3;
  };

  // Builds the network. Returns nullptr and sets `skipReason` when it cannot run here (not
  // root, `ip`/`nsenter`/`setsid` missing, namespaces or bridges not permitted); throws
  // fsdp::Error (with the failing command's output) when it should run but fails.
  static std::unique_ptr<NamespaceNetwork> create(const Options& options, std::string* skipReason);

  ~NamespaceNetwork();
  NamespaceNetwork(const NamespaceNetwork&) = delete;
  NamespaceNetwork& operator=(const NamespaceNetwork&) = delete;

  int nodes() const { return nodes_; }
  // Node numbers are 1-based. "fsdpp-<pid>-n1", under /run/netns.
  std::string nodeNamespace(int node) const;
  // "10.236.S.11" for node 1.
  std::string address(int node) const;
  // The bridge-side end of node's veth: "fpv<pid>n1".
  std::string hostVeth(int node) const;
  const std::string& bridge() const { return bridge_; }
  // argv prefix that runs a program in node's network namespace (nsenter, which execs the
  // program: the spawned pid is the program's; `ip netns exec` would remount /sys).
  std::vector<std::string> enter(int node) const;

  // Cuts node off: its veth's bridge side goes down, so the bridge forwards nothing to or
  // from it and its eth0 loses carrier. Packets are dropped without an answer (no RST, no
  // ICMP from the others): a silent partition. Its processes run on. Throws on failure.
  void cut(int node);

  // What of this network still exists on the machine (namespaces, links), for a check that
  // the teardown was complete; empty when nothing. Usable after destruction through
  // leftoversOf(names()).
  struct Names {
    std::vector<std::string> namespaces;
    std::vector<std::string> links;  // the bridge and the host-side veths
  };
  Names names() const;
  static std::vector<std::string> leftoversOf(const Names& names);

 private:
  NamespaceNetwork(int nodes, int guardFd);
  void tearDown();
  int nodes_;
  std::string tag_;     // the pid, in every name
  std::string subnet_;  // "10.236.S"
  std::string bridge_;
  int guardFd_;  // write end of the guard's stdin: "disarm\n", or closed (= tear down)
};

}  // namespace fsdp::testing::netns
