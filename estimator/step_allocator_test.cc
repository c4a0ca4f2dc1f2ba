// The caching allocator's replay (Note [The caching allocator's reserve]) on allocation
// sequences whose reserve follows from c10/cuda/CUDACachingAllocator.cpp's rules by hand.
#include "estimator/step_allocator.h"

#include <doctest/doctest.h>

#include <vector>

namespace memplan::estimator::step {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

AllocatorEvent A(int id, uint64_t bytes, int stream = 0) { return {id, true, bytes, stream}; }
AllocatorEvent F(int id) { return {id, false, 0, 0}; }

TEST_CASE("allocator replay: segment sizes by pool") {
  // Up to 1 MiB: a 2 MiB small-pool segment; under 10 MiB: 20 MiB; beyond: rounded to 2 MiB.
  CHECK(ReplayCachingAllocator({A(0, 512)}).reserved == 2 * kMiB);
  CHECK(ReplayCachingAllocator({A(0, kMiB)}).reserved == 2 * kMiB);
  CHECK(ReplayCachingAllocator({A(0, kMiB + 512)}).reserved == 20 * kMiB);
  CHECK(ReplayCachingAllocator({A(0, 10 * kMiB)}).reserved == 10 * kMiB);
  CHECK(ReplayCachingAllocator({A(0, 10 * kMiB + 512)}).reserved == 12 * kMiB);
  // Small requests share a segment until it is full: four of 512 KiB fill one.
  std::vector<AllocatorEvent> small;
  for (int i = 0; i < 4; ++i) small.push_back(A(i, 512 * 1024));
  CHECK(ReplayCachingAllocator(small).reserved == 2 * kMiB);
  small.push_back(A(4, 512 * 1024));
  CHECK(ReplayCachingAllocator(small).reserved == 4 * kMiB);
}

TEST_CASE("allocator replay: a large block's rest is split off only beyond 1 MiB") {
  // 11.5 MiB in a 12 MiB segment: the 0.5 MiB rest stays in the block (allocated 12 MiB).
  AllocatorPeaks p = ReplayCachingAllocator({A(0, 11 * kMiB + kMiB / 2)});
  CHECK(p.allocated == 12 * kMiB);
  // 10.5 MiB: the 1.5 MiB rest is a free block, which a 1.25 MiB request then takes whole (its
  // own rest is under 1 MiB).
  p = ReplayCachingAllocator({A(0, 10 * kMiB + kMiB / 2), A(1, kMiB + kMiB / 4)});
  CHECK(p.allocated == 12 * kMiB);
  CHECK(p.reserved == 12 * kMiB);
}

TEST_CASE("allocator replay: a freed block too small for the next request stays reserved") {
  // The loss's fp32 logits freed, their larger gradient asked for: both segments stay.
  AllocatorPeaks p = ReplayCachingAllocator({A(0, 100 * kMiB), F(0), A(1, 120 * kMiB)});
  CHECK(p.allocated == 120 * kMiB);
  CHECK(p.reserved == 220 * kMiB);
  // Only the segment with a live block is held: on a full GPU the other is given back.
  CHECK(p.held == 120 * kMiB);
  // A smaller request takes the cached block, split: nothing new.
  p = ReplayCachingAllocator({A(0, 100 * kMiB), F(0), A(1, 40 * kMiB), A(2, 40 * kMiB)});
  CHECK(p.reserved == 100 * kMiB);
  CHECK(p.held == 100 * kMiB);
  CHECK(p.allocated == 100 * kMiB);
}

TEST_CASE("allocator replay: freed neighbours merge, and the smallest block that fits is taken") {
  // Three blocks carved from one 60 MiB segment, freed in an order that merges them back.
  AllocatorPeaks p =
      ReplayCachingAllocator({A(0, 60 * kMiB), F(0), A(1, 20 * kMiB), A(2, 20 * kMiB),
                              A(3, 20 * kMiB), F(1), F(3), F(2), A(4, 60 * kMiB)});
  CHECK(p.reserved == 60 * kMiB);
  // Without the merge the last request needs a new segment.
  p = ReplayCachingAllocator({A(0, 60 * kMiB), F(0), A(1, 20 * kMiB), A(2, 20 * kMiB),
                              A(3, 20 * kMiB), F(1), F(3), A(4, 40 * kMiB)});
  CHECK(p.reserved == 100 * kMiB);
  // Best fit: the 30 MiB request takes the 30 MiB block, not the 50 MiB one.
  p = ReplayCachingAllocator(
      {A(0, 50 * kMiB), A(1, 30 * kMiB), F(0), F(1), A(2, 30 * kMiB), A(3, 50 * kMiB)});
  CHECK(p.reserved == 80 * kMiB);
}

TEST_CASE("allocator replay: each stream caches its own blocks") {
  AllocatorPeaks p = ReplayCachingAllocator({A(0, 100 * kMiB, 2), F(0), A(1, 100 * kMiB, 0)});
  CHECK(p.reserved == 200 * kMiB);
  CHECK(p.held == 100 * kMiB);
  p = ReplayCachingAllocator({A(0, 100 * kMiB, 2), F(0), A(1, 100 * kMiB, 2)});
  CHECK(p.reserved == 100 * kMiB);
}

TEST_CASE("allocator replay: a reserve past 2^62 is reported as UINT64_MAX, never wrapped") {
  const uint64_t big = uint64_t{1} << 61;
  // Requests that grow, each freed before the next: every one needs a segment of its own.
  AllocatorPeaks p = ReplayCachingAllocator({A(0, big), F(0), A(1, big + 2 * kMiB), F(1),
                                             A(2, big + 4 * kMiB), F(2), A(3, big + 6 * kMiB)});
  CHECK(p.reserved == UINT64_MAX);
  CHECK(p.allocated == UINT64_MAX);
  CHECK(p.held == UINT64_MAX);
  CHECK(ReplayCachingAllocator({A(0, UINT64_MAX)}).reserved == UINT64_MAX);
  // Under the bound the figures are exact.
  const uint64_t half = big / 2;
  p = ReplayCachingAllocator({A(0, half), F(0), A(1, half + 2 * kMiB)});
  CHECK(p.allocated == half + 2 * kMiB);
  CHECK(p.reserved == 2 * half + 2 * kMiB);
}

TEST_CASE("allocator replay: frees of unknown ids and zero-byte requests are ignored") {
  AllocatorPeaks p = ReplayCachingAllocator({F(7), A(0, 0), A(1, 4 * kMiB), F(1), F(1)});
  CHECK(p.reserved == 20 * kMiB);
  CHECK(p.allocated == 4 * kMiB);
}

}  // namespace
}  // namespace memplan::estimator::step
