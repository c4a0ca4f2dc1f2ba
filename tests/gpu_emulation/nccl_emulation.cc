// The emulated NCCL: the calls memplan's NcclCollective makes, compiled against the real nccl.h and
// linked in place of libnccl in a -DMEMPLAN_GPU_EMULATION=ON build. README.md says what it models.
//
// Note [Ranks as threads]: the ranks of a communicator are threads of one process that called
// ncclCommInitRank with the same unique id; they form a clique. A collective is queued on the
// caller's emulated stream like any kernel; when the stream's worker reaches it, it arrives at the
// clique's round for that call number and waits for every rank's arrival. The last to arrive
// checks that all ranks issued the same call (operation, count, type, reduction) and computes the
// result for everyone from the send buffers (through the device memory's read-write view), so
// in-place calls work as in NCCL. A mismatch fails the round on every rank with ncclInvalidUsage; a
// rank that waits longer than Config::collective_timeout fails with ncclSystemError. Either way the
// error becomes the communicator's asynchronous error (ncclCommGetAsyncError) and the message
// (ncclGetLastError) names each rank's call, so a test sees which rank diverged instead of a hang.
//
// Sums run in rank order and round to the element type after every addition, as NCCL's ring
// rounds at every hop (the order of a real ring differs: bf16 and fp16 sums are close to NCCL's,
// not equal; fp32 sums equal a rank-order fp32 sum).
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "emulation_internal.h"
#include "offload/half.h"

namespace memplan::gpu_emulation::internal {
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

int TypeBytes(ncclDataType_t type) {
  switch (type) {
    case ncclFloat32: return 4;
    case ncclFloat16: return 2;
    case ncclBfloat16: return 2;
    default: return 0;
  }
}

const char* TypeName(ncclDataType_t type) {
  switch (type) {
    case ncclFloat32: return "fp32";
    case ncclFloat16: return "fp16";
    case ncclBfloat16: return "bf16";
    default: return "unsupported type";
  }
}

struct Call {
  Op op = Op::kAllGather;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t red = ncclSum;
  uint64_t count = 0;
  uint64_t sequence = 0;
  std::byte* send = nullptr;  // read-write views of the device buffers
  std::byte* recv = nullptr;

  bool SameAs(const Call& o) const {
    return op == o.op && type == o.type && red == o.red && count == o.count;
  }
  std::string Describe() const {
    return "#" + std::to_string(sequence) + " " + OpName(op) + "(" + std::to_string(count) + " x " +
           TypeName(type) + ")";
  }
};

struct Round {
  std::vector<std::optional<Call>> arrivals;
  int arrived = 0;
  int left = 0;
  bool done = false;
  bool failed = false;
  ncclResult_t error = ncclSuccess;
  std::string message;
};

// The last error of any communicator, as NCCL keeps it (ncclGetLastError ignores its argument).
struct LastError {
  std::mutex mu;
  std::string text;  // guarded by mu
};
LastError& Last() {
  static LastError* const last = new LastError();
  return *last;
}
void SetLast(const std::string& text) {
  std::lock_guard<std::mutex> lock(Last().mu);
  Last().text = text;
}

struct Comm;

struct Clique {
  int nranks = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Comm*> members;        // guarded by mu: by rank; null until joined
  std::vector<int> devices;          // guarded by mu
  int joined = 0;                    // guarded by mu
  std::map<uint64_t, Round> rounds;  // guarded by mu: by call number
  std::vector<std::string> issued;   // guarded by mu: each rank's last call
};

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::string last_error;  // guarded by mu
  uint64_t issued = 0;     // the issuing thread's only
  std::thread init;        // non-blocking init's joining thread

  void SetError(ncclResult_t error, const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (async_error.load() == ncclSuccess || async_error.load() == ncclInProgress) {
      last_error = message;
      async_error = error;
      SetLast(message);
    }
  }
};

struct Registry {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<Clique>> cliques;  // by unique id
  std::map<Comm*, std::shared_ptr<Comm>> comms;
  uint64_t next_id = 0;
};

Registry& R() {
  static Registry* const registry = new Registry();
  return *registry;
}

thread_local std::string last_error;

std::shared_ptr<Comm> FindComm(ncclComm_t handle) {
  std::lock_guard<std::mutex> lock(R().mu);
  auto it = R().comms.find(reinterpret_cast<Comm*>(handle));
  return it == R().comms.end() ? nullptr : it->second;
}

ncclResult_t Refuse(ncclResult_t result, const std::string& message) {
  SetLast(message);
  std::fprintf(stderr, "nccl emulation: %s\n", message.c_str());
  return result;
}

std::string Ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return "{" + out + "}";
}

// Joins the clique and waits for every rank (Note [Ranks as threads]).
ncclResult_t Join(Comm& comm) {
  Clique& c = *comm.clique;
  const auto deadline = std::chrono::steady_clock::now() + ConfigSnapshot().collective_timeout;
  std::unique_lock<std::mutex> lock(c.mu);
  if (c.members[comm.rank] != nullptr) {
    return Refuse(ncclInvalidArgument, "rank " + std::to_string(comm.rank) + " joined twice");
  }
  c.members[comm.rank] = &comm;
  c.devices[comm.rank] = comm.device;
  ++c.joined;
  c.cv.notify_all();
  const bool all =
      c.cv.wait_until(lock, deadline, [&] { return c.joined == c.nranks || comm.aborted.load(); });
  if (comm.aborted.load()) return ncclInvalidUsage;
  if (!all) {
    std::vector<int> missing;
    for (int r = 0; r < c.nranks; ++r) {
      if (c.members[r] == nullptr) missing.push_back(r);
    }
    const std::string message = "nccl emulation: rank " + std::to_string(comm.rank) + " of " +
                                std::to_string(c.nranks) + " waited " +
                                std::to_string(ConfigSnapshot().collective_timeout.count()) +
                                " ms in init for ranks " + Ranks(missing) + " to join";
    comm.SetError(ncclSystemError, message);
    return ncclSystemError;
  }
  for (int r = 0; r < c.nranks; ++r) {
    if (r != comm.rank && c.devices[r] == comm.device) {
      const std::string message = "Duplicate GPU detected : rank " + std::to_string(comm.rank) +
                                  " and rank " + std::to_string(r) + " both on CUDA device " +
                                  std::to_string(comm.device);
      comm.SetError(ncclInvalidUsage, message);
      return ncclInvalidUsage;
    }
  }
  return ncclSuccess;
}

template <typename Load, typename Store>
void Sum(const std::vector<const std::byte*>& sends, std::byte* out, uint64_t count, int eb,
         Load load, Store store) {
  for (uint64_t i = 0; i < count; ++i) {
    float acc = load(sends[0] + i * eb);
    for (size_t r = 1; r < sends.size(); ++r) acc = store(acc + load(sends[r] + i * eb), nullptr);
    store(acc, out + i * eb);
  }
}

// Sum over a 16-bit float format: each element widened to float, each partial sum rounded back.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void SumHalf(const std::vector<const std::byte*>& sends, std::byte* out, uint64_t count) {
  Sum(
      sends, out, count, 2,
      [](const std::byte* p) {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return ToFloat(h);
      },
      [](float v, std::byte* p) {
        const uint16_t h = FromFloat(v);
        if (p) std::memcpy(p, &h, 2);
        return ToFloat(h);
      });
}

// out[i] = sum over ranks of sends[r][i], in rank order, rounded to the type after each addition.
void SumTyped(ncclDataType_t type, const std::vector<const std::byte*>& sends, std::byte* out,
              uint64_t count) {
  switch (type) {
    case ncclFloat32:
      Sum(
          sends, out, count, 4,
          [](const std::byte* p) {
            float v;
            std::memcpy(&v, p, 4);
            return v;
          },
          [](float v, std::byte* p) {
            if (p) std::memcpy(p, &v, 4);
            return v;
          });
      break;
    case ncclBfloat16:
      SumHalf<offload::Bf16ToFloat, offload::FloatToBf16>(sends, out, count);
      break;
    case ncclFloat16: SumHalf<offload::Fp16ToFloat, offload::FloatToFp16>(sends, out, count); break;
    default: break;
  }
}

// Computes a complete, consistent round for every rank. Caller holds the clique's lock.
void Compute(Round& round, int nranks) {
  const Call& first = *round.arrivals[0];
  const uint64_t eb = static_cast<uint64_t>(TypeBytes(first.type));
  const uint64_t n = first.count;
  // Every send is read before any receive is written: in-place calls alias them.
  std::vector<std::vector<std::byte>> sends(nranks);
  const uint64_t send_bytes = first.op == Op::kReduceScatter ? n * eb * nranks : n * eb;
  for (int r = 0; r < nranks; ++r) {
    const std::byte* s = round.arrivals[r]->send;
    sends[r].assign(s, s + send_bytes);
  }
  std::vector<const std::byte*> pointers(nranks);
  switch (first.op) {
    case Op::kAllGather:
      for (int r = 0; r < nranks; ++r) {
        for (int i = 0; i < nranks; ++i) {
          std::memcpy(round.arrivals[r]->recv + i * n * eb, sends[i].data(), n * eb);
        }
      }
      break;
    case Op::kReduceScatter:
      for (int r = 0; r < nranks; ++r) {
        for (int i = 0; i < nranks; ++i) pointers[i] = sends[i].data() + r * n * eb;
        SumTyped(first.type, pointers, round.arrivals[r]->recv, n);
      }
      break;
    case Op::kAllReduce: {
      for (int i = 0; i < nranks; ++i) pointers[i] = sends[i].data();
      std::vector<std::byte> sum(n * eb);
      SumTyped(first.type, pointers, sum.data(), n);
      for (int r = 0; r < nranks; ++r) std::memcpy(round.arrivals[r]->recv, sum.data(), n * eb);
      break;
    }
  }
}

// What every rank has issued, for a failure message. Caller holds the clique's lock.
std::string Issued(const Clique& c) {
  std::string out;
  for (int r = 0; r < c.nranks; ++r) {
    out += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + " last issued " +
           (c.issued[r].empty() ? std::string("nothing") : c.issued[r]);
  }
  return out;
}

// A stream worker reaching call `call` of `comm` (Note [Ranks as threads]).
void Arrive(const std::shared_ptr<Comm>& comm, Call call) {
  Clique& c = *comm->clique;
  const auto timeout = ConfigSnapshot().collective_timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(c.mu);
  if (comm->aborted.load() || comm->async_error.load() != ncclSuccess) return;
  Round& round = c.rounds[call.sequence];
  if (round.arrivals.empty()) round.arrivals.resize(static_cast<size_t>(c.nranks));
  round.arrivals[comm->rank] = call;
  ++round.arrived;
  if (!round.failed) {
    for (const auto& other : round.arrivals) {
      if (other && !other->SameAs(call)) {
        round.failed = true;
        round.error = ncclInvalidUsage;
        std::string what;
        for (int r = 0; r < c.nranks; ++r) {
          what += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " +
                  (round.arrivals[r] ? round.arrivals[r]->Describe() : std::string("not yet"));
        }
        round.message = "nccl emulation: the ranks issued different collectives as call #" +
                        std::to_string(call.sequence) + ": " + what;
        break;
      }
    }
  }
  if (!round.failed && round.arrived == c.nranks) {
    Compute(round, c.nranks);
    round.done = true;
  }
  c.cv.notify_all();
  const bool finished = c.cv.wait_until(
      lock, deadline, [&] { return round.done || round.failed || comm->aborted.load(); });
  if (!finished) {
    std::vector<int> missing;
    for (int r = 0; r < c.nranks; ++r) {
      if (!round.arrivals[r]) missing.push_back(r);
    }
    round.failed = true;
    round.error = ncclSystemError;
    round.message = "nccl emulation: rank " + std::to_string(comm->rank) + " waited " +
                    std::to_string(timeout.count()) + " ms in " + call.Describe() + " for ranks " +
                    Ranks(missing) + "; " + Issued(c);
    c.cv.notify_all();
  }
  if (round.failed) comm->SetError(round.error, round.message);
  if (++round.left == c.nranks && round.done) c.rounds.erase(call.sequence);
}

ncclResult_t Issue(const char* name, Op op, const void* send, void* recv, size_t count,
                   ncclDataType_t type, ncclRedOp_t red, ncclComm_t handle, cudaStream_t stream) {
  int injected = 0;
  if (Faulted(name, &injected)) return static_cast<ncclResult_t>(injected);
  auto comm = FindComm(handle);
  if (!comm) return Refuse(ncclInvalidArgument, std::string(name) + ": unknown communicator");
  if (comm->aborted.load())
    return Refuse(ncclInvalidUsage, std::string(name) + ": aborted communicator");
  if (comm->async_error.load() == ncclInProgress) {
    return Refuse(ncclInvalidUsage, std::string(name) + ": communicator still initialising");
  }
  if (TypeBytes(type) == 0) return Refuse(ncclInvalidArgument, std::string(name) + ": type");
  if (type == ncclBfloat16 && ConfigSnapshot().nccl_version < 21000) {
    return Refuse(ncclInvalidArgument, std::string(name) + ": bf16 needs NCCL 2.10 or later");
  }
  if (red != ncclSum) return Refuse(ncclInvalidArgument, std::string(name) + ": only ncclSum");
  auto s = FindStream(stream);
  if (!s) return Refuse(ncclInvalidArgument, std::string(name) + ": unknown stream");
  if (s->device != comm->device) {
    return Refuse(ncclInvalidArgument, std::string(name) + ": a stream of device " +
                                           std::to_string(s->device) + " for a communicator on " +
                                           std::to_string(comm->device));
  }
  const uint64_t eb = static_cast<uint64_t>(TypeBytes(type));
  const uint64_t n = static_cast<uint64_t>(comm->nranks);
  const uint64_t send_bytes = (op == Op::kReduceScatter ? count * n : count) * eb;
  const uint64_t recv_bytes = (op == Op::kAllGather ? count * n : count) * eb;
  Call call;
  call.op = op;
  call.type = type;
  call.red = red;
  call.count = count;
  call.send = static_cast<std::byte*>(ViewOn(comm->device, send, send_bytes));
  call.recv = static_cast<std::byte*>(ViewOn(comm->device, recv, recv_bytes));
  if (count > 0 && (call.send == nullptr || call.recv == nullptr)) {
    return Refuse(ncclInvalidArgument, std::string(name) + ": a buffer is not " +
                                           std::to_string(count) +
                                           "-element device memory of "
                                           "device " +
                                           std::to_string(comm->device));
  }
  call.sequence = ++comm->issued;
  {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->clique->issued[comm->rank] = call.Describe();
  }
  CountCollective();
  Enqueue(s, [comm, call] { Arrive(comm, call); });
  return ncclSuccess;
}

ncclResult_t Init(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking) {
  int injected = 0;
  if (Faulted("ncclCommInitRank", &injected)) return static_cast<ncclResult_t>(injected);
  if (out == nullptr || nranks < 1 || rank < 0 || rank >= nranks) {
    return Refuse(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) + " of " +
                                           std::to_string(nranks));
  }
  *out = nullptr;
  auto comm = std::make_shared<Comm>();
  comm->rank = rank;
  comm->nranks = nranks;
  comm->device = CurrentDevice();
  {
    std::lock_guard<std::mutex> lock(R().mu);
    const std::string key(id.internal, sizeof(id.internal));
    std::shared_ptr<Clique> clique = R().cliques[key].lock();
    if (!clique) {
      clique = std::make_shared<Clique>();
      clique->nranks = nranks;
      clique->members.assign(static_cast<size_t>(nranks), nullptr);
      clique->devices.assign(static_cast<size_t>(nranks), -1);
      clique->issued.assign(static_cast<size_t>(nranks), "");
      R().cliques[key] = clique;
    } else if (clique->nranks != nranks) {
      return Refuse(ncclInvalidArgument, "ncclCommInitRank: nranks " + std::to_string(nranks) +
                                             ", the others said " + std::to_string(clique->nranks));
    }
    comm->clique = clique;
    R().comms.emplace(comm.get(), comm);
  }
  *out = reinterpret_cast<ncclComm_t>(comm.get());
  if (!blocking) {
    comm->async_error = ncclInProgress;
    Comm* raw = comm.get();
    comm->init = std::thread([raw] {
      const ncclResult_t result = Join(*raw);
      std::lock_guard<std::mutex> lock(raw->mu);
      if (raw->async_error.load() == ncclInProgress) raw->async_error = result;
    });
    return ncclInProgress;
  }
  const ncclResult_t result = Join(*comm);
  if (result != ncclSuccess) {
    // A failed blocking init leaves nothing for the caller to free.
    comm->aborted = true;
    std::lock_guard<std::mutex> lock(R().mu);
    R().comms.erase(comm.get());
    *out = nullptr;
  }
  return result;
}

ncclResult_t Remove(ncclComm_t handle, bool abort) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(R().mu);
    auto it = R().comms.find(reinterpret_cast<Comm*>(handle));
    if (it == R().comms.end()) return Refuse(ncclInvalidArgument, "unknown communicator");
    comm = it->second;
    R().comms.erase(it);
  }
  // A rank's stream may be waiting in a collective, and non-blocking init in Join: wake them.
  // (Set under the clique's lock, or a waiter could miss it between its check and its wait.)
  if (abort || comm->init.joinable()) {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    comm->aborted = true;
  }
  comm->clique->cv.notify_all();
  if (comm->init.joinable()) comm->init.join();
  return ncclSuccess;
}

}  // namespace

int LiveCommunicators() {
  std::lock_guard<std::mutex> lock(R().mu);
  return static_cast<int>(R().comms.size());
}

}  // namespace memplan::gpu_emulation::internal

namespace emu = memplan::gpu_emulation::internal;

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = emu::ConfigSnapshot().nccl_version;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  int injected = 0;
  if (emu::Faulted("ncclGetUniqueId", &injected)) return static_cast<ncclResult_t>(injected);
  if (id == nullptr) return ncclInvalidArgument;
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(emu::R().mu);
    n = ++emu::R().next_id;
  }
  std::memset(id->internal, 0, sizeof(id->internal));
  std::snprintf(id->internal, sizeof(id->internal), "memplan-emulated-nccl:%d:%llu",
                static_cast<int>(::getpid()), static_cast<unsigned long long>(n));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return emu::Init(comm, nranks, id, rank, /*blocking=*/true);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  const bool blocking = config == nullptr || config->blocking != 0;
  return emu::Init(comm, nranks, id, rank, blocking);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return emu::FindComm(comm) ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  return emu::Remove(comm, /*abort=*/false);
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  return emu::Remove(comm, /*abort=*/true);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  auto c = emu::FindComm(comm);
  if (!c || error == nullptr) return ncclInvalidArgument;
  *error = static_cast<ncclResult_t>(c->async_error.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  auto c = emu::FindComm(comm);
  if (!c || count == nullptr) return ncclInvalidArgument;
  *count = c->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  auto c = emu::FindComm(comm);
  if (!c || device == nullptr) return ncclInvalidArgument;
  *device = c->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  auto c = emu::FindComm(comm);
  if (!c || rank == nullptr) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  std::string text;
  if (auto c = comm != nullptr ? emu::FindComm(comm) : nullptr) {
    std::lock_guard<std::mutex> lock(c->mu);
    text = c->last_error;
  }
  if (text.empty()) {
    std::lock_guard<std::mutex> lock(emu::Last().mu);
    text = emu::Last().text;
  }
  emu::last_error = text;  // the caller's thread's copy stays valid until its next call
  return emu::last_error.c_str();
}

ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  return emu::Issue("ncclAllGather", emu::Op::kAllGather, send, recv, count, type, ncclSum, comm,
                    stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return emu::Issue("ncclReduceScatter", emu::Op::kReduceScatter, send, recv, count, type, op, comm,
                    stream);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return emu::Issue("ncclAllReduce", emu::Op::kAllReduce, send, recv, count, type, op, comm,
                    stream);
}
