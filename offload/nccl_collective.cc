// The NCCL Collective: one communicator per Collective, its calls on the collective's own
// non-blocking stream on the CUDA runtime's device, each synchronised before returning. Compiled
// only where NCCL was found (MEMPLAN_HAVE_NCCL); nccl_collective_stub.cc stands in otherwise.
//
// Note [Deadlines]: a collective blocks until every rank has made the same call, so one rank that
// died, hangs, or took another path leaves its peers waiting for ever, in ncclCommInitRank as much
// as in a collective; and ncclCommFinalize waits for the peers too. So the communicator is created
// non-blocking (ncclConfig_t::blocking = 0), and every wait, init, collective and finalize, polls
// the communicator's state against a deadline (NcclOptions::timeout). Past it, the communicator is
// aborted (non-blocking communicators abort without waiting for their peers) and the call fails
// with IoError saying which rank, which call and how long it waited: an error the job can report,
// instead of a hang. Every later call is then FailedPrecondition.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "common/checked_math.h"
#include "offload/collective.h"
#include "offload/collective_internal.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_runtime_internal.h"

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
    case ncclInvalidUsage: return Status::InvalidArgument(std::move(msg));
    default: return Status::IoError(std::move(msg));
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
    case ElementType::kFloat32: return ncclFloat32;
    case ElementType::kBFloat16: return ncclBfloat16;
    case ElementType::kFloat16: return ncclFloat16;
  }
  return ncclFloat32;  // unreachable: CollectiveBytes has refused other values
}

const char* TypeName(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return "fp32";
    case ElementType::kBFloat16: return "bf16";
    case ElementType::kFloat16: return "fp16";
  }
  return "?";
}

std::string Seconds(std::chrono::milliseconds d) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g s", static_cast<double>(d.count()) / 1000.0);
  return text;
}

// NCCL learnt bf16 in 2.10.
constexpr int kNcclBf16Version = 21000;
// A destructor does not wait longer than this for a finalize (then it aborts).
constexpr std::chrono::milliseconds kFinalizeTimeout{30000};

class NcclCollective final : public Collective {
 public:
  static Result<std::unique_ptr<Collective>> Create(gpu::Runtime* runtime, int rank, int world_size,
                                                    const std::string& unique_id,
                                                    const NcclOptions& options);

  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  // Releases the communicator and the stream (every call has already synchronised, so nothing is
  // queued). A communicator with an asynchronous error, or one whose finalize does not finish
  // within the deadline (Note [Deadlines]), is aborted rather than destroyed. Errors cannot be
  // reported from here and are ignored.
  ~NcclCollective() override {
    ScopedDevice device(device_);
    (void)device.Enter();
    if (comm_ != nullptr) {
      ncclResult_t async = ncclSuccess;
      const bool healthy =
          ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess;
      const ncclResult_t finalized = healthy ? ncclCommFinalize(comm_) : ncclInternalError;
      if ((finalized == ncclSuccess || finalized == ncclInProgress) &&
          Poll("ncclCommFinalize", std::min(timeout_, kFinalizeTimeout)).ok()) {
        (void)ncclCommDestroy(comm_);
      } else {
        Abort();
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
    const std::string call = Call("ncclAllGather", count, type);
    MEMPLAN_RETURN_IF_ERROR(
        Issued(ncclAllGather(send, recv, count, NcclType(type), comm_, stream_), call));
    return Finish(call);
  }

  Status ReduceScatter(const void* send, void* recv, uint64_t count, ElementType type) override {
    MEMPLAN_RETURN_IF_ERROR(CheckCall("ReduceScatter", send, recv, count, type));
    if (count == 0) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    const std::string call = Call("ncclReduceScatter", count, type);
    MEMPLAN_RETURN_IF_ERROR(Issued(
        ncclReduceScatter(send, recv, count, NcclType(type), ncclSum, comm_, stream_), call));
    return Finish(call);
  }

  Status AllReduce(void* buffer, uint64_t count, ElementType type) override {
    MEMPLAN_RETURN_IF_ERROR(CheckCall("AllReduce", buffer, buffer, count, type));
    if (count == 0) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    const std::string call = Call("ncclAllReduce", count, type);
    MEMPLAN_RETURN_IF_ERROR(Issued(
        ncclAllReduce(buffer, buffer, count, NcclType(type), ncclSum, comm_, stream_), call));
    return Finish(call);
  }

 private:
  NcclCollective(int device, int rank, int world_size, std::chrono::milliseconds timeout)
      : device_(device), rank_(rank), world_size_(world_size), timeout_(timeout) {}

  std::string Who() const {
    return "nccl collective: rank " + std::to_string(rank_) + " of " + std::to_string(world_size_);
  }
  static std::string Call(const char* op, uint64_t count, ElementType type) {
    return std::string(op) + "(" + std::to_string(count) + " x " + TypeName(type) + ")";
  }

  // A collective's own return: queued (ncclSuccess, or ncclInProgress on a non-blocking
  // communicator) or refused, in which case the communicator is aborted.
  Status Issued(ncclResult_t result, const std::string& call) {
    if (result == ncclSuccess || result == ncclInProgress) return Status::Ok();
    Status s = MEMPLAN_NCCL_STATUS(result, call.c_str());
    Abort();
    return s.WithPrefix(Who());
  }

  // Creates the stream and the communicator, non-blocking, and waits for every rank to join, up to
  // the deadline (Note [Deadlines]). On failure the destructor releases what was made.
  Status Init(const std::string& unique_id) {
    MEMPLAN_CUDA_ON_DEVICE(device_);
    cudaStream_t stream = nullptr;  // assigned only on success: the destructor destroys it
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_ = stream;
    MEMPLAN_NCCL_RETURN_IF_ERROR(ncclGetVersion(&version_));
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Into a local: what NCCL leaves in its output on failure is not ours to free.
    ncclComm_t comm = nullptr;
    const ncclResult_t result = ncclCommInitRankConfig(&comm, world_size_, id, rank_, &config);
    if (result != ncclSuccess && result != ncclInProgress) {
      if (comm != nullptr) (void)ncclCommAbort(comm);
      return MEMPLAN_NCCL_STATUS(result, "ncclCommInitRankConfig").WithPrefix(Who());
    }
    comm_ = comm;
    MEMPLAN_RETURN_IF_ERROR(Poll("creating the communicator (ncclCommInitRankConfig)", timeout_));
    return Status::Ok();
  }

  // Waits until the communicator is no longer in progress (a non-blocking init or finalize);
  // past the deadline, aborts it and fails (Note [Deadlines]).
  Status Poll(const std::string& what, std::chrono::milliseconds timeout) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(comm_, &state);
      if (got != ncclSuccess) {
        Status s = MEMPLAN_NCCL_STATUS(got, "ncclCommGetAsyncError");
        Abort();
        return s.WithPrefix(Who() + ": " + what);
      }
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) {
        Status s = MEMPLAN_NCCL_STATUS(state, what.c_str());
        Abort();
        return s.WithPrefix(Who());
      }
      if (std::chrono::steady_clock::now() - start > timeout) {
        Abort();
        return Status::IoError(Who() + ": " + what + " did not finish within " + Seconds(timeout) +
                               ": a rank did not join (it failed, never started, or was given "
                               "another unique id); the communicator is aborted");
      }
      Pause(polls);
    }
  }

  static void Pause(int polls) {
    if (polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 10000 ? 50 : 1000));
    }
  }

  // The checks every call makes before reaching NCCL: a usable communicator, a valid type, sizes
  // that fit 64 bits (the larger buffer holds count * world_size elements), non-null buffers.
  Status CheckCall(std::string_view op, const void* send, const void* recv, uint64_t count,
                   ElementType type) const {
    if (comm_ == nullptr) {
      return Status::FailedPrecondition(
          "nccl collective: the communicator was aborted after an earlier error; make a new one");
    }
    if (type == ElementType::kBFloat16 && version_ < kNcclBf16Version) {
      return Status::Unimplemented("nccl collective: NCCL " + std::to_string(version_) +
                                   " cannot reduce or gather bf16 (2.10 and later can); "
                                   "update NCCL or use fp16/fp32");
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
  // recommended pattern), up to the deadline (Note [Deadlines]); on an error or past the deadline,
  // abort the communicator, which releases the stream, and report it. Spin briefly first, since
  // small collectives finish in microseconds.
  Status Finish(const std::string& call) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      const cudaError_t err = cudaStreamQuery(stream_);
      if (err != cudaSuccess && err != cudaErrorNotReady) {
        Status s = MEMPLAN_CUDA_STATUS(err, "cudaStreamQuery(collective stream)");
        Abort();
        return s.WithPrefix(Who() + ": " + call);
      }
      if (err == cudaErrorNotReady) (void)cudaGetLastError();  // not an error
      // Asked even when the stream is done: a collective that failed (a peer gone, ranks that
      // issued different calls) may still have let the stream go on.
      ncclResult_t async = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(comm_, &async);
      if (got != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        Status s = got != ncclSuccess
                       ? MEMPLAN_NCCL_STATUS(got, "ncclCommGetAsyncError(comm, &async)")
                       : MEMPLAN_NCCL_STATUS(async, "ncclCommGetAsyncError: asynchronous error");
        Abort();
        return s.WithPrefix(Who() + ": " + call);
      }
      if (err == cudaSuccess) return Status::Ok();
      if (std::chrono::steady_clock::now() - start > timeout_) {
        Abort();
        return Status::IoError(Who() + ": " + call + " did not finish within " + Seconds(timeout_) +
                               ": another rank failed, stopped, or issued a different collective; "
                               "the communicator is aborted");
      }
      Pause(polls);
    }
  }

  void Abort() {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  const int device_;
  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  int version_ = 0;  // ncclGetVersion's
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;  // null after Abort()
};

Result<std::unique_ptr<Collective>> NcclCollective::Create(gpu::Runtime* runtime, int rank,
                                                           int world_size,
                                                           const std::string& unique_id,
                                                           const NcclOptions& options) {
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
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument("nccl collective: the timeout must be positive");
  }
  std::unique_ptr<NcclCollective> collective(
      new NcclCollective(device, rank, world_size, options.timeout));
  MEMPLAN_RETURN_IF_ERROR(collective->Init(unique_id));
  return std::unique_ptr<Collective>(std::move(collective));
}

}  // namespace

Result<std::unique_ptr<Collective>> CreateNcclCollective(gpu::Runtime* runtime, int rank,
                                                         int world_size,
                                                         const std::string& unique_id,
                                                         const NcclOptions& options) {
  return NcclCollective::Create(runtime, rank, world_size, unique_id, options);
}

Result<std::string> NcclUniqueId() {
  ncclUniqueId id;
  MEMPLAN_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace memplan::offload
