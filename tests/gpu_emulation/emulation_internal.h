// What the emulated NCCL (nccl_emulation.cc) shares with the emulated CUDA runtime
// (cuda_emulation.cc). Not a test API: tests use gpu_emulation.h.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "gpu_emulation.h"

namespace memplan::gpu_emulation::internal {

// One stream: a FIFO of operations run in order by its own worker thread, each after a random
// delay (Note [Stream workers] in cuda_emulation.cc).
struct Stream {
  int device = 0;
  bool blocking = true;  // created without cudaStreamNonBlocking: orders with the legacy stream
  bool legacy = false;   // the device's legacy default stream (handle 0)
  std::mutex mu;
  std::condition_variable cv;               // an operation queued or finished, or stop
  std::deque<std::function<void()>> queue;  // guarded by mu
  uint64_t enqueued = 0;                    // guarded by mu
  uint64_t completed = 0;                   // guarded by mu
  bool stop = false;                        // guarded by mu
  std::mt19937_64 rng;                      // the worker's only
  uint32_t max_delay_us = 0;
  std::thread worker;

  // Blocks until the operations queued so far have run.
  void WaitIdle();
  // Blocks until at least `target` operations have run.
  void WaitReached(uint64_t target);
};

// The stream behind a handle (0 and cudaStreamLegacy: the current device's legacy stream); null
// for a handle the emulation did not create or has destroyed.
std::shared_ptr<Stream> FindStream(cudaStream_t handle);
// Queues `op` on `stream`, after the implicit ordering of the legacy default stream.
void Enqueue(const std::shared_ptr<Stream>& stream, std::function<void()> op);

// The emulator's read-write view of [ptr, ptr + bytes) when that is allocated memory of `device`
// (any device for -1); null otherwise.
void* ViewOn(int device, const void* ptr, uint64_t bytes);

int CurrentDevice();  // the calling thread's
Config ConfigSnapshot();
// Counts the call of `function`; true when an armed fault fires, with its error in *error.
bool Faulted(const char* function, int* error);
void CountCollective();

// Communicators alive (nccl_emulation.cc), for Reset's idleness check.
int LiveCommunicators();

}  // namespace memplan::gpu_emulation::internal
