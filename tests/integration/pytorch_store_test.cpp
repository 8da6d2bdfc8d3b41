// PyTorch's own store clients against fsdprun-rdzv: LibTorch 1.13's c10d::TCPStore (C++) and
// python3-torch's torch.distributed.TCPStore, over loopback.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#include "fsdp/rendezvous/store_client.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"

namespace {

using namespace std::chrono_literals;

std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<std::uint8_t>& b) { return {b.begin(), b.end()}; }

std::unique_ptr<c10d::TCPStore> client(std::uint16_t port, std::size_t worldSize = 0) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = false;
  if (worldSize > 0) o.numWorkers = worldSize;
  o.waitWorkers = false;
  o.timeout = 10s;
  return std::make_unique<c10d::TCPStore>("127.0.0.1", o);
}

TEST(PytorchStore, LibTorch113ClientDoesEveryOperation) {
  fsdp::testing::RdzvDaemon daemon;
  auto storePtr = client(daemon.port(), 1);
  auto& store = *storePtr;
  store.set("a", bytes("1"));
  EXPECT_EQ(text(store.get("a")), "1");
  EXPECT_EQ(store.add("n", 5), 5);
  EXPECT_EQ(store.add("n", -2), 3);
  EXPECT_EQ(text(store.get("n")), "3");
  EXPECT_EQ(text(store.compareSet("a", bytes("1"), bytes("2"))), "2");
  EXPECT_EQ(text(store.compareSet("a", bytes("x"), bytes("3"))), "2");
  EXPECT_EQ(text(store.compareSet("fresh", bytes(""), bytes("new"))), "new");
  EXPECT_TRUE(store.check({"a", "n"}));
  EXPECT_FALSE(store.check({"a", "absent"}));
  EXPECT_EQ(store.getNumKeys(), 3);  // a, n, fresh (no init/ key: waitWorkers is off)
  EXPECT_TRUE(store.deleteKey("fresh"));
  EXPECT_FALSE(store.deleteKey("fresh"));
  store.wait({"a", "n"});
  EXPECT_THROW(store.wait({"never"}, 200ms), std::exception);
  // The connection goes on serving after a timed-out wait: the next request drops the stale
  // wait. (1.13's protocol has no CANCEL_WAIT: had the key arrived before that next request,
  // the reply would have been sent, as c10d's own server does.)
  EXPECT_EQ(store.getNumKeys(), 2);  // a, n
  auto other = client(daemon.port());
  other->set("never", bytes("late"));
  EXPECT_EQ(text(store.get("never")), "late");
  EXPECT_EQ(store.getNumKeys(), 3);
}

TEST(PytorchStore, WaitIsAnsweredWhenAnotherClientSetsTheKey) {
  fsdp::testing::RdzvDaemon daemon;
  auto waiter = client(daemon.port());
  auto setter = client(daemon.port());
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    setter->set("late", bytes("here"));
  });
  EXPECT_EQ(text(waiter->get("late")), "here");
  t.join();
}

TEST(PytorchStore, OurClientAndTheirsShareTheDefaultRun) {
  fsdp::testing::RdzvDaemon daemon;
  auto theirs = client(daemon.port());
  theirs->set("k", bytes("v"));
  auto ours = fsdp::rendezvous::StoreClient::connect("127.0.0.1", daemon.port());
  EXPECT_EQ(ours->get("/k", 1s), "v");  // c10d prefixes user keys with '/'
}

TEST(PytorchStore, RefusedWhenATokenIsSetUnlessAllowed) {
  fsdp::testing::TempDir dir;
  const std::string tokenFile = dir.path() + "/token";
  std::ofstream(tokenFile) << "s3cret\n";
  fsdp::testing::RdzvDaemon strict({"--token_file", tokenFile});
  c10d::TCPStoreOptions o;
  o.port = strict.port();
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = 2s;
  auto refused = [&] {
    auto s = c10d::TCPStore("127.0.0.1", o);
    s.add("x", 1);
  };
  EXPECT_THROW(refused(), std::exception);
  fsdp::testing::RdzvDaemon open({"--token_file", tokenFile, "--allow_pytorch_clients"});
  EXPECT_EQ(client(open.port())->add("x", 1), 1);
}

TEST(PytorchStore, PythonTcpStoreClientDoesEveryOperation) {
  const auto probe = fsdp::testing::runCommand({"/usr/bin/python3", "-c", "import torch"}, 60s);
  if (probe.exitCode != 0) GTEST_SKIP() << "python3-torch is not installed";
  fsdp::testing::RdzvDaemon daemon;
  const std::string script = R"(
import sys, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=10))
s.set("k", "v1")
assert s.get("k") == b"v1", s.get("k")
assert s.add("c", 5) == 5 and s.add("c", 2) == 7
assert s.compare_set("k", "v1", "v2") == b"v2"
assert s.compare_set("k", "zz", "v3") == b"v2"
s.wait(["k", "c"])
try:
    s.wait(["missing"], datetime.timedelta(milliseconds=200))
    raise SystemExit("wait did not time out")
except RuntimeError:
    pass
assert s.num_keys() == 3, s.num_keys()   # init/, k, c
assert s.delete_key("k") and not s.delete_key("k")
print("python TCPStore ok")
)";
  const auto r = fsdp::testing::runCommand(
      {"/usr/bin/python3", "-c", script, std::to_string(daemon.port())}, 60s);
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("python TCPStore ok"), std::string::npos) << r.err;
}

}  // namespace
