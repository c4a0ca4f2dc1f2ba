// ElementBytes and the single-process (world size 1) Collective.
#include "offload/collective.h"

#include <string>

#include "common/checked_math.h"
#include "offload/collective_internal.h"

namespace memplan::offload {

int ElementBytes(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return 4;
    case ElementType::kBFloat16:
    case ElementType::kFloat16: return 2;
  }
  return 0;
}

namespace internal {

Result<uint64_t> CollectiveBytes(std::string_view who, std::string_view op, uint64_t count,
                                 ElementType type) {
  const int element = ElementBytes(type);
  if (element == 0) {
    return Status::InvalidArgument(std::string(who) + ": " + std::string(op) +
                                   " with an invalid element type");
  }
  const auto bytes = CheckedMul(count, static_cast<uint64_t>(element));
  if (!bytes) {
    return Status::OutOfRange(std::string(who) + ": " + std::string(op) + " of " +
                              std::to_string(count) + " elements overflows 64 bits");
  }
  return *bytes;
}

}  // namespace internal

namespace {

// World size 1: rank 0's send buffer is the whole result, so all-gather and reduce-scatter are one
// device-to-device copy each (through the runtime, so they work on real device memory), and
// all-reduce has nothing to add.
class SingleProcessCollective final : public Collective {
 public:
  explicit SingleProcessCollective(gpu::Runtime* runtime) : runtime_(runtime) {}

  std::string_view Name() const override { return "single-process"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

  Status AllGather(const void* send, void* recv, uint64_t count, ElementType type) override {
    return Copy("AllGather", send, recv, count, type);
  }
  Status ReduceScatter(const void* send, void* recv, uint64_t count, ElementType type) override {
    return Copy("ReduceScatter", send, recv, count, type);
  }
  Status AllReduce(void* buffer, uint64_t count, ElementType type) override {
    MEMPLAN_ASSIGN_OR_RETURN(const uint64_t bytes,
                             internal::CollectiveBytes(Name(), "AllReduce", count, type));
    if (bytes > 0 && buffer == nullptr) {
      return Status::InvalidArgument("single-process collective: AllReduce with a null buffer");
    }
    return Status::Ok();
  }

 private:
  Status Copy(std::string_view op, const void* send, void* recv, uint64_t count, ElementType type) {
    MEMPLAN_ASSIGN_OR_RETURN(const uint64_t bytes,
                             internal::CollectiveBytes(Name(), op, count, type));
    if (bytes == 0) return Status::Ok();
    if (send == nullptr || recv == nullptr) {
      return Status::InvalidArgument("single-process collective: " + std::string(op) +
                                     " with a null buffer");
    }
    if (send == recv) return Status::Ok();  // in place: the data is already where it belongs
    const auto s = reinterpret_cast<uintptr_t>(send);
    const auto r = reinterpret_cast<uintptr_t>(recv);
    if (s < r + bytes && r < s + bytes) {
      return Status::InvalidArgument("single-process collective: " + std::string(op) +
                                     " with send and recv buffers that partly overlap");
    }
    MEMPLAN_ASSIGN_OR_RETURN(
        const gpu::CopyTicket ticket,
        runtime_->CopyAsync(gpu::CopyDirection::kDeviceToDevice, recv, send, bytes));
    return runtime_->Wait(ticket).WithPrefix("single-process collective: " + std::string(op));
  }

  gpu::Runtime* const runtime_;
};

}  // namespace

std::unique_ptr<Collective> CreateSingleProcessCollective(gpu::Runtime* runtime) {
  if (runtime == nullptr) runtime = &gpu::DefaultHostOnlyRuntime();
  return std::make_unique<SingleProcessCollective>(runtime);
}

}  // namespace memplan::offload
