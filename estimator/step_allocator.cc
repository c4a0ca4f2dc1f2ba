#include "estimator/step_allocator.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace memplan::estimator::step {

// Note [The caching allocator's reserve]
// torch.cuda.max_memory_reserved is the most the caching allocator held from cudaMalloc, and it
// is more than max_memory_allocated by what its caching could not reuse
// (c10/cuda/CUDACachingAllocator.cpp, without expandable segments or a max_split_size):
//  - requests of up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger
//    ones from the large pool, whose new segments are 20 MiB for requests under 10 MiB and the
//    request rounded up to 2 MiB beyond (get_allocation_size);
//  - a request takes the smallest free block of its pool that holds it (get_free_block) and
//    splits off the rest when the rest is at least 512 bytes (small pool) or more than 1 MiB
//    (large pool) (should_split); otherwise a new segment is allocated;
//  - a freed block merges with free neighbours of its own segment (free_block,
//    try_merge_blocks) and stays cached.
// So a freed block too small for a later, larger request stays reserved beside it: the whole
// logits' fp32 copy freed after the loss and their gradient asked for in backward, a recompute
// whose tensors are a little larger than the forward's. The step model replays its allocations
// through these rules on one stream (FSDP2's collective streams share the compute stream's
// pool here) until nothing is freed to the device, as on a GPU with room to spare: the reserve
// a step settles into, which max_memory_reserved reports.
namespace {

// A hostile setup's segments could add up past 2^64: beyond 2^62 reserved (the most bytes the
// step model counts) the replay stops and reports every total as UINT64_MAX.
constexpr uint64_t kMostReserved = uint64_t{1} << 62;

constexpr uint64_t kSmallSize = uint64_t{1} << 20;
constexpr uint64_t kSmallBuffer = uint64_t{2} << 20;
constexpr uint64_t kLargeBuffer = uint64_t{20} << 20;
constexpr uint64_t kMinLargeAlloc = uint64_t{10} << 20;
constexpr uint64_t kRoundLarge = uint64_t{2} << 20;
constexpr uint64_t kMinBlockSize = 512;

struct Block {
  uint64_t addr = 0, size = 0;
  int segment = -1;
  int prev = -1, next = -1;  // neighbours in the segment
  bool free = false;
  bool small = false;
};

// The device's totals, shared by the streams' allocators.
struct Counters {
  uint64_t reserved = 0, allocated = 0, held = 0;
  uint64_t peak_reserved = 0, peak_allocated = 0, peak_held = 0;
  bool saturated = false;  // past kMostReserved: the replay stopped
};

class Allocator {
 public:
  explicit Allocator(Counters* counters) : c_(counters) {}

  // The block for a request of `bytes`; -1 once the reserve would pass kMostReserved.
  int Malloc(uint64_t bytes) {
    const bool small = bytes <= kSmallSize;
    auto& pool = small ? small_ : large_;
    int b = -1;
    auto it = std::lower_bound(pool.begin(), pool.end(), std::make_tuple(bytes, uint64_t{0}, 0));
    if (it != pool.end()) {
      b = std::get<2>(*it);
      pool.erase(it);
    } else {
      if (bytes > kMostReserved || c_->reserved > kMostReserved - bytes - kLargeBuffer) {
        c_->saturated = true;
        return -1;
      }
      const uint64_t seg = small ? kSmallBuffer
                           : bytes < kMinLargeAlloc
                               ? kLargeBuffer
                               : (bytes + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
      b = NewBlock(next_addr_, seg, small);
      blocks_[static_cast<size_t>(b)].segment = static_cast<int>(segments_.size());
      segments_.push_back({seg, 0});
      next_addr_ += seg + kRoundLarge;  // segments are never neighbours
      c_->reserved += seg;
      c_->peak_reserved = std::max(c_->peak_reserved, c_->reserved);
    }
    Block& blk = blocks_[static_cast<size_t>(b)];
    blk.free = false;
    const uint64_t rest = blk.size - bytes;
    if (small ? rest >= kMinBlockSize : rest > kSmallSize) {
      const int r = NewBlock(blk.addr + bytes, rest, small);
      Block& head = blocks_[static_cast<size_t>(b)];
      Block& tail = blocks_[static_cast<size_t>(r)];
      tail.segment = head.segment;
      tail.prev = b;
      tail.next = head.next;
      if (head.next >= 0) blocks_[static_cast<size_t>(head.next)].prev = r;
      head.next = r;
      head.size = bytes;
      Release(r);
    }
    c_->allocated += blocks_[static_cast<size_t>(b)].size;
    c_->peak_allocated = std::max(c_->peak_allocated, c_->allocated);
    Segment& seg = segments_[static_cast<size_t>(blocks_[static_cast<size_t>(b)].segment)];
    if (seg.live++ == 0) c_->held += seg.size;
    c_->peak_held = std::max(c_->peak_held, c_->held);
    return b;
  }

  void Free(int b) {
    c_->allocated -= blocks_[static_cast<size_t>(b)].size;
    Segment& seg = segments_[static_cast<size_t>(blocks_[static_cast<size_t>(b)].segment)];
    if (--seg.live == 0) c_->held -= seg.size;
    Release(b);
  }

 private:
  int NewBlock(uint64_t addr, uint64_t size, bool small) {
    Block blk;
    blk.addr = addr;
    blk.size = size;
    blk.small = small;
    blocks_.push_back(blk);
    return static_cast<int>(blocks_.size()) - 1;
  }

  // Marks `b` free, merged with its free neighbours, and caches it.
  void Release(int b) {
    Block* blk = &blocks_[static_cast<size_t>(b)];
    auto& pool = blk->small ? small_ : large_;
    for (int side = 0; side < 2; ++side) {
      const int n = side == 0 ? blk->prev : blk->next;
      if (n < 0 || !blocks_[static_cast<size_t>(n)].free) continue;
      Block& other = blocks_[static_cast<size_t>(n)];
      pool.erase(
          std::lower_bound(pool.begin(), pool.end(), std::make_tuple(other.size, other.addr, 0)));
      if (side == 0) {
        // The previous block absorbs this one.
        other.size += blk->size;
        other.next = blk->next;
        if (blk->next >= 0) blocks_[static_cast<size_t>(blk->next)].prev = n;
        blk->size = 0;
        b = n;
        blk = &other;
      } else {
        blk->size += other.size;
        blk->next = other.next;
        if (other.next >= 0) blocks_[static_cast<size_t>(other.next)].prev = b;
        other.size = 0;
      }
    }
    blk->free = true;
    const auto entry = std::make_tuple(blk->size, blk->addr, b);
    pool.insert(std::lower_bound(pool.begin(), pool.end(), entry), entry);
  }

  struct Segment {
    uint64_t size = 0;
    int live = 0;  // blocks in use
  };
  std::vector<Block> blocks_;
  std::vector<Segment> segments_;
  // Free blocks by (size, address), sorted: a few hundred at most, so a vector beats a tree.
  using Pool = std::vector<std::tuple<uint64_t, uint64_t, int>>;
  Pool small_, large_;
  uint64_t next_addr_ = 0;
  Counters* c_;
};

}  // namespace

AllocatorPeaks ReplayCachingAllocator(const std::vector<AllocatorEvent>& events) {
  // The streams share the counters: one device's reserve.
  Counters counters;
  std::map<int, Allocator> streams;
  int ids = 0;
  for (const AllocatorEvent& e : events) ids = std::max(ids, e.id + 1);
  // id -> its stream's allocator and block, while live.
  std::vector<std::pair<Allocator*, int>> live(static_cast<size_t>(ids), {nullptr, -1});
  for (const AllocatorEvent& e : events) {
    if (e.id < 0) continue;
    auto& slot = live[static_cast<size_t>(e.id)];
    if (e.alloc) {
      if (e.bytes == 0 || slot.first != nullptr) continue;
      Allocator& a = streams.try_emplace(e.stream, &counters).first->second;
      const int block = a.Malloc(e.bytes);
      if (counters.saturated) return {UINT64_MAX, UINT64_MAX, UINT64_MAX};
      slot = {&a, block};
    } else if (slot.first != nullptr) {
      slot.first->Free(slot.second);
      slot = {nullptr, -1};
    }
  }
  return {counters.peak_allocated, counters.peak_reserved, counters.peak_held};
}

}  // namespace memplan::estimator::step
