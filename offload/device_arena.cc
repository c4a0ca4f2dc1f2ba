// DeviceArena: see device_arena.h.
#include "offload/device_arena.h"

#include <algorithm>
#include <iterator>
#include <string>

namespace memplan::offload {
namespace {

constexpr uint64_t kUnit = 256;

}  // namespace

uint64_t DeviceArena::Rounded(uint64_t bytes) { return (bytes + kUnit - 1) / kUnit * kUnit; }

Result<std::unique_ptr<DeviceArena>> DeviceArena::Create(gpu::Runtime* runtime, uint64_t bytes) {
  if (runtime == nullptr) return Status::InvalidArgument("device arena: no runtime");
  if (bytes == 0) return Status::InvalidArgument("device arena: size 0");
  bytes = Rounded(bytes);
  MEMPLAN_ASSIGN_OR_RETURN(void* base, runtime->AllocateDevice(bytes));
  return std::unique_ptr<DeviceArena>(
      new DeviceArena(runtime, static_cast<std::byte*>(base), bytes));
}

DeviceArena::DeviceArena(gpu::Runtime* runtime, std::byte* base, uint64_t bytes)
    : runtime_(runtime), base_(base) {
  free_.emplace(0, bytes);
  stats_.capacity_bytes = bytes;
  stats_.largest_free_bytes = bytes;
}

DeviceArena::~DeviceArena() { (void)runtime_->FreeDevice(base_); }

Result<void*> DeviceArena::Allocate(uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("device arena: Allocate(0)");
  const uint64_t need = Rounded(bytes);
  MutexLock lock(&mu_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= need && (best == free_.end() || it->second < best->second)) best = it;
  }
  if (best == free_.end()) {
    ++stats_.failures;
    return Status::ResourceExhausted(
        "device arena: no room for " + std::to_string(bytes) + " bytes (arena " +
        std::to_string(stats_.capacity_bytes) + " bytes, " + std::to_string(stats_.in_use_bytes) +
        " in use, largest free range " + std::to_string(stats_.largest_free_bytes) + ")");
  }
  const uint64_t offset = best->first;
  const uint64_t left = best->second - need;
  free_.erase(best);
  if (left > 0) free_.emplace(offset + need, left);
  used_.emplace(offset, need);
  stats_.in_use_bytes += need;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  ++stats_.allocations;
  stats_.largest_free_bytes = 0;
  for (const auto& [o, b] : free_)
    stats_.largest_free_bytes = std::max(stats_.largest_free_bytes, b);
  return static_cast<void*>(base_ + offset);
}

Status DeviceArena::Free(void* ptr) {
  if (ptr == nullptr) return Status::Ok();
  const auto* p = static_cast<const std::byte*>(ptr);
  MutexLock lock(&mu_);
  auto it = p >= base_ ? used_.find(static_cast<uint64_t>(p - base_)) : used_.end();
  if (it == used_.end()) {
    return Status::InvalidArgument("device arena: Free of a buffer the arena did not hand out");
  }
  uint64_t begin = it->first, bytes = it->second;
  used_.erase(it);
  stats_.in_use_bytes -= bytes;
  auto next = free_.lower_bound(begin);
  if (next != free_.end() && next->first == begin + bytes) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(begin, bytes);
  stats_.largest_free_bytes = std::max(stats_.largest_free_bytes, bytes);
  return Status::Ok();
}

DeviceArenaStats DeviceArena::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace memplan::offload
