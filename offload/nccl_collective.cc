// The NCCL Collective: one communicator per Collective, its calls on the collective's own
// non-blocking stream on the CUDA runtime's device, each synchronised before returning. Compiled
// only where NCCL was found (MEMPLAN_HAVE_NCCL); nccl_collective_stub.cc stands in otherwise.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "common/checked_math.h"
#include "offload/collective.h"
#include "offload/collective_internal.h"
#include "offload/cuda_check.h"
#include "offload/cuda_runtime_internal.h"

namespace memplan::offload {
namespace {

using gpu::internal::ScopedDevice;

// NCCL's code mapped like CUDA's (see CudaStatus): a misuse -> InvalidArgument; a peer gone or a
// network failure (ncclRemoteError, ncclSystemError), a CUDA failure inside NCCL, or NCCL's own
// internal error -> IoError. ncclGetLastError adds NCCL's detail ("NET/Socket: connection closed by
// peer") to ncclGetErrorString's generic text.
Status NcclStatus(ncclResult_t result, const char* call, const char* file, int line) {
  std::string msg = std::string(call) + ": " + ncclGetErrorString(result);
  const char* detail = ncclGetLastError(nullptr);
  if (detail != nullptr && *detail != '\0') msg += std::string(" (") + detail + ")";
  msg += std::string(" (") + gpu::internal::ShortFile(file) + ":" + std::to_string(line) + ")";
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return Status::InvalidArgument(std::move(msg));
    default:
      return Status::IoError(std::move(msg));
  }
}

}  // namespace
}  // namespace memplan::offload

#define MEMPLAN_NCCL_STATUS(result, call) \
  ::memplan::offload::NcclStatus((result), (call), __FILE__, __LINE__)

// Runs the NCCL call `expr`; when it fails, returns a Status naming the call, NCCL's error and the
// file and line from the enclosing function.
#define MEMPLAN_NCCL_RETURN_IF_ERROR(expr)                     \
  do {                                                         \
    const ncclResult_t memplan_nccl_result_ = (expr);          \
    if (memplan_nccl_result_ != ncclSuccess) {                 \
      return MEMPLAN_NCCL_STATUS(memplan_nccl_result_, #expr); \
    }                                                          \
  } while (0)

namespace memplan::offload {
namespace {

ncclDataType_t NcclType(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
      return ncclFloat32;
    case ElementType::kBFloat16:
      return ncclBfloat16;
    case ElementType::kFloat16:
      return ncclFloat16;
  }
  return ncclFloat32;  // unreachable: CollectiveBytes has refused other values
}

class NcclCollective final : public Collective {
 public:
  static Result<std::unique_ptr<Collective>> Create(gpu::Runtime* runtime, int rank, int world_size,
                                                    const std::string& unique_id);

  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  // Releases the communicator and the stream (every call has already synchronised, so nothing is
  // queued). A communicator with an asynchronous error, or one that fails to finalise, is aborted
  // rather than finalised, which would wait on its peers. Errors cannot be reported from here and
  // are ignored.
  ~NcclCollective() override {
    ScopedDevice device(device_);
    (void)device.Enter();
    if (comm_ != nullptr) {
      ncclResult_t async = ncclSuccess;
      const bool healthy =
          ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess;
      if (healthy && ncclCommFinalize(comm_) == ncclSuccess) {
        (void)ncclCommDestroy(comm_);
      } else {
        (void)ncclCommAbort(comm_);
      }
    }
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    (void)cudaGetLastError();
  }

  std::string_view Name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status AllGather(const void* send, void* recv, uint64_t count, ElementType type) override {
    MEMPLAN_RETURN_IF_ERROR(CheckCall("AllGather", send, recv, count, type));
    if (count == 0) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    MEMPLAN_NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, count, NcclType(type), comm_, stream_));
    return Finish("ncclAllGather");
  }

  Status ReduceScatter(const void* send, void* recv, uint64_t count, ElementType type) override {
    MEMPLAN_RETURN_IF_ERROR(CheckCall("ReduceScatter", send, recv, count, type));
    if (count == 0) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    MEMPLAN_NCCL_RETURN_IF_ERROR(
        ncclReduceScatter(send, recv, count, NcclType(type), ncclSum, comm_, stream_));
    return Finish("ncclReduceScatter");
  }

  Status AllReduce(void* buffer, uint64_t count, ElementType type) override {
    MEMPLAN_RETURN_IF_ERROR(CheckCall("AllReduce", buffer, buffer, count, type));
    if (count == 0) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    MEMPLAN_NCCL_RETURN_IF_ERROR(
        ncclAllReduce(buffer, buffer, count, NcclType(type), ncclSum, comm_, stream_));
    return Finish("ncclAllReduce");
  }

 private:
  NcclCollective(int device, int rank, int world_size)
      : device_(device), rank_(rank), world_size_(world_size) {}

  // Creates the stream and the communicator (which blocks until every rank has joined). On failure
  // the destructor releases what was made.
  Status Init(const std::string& unique_id) {
    MEMPLAN_CUDA_ON_DEVICE(device_);
    cudaStream_t stream = nullptr;  // assigned only on success: the destructor destroys it
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_ = stream;
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    // Into a local: what NCCL leaves in its output on failure is not ours to free.
    ncclComm_t comm = nullptr;
    MEMPLAN_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, world_size_, id, rank_));
    comm_ = comm;
    return Status::Ok();
  }

  // The checks every call makes before reaching NCCL: a usable communicator, a valid type, sizes
  // that fit 64 bits (the larger buffer holds count * world_size elements), non-null buffers.
  Status CheckCall(std::string_view op, const void* send, const void* recv, uint64_t count,
                   ElementType type) const {
    if (comm_ == nullptr) {
      return Status::FailedPrecondition(
          "nccl collective: the communicator was aborted after an earlier error; make a new one");
    }
    const auto elements = CheckedMul(count, static_cast<uint64_t>(world_size_));
    if (!elements) {
      return Status::OutOfRange("nccl collective: " + std::string(op) + " of " +
                                std::to_string(count) + " elements per rank overflows 64 bits");
    }
    MEMPLAN_RETURN_IF_ERROR(internal::CollectiveBytes(Name(), op, *elements, type).status());
    if (count > 0 && (send == nullptr || recv == nullptr)) {
      return Status::InvalidArgument("nccl collective: " + std::string(op) + " with a null buffer");
    }
    return Status::Ok();
  }

  // Note [Waiting for NCCL]: a plain cudaStreamSynchronize would hang for ever if a peer died
  // mid-collective. Instead poll the stream and the communicator's asynchronous error (NCCL's
  // recommended pattern); on an error, abort the communicator, which releases the stream, and
  // report it. Spin briefly first, since small collectives finish in microseconds.
  Status Finish(const char* op) {
    for (int polls = 0;; ++polls) {
      const cudaError_t err = cudaStreamQuery(stream_);
      if (err == cudaSuccess) return Status::Ok();
      if (err != cudaErrorNotReady) {
        Status s = MEMPLAN_CUDA_STATUS(err, "cudaStreamQuery(collective stream)");
        Abort();
        return s.WithPrefix(op);
      }
      (void)cudaGetLastError();  // cudaErrorNotReady is not an error
      ncclResult_t async = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(comm_, &async);
      if (got != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        Status s = got != ncclSuccess
                       ? MEMPLAN_NCCL_STATUS(got, "ncclCommGetAsyncError(comm, &async)")
                       : MEMPLAN_NCCL_STATUS(async, "ncclCommGetAsyncError: asynchronous error");
        Abort();
        return s.WithPrefix(op);
      }
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  void Abort() {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  const int device_;
  const int rank_;
  const int world_size_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;  // null after Abort()
};

Result<std::unique_ptr<Collective>> NcclCollective::Create(gpu::Runtime* runtime, int rank,
                                                           int world_size,
                                                           const std::string& unique_id) {
  if (runtime == nullptr) {
    return Status::InvalidArgument("nccl collective: needs the CUDA runtime, got none");
  }
  const int device = gpu::internal::CudaDeviceOf(*runtime);
  if (device < 0) {
    return Status::InvalidArgument("nccl collective: needs the CUDA runtime, got " +
                                   std::string(runtime->Name()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("nccl collective: rank " + std::to_string(rank) +
                                   " is not in a world of size " + std::to_string(world_size));
  }
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return Status::InvalidArgument(
        "nccl collective: the unique id must be " + std::to_string(NCCL_UNIQUE_ID_BYTES) +
        " bytes (from NcclUniqueId()), got " + std::to_string(unique_id.size()));
  }
  std::unique_ptr<NcclCollective> collective(new NcclCollective(device, rank, world_size));
  MEMPLAN_RETURN_IF_ERROR(collective->Init(unique_id));
  return std::unique_ptr<Collective>(std::move(collective));
}

}  // namespace

Result<std::unique_ptr<Collective>> CreateNcclCollective(gpu::Runtime* runtime, int rank,
                                                         int world_size,
                                                         const std::string& unique_id) {
  return NcclCollective::Create(runtime, rank, world_size, unique_id);
}

Result<std::string> NcclUniqueId() {
  ncclUniqueId id;
  MEMPLAN_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace memplan::offload
