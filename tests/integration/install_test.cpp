// The installed package: `cmake --install`, then the README's quickstart built against it with
// find_package(fsdp) in a project of its own, then run under the installed fsdprun.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "run_command.hpp"

namespace {

using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using namespace std::chrono_literals;

const std::string kSource = FSDP_SOURCE_DIR;

TEST(Install, TheQuickstartBuildsAgainstTheInstalledPackageAndTrains) {
  fsdp::testing::TempDir dir;
  const std::string prefix = dir.path() + "/prefix";
  const auto install = runCommand({"cmake", "--install", FSDP_BUILD_DIR, "--prefix", prefix}, 300s);
  ASSERT_EQ(install.exitCode, 0) << install.out << install.err;
  for (const char* file : {"/lib/cmake/fsdp/fsdpConfig.cmake", "/include/fsdp/worker/trainer.hpp", "/bin/fsdprun",
                           "/bin/fsdp-ckpt", "/bin/fsdp-plot", "/lib/fsdprun/python/fsdprun/__init__.py"}) {
    EXPECT_TRUE(std::filesystem::exists(prefix + file)) << file;
  }
  // The installed fsdprun hands its workers the installed Python module.
  const auto imported = runCommand({prefix + "/bin/fsdprun", "--nproc_per_node", "1", "--no_python",
                                    "/usr/bin/python3", "-c", "import fsdprun; print(fsdprun.__file__)"},
                                   120s);
  EXPECT_EQ(imported.exitCode, 0) << imported.err;
  EXPECT_NE(imported.out.find(prefix + "/lib/fsdprun/python/fsdprun/__init__.py"), std::string::npos)
      << imported.out << imported.err;
  const std::string build = dir.path() + "/build";
  // The installed package first, then wherever this build found its own dependencies.
  std::string prefixPath = prefix;
  if (const std::string outer = FSDP_PREFIX_PATH; !outer.empty()) {
    prefixPath += ";" + outer;
    std::replace(prefixPath.begin(), prefixPath.end(), '|', ';');
  }
  std::vector<std::string> configure = {"cmake", "-S", kSource + "/examples/quickstart", "-B", build, "-G", "Ninja",
                                        "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_PREFIX_PATH=" + prefixPath};
  if (std::string(FSDP_SANITIZE_FLAGS).size() > 0) {  // a sanitizer build installs sanitized libraries
    configure.push_back(std::string("-DCMAKE_CXX_FLAGS=") + FSDP_SANITIZE_FLAGS);
    configure.push_back(std::string("-DCMAKE_EXE_LINKER_FLAGS=") + FSDP_SANITIZE_FLAGS);
  }
  if (std::filesystem::exists("/usr/bin/ccache")) configure.push_back("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache");
  const auto configured = runCommand(configure, 300s);
  ASSERT_EQ(configured.exitCode, 0) << configured.out << configured.err;
  const auto built = runCommand({"cmake", "--build", build}, 900s);
  ASSERT_EQ(built.exitCode, 0) << built.out << built.err;
  const std::string out = dir.path() + "/out";
  std::filesystem::create_directories(out);
  const auto trained = runCommand({prefix + "/bin/fsdprun", "--nproc_per_node", "2", build + "/train", out}, 300s);
  ASSERT_EQ(trained.exitCode, 0) << trained.err;
  EXPECT_NE(trained.out.find("test accuracy 0.9"), std::string::npos) << trained.out;
  EXPECT_TRUE(std::filesystem::exists(out + "/metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoints"));
}

TEST(Install, TheReadmeShowsTheQuickstartAsItIs) {
  const std::string readme = readFile(kSource + "/README.md");
  const std::string program = readFile(kSource + "/examples/quickstart/train.cpp");
  ASSERT_FALSE(program.empty());
  EXPECT_NE(readme.find("```cpp\n" + program + "```"), std::string::npos)
      << "README.md must show examples/quickstart/train.cpp verbatim in a ```cpp block";
  EXPECT_LE(std::count(program.begin(), program.end(), '\n'), 60);
}

}  // namespace
