// The thread-group Collective: see thread_collective.h for the contract.
//
// Note [Two barriers per call]
// Every call is: post (operation, buffers) under the group's mutex; barrier 1 (everyone posted);
// check that the posts agree, then read the peers' send buffers and write this rank's own recv;
// barrier 2 (everyone done reading); return. Between the barriers nobody writes a buffer another
// rank reads: a rank writes only its recv, and for the in-place forms the part of a rank's buffer
// that the others read (its own slot) is one it does not write (all-gather) or writes only after
// reading it itself, element by element (reduce-scatter). All-reduce reads every rank's whole
// buffer, so its result goes to a private vector first and into the buffer after barrier 2, when
// nobody reads it any more; the next call cannot read it before this rank posts again. The posts
// themselves are only read between the barriers, so a rank that returns and posts its next call
// never overwrites a post a slower rank is still reading. The mutex's hand-offs at the barriers are
// what order one rank's writes before another's reads.
#include "offload/thread_collective.h"

#include <cstring>
#include <string>

#include "common/checked_math.h"
#include "common/mutex.h"
#include "offload/collective_internal.h"
#include "offload/half.h"

namespace memplan::offload {
namespace {

enum class Op { kAllGather, kReduceScatter, kAllReduce };

const char* OpName(Op op) {
  switch (op) {
    case Op::kAllGather: return "AllGather";
    case Op::kReduceScatter: return "ReduceScatter";
    case Op::kAllReduce: return "AllReduce";
  }
  return "?";
}

float Load(const std::byte* base, uint64_t i, ElementType type) {
  switch (type) {
    case ElementType::kFloat32: {
      float v;
      std::memcpy(&v, base + i * 4, 4);
      return v;
    }
    case ElementType::kBFloat16:
    case ElementType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, base + i * 2, 2);
      return type == ElementType::kBFloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
    }
  }
  return 0.0f;
}

void Store(std::byte* base, uint64_t i, ElementType type, float v) {
  switch (type) {
    case ElementType::kFloat32: std::memcpy(base + i * 4, &v, 4); return;
    case ElementType::kBFloat16:
    case ElementType::kFloat16: {
      const uint16_t h = type == ElementType::kBFloat16 ? FloatToBf16(v) : FloatToFp16(v);
      std::memcpy(base + i * 2, &h, 2);
      return;
    }
  }
}

struct Group {
  struct Post {
    Op op = Op::kAllGather;
    const std::byte* send = nullptr;
    std::byte* recv = nullptr;
    uint64_t count = 0;
    ElementType type = ElementType::kFloat32;
  };

  Group(int world, std::chrono::milliseconds wait)
      : world_size(world), timeout(wait), posts(world) {}

  const int world_size;
  const std::chrono::milliseconds timeout;
  Mutex mu;
  CondVar cv;
  uint64_t generation GUARDED_BY(mu) = 0;  // barriers completed
  int arrived GUARDED_BY(mu) = 0;          // ranks waiting at the current barrier
  Status broken GUARDED_BY(mu);            // set once a barrier timed out
  std::vector<Post> posts;  // Written under mu before barrier 1, read between the barriers.

  // Waits until every rank has arrived; `mu` is released while waiting.
  Status Barrier(int rank) REQUIRES(mu) {
    if (!broken.ok()) return broken;
    const uint64_t gen = generation;
    if (++arrived == world_size) {
      arrived = 0;
      ++generation;
      cv.SignalAll();
      return Status::Ok();
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (generation == gen && broken.ok()) {
      if (!cv.WaitUntil(&mu, deadline)) break;  // timed out: the checks below decide
    }
    if (generation != gen) return Status::Ok();
    if (broken.ok()) {
      broken = Status::FailedPrecondition(
          "thread collective: rank " + std::to_string(rank) + " waited " +
          std::to_string(timeout.count()) +
          " ms for the other ranks; the group is broken, make a new one");
      cv.SignalAll();
    }
    return broken;
  }
};

class ThreadCollective final : public Collective {
 public:
  ThreadCollective(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  std::string_view Name() const override { return "thread-group"; }
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size; }

  Status AllGather(const void* send, void* recv, uint64_t count, ElementType type) override {
    return Call(Op::kAllGather, send, recv, count, type);
  }
  Status ReduceScatter(const void* send, void* recv, uint64_t count, ElementType type) override {
    return Call(Op::kReduceScatter, send, recv, count, type);
  }
  Status AllReduce(void* buffer, uint64_t count, ElementType type) override {
    return Call(Op::kAllReduce, buffer, buffer, count, type);
  }

 private:
  Status Call(Op op, const void* send, void* recv, uint64_t count, ElementType type) {
    Group& g = *group_;
    const uint64_t ranks = static_cast<uint64_t>(g.world_size);
    const auto total = CheckedMul(count, ranks);
    if (!total) {
      return Status::OutOfRange("thread collective: " + std::string(OpName(op)) + " of " +
                                std::to_string(count) + " elements per rank overflows 64 bits");
    }
    MEMPLAN_RETURN_IF_ERROR(internal::CollectiveBytes(Name(), OpName(op), *total, type).status());
    if (count > 0 && (send == nullptr || recv == nullptr)) {
      return Status::InvalidArgument("thread collective: " + std::string(OpName(op)) +
                                     " with a null buffer");
    }
    MutexLock lock(&g.mu);
    g.posts[static_cast<size_t>(rank_)] = {op, static_cast<const std::byte*>(send),
                                           static_cast<std::byte*>(recv), count, type};
    MEMPLAN_RETURN_IF_ERROR(g.Barrier(rank_));
    lock.Unlock();
    // Between the barriers (Note [Two barriers per call]).
    Status status = Check(op, count, type);
    std::vector<float> reduced;
    if (status.ok()) reduced = Run(op, count, type);
    lock.Lock();
    MEMPLAN_RETURN_IF_ERROR(g.Barrier(rank_));
    lock.Unlock();
    if (status.ok() && op == Op::kAllReduce) {
      auto* out = static_cast<std::byte*>(recv);
      for (uint64_t i = 0; i < count; ++i) Store(out, i, type, reduced[i]);
    }
    return status;
  }

  Status Check(Op op, uint64_t count, ElementType type) const {
    for (int r = 0; r < group_->world_size; ++r) {
      const Group::Post& p = group_->posts[static_cast<size_t>(r)];
      if (p.op != op || p.count != count || p.type != type) {
        return Status::InvalidArgument(
            "thread collective: rank " + std::to_string(rank_) + " called " + OpName(op) + "(" +
            std::to_string(count) + " x " + std::to_string(ElementBytes(type)) +
            " bytes) while rank " + std::to_string(r) + " called " + OpName(p.op) + "(" +
            std::to_string(p.count) + " x " + std::to_string(ElementBytes(p.type)) +
            " bytes); every rank must make the same calls "
            "in the same order");
      }
    }
    return Status::Ok();
  }

  // The data movement of one call; for all-reduce, returns the sums (stored after barrier 2).
  std::vector<float> Run(Op op, uint64_t count, ElementType type) const {
    const std::vector<Group::Post>& posts = group_->posts;
    const Group::Post& me = posts[static_cast<size_t>(rank_)];
    const uint64_t eb = static_cast<uint64_t>(ElementBytes(type));
    const uint64_t bytes = count * eb;
    const int world = group_->world_size;
    std::vector<float> reduced;
    switch (op) {
      case Op::kAllGather:
        for (int r = 0; r < world; ++r) {
          std::byte* dst = me.recv + static_cast<uint64_t>(r) * bytes;
          const std::byte* src = posts[static_cast<size_t>(r)].send;
          if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
        }
        break;
      case Op::kReduceScatter: {
        const uint64_t at = static_cast<uint64_t>(rank_) * count;
        for (uint64_t i = 0; i < count; ++i) {
          float sum = Load(posts[0].send, at + i, type);
          for (int r = 1; r < world; ++r)
            sum += Load(posts[static_cast<size_t>(r)].send, at + i, type);
          Store(me.recv, i, type, sum);
        }
        break;
      }
      case Op::kAllReduce:
        reduced.resize(count);
        for (uint64_t i = 0; i < count; ++i) {
          float sum = Load(posts[0].send, i, type);
          for (int r = 1; r < world; ++r) sum += Load(posts[static_cast<size_t>(r)].send, i, type);
          reduced[i] = sum;
        }
        break;
    }
    return reduced;
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Collective>>> CreateThreadGroupCollectives(
    int world_size, gpu::Runtime* runtime, std::chrono::milliseconds timeout) {
  if (world_size < 1) {
    return Status::InvalidArgument("thread collective: world size " + std::to_string(world_size) +
                                   " (must be >= 1)");
  }
  if (timeout.count() <= 0)
    return Status::InvalidArgument("thread collective: timeout must be > 0");
  if (runtime == nullptr) runtime = &gpu::DefaultHostOnlyRuntime();
  if (runtime->has_device()) {
    return Status::InvalidArgument("thread collective: runtime " + std::string(runtime->Name()) +
                                   " has device memory the CPU cannot read; use NCCL");
  }
  auto group = std::make_shared<Group>(world_size, timeout);
  std::vector<std::unique_ptr<Collective>> out;
  out.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<ThreadCollective>(group, r));
  return out;
}

}  // namespace memplan::offload
