// Differential test: hostlist expressions generated from a fixed seed, expanded by
// fsdp::slurm::expandHostlist and by the real `scontrol show hostnames` (Slurm 22.05): the same
// host lists for valid expressions, a rejection by both for invalid ones. A third kind of
// input, which scontrol "expands" without an error into something nobody meant (unbalanced
// brackets, signs and spaces inside brackets, ...), must be rejected by us; what scontrol made
// of it is printed for the record.
//
// scontrol only needs a slurm.conf to parse (no daemon): the test writes a minimal one. Skips
// when scontrol is not installed. One scontrol process per expression costs ~2 ms.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/slurm/hostlist.hpp"
#include "run_command.hpp"

extern char** environ;

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;
using Hosts = std::vector<std::string>;

constexpr std::uint64_t kSeed = 20240521;
constexpr int kValid = 400;
constexpr int kInvalid = 150;
constexpr int kMangled = 60;

// Expressions from the unit tests' golden table and the issue, checked against scontrol too.
const std::vector<std::string> kFixedValid = {
    "tux[0-5,12,20-25]",
    "node[001-128]",
    "rack[1-2]-n[01-04]",
    "a,,b",
    " a",
    "a b",
    "a\tb",
    "n[5]",
    "n1[1-2]",
    "n[1-010]",
    "n[01-9]",
    "n[001-10]",
    "n[9-11]",
    "n[7-007]",
    "a,a,a",
    "n[1-3,2]",
    "n[8-10],n011",
    "n[98-99],n[0100-0101]",
    "[1-2][3-4]",
    "x[1-2],[3]",
    "a[1-2]b[3-4]c[5-6]d[7-8]",
    "n[0-65535]",
    "a[0-65535]b[0]",
    "n[4294967296]",
    "007",
    "-",
    "tux[0-5,12],node[001-003],rack[1-2]-n[01-02],login1"};
const std::vector<std::string> kFixedInvalid = {
    "n[3-1]",  "n[]",      "n[a-b]",   "x[1-[2]]",     "n[[1-2]]",      "n[1-2]x",
    "n[1,,2]", "n[-1]",    "n[1-2-3]", "n[1-2 ]",      "a[1-2]b[3-4]c", "n[1--3]",
    "n[0x1]",  "n[1-0x3]", "n[1-2]]",  "a[1-2]b]c[3]", "n[0-65536]",    "a[0-65535,0]b[0]"};
const std::vector<std::string> kFixedMangled = {
    "n[1-2",   "n[1,2",   "n]1[",    "[1-2",    "n]",    "n[[1]",
    "n[ 1-2]", "n[+1-2]", "n[1a-3]", "n[1- 3]", "n[1-]", "n99999999999999999999999",
    "a\nb"};

class Generator {
 public:
  explicit Generator(std::uint64_t seed) : rng_(seed) {}

  std::uint64_t pick(std::uint64_t n) { return rng_() % n; }

  // A valid expression: 1-4 items, separated by commas, spaces or tabs (sometimes doubled,
  // leading or trailing).
  std::string valid() {
    static const std::vector<std::string> kSeparators = {",", ",", ",", ",", " ", "\t", ", ", ",,"};
    std::string out;
    if (pick(10) == 0) out += kSeparators[pick(kSeparators.size())];
    const auto items = 1 + pick(4);
    for (std::uint64_t i = 0; i < items; ++i) {
      if (i > 0) out += kSeparators[pick(kSeparators.size())];
      out += item();
    }
    if (pick(10) == 0) out += kSeparators[pick(kSeparators.size())];
    return out;
  }

  // An expression both must reject: a valid list with one broken item in it.
  std::string invalid() {
    std::string bad;
    const std::string p = text(1 + pick(4));
    const std::uint64_t lo = pick(50);
    const std::uint64_t hi = lo + 1 + pick(20);
    switch (pick(12)) {
      case 0:
        bad = p + "[" + std::to_string(hi) + "-" + std::to_string(lo) + "]";
        break;
      case 1:
        bad = p + "[]";
        break;
      case 2:
        bad = p + "[" + std::to_string(lo) + ",," + std::to_string(hi) + "]";
        break;
      case 3:
        bad = p + "[" + std::to_string(lo) + "-" + letters(1 + pick(2)) + "]";
        break;
      case 4:
        bad = item(true) + letters(1 + pick(3));
        break;  // text after the last ']'
      case 5:
        bad = p + "[" + std::to_string(lo) + "-[" + std::to_string(hi) + "]]";
        break;
      case 6:
        bad = p + "[" + range() + "]]";
        break;
      case 7:
        bad = p + "[-" + std::to_string(lo) + "]";
        break;
      case 8:
        bad = p + "[" + std::to_string(lo) + "-" + std::to_string(hi) + "-3]";
        break;
      case 9:
        bad = p + "[" + std::to_string(lo) + "-" + std::to_string(lo + 65536 + pick(9)) + "]";
        break;
      case 10:
        bad = p + "[0x" + std::to_string(lo) + "]";
        break;
      default:
        bad = p + "[" + range() + "]" + letters(1) + "[" + range() + "]" + letters(1);
        break;
    }
    std::string out;
    if (pick(2) == 0) out += item() + ",";
    out += bad;
    if (pick(2) == 0) out += "," + item();
    return out;
  }

  // An expression scontrol expands without an error into something nobody meant.
  std::string mangled() {
    const std::string p = text(1 + pick(4));
    const std::string r = range();
    switch (pick(7)) {
      case 0:
        return p + "[" + r;  // unbalanced '['
      case 1:
        return p + "]" + text(1 + pick(3));  // stray ']'
      case 2:
        return p + "[ " + r + "]";  // space inside
      case 3:
        return p + "[+" + std::to_string(pick(9)) + "]";  // sign
      case 4:
        return p + "[" + std::to_string(pick(9)) + "a-12]";  // letter in lo
      case 5:
        return p + "[" + std::to_string(pick(9)) + "-]";  // no upper bound
      default:
        return p + "[[" + r + "]";  // nested unbalanced
    }
  }

 private:
  std::string letters(std::uint64_t n) {
    static const std::string kLetters = "abcnxyz";
    std::string s;
    for (std::uint64_t i = 0; i < n; ++i) s += kLetters[pick(kLetters.size())];
    return s;
  }

  // Host-name text: letters, digits, '-', '.', '_'; starts with a letter.
  std::string text(std::uint64_t n) {
    static const std::string kChars = "abcnodexyz0123456789-._";
    std::string s = letters(1);
    for (std::uint64_t i = 1; i < n; ++i) s += kChars[pick(kChars.size())];
    return s;
  }

  static std::string padded(std::uint64_t v, std::uint64_t extraZeros) {
    return std::string(extraZeros, '0') + std::to_string(v);
  }

  // "7", "007", "3-12", "08-10", "1-010", "1000000000-1000000003".
  std::string range() {
    const auto kind = pick(10);
    if (kind < 3) return padded(pick(300), pick(4) == 0 ? 1 + pick(2) : 0);
    std::uint64_t lo = pick(200);
    std::uint64_t span = pick(15);
    if (kind == 9) {
      lo = 1'000'000'000 + pick(1000);
      span = pick(4);
    }
    return padded(lo, pick(4) == 0 ? 1 + pick(2) : 0) + "-" +
           padded(lo + span, pick(5) == 0 ? 1 + pick(2) : 0);
  }

  std::string bracket() {
    std::string s = "[" + range();
    const auto more = pick(3);
    for (std::uint64_t i = 0; i < more; ++i) s += "," + range();
    return s + "]";
  }

  // A plain host name ("n007", "login1") or one with 1-3 bracket groups.
  std::string item(bool bracketed = false) {
    if (!bracketed && pick(3) == 0) return text(1 + pick(8));
    const auto groups = 1 + (pick(4) == 0 ? 2 : pick(2));
    std::string s = pick(8) == 0 ? "" : text(1 + pick(5));
    for (std::uint64_t g = 0; g < groups; ++g) {
      if (g > 0 && pick(4) != 0) s += text(1 + pick(3));
      s += bracket();
    }
    return s;
  }

  std::mt19937_64 rng_;
};

struct Scontrol {
  bool rejected = false;
  Hosts hosts;
  std::string err;
};

std::string printable(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else
      out += c;
  }
  return "'" + out + "'";
}

std::string joined(const Hosts& hosts) {
  std::string out;
  for (const auto& h : hosts) out += (out.empty() ? "" : " ") + h;
  return out;
}

class HostlistVsScontrol : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string why;
    scontrol_ = findExecutable("scontrol", &why).value_or("");
    if (scontrol_.empty()) return;
    // scontrol reads SLURM_JOB_NODELIST when given no list; no SLURM_* of ours may leak in.
    std::vector<std::string> names;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      if (entry.rfind("SLURM_", 0) == 0) names.push_back(entry.substr(0, entry.find('=')));
    }
    for (const auto& name : names) ::unsetenv(name.c_str());
    dir_ = std::make_unique<TempDir>();
    const std::string conf = dir_->path() + "/slurm.conf";
    std::FILE* f = std::fopen(conf.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(
        "# minimal configuration: scontrol show hostnames only parses it\n"
        "ClusterName=hostlist\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
        "PartitionName=p Nodes=ALL\n",
        f);
    std::fclose(f);
    ::setenv("SLURM_CONF", conf.c_str(), 1);
  }

  static void TearDownTestSuite() { dir_.reset(); }

  void SetUp() override {
    if (scontrol_.empty()) {
      GTEST_SKIP() << "scontrol not found on PATH: install slurm-client (scripts/install-deps)";
    }
  }

  static Scontrol runScontrol(const std::string& expression) {
    const auto r = runCommand({scontrol_, "show", "hostnames", expression}, 10s);
    if (r.timedOut) throw std::runtime_error("scontrol timed out on " + printable(expression));
    Scontrol out;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) out.hosts.push_back(line);
    out.err = r.err;
    out.rejected = out.hosts.empty() && r.err.find("Invalid hostlist") != std::string::npos;
    return out;
  }

  static std::optional<Hosts> ours(const std::string& expression, std::string* error) {
    try {
      return slurm::expandHostlist(expression);
    } catch (const ConfigError& e) {
      *error = e.what();
      return std::nullopt;
    }
  }

  static inline std::string scontrol_;
  static inline std::unique_ptr<TempDir> dir_;
};

TEST_F(HostlistVsScontrol, ValidExpressionsExpandToTheSameHosts) {
  Generator gen(kSeed);
  std::vector<std::string> expressions = kFixedValid;
  std::set<std::string> seen(expressions.begin(), expressions.end());
  while (expressions.size() < kFixedValid.size() + kValid) {
    std::string e = gen.valid();
    std::string error;
    const auto hosts = ours(e, &error);
    ASSERT_TRUE(hosts) << "generated " << printable(e) << " is invalid for us: " << error;
    if (hosts->size() > 5000 || !seen.insert(e).second) continue;  // keep it fast and distinct
    expressions.push_back(std::move(e));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t totalHosts = 0;
  for (const auto& e : expressions) {
    std::string error;
    const auto mine = ours(e, &error);
    const auto theirs = runScontrol(e);
    ASSERT_TRUE(mine) << printable(e) << ": " << error;
    EXPECT_FALSE(theirs.rejected) << printable(e) << ": scontrol: " << theirs.err;
    EXPECT_EQ(joined(*mine), joined(theirs.hosts)) << printable(e);
    totalHosts += mine->size();
  }
  std::printf("[ compared ] %zu valid expressions (%zu hosts) in %.2f s, seed %llu\n",
              expressions.size(), totalHosts,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              static_cast<unsigned long long>(kSeed));
}

TEST_F(HostlistVsScontrol, InvalidExpressionsAreRejectedByBoth) {
  Generator gen(kSeed + 1);
  std::vector<std::string> expressions = kFixedInvalid;
  for (int i = 0; i < kInvalid; ++i) expressions.push_back(gen.invalid());
  for (const auto& e : expressions) {
    std::string error;
    const auto mine = ours(e, &error);
    const auto theirs = runScontrol(e);
    EXPECT_FALSE(mine) << printable(e) << " expanded by us to " << joined(*mine);
    EXPECT_TRUE(theirs.rejected) << printable(e) << " expanded by scontrol to "
                                 << joined(theirs.hosts) << theirs.err;
  }
  std::printf("[ compared ] %zu invalid expressions, seed %llu\n", expressions.size(),
              static_cast<unsigned long long>(kSeed + 1));
}

TEST_F(HostlistVsScontrol, WhatScontrolManglesWeReject) {
  Generator gen(kSeed + 2);
  std::vector<std::string> expressions = kFixedMangled;
  for (int i = 0; i < kMangled; ++i) expressions.push_back(gen.mangled());
  int silentlyMangled = 0;
  for (const auto& e : expressions) {
    std::string error;
    const auto mine = ours(e, &error);
    EXPECT_FALSE(mine) << printable(e) << " expanded by us to " << joined(*mine);
    const auto theirs = runScontrol(e);
    if (!theirs.rejected) {
      ++silentlyMangled;
      if (silentlyMangled <= 8) {
        std::printf("[ mangled  ] %s: scontrol prints %s; we say: %s\n", printable(e).c_str(),
                    printable(joined(theirs.hosts)).c_str(), error.c_str());
      }
    }
  }
  std::printf(
      "[ compared ] %zu malformed expressions: we reject all, scontrol printed hosts "
      "for %d\n",
      expressions.size(), silentlyMangled);
}

TEST_F(HostlistVsScontrol, TheFsdpHostlistToolPrintsWhatScontrolPrints) {
  Generator gen(kSeed + 3);
  for (int i = 0; i < 20; ++i) {
    const std::string e = i < 5 ? kFixedValid[static_cast<std::size_t>(i)] : gen.valid();
    const auto tool = runCommand({std::string(FSDP_BIN_DIR) + "/fsdp-hostlist", e}, 10s);
    const auto ref = runCommand({scontrol_, "show", "hostnames", e}, 10s);
    EXPECT_EQ(tool.exitCode, 0) << printable(e) << tool.err;
    EXPECT_EQ(tool.out, ref.out) << printable(e);
  }
  const auto bad = runCommand({std::string(FSDP_BIN_DIR) + "/fsdp-hostlist", "tux[3-1]"}, 10s);
  EXPECT_EQ(bad.exitCode, 2);
  EXPECT_EQ(bad.out, "");
  EXPECT_EQ(
      bad.err,
      "fsdp-hostlist: invalid hostlist 'tux[3-1]': bad range '3-1' (reversed: the upper bound "
      "is below the lower one) at position 5\n");
}

}  // namespace
}  // namespace fsdp::testing
