// The emulated CUDA runtime: the subset of libcudart that memplan calls, compiled against the real
// cuda_runtime_api.h (so every signature is checked by the compiler) and linked in its place in a
// -DMEMPLAN_GPU_EMULATION=ON build. README.md says what it models and what it does not.
//
// Note [Device memory]: each device is a memfd of Config::device_bytes, mapped twice. The pointers
// cudaMalloc hands out lie in a PROT_NONE mapping, so host code that dereferences device memory
// faults as it would on a GPU; the stream workers read and write through a second, read-write
// mapping of the same file at the same offset. The file is sparse: only what is written costs
// memory, and freed ranges are punched out again. Allocation is first fit in 256-byte units over
// the device's free ranges, capped at the device size (cudaErrorMemoryAllocation beyond it).
//
// Note [Stream workers]: a stream is a FIFO run by its own thread, which sleeps a random 0 ..
// max_delay_us (from a generator seeded by Config::seed and the stream's number) before each
// operation, so two streams' work interleaves differently from run to run of a seed, and work that
// nothing orders really does finish late. Events carry a generation: cudaEventRecord queues "mark
// generation g done", cudaStreamWaitEvent queues "wait until the event's generation at the time of
// the call is done", as CUDA specifies. The legacy default stream (handle 0) waits for the work
// queued before on every blocking stream of its device, and blocking streams wait for it;
// non-blocking streams (cudaStreamNonBlocking, all of memplan's) order with nothing.
//
// Note [Copies]: cudaMemcpyAsync checks its pointers: device pointers must lie inside one
// allocation of the stream's device (a cross-device pointer is an error here, where CUDA might
// copy through peer access or staging, so that "fetched from another GPU" is visible), and the
// pointers must match the kind. From registered (pinned) host memory a copy is queued and reads or
// writes the host buffer when it runs. From pageable memory, as CUDA documents: host to device
// waits for the stream to drain and stages the source before returning (the device write stays
// asynchronous); device to pageable host is fully synchronous.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "emulation_internal.h"
#include "gpu_emulation.h"

namespace memplan::gpu_emulation {
namespace internal {
namespace {

constexpr uint64_t kAlignment = 256;
constexpr uint64_t kPage = 4096;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "gpu emulation: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

struct Event {
  unsigned flags = 0;
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // guarded by mu: generations recorded
  uint64_t completed = 0;  // guarded by mu: the highest generation whose record op has run
};

struct Device {
  int memfd = -1;
  std::byte* user = nullptr;  // PROT_NONE: what cudaMalloc hands out
  std::byte* rw = nullptr;    // read-write: what the workers use
  uint64_t capacity = 0;
  std::map<uint64_t, uint64_t> used;  // offset -> bytes (rounded)
  std::map<uint64_t, uint64_t> free;  // offset -> bytes, coalesced
  std::shared_ptr<Stream> legacy;
};

struct Fault {
  uint64_t remaining;  // calls to go; fires at 0
  int error;
};

struct State {
  std::mutex mu;
  Config config;
  bool configured = false;
  Device devices[kMaxDevices];
  std::map<Stream*, std::shared_ptr<Stream>> streams;  // user-created
  // Destroyed streams whose queued work may still be running (Note [Destroyed streams]).
  std::vector<std::shared_ptr<Stream>> retired;
  std::map<Event*, std::shared_ptr<Event>> events;
  std::map<uintptr_t, uint64_t> registered;  // exact start -> bytes
  Counters counters;
  std::unordered_map<std::string, std::vector<Fault>> faults;
  uint64_t next_stream_id = 0;
};

// Never destroyed: runtimes and pools may be torn down during static destruction.
State& S() {
  static State* const state = new State();
  return *state;
}

// Caller holds S().mu.
void CreateContext(int device) { S().counters.context_created[device] = true; }

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;

uint64_t EnvNumber(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strtoull(value, nullptr, 0);
}

// Caller holds S().mu.
void EnsureConfiguredLocked() {
  State& s = S();
  if (s.configured) return;
  Config c;
  c.devices = static_cast<int>(EnvNumber("MEMPLAN_GPU_EMULATION_DEVICES", 2));
  c.device_bytes = EnvNumber("MEMPLAN_GPU_EMULATION_DEVICE_BYTES", c.device_bytes);
  c.seed = EnvNumber("MEMPLAN_GPU_EMULATION_SEED", c.seed);
  c.max_delay_us =
      static_cast<uint32_t>(EnvNumber("MEMPLAN_GPU_EMULATION_MAX_DELAY_US", c.max_delay_us));
  if (c.devices < 1 || c.devices > kMaxDevices) Die("MEMPLAN_GPU_EMULATION_DEVICES out of 1..8");
  s.config = c;
  s.configured = true;
}

// Maps device `d`'s memory on first use. Caller holds S().mu.
Device& DeviceLocked(int d) {
  State& s = S();
  Device& dev = s.devices[d];
  if (dev.memfd >= 0) return dev;
  const uint64_t bytes = (s.config.device_bytes + kPage - 1) / kPage * kPage;
  const std::string name = "memplan-emulated-gpu" + std::to_string(d);
  dev.memfd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (dev.memfd < 0 || ::ftruncate(dev.memfd, static_cast<off_t>(bytes)) != 0) {
    Die("cannot create the device memory file of " + std::to_string(bytes) + " bytes");
  }
  void* user = ::mmap(nullptr, bytes, PROT_NONE, MAP_SHARED | MAP_NORESERVE, dev.memfd, 0);
  void* rw =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, dev.memfd, 0);
  if (user == MAP_FAILED || rw == MAP_FAILED) Die("cannot map the device memory");
  dev.user = static_cast<std::byte*>(user);
  dev.rw = static_cast<std::byte*>(rw);
  dev.capacity = bytes;
  dev.free.clear();
  dev.free.emplace(0, bytes);
  return dev;
}

void UnmapLocked(Device& dev) {
  if (dev.memfd < 0) return;
  ::munmap(dev.user, dev.capacity);
  ::munmap(dev.rw, dev.capacity);
  ::close(dev.memfd);
  dev = Device();
}

cudaError_t Fail(cudaError_t error) {
  last_error = error;
  return error;
}

// A misuse CUDA would also refuse: said on stderr, since the error code alone rarely tells a test
// author what went wrong.
cudaError_t Misuse(cudaError_t error, const std::string& what) {
  std::fprintf(stderr, "gpu emulation: %s\n", what.c_str());
  return Fail(error);
}

#define EMU_ENTER(name)                                                           \
  do {                                                                            \
    int memplan_emu_error_ = 0;                                                   \
    if (::memplan::gpu_emulation::internal::Faulted(name, &memplan_emu_error_)) { \
      return Fail(static_cast<cudaError_t>(memplan_emu_error_));                  \
    }                                                                             \
  } while (0)

// Where a pointer lies.
struct Place {
  enum Kind { kHostPageable, kHostRegistered, kDevice, kDeviceOutOfBounds } kind = kHostPageable;
  int device = -1;
  std::byte* view = nullptr;  // device: the read-write view; host: the pointer itself
};

// Caller holds S().mu.
Place LocateLocked(const void* ptr, uint64_t bytes) {
  State& s = S();
  const auto* p = static_cast<const std::byte*>(ptr);
  for (int d = 0; d < kMaxDevices; ++d) {
    Device& dev = s.devices[d];
    if (dev.memfd < 0 || p < dev.user || p >= dev.user + dev.capacity) continue;
    Place place;
    place.device = d;
    const uint64_t offset = static_cast<uint64_t>(p - dev.user);
    auto it = dev.used.upper_bound(offset);
    if (it == dev.used.begin()) {
      place.kind = Place::kDeviceOutOfBounds;
      return place;
    }
    --it;
    if (offset + bytes > it->first + it->second || bytes > it->second) {
      place.kind = Place::kDeviceOutOfBounds;
      return place;
    }
    place.kind = Place::kDevice;
    place.view = dev.rw + offset;
    return place;
  }
  Place place;
  place.view = const_cast<std::byte*>(p);
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  auto it = s.registered.upper_bound(begin);
  if (it != s.registered.begin()) {
    --it;
    if (begin + bytes <= it->first + it->second) place.kind = Place::kHostRegistered;
  }
  return place;
}

// Caller holds S().mu.
void CountAllocationLocked(int d, int64_t delta) {
  Counters& c = S().counters;
  c.device_bytes_in_use[d] =
      static_cast<uint64_t>(static_cast<int64_t>(c.device_bytes_in_use[d]) + delta);
  c.peak_device_bytes[d] = std::max(c.peak_device_bytes[d], c.device_bytes_in_use[d]);
}

std::shared_ptr<Stream> StartStream(int device, bool blocking, bool legacy) {
  State& s = S();
  auto stream = std::make_shared<Stream>();
  stream->device = device;
  stream->blocking = blocking;
  stream->legacy = legacy;
  const uint64_t id = ++s.next_stream_id;
  stream->rng.seed(s.config.seed * 0x9e3779b97f4a7c15ull + id);
  stream->max_delay_us = s.config.max_delay_us;
  Stream* raw = stream.get();
  // The worker holds its stream, so that a destroyed stream's worker can finish its queue after
  // cudaStreamDestroy let go of it (Note [Destroyed streams]).
  stream->worker = std::thread([raw, keep = stream] {
    (void)keep;
    std::unique_lock<std::mutex> lock(raw->mu);
    for (;;) {
      raw->cv.wait(lock, [raw] { return raw->stop || !raw->queue.empty(); });
      if (raw->queue.empty()) return;  // stopped and drained
      std::function<void()> op = std::move(raw->queue.front());
      raw->queue.pop_front();
      lock.unlock();
      if (raw->max_delay_us > 0) {
        const uint64_t delay = raw->rng() % (uint64_t{raw->max_delay_us} + 1);
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      }
      op();
      lock.lock();
      ++raw->completed;
      raw->cv.notify_all();
    }
  });
  return stream;
}

void StopStream(const std::shared_ptr<Stream>& stream) {
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    stream->stop = true;
  }
  stream->cv.notify_all();
  if (stream->worker.joinable()) stream->worker.join();
}

// Caller holds S().mu.
std::shared_ptr<Stream> LegacyLocked(int d) {
  Device& dev = DeviceLocked(d);
  if (!dev.legacy) dev.legacy = StartStream(d, /*blocking=*/true, /*legacy=*/true);
  return dev.legacy;
}

// Streams of device `d`, the legacy one included. Caller holds S().mu.
std::vector<std::shared_ptr<Stream>> StreamsOfLocked(int d) {
  std::vector<std::shared_ptr<Stream>> out;
  for (auto& [raw, stream] : S().streams) {
    if (stream->device == d) out.push_back(stream);
  }
  if (S().devices[d].legacy) out.push_back(S().devices[d].legacy);
  return out;
}

std::shared_ptr<Event> FindEvent(cudaEvent_t handle) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(reinterpret_cast<Event*>(handle));
  return it == s.events.end() ? nullptr : it->second;
}

void SyncDevice(int d) {
  std::vector<std::shared_ptr<Stream>> streams;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    streams = StreamsOfLocked(d);
    for (auto& stream : S().retired) {
      if (stream->device == d) streams.push_back(stream);
    }
    ++S().counters.device_syncs;
  }
  for (auto& stream : streams) stream->WaitIdle();
}

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
};

const ErrorText& TextOf(cudaError_t error) {
  static constexpr ErrorText kUnknown{cudaErrorUnknown, "cudaErrorUnknown", "unknown error"};
  for (const ErrorText& e : kErrors) {
    if (e.error == error) return e;
  }
  return kUnknown;
}

// cuDevicePrimaryCtxGetState, as cudaGetDriverEntryPointByVersion hands it out.
int PrimaryCtxGetState(int device, unsigned int* flags, int* active) {
  if (device < 0 || device >= kMaxDevices || flags == nullptr || active == nullptr) return 1;
  std::lock_guard<std::mutex> lock(S().mu);
  *flags = 0;
  *active = S().counters.context_created[device] ? 1 : 0;
  return 0;
}

bool ValidDevice(int device) {
  std::lock_guard<std::mutex> lock(S().mu);
  EnsureConfiguredLocked();
  return device >= 0 && device < S().config.devices;
}

}  // namespace

void Stream::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu);
  const uint64_t target = enqueued;
  cv.wait(lock, [&] { return completed >= target; });
}

void Stream::WaitReached(uint64_t target) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return completed >= target; });
}

std::shared_ptr<Stream> FindStream(cudaStream_t handle) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  EnsureConfiguredLocked();
  // cudaStreamPerThread is served by the legacy stream: stricter ordering, never looser.
  if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    CreateContext(current_device);
    return LegacyLocked(current_device);
  }
  auto it = s.streams.find(reinterpret_cast<Stream*>(handle));
  return it == s.streams.end() ? nullptr : it->second;
}

void Enqueue(const std::shared_ptr<Stream>& stream, std::function<void()> op) {
  // The legacy stream's implicit ordering (Note [Stream workers]): what to wait for is fixed now,
  // at enqueue time, as CUDA fixes it at launch.
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> before;
  if (stream->legacy || stream->blocking) {
    std::lock_guard<std::mutex> lock(S().mu);
    for (auto& other : StreamsOfLocked(stream->device)) {
      if (other == stream || !other->blocking) continue;
      if (!stream->legacy && !other->legacy) continue;  // blocking streams wait for legacy only
      std::lock_guard<std::mutex> other_lock(other->mu);
      if (other->completed < other->enqueued) before.emplace_back(other, other->enqueued);
    }
  }
  std::lock_guard<std::mutex> lock(stream->mu);
  if (!before.empty()) {
    ++stream->enqueued;
    stream->queue.push_back([before = std::move(before)] {
      for (const auto& [other, target] : before) other->WaitReached(target);
    });
  }
  ++stream->enqueued;
  stream->queue.push_back(std::move(op));
  stream->cv.notify_all();
}

void* ViewOn(int device, const void* ptr, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(S().mu);
  Place place = LocateLocked(ptr, bytes);
  if (place.kind != Place::kDevice) return nullptr;
  if (device >= 0 && place.device != device) return nullptr;
  return place.view;
}

int CurrentDevice() { return current_device; }

Config ConfigSnapshot() {
  std::lock_guard<std::mutex> lock(S().mu);
  EnsureConfiguredLocked();
  return S().config;
}

bool Faulted(const char* function, int* error) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  EnsureConfiguredLocked();
  auto it = s.faults.find(function);
  if (it == s.faults.end()) return false;
  bool fired = false;
  for (auto f = it->second.begin(); f != it->second.end();) {
    if (--f->remaining == 0) {
      if (!fired) *error = f->error;
      fired = true;
      f = it->second.erase(f);
    } else {
      ++f;
    }
  }
  return fired;
}

void CountCollective() {
  std::lock_guard<std::mutex> lock(S().mu);
  ++S().counters.collectives;
}

}  // namespace internal

// ---- Test controls (gpu_emulation.h) -----------------------------------------------------------

using internal::S;

void Reset(const Config& config) {
  if (config.devices < 1 || config.devices > kMaxDevices) {
    internal::Die("Reset: devices must be 1.." + std::to_string(kMaxDevices));
  }
  std::vector<std::shared_ptr<internal::Stream>> legacy;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    internal::State& s = S();
    internal::EnsureConfiguredLocked();
    std::string busy;
    for (int d = 0; d < kMaxDevices; ++d) {
      if (!s.devices[d].used.empty()) {
        busy += " device " + std::to_string(d) + " has " +
                std::to_string(s.devices[d].used.size()) + " allocations;";
      }
    }
    if (!s.streams.empty()) busy += " " + std::to_string(s.streams.size()) + " streams;";
    if (!s.events.empty()) busy += " " + std::to_string(s.events.size()) + " events;";
    if (!s.registered.empty()) {
      busy += " " + std::to_string(s.registered.size()) + " host registrations;";
    }
    if (!busy.empty()) internal::Die("Reset while in use:" + busy);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (s.devices[d].legacy) legacy.push_back(s.devices[d].legacy);
      s.devices[d].legacy.reset();
    }
  }
  if (internal::LiveCommunicators() > 0) internal::Die("Reset while communicators are alive");
  for (auto& stream : legacy) internal::StopStream(stream);
  std::vector<std::shared_ptr<internal::Stream>> retired;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    retired.swap(S().retired);
  }
  for (auto& stream : retired) stream->WaitIdle();  // before their memory is unmapped
  std::lock_guard<std::mutex> lock(S().mu);
  internal::State& s = S();
  for (auto& dev : s.devices) internal::UnmapLocked(dev);
  s.config = config;
  s.configured = true;
  s.counters = Counters();
  internal::current_device = 0;  // the calling thread's, without creating a context
  s.faults.clear();
  s.next_stream_id = 0;
}

Config CurrentConfig() { return internal::ConfigSnapshot(); }

Counters GetCounters() {
  std::lock_guard<std::mutex> lock(S().mu);
  return S().counters;
}

void ResetCounters() {
  std::lock_guard<std::mutex> lock(S().mu);
  Counters& c = S().counters;
  Counters fresh;
  for (int d = 0; d < kMaxDevices; ++d) {
    fresh.device_bytes_in_use[d] = c.device_bytes_in_use[d];
    fresh.peak_device_bytes[d] = c.device_bytes_in_use[d];
    fresh.context_created[d] = c.context_created[d];
  }
  c = fresh;
}

void FailNthCall(const std::string& function, uint64_t nth, int error) {
  std::lock_guard<std::mutex> lock(S().mu);
  internal::EnsureConfiguredLocked();
  if (nth == 0) internal::Die("FailNthCall: nth counts from 1");
  S().faults[function].push_back({nth, error});
}

void ClearFaults() {
  std::lock_guard<std::mutex> lock(S().mu);
  S().faults.clear();
}

void LaunchKernel(cudaStream_t stream, std::function<void()> body) {
  auto s = internal::FindStream(stream);
  if (!s) internal::Die("LaunchKernel on a stream the emulation does not know");
  {
    std::lock_guard<std::mutex> lock(S().mu);
    ++S().counters.kernels;
  }
  internal::Enqueue(s, std::move(body));
}

void* DeviceView(const void* ptr, uint64_t bytes) {
  void* view = internal::ViewOn(-1, ptr, bytes);
  if (view == nullptr) {
    char text[128];
    std::snprintf(text, sizeof(text), "DeviceView(%p, %llu): not allocated device memory", ptr,
                  static_cast<unsigned long long>(bytes));
    internal::Die(text);
  }
  return view;
}

int DeviceOf(const void* ptr) {
  std::lock_guard<std::mutex> lock(S().mu);
  internal::Place place = internal::LocateLocked(ptr, 1);
  return place.kind == internal::Place::kDevice || place.kind == internal::Place::kDeviceOutOfBounds
             ? place.device
             : -1;
}

void KernelRead(cudaStream_t stream, const void* src, uint64_t bytes,
                std::shared_ptr<std::vector<std::byte>> out) {
  LaunchKernel(stream, [src, bytes, out] {
    const auto* view = static_cast<const std::byte*>(DeviceView(src, bytes));
    out->assign(view, view + bytes);
  });
}

void KernelWrite(cudaStream_t stream, void* dst, std::vector<std::byte> data) {
  LaunchKernel(stream, [dst, data = std::move(data)] {
    std::memcpy(DeviceView(dst, data.size()), data.data(), data.size());
  });
}

// ---- CachingAllocator
// ----------------------------------------------------------------------------

CachingAllocator::CachingAllocator(int device) : device_(device) {}

CachingAllocator::~CachingAllocator() {
  for (auto& [ptr, block] : blocks_) {
    for (cudaEvent_t e : block.pending) {
      (void)cudaEventSynchronize(e);
      (void)cudaEventDestroy(e);
    }
    int previous = 0;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    (void)cudaFree(ptr);
    (void)cudaSetDevice(previous);
  }
}

void* CachingAllocator::TakeCached(uint64_t bytes, cudaStream_t stream) {
  for (auto& [ptr, block] : blocks_) {
    if (block.in_use || block.bytes != bytes || block.stream != stream) continue;
    bool idle = true;
    for (cudaEvent_t e : block.pending) idle = idle && cudaEventQuery(e) == cudaSuccess;
    (void)cudaGetLastError();
    if (!idle) continue;
    for (cudaEvent_t e : block.pending) (void)cudaEventDestroy(e);
    block.pending.clear();
    block.in_use = true;
    return ptr;
  }
  return nullptr;
}

void CachingAllocator::EmptyCache() {
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    Block& block = it->second;
    if (block.in_use) {
      ++it;
      continue;
    }
    for (cudaEvent_t e : block.pending) {
      (void)cudaEventSynchronize(e);
      (void)cudaEventDestroy(e);
    }
    (void)cudaFree(it->first);
    reserved_ -= block.bytes;
    it = blocks_.erase(it);
  }
}

void* CachingAllocator::Allocate(uint64_t bytes, cudaStream_t stream) {
  int previous = 0;
  (void)cudaGetDevice(&previous);
  (void)cudaSetDevice(device_);
  bytes = (bytes + 511) / 512 * 512;
  void* ptr = TakeCached(bytes, stream);
  if (ptr == nullptr) {
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      EmptyCache();
      if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        (void)cudaSetDevice(previous);
        return nullptr;
      }
    }
    blocks_[ptr] = Block{bytes, stream, {}, {}, true};
    reserved_ += bytes;
  }
  (void)cudaSetDevice(previous);
  allocated_ += bytes;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  return ptr;
}

void CachingAllocator::RecordStream(void* ptr, cudaStream_t stream) {
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.in_use) internal::Die("RecordStream of a free block");
  if (stream != it->second.stream) it->second.recorded.push_back(stream);
}

void CachingAllocator::Free(void* ptr) {
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.in_use) internal::Die("CachingAllocator: double free");
  Block& block = it->second;
  for (cudaStream_t s : block.recorded) {
    cudaEvent_t e = nullptr;
    (void)cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    (void)cudaEventRecord(e, s);
    block.pending.push_back(e);
  }
  block.recorded.clear();
  block.in_use = false;
  allocated_ -= block.bytes;
}

}  // namespace memplan::gpu_emulation

// ---- The CUDA runtime API ----------------------------------------------------------------------

using memplan::gpu_emulation::kMaxDevices;
using memplan::gpu_emulation::internal::Fail;
using memplan::gpu_emulation::internal::Misuse;
using memplan::gpu_emulation::internal::S;
namespace emu = memplan::gpu_emulation::internal;

cudaError_t cudaGetDeviceCount(int* count) {
  EMU_ENTER("cudaGetDeviceCount");
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = emu::ConfigSnapshot().devices;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  EMU_ENTER("cudaSetDevice");
  if (!emu::ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  emu::current_device = device;
  std::lock_guard<std::mutex> lock(S().mu);
  emu::CreateContext(device);  // CUDA 12+: cudaSetDevice creates the primary context
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  EMU_ENTER("cudaGetDevice");
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = emu::current_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  EMU_ENTER("cudaGetDeviceProperties");
  if (prop == nullptr) return Fail(cudaErrorInvalidValue);
  if (!emu::ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "memplan emulated GPU %d", device);
  prop->totalGlobalMem = emu::ConfigSnapshot().device_bytes;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->unifiedAddressing = 1;
  prop->asyncEngineCount = 2;
  prop->pciDeviceID = device;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  EMU_ENTER("cudaMemGetInfo");
  if (free_bytes == nullptr || total_bytes == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(S().mu);
  const int d = emu::current_device;
  emu::CreateContext(d);
  emu::Device& dev = emu::DeviceLocked(d);
  *total_bytes = dev.capacity;
  *free_bytes = dev.capacity - S().counters.device_bytes_in_use[d];
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  EMU_ENTER("cudaDeviceSynchronize");
  emu::SyncDevice(emu::current_device);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  EMU_ENTER("cudaMalloc");
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(S().mu);
  const int d = emu::current_device;
  emu::CreateContext(d);
  emu::Device& dev = emu::DeviceLocked(d);
  ++S().counters.mallocs;
  const uint64_t rounded = (bytes + emu::kAlignment - 1) / emu::kAlignment * emu::kAlignment;
  for (auto it = dev.free.begin(); it != dev.free.end(); ++it) {
    if (it->second < rounded) continue;
    const uint64_t offset = it->first;
    const uint64_t left = it->second - rounded;
    dev.free.erase(it);
    if (left > 0) dev.free.emplace(offset + rounded, left);
    dev.used.emplace(offset, rounded);
    emu::CountAllocationLocked(d, static_cast<int64_t>(rounded));
    // cudaMalloc does not clear memory: give small blocks a recognisable garbage pattern, so that
    // reading what was never written shows (large ones stay as the sparse file has them).
    if (rounded <= (uint64_t{16} << 20)) std::memset(dev.rw + offset, 0xcb, rounded);
    *ptr = dev.user + offset;
    return cudaSuccess;
  }
  ++S().counters.failed_mallocs;
  return Fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* ptr) {
  EMU_ENTER("cudaFree");
  if (ptr == nullptr) {
    std::lock_guard<std::mutex> lock(S().mu);
    emu::EnsureConfiguredLocked();
    emu::CreateContext(emu::current_device);
    return cudaSuccess;
  }
  int d = -1;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    emu::Place place = emu::LocateLocked(ptr, 1);
    if (place.kind == emu::Place::kDevice &&
        S().devices[place.device].used.count(static_cast<uint64_t>(
            static_cast<std::byte*>(ptr) - S().devices[place.device].user)) != 0) {
      d = place.device;
    }
  }
  if (d < 0)
    return Misuse(cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc did not return");
  emu::SyncDevice(d);  // cudaFree waits for the device, as CUDA's does
  std::lock_guard<std::mutex> lock(S().mu);
  emu::Device& dev = S().devices[d];
  const uint64_t offset = static_cast<uint64_t>(static_cast<std::byte*>(ptr) - dev.user);
  auto it = dev.used.find(offset);
  if (it == dev.used.end()) return Fail(cudaErrorInvalidValue);  // freed meanwhile
  uint64_t begin = offset, bytes = it->second;
  dev.used.erase(it);
  ++S().counters.frees;
  emu::CountAllocationLocked(d, -static_cast<int64_t>(bytes));
  if (bytes >= (uint64_t{1} << 20)) {
    (void)::fallocate(dev.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(begin), static_cast<off_t>(bytes));
  }
  // Coalesce with the free neighbours.
  auto next = dev.free.lower_bound(begin);
  if (next != dev.free.end() && next->first == begin + bytes) {
    bytes += next->second;
    next = dev.free.erase(next);
  }
  if (next != dev.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      bytes += prev->second;
      dev.free.erase(prev);
    }
  }
  dev.free.emplace(begin, bytes);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int /*flags*/) {
  EMU_ENTER("cudaHostRegister");
  if (ptr == nullptr || bytes == 0) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(S().mu);
  emu::EnsureConfiguredLocked();
  emu::Place place = emu::LocateLocked(ptr, bytes);
  if (place.kind == emu::Place::kDevice || place.kind == emu::Place::kDeviceOutOfBounds) {
    return Misuse(cudaErrorInvalidValue, "cudaHostRegister of device memory");
  }
  // CUDA pins whole pages: a range sharing a page with a registered one is refused.
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t page_begin = begin / emu::kPage * emu::kPage;
  const uintptr_t page_end = (begin + bytes + emu::kPage - 1) / emu::kPage * emu::kPage;
  for (const auto& [start, length] : S().registered) {
    const uintptr_t b = start / emu::kPage * emu::kPage;
    const uintptr_t e = (start + length + emu::kPage - 1) / emu::kPage * emu::kPage;
    if (b < page_end && page_begin < e) return Fail(cudaErrorHostMemoryAlreadyRegistered);
  }
  S().registered.emplace(begin, bytes);
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  EMU_ENTER("cudaHostUnregister");
  std::lock_guard<std::mutex> lock(S().mu);
  if (S().registered.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
    return Fail(cudaErrorHostMemoryNotRegistered);
  }
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  EMU_ENTER("cudaPointerGetAttributes");
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(S().mu);
  emu::Place place = emu::LocateLocked(ptr, 1);
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->device = place.device < 0 ? emu::current_device : place.device;
  switch (place.kind) {
    case emu::Place::kDevice:
    case emu::Place::kDeviceOutOfBounds:
      attributes->type = cudaMemoryTypeDevice;
      attributes->devicePointer = const_cast<void*>(ptr);
      break;
    case emu::Place::kHostRegistered:
      attributes->type = cudaMemoryTypeHost;
      attributes->hostPointer = const_cast<void*>(ptr);
      attributes->devicePointer = const_cast<void*>(ptr);
      break;
    case emu::Place::kHostPageable:
      attributes->type = cudaMemoryTypeUnregistered;
      attributes->hostPointer = const_cast<void*>(ptr);
      break;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  EMU_ENTER("cudaStreamCreateWithFlags");
  if (stream == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(S().mu);
  emu::EnsureConfiguredLocked();
  const int d = emu::current_device;
  emu::CreateContext(d);
  (void)emu::DeviceLocked(d);
  auto s = emu::StartStream(d, (flags & cudaStreamNonBlocking) == 0, /*legacy=*/false);
  S().streams.emplace(s.get(), s);
  *stream = reinterpret_cast<cudaStream_t>(s.get());
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  EMU_ENTER("cudaStreamDestroy");
  std::shared_ptr<emu::Stream> s;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    auto it = S().streams.find(reinterpret_cast<emu::Stream*>(stream));
    if (it == S().streams.end()) {
      return Misuse(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of an unknown stream");
    }
    s = it->second;
    S().streams.erase(it);
    S().retired.push_back(s);
  }
  // Note [Destroyed streams]: as with CUDA, the call returns at once and the work queued still
  // runs; cudaDeviceSynchronize and cudaFree wait for it, and Reset. The worker, which holds the
  // stream, stops once the queue is empty.
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stop = true;
  }
  s->cv.notify_all();
  s->worker.detach();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  EMU_ENTER("cudaStreamSynchronize");
  auto s = emu::FindStream(stream);
  if (!s) return Misuse(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: unknown stream");
  {
    std::lock_guard<std::mutex> lock(S().mu);
    ++S().counters.stream_syncs;
  }
  s->WaitIdle();
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  EMU_ENTER("cudaStreamQuery");
  auto s = emu::FindStream(stream);
  if (!s) return Misuse(cudaErrorInvalidResourceHandle, "cudaStreamQuery: unknown stream");
  std::lock_guard<std::mutex> lock(s->mu);
  return s->completed >= s->enqueued ? cudaSuccess : Fail(cudaErrorNotReady);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  EMU_ENTER("cudaStreamWaitEvent");
  auto s = emu::FindStream(stream);
  auto e = emu::FindEvent(event);
  if (!s || !e)
    return Misuse(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown handle");
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    generation = e->recorded;
  }
  if (generation == 0) return cudaSuccess;  // never recorded: nothing to wait for
  {
    std::lock_guard<std::mutex> lock(S().mu);
    ++S().counters.stream_wait_events;
  }
  emu::Enqueue(s, [e, generation] {
    std::unique_lock<std::mutex> lock(e->mu);
    e->cv.wait(lock, [&] { return e->completed >= generation; });
  });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  EMU_ENTER("cudaEventCreateWithFlags");
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  auto e = std::make_shared<emu::Event>();
  e->flags = flags;
  e->device = emu::current_device;
  std::lock_guard<std::mutex> lock(S().mu);
  emu::EnsureConfiguredLocked();
  emu::CreateContext(e->device);
  S().events.emplace(e.get(), e);
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  EMU_ENTER("cudaEventDestroy");
  std::lock_guard<std::mutex> lock(S().mu);
  // Queued records and waits hold their own reference: destroying is safe while they run.
  if (S().events.erase(reinterpret_cast<emu::Event*>(event)) == 0) {
    return Misuse(cudaErrorInvalidResourceHandle, "cudaEventDestroy of an unknown event");
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  EMU_ENTER("cudaEventRecord");
  auto s = emu::FindStream(stream);
  auto e = emu::FindEvent(event);
  if (!s || !e) return Misuse(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown handle");
  if (s->device != e->device) {
    return Misuse(cudaErrorInvalidResourceHandle,
                  "cudaEventRecord: event of device " + std::to_string(e->device) +
                      " recorded on a stream of device " + std::to_string(s->device));
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    generation = ++e->recorded;
  }
  {
    std::lock_guard<std::mutex> lock(S().mu);
    ++S().counters.event_records;
  }
  emu::Enqueue(s, [e, generation] {
    std::lock_guard<std::mutex> lock(e->mu);
    e->completed = std::max(e->completed, generation);
    e->cv.notify_all();
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  EMU_ENTER("cudaEventQuery");
  auto e = emu::FindEvent(event);
  if (!e) return Misuse(cudaErrorInvalidResourceHandle, "cudaEventQuery: unknown event");
  std::lock_guard<std::mutex> lock(e->mu);
  return e->completed >= e->recorded ? cudaSuccess : Fail(cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  EMU_ENTER("cudaEventSynchronize");
  auto e = emu::FindEvent(event);
  if (!e) return Misuse(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: unknown event");
  {
    std::lock_guard<std::mutex> lock(S().mu);
    ++S().counters.event_syncs;
    if ((e->flags & cudaEventBlockingSync) == 0) ++S().counters.spin_waits;
  }
  std::unique_lock<std::mutex> lock(e->mu);
  const uint64_t target = e->recorded;
  e->cv.wait(lock, [&] { return e->completed >= target; });
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  EMU_ENTER("cudaMemcpyAsync");
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  auto s = emu::FindStream(stream);
  if (!s) return Misuse(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: unknown stream");
  emu::Place to, from;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    to = emu::LocateLocked(dst, bytes);
    from = emu::LocateLocked(src, bytes);
  }
  const bool dst_device = to.kind == emu::Place::kDevice;
  const bool src_device = from.kind == emu::Place::kDevice;
  if (to.kind == emu::Place::kDeviceOutOfBounds || from.kind == emu::Place::kDeviceOutOfBounds) {
    return Misuse(cudaErrorInvalidValue, "cudaMemcpyAsync of " + std::to_string(bytes) +
                                             " bytes runs past a device allocation");
  }
  bool kind_ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice: kind_ok = dst_device && !src_device; break;
    case cudaMemcpyDeviceToHost: kind_ok = !dst_device && src_device; break;
    case cudaMemcpyDeviceToDevice: kind_ok = dst_device && src_device; break;
    case cudaMemcpyHostToHost: kind_ok = !dst_device && !src_device; break;
    case cudaMemcpyDefault: break;
    default: return Fail(cudaErrorInvalidMemcpyDirection);
  }
  if (!kind_ok) {
    return Misuse(cudaErrorInvalidValue,
                  std::string("cudaMemcpyAsync: the pointers do not match the kind (dst is ") +
                      (dst_device ? "device" : "host") + ", src is " +
                      (src_device ? "device" : "host") + " memory)");
  }
  for (const emu::Place* p : {&to, &from}) {
    if (p->kind == emu::Place::kDevice && p->device != s->device) {
      return Misuse(cudaErrorInvalidValue,
                    "cudaMemcpyAsync: memory of device " + std::to_string(p->device) +
                        " on a stream of device " + std::to_string(s->device));
    }
  }
  std::byte* d = to.view;
  const std::byte* f = from.view;
  const bool pageable_src = from.kind == emu::Place::kHostPageable;
  const bool pageable_dst = to.kind == emu::Place::kHostPageable;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    memplan::gpu_emulation::Counters& c = S().counters;
    if (dst_device && src_device) c.d2d_bytes += bytes;
    if (dst_device && !src_device)
      (pageable_src ? c.h2d_pageable_bytes : c.h2d_pinned_bytes) += bytes;
    if (!dst_device && src_device)
      (pageable_dst ? c.d2h_pageable_bytes : c.d2h_pinned_bytes) += bytes;
    if ((dst_device && pageable_src) || (src_device && pageable_dst)) ++c.pageable_copies;
  }
  if (src_device && pageable_dst) {
    // Device to pageable memory: synchronous, after the stream's earlier work.
    s->WaitIdle();
    std::memcpy(d, f, bytes);
    return cudaSuccess;
  }
  if (dst_device && pageable_src) {
    // Staged: the source is read now, after the stream drained; the device write comes later.
    s->WaitIdle();
    auto staging = std::make_shared<std::vector<std::byte>>(f, f + bytes);
    emu::Enqueue(s, [d, staging] { std::memcpy(d, staging->data(), staging->size()); });
    return cudaSuccess;
  }
  emu::Enqueue(s, [d, f, bytes] { std::memmove(d, f, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  EMU_ENTER("cudaMemsetAsync");
  if (bytes == 0) return cudaSuccess;
  auto s = emu::FindStream(stream);
  if (!s) return Misuse(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: unknown stream");
  void* view = emu::ViewOn(s->device, ptr, bytes);
  if (view == nullptr) {
    return Misuse(cudaErrorInvalidValue,
                  "cudaMemsetAsync: not device memory of the stream's device");
  }
  emu::Enqueue(s, [view, value, bytes] { std::memset(view, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t error = emu::last_error;
  emu::last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return emu::last_error; }

const char* cudaGetErrorName(cudaError_t error) { return emu::TextOf(error).name; }
const char* cudaGetErrorString(cudaError_t error) { return emu::TextOf(error).text; }

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function,
                                             unsigned int /*version*/, unsigned long long /*flags*/,
                                             cudaDriverEntryPointQueryResult* status) {
  EMU_ENTER("cudaGetDriverEntryPointByVersion");
  if (symbol == nullptr || function == nullptr) return Fail(cudaErrorInvalidValue);
  *function = nullptr;
  if (std::strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0) {
    *function = reinterpret_cast<void*>(&emu::PrimaryCtxGetState);
  }
  if (status != nullptr) {
    *status =
        *function != nullptr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  }
  return cudaSuccess;
}
