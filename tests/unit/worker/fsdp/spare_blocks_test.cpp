// The block memory a spare faults in while it waits (worker/src/fsdp/full_buffer.hpp, an
// internal): the blocks of its first step are cut from it, already in memory, and what it holds
// stays within the block cache's budget. Each test runs in its own process (gtest discovery), so
// the cache's budget is read afresh.
#include "fsdp/full_buffer.hpp"

#include "fsdp/common/error.hpp"
#include "fsdp/worker/runtime.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace fsdp::worker::detail {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// The fraction of the block's pages in memory (mincore), before anything writes to them.
double residentFraction(const at::Tensor& block) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(block.data_ptr()) / page * page;
  const auto end = reinterpret_cast<std::uintptr_t>(block.data_ptr()) + block.nbytes();
  std::vector<unsigned char> pages((end - begin + page - 1) / page);
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(begin), end - begin, pages.data()), 0);
  std::size_t in = 0;
  for (const unsigned char p : pages) in += p & 1U;
  return static_cast<double>(in) / static_cast<double>(pages.size());
}

at::Tensor block12MiB() { return emptyBlock(3 * static_cast<std::int64_t>(kMiB), at::kFloat); }

TEST(SpareBlocks, BlocksCutFromTheWarmedMemoryAreInMemoryBeforeTheirFirstWrite) {
  ::setenv("FSDP_SPARE_WARM_MB", "32", 1);
  startWarmingSpareBlocks();
  ASSERT_EQ(awaitWarmedSpareBlocks().bytes, 32 * kMiB);
  // 12 MiB and a header: 14 MiB of it each (whole huge pages), two fit, the third does not.
  const auto first = block12MiB();
  const auto second = block12MiB();
  const auto third = block12MiB();
  EXPECT_EQ(residentFraction(first), 1.0);
  EXPECT_EQ(residentFraction(second), 1.0);
  EXPECT_LT(residentFraction(third), 0.5) << "a fresh mapping: only its header's page written";
  // Every block is its own memory.
  first.fill_(1);
  second.fill_(2);
  third.fill_(3);
  EXPECT_EQ(first.sum().item<double>(), 3.0 * kMiB);
  EXPECT_EQ(second.sum().item<double>(), 6.0 * kMiB);
  EXPECT_EQ(third.sum().item<double>(), 9.0 * kMiB);
}

// The warm-up runs in the idle scheduling class, so that it takes no CPU time from the round's
// workers (on 2 cores, two spares' warm-ups at normal priority slowed the steps after a resume
// 2-6x), and a stop (the spare's activation) ends it at a piece's end: what it holds then is
// whole pieces, in memory, and the blocks are cut from them.
TEST(SpareBlocks, TheWarmUpRunsInTheIdleClassAndAStopLeavesWholePiecesInMemory) {
  ::setenv("FSDP_SPARE_WARM_MB", "256", 1);
  startWarmingSpareBlocks();
  const std::size_t atStop = stopWarmingSpareBlocks();
  const auto warmed = awaitWarmedSpareBlocks();
  EXPECT_TRUE(warmed.idleClass);
  EXPECT_LE(atStop, warmed.bytes);
  EXPECT_LE(warmed.bytes, 32 * kMiB) << "the stop came before the first piece was in: one piece at most";
  EXPECT_EQ(warmed.bytes % (32 * kMiB), 0U);
  if (warmed.bytes > 0) {
    EXPECT_EQ(residentFraction(block12MiB()), 1.0);
  }
}

TEST(SpareBlocks, NoneWhenTurnedOff) {
  ::setenv("FSDP_SPARE_WARM_MB", "0", 1);
  startWarmingSpareBlocks();
  EXPECT_EQ(awaitWarmedSpareBlocks().bytes, 0U);
  EXPECT_LT(residentFraction(block12MiB()), 0.5);
}

// The reserve counts against FSDP_BLOCK_CACHE_MB: never more than it, and its untouched rest
// gives way to a freed block, which the next block of that length takes back.
TEST(SpareBlocks, TheBlockCachesBudgetBoundsItAndItsRestGivesWayToFreedBlocks) {
  ::setenv("FSDP_BLOCK_CACHE_MB", "16", 1);
  ::setenv("FSDP_SPARE_WARM_MB", "64", 1);
  startWarmingSpareBlocks();
  ASSERT_EQ(awaitWarmedSpareBlocks().bytes, 16 * kMiB);
  auto one = emptyBlock(static_cast<std::int64_t>(kMiB), at::kFloat);  // 4 MiB: 6 of it
  EXPECT_EQ(residentFraction(one), 1.0);
  const void* const where = one.data_ptr();
  one = at::Tensor();  // cached: 6 MiB, with the rest's 10 MiB at the budget
  auto again = emptyBlock(static_cast<std::int64_t>(kMiB), at::kFloat);
  EXPECT_EQ(again.data_ptr(), where);
  EXPECT_EQ(residentFraction(again), 1.0);
  // A 12 MiB block does not fit the rest's 10 MiB: a fresh mapping. Freed, it is kept (the rest
  // gives way to it), and the next block of its length is that one.
  auto big = block12MiB();
  EXPECT_LT(residentFraction(big), 0.5);
  big.fill_(1);
  big = at::Tensor();
  again = at::Tensor();  // does not fit any more: unmapped
  // In memory: the block written before (a new mapping, even at the same address, is not).
  EXPECT_EQ(residentFraction(block12MiB()), 1.0) << "the rest gave way: the freed block was kept";
}

// A size that is not a number of megabytes is refused with the variable's name, not read as
// strtoull would (-1 a wrapped 16 EiB, "1g" 1 MiB).
TEST(SpareBlocks, ABadWarmSizeIsRefusedWithTheVariablesName) {
  ::setenv("FSDP_SPARE_WARM_MB", "1g", 1);
  try {
    startWarmingSpareBlocks();
    FAIL() << "FSDP_SPARE_WARM_MB=1g was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_SPARE_WARM_MB='1g': expected an integer"), std::string::npos) << e.what();
  }
}

// The budget is read once a process (the cache's first use): a test of its own.
TEST(SpareBlocks, ABadCacheBudgetIsRefusedWithTheVariablesName) {
  ::setenv("FSDP_SPARE_WARM_MB", "8", 1);
  ::setenv("FSDP_BLOCK_CACHE_MB", "-1", 1);
  try {
    startWarmingSpareBlocks();
    FAIL() << "FSDP_BLOCK_CACHE_MB=-1 was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_BLOCK_CACHE_MB='-1': expected megabytes, from 0 to"), std::string::npos)
        << e.what();
  }
}

// Only a spare faults blocks in, but every worker reads FSDP_SPARE_WARM_MB in fsdp::init(): a bad
// value stops the job at its start, where it once killed the waiting spares alone, unseen.
TEST(SpareBlocks, EveryWorkerRefusesABadWarmSizeInInitNotOnlyTheSpares) {
  ::setenv("FSDP_SPARE_WARM_MB", "-3", 1);
  ::unsetenv("FSDPRUN_STANDBY_FD");
  try {
    fsdp::init();
    FAIL() << "fsdp::init() took FSDP_SPARE_WARM_MB=-3";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_SPARE_WARM_MB='-3': expected megabytes"), std::string::npos) << e.what();
  }
}

// FSDP_CPU_BLOCK_ALLOCATOR=1: LibTorch's big CPU tensors come from the block cache (a freed
// one's memory, already in memory, serves the next of its size), are not taken for FSDP's own
// (a wrap of a model whose parameters they are is a first wrap), and small ones stay LibTorch's.
TEST(CpuBlockAllocator, BigTensorsReuseCachedMemoryAndAreNotFsdpsOwn) {
  ::setenv("FSDP_CPU_BLOCK_ALLOCATOR", "1", 1);
  checkBlockEnvironment();
  auto big = at::empty({static_cast<std::int64_t>(kMiB)}, at::kFloat);  // 4 MiB
  const void* const where = big.data_ptr();
  big.fill_(7);
  EXPECT_FALSE(managedByFsdp(big));
  big = at::Tensor();
  auto again = at::empty({static_cast<std::int64_t>(kMiB)}, at::kFloat);
  EXPECT_EQ(again.data_ptr(), where) << "the freed block was not reused";
  EXPECT_EQ(residentFraction(again), 1.0);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(again.data_ptr()) % 64, 0U);
  // Arithmetic over such tensors is LibTorch's as ever.
  again.fill_(2);
  auto sum = again + at::ones_like(again);
  EXPECT_EQ(sum.sum().item<double>(), 3.0 * kMiB);
  const auto small = at::ones({16}, at::kFloat);
  EXPECT_EQ(small.storage().data_ptr().get_deleter(), at::ones({16}).storage().data_ptr().get_deleter());
  EXPECT_NE(small.storage().data_ptr().get_deleter(), again.storage().data_ptr().get_deleter());
}

// oneDNN allocates raw through LibTorch's CPU allocator and frees through its raw deleter, one
// function for every size (a big raw allocation once failed LibTorch's check in every
// convolution): a big raw block goes back to the cache, a small one to LibTorch.
TEST(CpuBlockAllocator, RawAllocationsOfEverySizeAreFreedByTheirOwnAllocator) {
  ::setenv("FSDP_CPU_BLOCK_ALLOCATOR", "1", 1);
  checkBlockEnvironment();
  c10::Allocator* const cpu = c10::GetAllocator(c10::DeviceType::CPU);
  void* const big = cpu->raw_allocate(4 * kMiB);
  std::memset(big, 1, 4 * kMiB);
  void* const small = cpu->raw_allocate(64);
  std::memset(small, 1, 64);
  cpu->raw_deallocate(small);
  cpu->raw_deallocate(big);
  EXPECT_EQ(at::empty({static_cast<std::int64_t>(kMiB)}, at::kFloat).data_ptr(), big);
  // A convolution (oneDNN's buffers) over a big input runs and gives LibTorch's result.
  const auto input = at::ones({8, 16, 64, 64}, at::kFloat);
  const auto weight = at::full({16, 16, 3, 3}, 0.5f);
  EXPECT_EQ(at::conv2d(input, weight).mean().item<float>(), 72.0f);
}

TEST(CpuBlockAllocator, AValueOtherThanZeroOrOneIsRefusedWithTheVariablesName) {
  ::setenv("FSDP_CPU_BLOCK_ALLOCATOR", "2", 1);
  try {
    checkBlockEnvironment();
    FAIL() << "FSDP_CPU_BLOCK_ALLOCATOR=2 was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_CPU_BLOCK_ALLOCATOR='2': expected 0 or 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fsdp::worker::detail
