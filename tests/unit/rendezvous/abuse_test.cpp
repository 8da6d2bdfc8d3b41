// A live server under attack (random bytes, truncated frames, oversized lengths,
// unauthenticated requests) while well-behaved clients keep working.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "raw_socket.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;

// Sends `bytes` on a fresh connection, then reads until the server closes it (bounded).
void attack(std::uint16_t port, const std::vector<std::uint8_t>& bytes) {
  const int fd = fsdp::testing::connectLoopback(port, 300ms);
  if (fd < 0) return;
  [[maybe_unused]] auto n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  char buf[256];
  while (::read(fd, buf, sizeof(buf)) > 0) {
  }
  ::close(fd);
}

TEST(StoreServerUnderAttack, WellBehavedClientsKeepWorking) {
  ServerOptions options{.frameTimeout = 200ms, .token = "job-token"};
  StoreServer server(options);
  const auto port = server.port();
  std::atomic<bool> done{false};  // the attack is over
  std::atomic<int> attacks{0};

  std::vector<std::thread> attackers;
  for (int a = 0; a < 2; ++a) {
    attackers.emplace_back([&, a] {
      std::mt19937 rng(1234 + a);
      for (int n = 0; n < 40; ++n) {
        std::vector<std::uint8_t> bytes;
        switch (rng() % 5) {
          case 0:  // random garbage
            bytes.resize(1 + rng() % 64);
            for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
            break;
          case 1: {  // a truncated frame: header promises more than comes
            bytes = encodeRequest({.op = Op::kSet, .keys = {"k"}, .value = "v"});
            bytes.resize(bytes.size() / 2);
            break;
          }
          case 2:  // an oversized length
            bytes = {0x46, 0x53, 0x44, 0x50, 1, 1, 0, 0, 0xff, 0xff, 0xff, 0xff};
            break;
          case 3:  // a valid request without HELLO/AUTH
            bytes = encodeRequest({.op = Op::kGet, .keys = {"secret"}, .timeoutMs = 10});
            break;
          default: {  // HELLO, then a request without proving the token
            bytes = encodeRequest({.op = Op::kHello, .keys = {"job"}, .value = "nonce"});
            const auto set = encodeRequest({.op = Op::kSet, .keys = {"secret"}, .value = "stolen"});
            bytes.insert(bytes.end(), set.begin(), set.end());
            break;
          }
        }
        attack(port, bytes);
        ++attacks;
      }
    });
  }

  std::vector<std::thread> clients;
  std::atomic<int> failures{0};
  std::atomic<int> ops{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      try {
        auto client = StoreClient::connect("127.0.0.1", port, {.timeout = 10s, .runId = "job", .token = "job-token"});
        // Keep working for as long as the attack lasts.
        for (int i = 0; i < 300 || !done; ++i) {
          const std::string key = "c" + std::to_string(c) + "/" + std::to_string(i);
          client->set(key, std::to_string(i));
          if (client->get(key, 1s) != std::to_string(i)) ++failures;
          client->add("counter", 1);
          ++ops;
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "client " << c << ": " << e.what();
        ++failures;
      }
    });
  }
  for (auto& t : attackers) t.join();
  done = true;
  for (auto& t : clients) t.join();

  EXPECT_EQ(failures, 0);
  auto check = StoreClient::connect("127.0.0.1", port, {.runId = "job", .token = "job-token"});
  EXPECT_EQ(check->add("counter", 0), ops.load());
  EXPECT_FALSE(check->check({"secret"})) << "an unauthenticated client wrote into the run";
  const auto stats = server.stats();
  EXPECT_EQ(attacks.load(), 80);
  EXPECT_GT(stats.protocolErrors, 0u);
  EXPECT_GT(stats.authFailures, 0u);
}

}  // namespace
}  // namespace fsdp::rendezvous
