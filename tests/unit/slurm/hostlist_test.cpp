#include "fsdp/slurm/hostlist.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"

namespace fsdp::slurm {
namespace {

using Hosts = std::vector<std::string>;

TEST(Hostlist, ExpandsSlurmSyntax) {
  EXPECT_EQ(expandHostlist("tux1"), Hosts({"tux1"}));
  EXPECT_EQ(expandHostlist("tux[0-2,12]"), Hosts({"tux0", "tux1", "tux2", "tux12"}));
  EXPECT_EQ(expandHostlist("node[008-011]"), Hosts({"node008", "node009", "node010", "node011"}));
  EXPECT_EQ(expandHostlist("rack[1-2]-n[01-02]"),
            Hosts({"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}));
  EXPECT_EQ(expandHostlist("a,b[1-2],c"), Hosts({"a", "b1", "b2", "c"}));
}

TEST(Hostlist, RejectsInvalidExpressionsNamingThem) {
  for (const char* bad : {"", "tux[1-2", "tux1-2]", "tux[3-1]", "tux[a-b]", "tux[]", "x[1-[2]]"}) {
    EXPECT_THROW(expandHostlist(bad), ConfigError) << bad;
  }
  try {
    expandHostlist("tux[5-1]");
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("reversed range '5-1'"), std::string::npos) << e.what();
  }
}

TEST(TasksPerNode, ExpandsRepeats) {
  EXPECT_EQ(expandTasksPerNode("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(expandTasksPerNode("4"), std::vector<int>({4}));
  EXPECT_THROW(expandTasksPerNode("2(x"), ConfigError);
  EXPECT_THROW(expandTasksPerNode("x"), ConfigError);
}

}  // namespace
}  // namespace fsdp::slurm
