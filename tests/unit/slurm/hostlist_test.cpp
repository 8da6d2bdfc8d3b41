#include "fsdp/slurm/hostlist.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"

namespace fsdp::slurm {
namespace {

using Hosts = std::vector<std::string>;

std::string joined(const Hosts& hosts) {
  std::string out;
  for (const auto& h : hosts) out += (out.empty() ? "" : " ") + h;
  return out;
}

std::string errorOf(const std::string& expression) {
  try {
    const auto hosts = expandHostlist(expression);
    return "no error, got: " + joined(hosts);
  } catch (const ConfigError& e) {
    return e.what();
  }
}

// Every expected value below is what `scontrol show hostnames EXPR` (Slurm 22.05.8) prints.
TEST(Hostlist, MatchesScontrolOnAGoldenTable) {
  const std::vector<std::pair<std::string, std::string>> table = {
      {"tux1", "tux1"},
      {"tux[0-5,12,20-25]",
       "tux0 tux1 tux2 tux3 tux4 tux5 tux12 tux20 tux21 tux22 tux23 tux24 tux25"},
      {"node[001-004]", "node001 node002 node003 node004"},
      {"rack[1-2]-n[01-02]", "rack1-n01 rack1-n02 rack2-n01 rack2-n02"},
      {"a,b[1-2],c", "a b1 b2 c"},
      {"a,,b", "a b"},
      {",a", "a"},
      {"a,", "a"},
      {" a", "a"},
      {"a b", "a b"},
      {"a, b", "a b"},
      {"a\tb", "a b"},
      {"n[5]", "n5"},
      {"n1[1-2]", "n11 n12"},
      {"n0[1-2]", "n01 n02"},
      {"n[1-010]", "n1 n2 n3 n4 n5 n6 n7 n8 n9 n10"},
      {"n[01-9]", "n01 n02 n03 n04 n05 n06 n07 n08 n09"},
      {"n[001-10]", "n001 n002 n003 n004 n005 n006 n007 n008 n009 n010"},
      {"n[9-11]", "n9 n10 n11"},
      {"n[09-11]", "n09 n10 n11"},
      {"n[7-007]", "n7"},
      {"n[007]", "n007"},
      {"n[0-0]", "n0"},
      {"a,a,a", "a a a"},
      {"n[1-3,2]", "n1 n2 n3 n2"},
      {"n[3,1-2]", "n3 n1 n2"},
      {"n[1-2],n[2-3]", "n1 n2 n2 n3"},
      {"n[8-10],n011", "n8 n9 n10 n011"},
      {"n[98-99],n[0100-0101]", "n98 n99 n0100 n0101"},
      {"n09,n10", "n09 n10"},
      {"n[1-2][3-4]", "n13 n14 n23 n24"},
      {"[1-2]", "1 2"},
      {"[1-2][3-4]", "13 14 23 24"},
      {"x[1-2],[3]", "x1 x2 3"},
      {"n[1-2]-[3-4]", "n1-3 n1-4 n2-3 n2-4"},
      {"n[1-3]-s[1]", "n1-s1 n2-s1 n3-s1"},
      {"n.[1-2]", "n.1 n.2"},
      {"-", "-"},
      {"007", "007"},
      {"a[1-2]b[3-4]c[5-6]", "a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 a1b4c6 a2b4c5 a2b4c6"},
      {"a[1-2][3-4][5-6]", "a135 a136 a235 a236 a145 a146 a245 a246"},
      {"x[1-2,5]y[3]z[7-8]", "x1y3z7 x1y3z8 x2y3z7 x2y3z8 x5y3z7 x5y3z8"},
      {"a[1-2]b[3-4]c[5-6]d[7-8]",
       "a1b3c5d7 a1b3c5d8 a2b3c5d7 a2b3c5d8 a1b4c5d7 a1b4c5d8 a2b4c5d7 a2b4c5d8 "
       "a1b3c6d7 a1b3c6d8 a2b3c6d7 a2b3c6d8 a1b4c6d7 a1b4c6d8 a2b4c6d7 a2b4c6d8"},
      {"n[4294967296]", "n4294967296"},
  };
  for (const auto& [expression, expected] : table) {
    EXPECT_EQ(joined(expandHostlist(expression)), expected) << expression;
  }
}

TEST(Hostlist, KeepsSlurmsLimits) {
  EXPECT_EQ(expandHostlist("n[0-65535]").size(), 65536u);
  EXPECT_EQ(expandHostlist("b[0-65535,0-65535]").size(), 131072u);
  EXPECT_EQ(expandHostlist("a[0-65535]b[0]").size(), 65536u);
  EXPECT_EQ(expandHostlist("a[0-3]c[0-65535]b[0]").size(), 262144u);
  EXPECT_EQ(expandHostlist("a[0-1000]b[0-999]").size(), 1001000u);
  EXPECT_NE(errorOf("n[0-65536]").find("more than 65536 hosts"), std::string::npos);
  EXPECT_NE(errorOf("a[0-65535,0]b[0]").find("before the last one"), std::string::npos);
  EXPECT_NE(errorOf("a[0-1048575]b[0]").find("more than 65536"), std::string::npos);
  EXPECT_NE(errorOf("a[0-2000]b[0-999]").find("more than 1048576 hosts"), std::string::npos);
  EXPECT_NE(errorOf("n[0-65535]x[0-65535]").find("more than 1048576 hosts"), std::string::npos);
}

TEST(Hostlist, RejectsWhatScontrolRejects) {
  for (const char* bad : {"n[3-1]", "n[]", "n[a-b]", "x[1-[2]]", "n[[1-2]]", "n[1-2]x", "n[1,,2]",
                          "n[-1]", "n[1-2-3]", "n[1-2 ]", "a[1-2]b[3-4]c", "n[1--3]", "n[0x1]",
                          "n[1-0x3]", "n[1-2]]", "a[1-2]b]c[3]", "n[1-2]x,y", "n[1-2]5", ""}) {
    EXPECT_THROW(expandHostlist(bad), ConfigError) << bad;
  }
}

TEST(Hostlist, RejectsWhatScontrolMangles) {
  // scontrol prints these without an error, but not what anybody meant: "n]", "n] 2",
  // "n]1]", "1-2", "]", "n[1", "n01 n02", "n01..n03", "n1", "n...18446744073709551615".
  for (const char* bad : {"n[1-2",
                          "n[1,2",
                          "n]1[",
                          "[1-2",
                          "[",
                          "]",
                          "n]",
                          "n[[1]",
                          "n[ 1-2]",
                          "n[1 -2]",
                          "n[+1-2]",
                          "n[1a-3]",
                          "n[1-+3]",
                          "n[1- 3]",
                          "n[1-]",
                          "a\nb",
                          "n99999999999999999999999",
                          "n[99999999999999999999-99999999999999999999]",
                          "n[1, 2]",
                          ",",
                          " ",
                          "\t, "}) {
    EXPECT_THROW(expandHostlist(bad), ConfigError) << bad;
  }
}

TEST(Hostlist, ErrorsNameTheExpressionThePartAndThePosition) {
  EXPECT_EQ(errorOf("tux[5-1]"),
            "invalid hostlist 'tux[5-1]': bad range '5-1' (reversed: the upper bound is below the "
            "lower one) at position 5");
  EXPECT_EQ(errorOf("tux[1-2"),
            "invalid hostlist 'tux[1-2': '[' is never closed by a ']' at position 4");
  EXPECT_EQ(errorOf("a,tux1-2]"),
            "invalid hostlist 'a,tux1-2]': ']' without a matching '[' at position 9");
  EXPECT_NE(errorOf("x[1-[2]]").find("'[' inside brackets"), std::string::npos);
  EXPECT_NE(errorOf("n[1-2]x").find("text after the last ']' ('x')"), std::string::npos);
  EXPECT_NE(errorOf("n[1-]").find("missing upper bound"), std::string::npos);
  EXPECT_NE(errorOf("n[]").find("empty range"), std::string::npos);
  EXPECT_EQ(errorOf(""), "invalid hostlist '': empty expression");
  EXPECT_EQ(errorOf(" , "), "invalid hostlist ' , ': no host names, only separators");
}

TEST(TasksPerNode, ExpandsRepeats) {
  EXPECT_EQ(expandTasksPerNode("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(expandTasksPerNode("1(x2)"), std::vector<int>({1, 1}));
  EXPECT_EQ(expandTasksPerNode("4"), std::vector<int>({4}));
  EXPECT_EQ(expandTasksPerNode("3,1(x2),2"), std::vector<int>({3, 1, 1, 2}));
}

TEST(TasksPerNode, RejectsMalformedCounts) {
  for (const char* bad :
       {"", "2(x", "x", "2(x0)", "2(x-1)", "2(3)", "2(x3)x", ",1", "1,", "-1", "1(x2000000)"}) {
    EXPECT_THROW(expandTasksPerNode(bad), ConfigError) << bad;
  }
}

}  // namespace
}  // namespace fsdp::slurm
