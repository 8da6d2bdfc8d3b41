// PyTorch against fsdprun: its own store clients against fsdprun-rdzv (LibTorch 1.13's
// c10d::TCPStore in C++, python3-torch's torch.distributed.TCPStore, over loopback), and a
// PyTorch DDP script under fsdprun.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/torch_compat.hpp"
#include "raw_socket.hpp"
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

// watchKey is LibTorch 1.13's: 2.x's c10d::TCPStore inherits a Store::watchKey that only throws,
// and c10d's own server there has no WATCH_KEY (torch_compat.hpp).
constexpr bool kTcpStoreWatchesKeys = fsdp::worker::compat::implementsWatchKey<c10d::TCPStore>();
constexpr const char* kNoWatchKey =
    "this LibTorch's c10d::TCPStore does not implement watchKey (gone after 1.13), and its server "
    "has no WATCH_KEY to compare ours against";

// store.watchKey(key, callback), written so that it compiles where Store has no watchKey at all.
template <typename Store, typename Callback>
void watchKey(Store& store, const std::string& key, Callback callback) {
  if constexpr (requires { store.watchKey(key, callback); }) {
    store.watchKey(key, std::move(callback));
  } else {
    throw std::runtime_error("this LibTorch's c10d::Store has no watchKey");
  }
}

// What a watchKey callback saw, in order: "old>new", with "-" for an absent value.
class WatchLog {
 public:
  // Generic over the optional type: c10::optional in 1.13, std::optional in 2.x.
  auto callback() {
    return [this](const auto& oldValue, const auto& newValue) {
      std::scoped_lock lock(mutex_);
      seen_.push_back(oldValue.value_or("-") + ">" + newValue.value_or("-"));
      changed_.notify_all();
    };
  }
  // The first n changes, or as many as came within the timeout.
  std::vector<std::string> first(std::size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, timeout, [&] { return seen_.size() >= n; });
    return seen_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> seen_;
};

// The same writes, watched with LibTorch 1.13's watchKey, against any server on `port`.
std::vector<std::string> watchedChanges(std::uint16_t port) {
  auto watcher = client(port);
  auto writer = client(port);
  WatchLog log;
  watchKey(*watcher, "k", log.callback());
  writer->set("k", bytes("v1"));
  writer->set("k", bytes("5"));
  writer->add("k", 2);
  writer->compareSet("k", bytes("no"), bytes("never"));  // no swap: no change
  writer->compareSet("k", bytes("7"), bytes("z"));
  writer->set("other", bytes("x"));
  writer->deleteKey("k");
  return log.first(5, 10s);
}

c10d::TCPStore referenceServer() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = 10s;
  return c10d::TCPStore("127.0.0.1", o);
}

// The trait the watch tests skip by says what TCPStore does: its watchKey registers (1.13) or
// throws (2.x's deprecated Store::watchKey).
TEST(PytorchStore, TcpStoreWatchesKeysExactlyWhereTorchCompatSaysSo) {
  auto reference = referenceServer();
  WatchLog log;  // outlives the watcher, whose thread would call it
  auto watcher = client(reference.getPort());
  if (kTcpStoreWatchesKeys) {
    EXPECT_NO_THROW(watchKey(*watcher, "k", log.callback()));
  } else {
    EXPECT_THROW(watchKey(*watcher, "k", log.callback()), std::exception);
  }
}

TEST(PytorchStore, LibTorch113WatchKeySeesWhatC10dsOwnServerShows) {
  if (!kTcpStoreWatchesKeys) GTEST_SKIP() << kNoWatchKey;
  fsdp::testing::RdzvDaemon daemon;
  const auto ours = watchedChanges(daemon.port());
  auto reference = referenceServer();
  const auto theirs = watchedChanges(reference.getPort());
  EXPECT_EQ(theirs, std::vector<std::string>({"->v1", "v1>5", "5>7", "7>z", "z>-"}));
  EXPECT_EQ(ours, theirs);
}

TEST(PytorchStore, LibTorch113WatchKeyAlsoSeesWritesOfOurOwnClients) {
  if (!kTcpStoreWatchesKeys) GTEST_SKIP() << kNoWatchKey;
  fsdp::testing::RdzvDaemon daemon;
  auto watcher = client(daemon.port());
  WatchLog log;
  watchKey(*watcher, "k", log.callback());
  auto ours = fsdp::rendezvous::StoreClient::connect("127.0.0.1", daemon.port());
  ours->set("/k", "a");
  ours->append("/k", "bc");  // c10d's KEY_APPENDED carries only the suffix; 1.13 reads an update
  ours->multiSet({"/k"}, {"m"});
  ours->remove("/k");
  EXPECT_EQ(log.first(4, 10s), std::vector<std::string>({"->a", ">bc", "abc>m", "m>-"}));
}

// Everything a watching connection receives, byte for byte: WATCH_KEY (opcode 7) of "/k" on a
// raw socket, then set, set, add, a failed and a successful compare_set, a write of another
// key and a delete, through a LibTorch client. Each server sends a change before it answers
// the write, so once the delete has returned, every byte is in the socket.
std::vector<std::uint8_t> watchBytes(std::uint16_t port, std::size_t expectedBytes) {
  const int fd = fsdp::testing::connectLoopback(port);
  EXPECT_GE(fd, 0);
  const std::uint8_t watch[] = {7, 2, 0, 0, 0, 0, 0, 0, 0, '/', 'k'};
  EXPECT_EQ(::write(fd, watch, sizeof(watch)), static_cast<ssize_t>(sizeof(watch)));
  auto received = fsdp::testing::readUpTo(fd, 1);
  EXPECT_EQ(received.size(), 1u);  // KEY_CALLBACK_REGISTERED, before any write
  auto writer = client(port);
  writer->set("k", bytes("v1"));
  writer->set("k", bytes("5"));
  writer->add("k", 2);
  writer->compareSet("k", bytes("no"), bytes("never"));
  writer->compareSet("k", bytes("7"), bytes("z"));
  writer->set("other", bytes("x"));
  writer->deleteKey("k");
  // Read until `expectedBytes` came or nothing more comes for a second: c10d's server sends
  // the empty new value of a deletion with MSG_MORE and nothing after it, so those last 8
  // bytes leave its kernel only when the cork times out (about 200 ms later).
  timeval shortWait{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &shortWait, sizeof(shortWait));
  const auto rest = fsdp::testing::readUpTo(fd, expectedBytes - received.size());
  received.insert(received.end(), rest.begin(), rest.end());
  ::close(fd);
  return received;
}

TEST(PytorchStore, WatchKeyBytesAreThoseOfC10dsOwnServer) {
  if (!kTcpStoreWatchesKeys) GTEST_SKIP() << kNoWatchKey;
  // KEY_CALLBACK_REGISTERED, then five changes: a type byte, then key, old and new value with
  // u64 lengths: ->v1 (29 bytes), v1>5 (30), 5>7 (29), 7>z (29), z> (28).
  constexpr std::size_t kExpected = 146;
  fsdp::testing::RdzvDaemon daemon;
  auto reference = referenceServer();
  const auto theirs = watchBytes(reference.getPort(), kExpected);
  const auto ours = watchBytes(daemon.port(), kExpected);
  EXPECT_EQ(theirs.size(), kExpected);
  EXPECT_EQ(ours, theirs);
}

using fsdp::testing::kSystemPython;
using fsdp::testing::systemPythonHasTorch;
const std::string kPythonDir = std::string(FSDP_SOURCE_DIR) + "/tests/integration/python/";

// tests/integration/python/store_client.py runs every operation its PyTorch's client has,
// first against that PyTorch's own server, then against ours, and names any that differs
// (scripts/gpu-check runs it with PyTorch 2.x, libuv and classic).
TEST(PytorchStore, PythonTcpStoreClientDoesEveryOperationAsPytorchsOwnServerDoes) {
  if (!systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  fsdp::testing::RdzvDaemon daemon;
  const auto r =
      fsdp::testing::runCommand({kSystemPython, kPythonDir + "store_client.py", "127.0.0.1",
                                 std::to_string(daemon.port()), "--compare"},
                                60s);
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("python TCPStore ok"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.out.find("same as PyTorch's own server"), std::string::npos) << r.out;
}

// A plain DDP script (env:// init, Gloo) under fsdprun, 3 ranks: every rank ends with the
// parameters one process gets on the whole batch (the script checks; rank 0 prints the diff).
TEST(PytorchDdp, AScriptUnderFsdprunTrainsAsOneProcessOnTheWholeBatch) {
  if (!systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  const auto r = fsdp::testing::runCommand(
      {std::string(FSDP_BIN_DIR) + "/fsdprun", "--standalone", "--nproc_per_node", "3",
       kPythonDir + "ddp_train.py", "--steps", "12", "--per_rank", "5"},
      120s, {std::string("PYTHON_EXEC=") + kSystemPython});
  ASSERT_FALSE(r.timedOut) << r.out << r.err;
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(fsdp::testing::countOccurrences(r.out, " of 3: ddp ok"), 3) << r.out << r.err;
  EXPECT_NE(r.out.find("one process on the whole batch: max |diff|"), std::string::npos) << r.out;
}

}  // namespace
