// The agent's snapshot keeper on its real sockets: what it keeps, what it refuses, and that a
// bad client or a stranger's stream costs only that connection.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/common/snapshot_wire.hpp"
#include "fsdp/launcher/snapshot_keeper.hpp"

namespace {

using fsdp::launcher::KeeperOptions;
using fsdp::launcher::SnapshotKeeper;
using fsdp::snapshot::Fd;
using nlohmann::json;

// A piece and what a worker's put names it.
struct TestPiece {
  Fd fd;
  json names;
};

// A piece of `dataBytes` bytes of data for (rank, world, step), sealed unless asked not to.
TestPiece makePiece(int rank, int world, std::int64_t step, std::uint64_t dataBytes = 4096, bool seal = true,
                    int round = 0) {
  const std::string header = json{{"rank", rank}, {"world", world}, {"step", step}, {"round", round},
                                  {"meta", json::object()}, {"blocks", json::array()}}
                                 .dump();
  const std::uint64_t total = fsdp::snapshot::dataOffsetFor(header.size()) + dataBytes;
  Fd fd = fsdp::snapshot::createMemfd("test-piece", total);
  void* map = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  EXPECT_NE(map, MAP_FAILED);
  fsdp::snapshot::writePiecePrefix(static_cast<char*>(map), header);
  ::munmap(map, total);
  if (seal) fsdp::snapshot::sealPiece(fd.get(), /*writes=*/false);
  return {std::move(fd), {{"rank", rank}, {"world", world}, {"step", step}, {"round", round}}};
}

class Client {
 public:
  explicit Client(const SnapshotKeeper& keeper) : fd_(fsdp::snapshot::connectSeqpacket(keeper.socketName())) {}
  json ask(const json& request, int passed = -1, Fd* received = nullptr) {
    fsdp::snapshot::sendMessage(fd_.get(), request.dump(), passed);
    auto answer = fsdp::snapshot::receiveMessage(fd_.get());
    if (!answer) return json{{"closed", true}};
    if (received != nullptr) *received = std::move(answer->second);
    return json::parse(answer->first);
  }
  json put(const TestPiece& piece) {
    json request = piece.names;
    request["op"] = "put";
    return ask(request, piece.fd.get());
  }
  std::vector<std::tuple<int, int, std::int64_t, bool>> list() {
    std::vector<std::tuple<int, int, std::int64_t, bool>> out;
    const json answer = ask({{"op", "list"}});
    for (const auto& p : answer["pieces"]) {
      out.emplace_back(p["rank"].get<int>(), p["world"].get<int>(), p["step"].get<std::int64_t>(), p["peer"].get<bool>());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  int fd() const { return fd_.get(); }

 private:
  Fd fd_;
};

KeeperOptions options(std::uint64_t limit = 1 << 30) {
  return {.runId = "keeper-test", .memoryLimit = limit, .listenAddress = "127.0.0.1", .token = "secret"};
}

TEST(SnapshotKeeper, KeepsTheNewestThreePerRankAndHandsThemBackUnchanged) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  for (int step = 1; step <= 5; ++step) {
    for (int rank = 0; rank < 2; ++rank) {
      const auto answer = c.put(makePiece(rank, 2, step));
      EXPECT_TRUE(answer["ok"].get<bool>());
      // What the worker may not overwrite yet: this rank's newest three.
      std::vector<std::int64_t> expected;
      for (int s = std::max(1, step - 2); s <= step; ++s) expected.push_back(s);
      auto held = answer["held"].get<std::vector<std::int64_t>>();
      std::sort(held.begin(), held.end());
      EXPECT_EQ(held, expected) << answer;
    }
  }
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 2, 3, false}, {0, 2, 4, false}, {0, 2, 5, false},
                                     {1, 2, 3, false}, {1, 2, 4, false}, {1, 2, 5, false}}));
  Fd piece;
  const auto answer = c.ask({{"op", "get"}, {"rank", 1}, {"world", 2}, {"step", 4}}, -1, &piece);
  ASSERT_TRUE(answer["ok"].get<bool>()) << answer;
  ASSERT_TRUE(piece);
  EXPECT_TRUE(fsdp::snapshot::isSealed(piece.get()));
  const auto header = json::parse(fsdp::snapshot::readPieceHeader(piece.get(), "piece"));
  EXPECT_EQ(header["step"], 4);
  EXPECT_EQ(header["rank"], 1);
  EXPECT_FALSE(c.ask({{"op", "get"}, {"rank", 1}, {"world", 2}, {"step", 1}})["ok"].get<bool>());
  // A piece of a new world size replaces every piece of the old one.
  EXPECT_TRUE(c.put(makePiece(0, 1, 9))["ok"].get<bool>());
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 1, 9, false}}));
}

std::optional<json> sendPeer(const SnapshotKeeper& keeper, const json& header, int piece, std::uint64_t bytes);

TEST(SnapshotKeeper, ARankThatRestoredTakesBackOnlyItsOwnPieceThatItsNextPutWouldDrop) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  for (int step = 4; step <= 6; ++step) {
    for (int rank = 0; rank < 2; ++rank) ASSERT_TRUE(c.put(makePiece(rank, 2, step))["ok"].get<bool>());
  }
  // A peer copy of another node's rank 1 at an older step: not this node's to hand out.
  Fd copy = makePiece(1, 2, 3, 4096).fd;
  const std::uint64_t copyBytes = fsdp::snapshot::fileBytes(copy.get());
  json header{{"run", "keeper-test"}, {"rank", 1}, {"world", 2}, {"step", 3}, {"bytes", copyBytes},
              {"mac", fsdp::snapshot::peerMac("secret", "keeper-test", 1, 2, 3, copyBytes)}};
  ASSERT_TRUE(sendPeer(keeper, header, copy.get(), copyBytes).value_or(json{}).value("ok", false));
  const std::uint64_t heldBefore = keeper.stats().bytesHeld;
  // Rank 1 restored step 6: its step 4, which its next put would drop, comes back as writable
  // memory with its bytes; steps 5 and 6 stay (a failure before that put may fall back to 5),
  // whatever `before` says.
  std::vector<std::int64_t> taken;
  for (int i = 0; i < 4; ++i) {
    Fd piece;
    const auto answer = c.ask({{"op", "recycle"}, {"rank", 1}, {"world", 2}, {"before", 99}}, -1, &piece);
    if (!answer.value("ok", false)) {
      EXPECT_FALSE(piece);
      break;
    }
    ASSERT_TRUE(piece);
    const std::uint64_t bytes = fsdp::snapshot::fileBytes(piece.get());
    void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, piece.get(), 0);
    ASSERT_NE(map, MAP_FAILED);
    const auto header = json::parse(fsdp::snapshot::readPieceHeader(piece.get(), "piece"));
    EXPECT_EQ(header["step"], answer["step"]);
    ::munmap(map, bytes);
    taken.push_back(answer["step"].get<std::int64_t>());
  }
  EXPECT_EQ(taken, (std::vector<std::int64_t>{4}));
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 2, 4, false}, {0, 2, 5, false}, {0, 2, 6, false},
                                     {1, 2, 3, true}, {1, 2, 5, false}, {1, 2, 6, false}}));
  EXPECT_LT(keeper.stats().bytesHeld, heldBefore);
  // Nothing older than `before` (rank 0 restored step 4), another world, a malformed request.
  EXPECT_FALSE(c.ask({{"op", "recycle"}, {"rank", 0}, {"world", 2}, {"before", 4}})["ok"].get<bool>());
  EXPECT_FALSE(c.ask({{"op", "recycle"}, {"rank", 0}, {"world", 3}, {"before", 6}})["ok"].get<bool>());
  EXPECT_FALSE(c.ask({{"op", "recycle"}, {"rank", "0"}})["ok"].get<bool>());
  EXPECT_EQ(c.list().size(), 6u);
}

// The buffer a worker wrote last (its piece the table dropped, no snapshot) outlives the worker
// in the keeper and goes back first to its replacement, the table's pieces all staying for a
// fallback; never while the worker lives. A new world size lets every such buffer go.
TEST(SnapshotKeeper, TheMemoryADeadWorkerLeftGoesToItsReplacementFirstNeverWhileItLives) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  int ready[2], go[2];  // child -> parent, parent -> child
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t worker = ::fork();
  ASSERT_GE(worker, 0);
  if (worker == 0) {  // rank 1's worker: steps 4 to 7 (step 4's piece is dropped), then it waits
    Client own(keeper);
    for (int step = 4; step <= 7; ++step) {
      if (!own.put(makePiece(1, 2, step)).value("ok", false)) ::_exit(3);
    }
    char byte = 0;
    if (::write(ready[1], &byte, 1) != 1 || ::read(go[0], &byte, 1) != 1) ::_exit(4);
    ::_exit(0);
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  EXPECT_GT(keeper.stats().bytesUnheld, 0u);
  const json recycle{{"op", "recycle"}, {"rank", 1}, {"world", 2}, {"before", 99}};
  // The worker lives: the table's oldest piece comes back, as before; the buffer stays its own.
  Fd piece;
  json answer = c.ask(recycle, -1, &piece);
  ASSERT_TRUE(answer.value("ok", false)) << answer;
  EXPECT_EQ(answer.value("step", 0), 5);
  ASSERT_EQ(::write(go[1], &byte, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(worker, &status, 0), worker);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  // It has exited: its last buffer (the memory of step 4's piece) comes back, the table unchanged.
  answer = c.ask(recycle, -1, &piece);
  ASSERT_TRUE(answer.value("ok", false)) << answer;
  EXPECT_EQ(answer.value("step", 0), 4);
  EXPECT_TRUE(answer.value("unheld", false));
  ASSERT_TRUE(piece);
  EXPECT_EQ(json::parse(fsdp::snapshot::readPieceHeader(piece.get(), "piece"))["step"], 4);
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{1, 2, 6, false}, {1, 2, 7, false}}));
  EXPECT_EQ(keeper.stats().bytesUnheld, 0u);
  EXPECT_EQ(c.ask(recycle, -1, &piece).value("ok", true), false) << "two of three pieces left: none to spare";
  // This process's rank 0 leaves a buffer too; a piece of a new world size lets it go.
  for (int step = 4; step <= 7; ++step) ASSERT_TRUE(c.put(makePiece(0, 2, step))["ok"].get<bool>());
  EXPECT_GT(keeper.stats().bytesUnheld, 0u);
  ASSERT_TRUE(c.put(makePiece(0, 1, 9))["ok"].get<bool>());
  EXPECT_EQ(keeper.stats().bytesUnheld, 0u);
  for (const int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
}

TEST(SnapshotKeeper, AnUnsealedPieceOrGarbageIsRefusedAndTheKeeperServesOn) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  const auto unsealed = c.put(makePiece(0, 1, 1, 4096, /*seal=*/false));
  EXPECT_FALSE(unsealed["ok"].get<bool>());
  EXPECT_NE(unsealed["error"].get<std::string>().find("sealed"), std::string::npos);
  Fd notAPiece = fsdp::snapshot::createMemfd("junk", 100);
  fsdp::snapshot::sealPiece(notAPiece.get(), /*writes=*/false);
  const auto junk = c.put({std::move(notAPiece), makePiece(0, 1, 1).names});
  EXPECT_FALSE(junk["ok"].get<bool>());
  EXPECT_NE(junk["error"].get<std::string>().find("not a snapshot"), std::string::npos) << junk;
  EXPECT_FALSE(c.ask({{"op", "nope"}})["ok"].get<bool>());
  EXPECT_FALSE(c.put({Fd(), makePiece(0, 1, 1).names})["ok"].get<bool>());  // a put without a piece
  // A put that does not say which piece it is, or says it with something else than integers.
  for (const json& names : {json{{"rank", 0}, {"world", 1}, {"step", 1}},
                            json{{"rank", 0}, {"world", 1}, {"step", "1"}, {"round", 0}}}) {
    const auto unnamed = c.put({makePiece(0, 1, 1).fd, names});
    EXPECT_FALSE(unnamed["ok"].get<bool>()) << names;
    EXPECT_NE(unnamed.value("error", "").find("a put names its piece"), std::string::npos) << unnamed;
  }
  // Another connection is unaffected, and the first still works.
  Client other(keeper);
  EXPECT_TRUE(other.put(makePiece(0, 1, 2))["ok"].get<bool>());
  EXPECT_EQ(c.list().size(), 1u);
  EXPECT_EQ(keeper.stats().piecesHeld, 1);
}

TEST(SnapshotKeeper, AResumeFromFurtherBackDropsTheAbandonedStepsAndALateRoundIsRefused) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  for (int step = 1; step <= 5; ++step) EXPECT_TRUE(c.put(makePiece(0, 1, step, 4096, true, 1))["ok"].get<bool>());
  // Round 2 resumed from disk at step 2: its step 3 replaces the old 3, 4 and 5.
  EXPECT_TRUE(c.put(makePiece(0, 1, 3, 4096, true, 2))["ok"].get<bool>());
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 1, 3, false}}));
  // A piece of round 1 arriving now (a stream that finished late) changes nothing.
  const auto late = c.put(makePiece(0, 1, 9, 4096, true, 1));
  EXPECT_FALSE(late["ok"].get<bool>());
  EXPECT_NE(late["error"].get<std::string>().find("older than round 2"), std::string::npos) << late;
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 1, 3, false}}));
}

// Round 1: rank 0 reached step 11, rank 1 step 10; round 2 resumed from step 10 (the newest
// both held). Rank 1's first put of round 2, step 11, drops rank 0's step 11 of round 1: the
// steps redone need not be the same bits, and a second failure before rank 0's own put of step
// 11 must restore step 10, not rank 0's old 11 beside rank 1's new one. Round 1's pieces before
// step 11 stay (both rounds went through them); so does a piece of round 2.
TEST(SnapshotKeeper, APutOfANewerRoundDropsEveryRanksPiecesOfTheTrajectoryItLeft) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  for (const auto& [rank, step] : {std::pair{0, 9}, {0, 10}, {0, 11}, {1, 9}, {1, 10}}) {
    EXPECT_TRUE(c.put(makePiece(rank, 2, step, 4096, true, 1))["ok"].get<bool>());
  }
  EXPECT_TRUE(c.put(makePiece(1, 2, 11, 4096, true, 2))["ok"].get<bool>());
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{0, 2, 9, false}, {0, 2, 10, false}, {1, 2, 9, false}, {1, 2, 10, false},
                                      {1, 2, 11, false}}));
  const json listed = c.ask({{"op", "list"}});
  for (const auto& p : listed["pieces"]) EXPECT_EQ(p["round"], p["step"] == 11 ? 2 : 1) << p;
  EXPECT_TRUE(c.put(makePiece(0, 2, 11, 4096, true, 2))["ok"].get<bool>());
  EXPECT_EQ(c.list().size(), 6u);
}

TEST(SnapshotKeeper, ThePieceThatDoesNotFitTheLimitIsRefusedNamingIt) {
  // Room for about three 64 KiB pieces.
  SnapshotKeeper keeper(options(200 * 1024));
  Client c(keeper);
  for (int step = 1; step <= 6; ++step) {
    EXPECT_TRUE(c.put(makePiece(0, 1, step, 60 * 1024))["ok"].get<bool>()) << step;
  }
  EXPECT_LE(keeper.stats().bytesHeld, 200u * 1024);
  const auto big = c.put(makePiece(0, 1, 7, 400 * 1024));
  EXPECT_FALSE(big["ok"].get<bool>());
  EXPECT_NE(big["error"].get<std::string>().find("--snapshot_memory_limit"), std::string::npos) << big;
  // What that rank held is older than what it could not keep: dropped, never restored.
  EXPECT_TRUE(c.list().empty());
  EXPECT_EQ(keeper.stats().refused, 1);
}

// Sends one peer stream frame; the reply, or nullopt when the keeper closed the stream.
std::optional<json> sendPeer(const SnapshotKeeper& keeper, const json& header, int piece, std::uint64_t bytes) {
  const std::string endpoint = keeper.peerEndpoint();
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1))));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  Fd fd(::socket(AF_INET, SOCK_STREAM, 0));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return std::nullopt;
  const std::string text = header.dump();
  const auto length = static_cast<std::uint32_t>(text.size());
  fsdp::snapshot::writeAll(fd.get(), &length, sizeof(length));
  fsdp::snapshot::writeAll(fd.get(), text.data(), text.size());
  std::vector<char> data(bytes);
  if (::pread(piece, data.data(), bytes, 0) != static_cast<ssize_t>(bytes)) return std::nullopt;
  try {
    fsdp::snapshot::writeAll(fd.get(), data.data(), data.size());
  } catch (const fsdp::Error&) {
    return std::nullopt;  // closed on us
  }
  std::uint32_t replyLength = 0;
  if (!fsdp::snapshot::readAll(fd.get(), &replyLength, sizeof(replyLength))) return std::nullopt;
  std::string reply(replyLength, '\0');
  if (!fsdp::snapshot::readAll(fd.get(), reply.data(), reply.size())) return std::nullopt;
  return json::parse(reply);
}

TEST(SnapshotKeeper, APeerStreamFromTheJobIsKeptAndAStrangersIsNot) {
  SnapshotKeeper keeper(options());
  Fd piece = makePiece(3, 4, 11).fd;
  const std::uint64_t bytes = fsdp::snapshot::fileBytes(piece.get());
  json header{{"run", "keeper-test"}, {"rank", 3}, {"world", 4}, {"step", 11}, {"bytes", bytes},
              {"mac", fsdp::snapshot::peerMac("wrong token", "keeper-test", 3, 4, 11, bytes)}};
  const auto stranger = sendPeer(keeper, header, piece.get(), bytes);
  EXPECT_FALSE(stranger.has_value() && stranger->value("ok", false));
  Client c(keeper);
  EXPECT_TRUE(c.list().empty());
  header["mac"] = fsdp::snapshot::peerMac("secret", "keeper-test", 3, 4, 11, bytes);
  const auto member = sendPeer(keeper, header, piece.get(), bytes);
  ASSERT_TRUE(member.has_value());
  EXPECT_TRUE(member->value("ok", false)) << *member;
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{3, 4, 11, true}}));
}

// A TCP stream to the keeper, with a timeout on every read (a test never hangs on it).
Fd connectTcp(const SnapshotKeeper& keeper) {
  const std::string endpoint = keeper.peerEndpoint();
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1))));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  Fd fd(::socket(AF_INET, SOCK_STREAM, 0));
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << endpoint;
  timeval tv{.tv_sec = 10, .tv_usec = 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// One remote get on `stream`: the reply and the piece's bytes when it says ok; nullopt when the
// keeper closed the stream instead.
std::optional<std::pair<json, std::string>> remoteGet(int stream, const json& header) {
  try {
    fsdp::snapshot::writeFrame(stream, header.dump());
    const auto text = fsdp::snapshot::readFrame(stream, "the keeper");
    if (!text) return std::nullopt;
    json reply = json::parse(*text);
    std::string bytes;
    if (reply.value("ok", false)) {
      bytes.resize(reply.at("bytes").get<std::size_t>());
      if (!fsdp::snapshot::readAll(stream, bytes.data(), bytes.size())) return std::nullopt;
    }
    return std::make_pair(std::move(reply), std::move(bytes));
  } catch (const fsdp::Error&) {
    return std::nullopt;  // reset by the keeper
  }
}

json getHeader(const std::string& run, const std::string& token, int rank, int world, std::int64_t step) {
  return {{"op", "get"}, {"run", run}, {"rank", rank}, {"world", world}, {"step", step},
          {"mac", fsdp::snapshot::getMac(token, run, rank, world, step)}};
}

// A piece that a remote get is sending (its reader slow: nothing read yet) is not taken back,
// and once a put drops it, the put's answer still names it held, until the send has ended.
TEST(SnapshotKeeper, APieceBeingSentIsNeitherTakenBackNorNamedFreeUntilItsSendEnds) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  constexpr std::uint64_t kBig = 64u << 20;  // far more than a loopback socket buffers
  ASSERT_TRUE(c.put(makePiece(1, 2, 4, kBig))["ok"].get<bool>());
  for (int step = 5; step <= 6; ++step) ASSERT_TRUE(c.put(makePiece(1, 2, step))["ok"].get<bool>());
  Fd stream = connectTcp(keeper);
  fsdp::snapshot::writeFrame(stream.get(), getHeader("keeper-test", "secret", 1, 2, 4).dump());
  const auto text = fsdp::snapshot::readFrame(stream.get(), "the keeper");
  ASSERT_TRUE(text.has_value());
  const json reply = json::parse(*text);
  ASSERT_TRUE(reply.value("ok", false)) << reply;  // the send has begun, and waits on this reader
  const json recycle{{"op", "recycle"}, {"rank", 1}, {"world", 2}, {"before", 6}};
  EXPECT_FALSE(c.ask(recycle)["ok"].get<bool>()) << "the piece being sent was handed back for writing";
  const auto held = [](const json& answer) {
    auto steps = answer.at("held").get<std::vector<std::int64_t>>();
    std::sort(steps.begin(), steps.end());
    return steps;
  };
  // Step 7 drops step 4 from the table, but its memory is still being sent.
  EXPECT_EQ(held(c.put(makePiece(1, 2, 7))), (std::vector<std::int64_t>{4, 5, 6, 7}));
  using T = std::tuple<int, int, std::int64_t, bool>;
  EXPECT_EQ(c.list(), (std::vector<T>{{1, 2, 5, false}, {1, 2, 6, false}, {1, 2, 7, false}}));
  std::string body(reply.at("bytes").get<std::size_t>(), '\0');
  ASSERT_TRUE(fsdp::snapshot::readAll(stream.get(), body.data(), body.size()));
  // The stream's next answer comes after the first get has returned: the send is over.
  const auto unknown = remoteGet(stream.get(), getHeader("keeper-test", "secret", 1, 2, 99));
  ASSERT_TRUE(unknown.has_value());
  EXPECT_EQ(held(c.put(makePiece(1, 2, 8))), (std::vector<std::int64_t>{6, 7, 8}));
  Fd piece;
  const json back = c.ask({{"op", "recycle"}, {"rank", 1}, {"world", 2}, {"before", 8}}, -1, &piece);
  EXPECT_TRUE(back.value("ok", false)) << back;
  EXPECT_EQ(back.value("step", -1), 6);
}

TEST(SnapshotKeeper, ARemoteGetOfTheJobGetsThePieceByteForByteAndAStrangersClosesOnlyItsStream) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  TestPiece piece = makePiece(1, 2, 4, 3 * 4096 + 17);
  // Data no other piece has: the get must hand back these very bytes.
  const std::uint64_t bytes = fsdp::snapshot::fileBytes(piece.fd.get());
  std::string expected(bytes, '\0');
  ASSERT_EQ(::pread(piece.fd.get(), expected.data(), bytes, 0), static_cast<ssize_t>(bytes));
  const std::uint64_t data = bytes - (3 * 4096 + 17);
  for (std::uint64_t i = data; i < bytes; ++i) expected[i] = static_cast<char>((i * 31 + 7) % 251);
  ASSERT_EQ(::pwrite(piece.fd.get(), expected.data() + data, bytes - data, static_cast<off_t>(data)),
            static_cast<ssize_t>(bytes - data));
  ASSERT_TRUE(c.put(piece)["ok"].get<bool>());

  Fd stream = connectTcp(keeper);
  const auto good = remoteGet(stream.get(), getHeader("keeper-test", "secret", 1, 2, 4));
  ASSERT_TRUE(good.has_value());
  ASSERT_TRUE(good->first.value("ok", false)) << good->first;
  EXPECT_EQ(good->first["bytes"].get<std::uint64_t>(), bytes);
  EXPECT_TRUE(good->second == expected) << "the bytes differ";
  // A piece not held is an answer, and the stream serves on.
  const auto unknown = remoteGet(stream.get(), getHeader("keeper-test", "secret", 1, 2, 5));
  ASSERT_TRUE(unknown.has_value());
  EXPECT_FALSE(unknown->first.value("ok", true));
  EXPECT_NE(unknown->first.value("error", "").find("rank 1 (world 2) at step 5"), std::string::npos) << unknown->first;
  const auto again = remoteGet(stream.get(), getHeader("keeper-test", "secret", 1, 2, 4));
  ASSERT_TRUE(again.has_value());
  EXPECT_TRUE(again->second == expected);

  // Refused, each on a stream of its own that the keeper then closes: a wrong MAC, another run,
  // and a put's header (its MAC under the job token) replayed as a get.
  json wrongMac = getHeader("keeper-test", "wrong token", 1, 2, 4);
  json otherRun = getHeader("other-run", "secret", 1, 2, 4);
  json replayed{{"run", "keeper-test"}, {"rank", 1}, {"world", 2}, {"step", 4}, {"bytes", bytes},
                {"mac", fsdp::snapshot::peerMac("secret", "keeper-test", 1, 2, 4, bytes)}};
  replayed["op"] = "get";
  json forged = getHeader("keeper-test", "secret", 1, 2, 4);
  forged["step"] = 3;  // a MAC of step 4 for step 3
  for (const json& header : {wrongMac, otherRun, replayed, forged}) {
    Fd refused = connectTcp(keeper);
    EXPECT_FALSE(remoteGet(refused.get(), header).has_value()) << header;
    // Closed: nothing more is served on it.
    EXPECT_FALSE(remoteGet(refused.get(), getHeader("keeper-test", "secret", 1, 2, 4)).has_value()) << header;
  }
  // The first stream and the worker's socket are unaffected.
  const auto after = remoteGet(stream.get(), getHeader("keeper-test", "secret", 1, 2, 4));
  ASSERT_TRUE(after.has_value());
  EXPECT_TRUE(after->second == expected);
  EXPECT_EQ(c.list().size(), 1u);
}

TEST(SnapshotKeeper, ARemoteGetPrefersTheKeepersOwnPieceToItsPeerCopy) {
  SnapshotKeeper keeper(options());
  Client c(keeper);
  ASSERT_TRUE(c.put(makePiece(0, 2, 7, 4096))["ok"].get<bool>());
  Fd copy = makePiece(0, 2, 7, 8192).fd;
  const std::uint64_t copyBytes = fsdp::snapshot::fileBytes(copy.get());
  json header{{"run", "keeper-test"}, {"rank", 0}, {"world", 2}, {"step", 7}, {"bytes", copyBytes},
              {"mac", fsdp::snapshot::peerMac("secret", "keeper-test", 0, 2, 7, copyBytes)}};
  ASSERT_TRUE(sendPeer(keeper, header, copy.get(), copyBytes).value_or(json{}).value("ok", false));
  Fd stream = connectTcp(keeper);
  const auto got = remoteGet(stream.get(), getHeader("keeper-test", "secret", 0, 2, 7));
  ASSERT_TRUE(got.has_value());
  ASSERT_TRUE(got->first.value("ok", false)) << got->first;
  EXPECT_LT(got->first["bytes"].get<std::uint64_t>(), copyBytes);  // the own (smaller) piece
}

TEST(SnapshotKeeper, SizesParseAsTheFlagSaysAndBadOnesNameTheFlag) {
  EXPECT_EQ(fsdp::launcher::parseByteSize("0", "--f"), 0u);
  EXPECT_EQ(fsdp::launcher::parseByteSize("512M", "--f"), 512ull << 20);
  EXPECT_EQ(fsdp::launcher::parseByteSize("4G", "--f"), 4ull << 30);
  EXPECT_EQ(fsdp::launcher::parseByteSize("1.5K", "--f"), 1536u);
  EXPECT_EQ(fsdp::launcher::parseByteSize("1000", "--f"), 1000u);
  for (const std::string bad : {"", "lots", "-1G", "4X", "G"}) {
    try {
      fsdp::launcher::parseByteSize(bad, "--snapshot_memory_limit");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const fsdp::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--snapshot_memory_limit '" + bad + "'"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
