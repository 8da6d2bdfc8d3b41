#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "processes.hpp"

namespace fsdp {
namespace {

std::string sha(const std::string& text) {
  Sha256 h;
  h.update(text);
  return h.hexDigest();
}

TEST(Sha256, MatchesTheFipsTestVectors) {
  EXPECT_EQ(sha(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PiecewiseUpdatesEqualOneUpdate) {
  const std::string text(1000, 'x');
  Sha256 pieces;
  for (std::size_t i = 0; i < text.size(); i += 7) pieces.update(std::string_view(text).substr(i, 7));
  EXPECT_EQ(pieces.hexDigest(), sha(text));
}

TEST(ParseInt, AcceptsWholeIntegersOnly) {
  EXPECT_EQ(parseInt("42"), 42);
  EXPECT_EQ(parseInt("-3"), -3);
  EXPECT_FALSE(parseInt(""));
  EXPECT_FALSE(parseInt("4x"));
  EXPECT_FALSE(parseInt(" 4"));
  EXPECT_FALSE(parseInt("99999999999999999999999"));
  EXPECT_EQ(parseDouble("0.5"), 0.5);
  EXPECT_FALSE(parseDouble("nan"));
}

TEST(EnvInt, NamesTheVariableWhenMalformedOrMissing) {
  const auto env = mapEnv({{"RANK", "x"}});
  try {
    envInt(env, "RANK", 0);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='x'"), std::string::npos);
  }
  EXPECT_EQ(envInt(env, "OTHER", 5), 5);
  EXPECT_THROW(requireEnvInt(env, "WORLD_SIZE"), ConfigError);
}

TEST(EnvFlag, TakesZeroOrOneAndNamesAnythingElse) {
  const auto env = mapEnv({{"ON", "1"}, {"OFF", "0"}, {"BAD", "yes"}, {"TWO", "2"}, {"EMPTY", ""}});
  EXPECT_TRUE(envFlag(env, "ON", false));
  EXPECT_FALSE(envFlag(env, "OFF", true));
  EXPECT_TRUE(envFlag(env, "UNSET", true));
  EXPECT_FALSE(envFlag(env, "UNSET", false));
  for (const char* name : {"BAD", "TWO", "EMPTY"}) {
    try {
      envFlag(env, name, false);
      FAIL() << name;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + "='"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("expected 0 or 1"), std::string::npos) << e.what();
    }
  }
}

TEST(Signals, NamesAndParses) {
  EXPECT_EQ(signalName(SIGTERM), "SIGTERM");
  EXPECT_EQ(parseSignal("SIGUSR1"), SIGUSR1);
  EXPECT_EQ(parseSignal("USR1"), SIGUSR1);
  EXPECT_EQ(parseSignal("15"), SIGTERM);
  EXPECT_FALSE(parseSignal("SIGNOPE"));
  EXPECT_FALSE(parseSignal("0"));
}

TEST(ChildProcess, ReportsExitCodeAndSignal) {
  auto exit3 = ChildProcess::spawn({.argv = {"/bin/sh", "-c", "exit 3"}, .env = currentEnvironment()});
  const auto status = exit3.waitFor(std::chrono::seconds(10));
  ASSERT_TRUE(status);
  EXPECT_EQ(describeWaitStatus(*status), "exit code 3");

  auto sleeper = ChildProcess::spawn({.argv = {"sleep", "30"}, .env = currentEnvironment()});
  sleeper.signal(SIGKILL);
  const auto killed = sleeper.waitFor(std::chrono::seconds(10));
  ASSERT_TRUE(killed);
  EXPECT_EQ(describeWaitStatus(*killed), "signal SIGKILL (9)");
}

TEST(ChildProcess, MissingProgramIsAConfigErrorNamingIt) {
  try {
    ChildProcess::spawn({.argv = {"/no/such/program"}, .env = {}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/program"), std::string::npos);
  }
}

TEST(ChildProcess, DestructorKillsAndReapsARunningChild) {
  pid_t pid = 0;
  {
    auto child = ChildProcess::spawn({.argv = {"sleep", "30"}, .env = currentEnvironment()});
    pid = child.pid();
  }
  // Reaped: the pid is no longer our child.
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
}

TEST(ChildProcess, WaitForTimesOutOnARunningChild) {
  auto child = ChildProcess::spawn({.argv = {"sleep", "30"}, .env = currentEnvironment()});
  EXPECT_FALSE(child.waitFor(std::chrono::milliseconds(50)));
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

TEST(HmacSha256, MatchesRfc4231TestCases) {
  const auto hex = [](const std::array<std::uint8_t, 32>& d) {
    return toHex(std::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
  };
  EXPECT_EQ(hex(hmacSha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex(hmacSha256(std::string(131, '\xaa'),
                           "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(ConstantTimeEqual, ComparesContentAndLength) {
  EXPECT_TRUE(constantTimeEqual("abc", "abc"));
  EXPECT_FALSE(constantTimeEqual("abc", "abd"));
  EXPECT_FALSE(constantTimeEqual("abc", "ab"));
  EXPECT_EQ(randomBytes(16).size(), 16u);
  EXPECT_NE(randomBytes(16), randomBytes(16));
}

}  // namespace
}  // namespace fsdp

namespace {

std::size_t openDescriptors() {
  return static_cast<std::size_t>(
      std::distance(std::filesystem::directory_iterator("/proc/self/fd"), std::filesystem::directory_iterator{}));
}

}  // namespace

TEST(DescriptorTable, ReservingGrowsTheTableAndLeavesNothingOpen) {
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  const long want = static_cast<long>(std::min<rlim_t>(limit.rlim_cur, 4096));
  if (want <= 64) GTEST_SKIP() << "a soft descriptor limit of " << limit.rlim_cur;
  if (fsdp::testing::procNumber("/proc/self/status", "FDSize:") >= want) GTEST_SKIP() << "the table is already that large";
  const auto before = openDescriptors();
  fsdp::reserveDescriptorTable(4096);
  EXPECT_GE(fsdp::testing::procNumber("/proc/self/status", "FDSize:"), want);
  EXPECT_EQ(openDescriptors(), before);
  // Asking for more than the soft limit allows is capped by it, not an error.
  fsdp::reserveDescriptorTable(std::size_t{1} << 40);
  EXPECT_EQ(openDescriptors(), before);
}
