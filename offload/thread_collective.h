// A Collective for N ranks that are N threads of one process, over host memory: what lets the
// engine's ZeRO-3 partitioning (world size > 1) run and be tested on a machine without GPUs or a
// launcher. Each rank gets its own Collective object; the objects of one group meet at a shared
// rendezvous for every call.
//
// Semantics are those of collective.h, with buffers in host memory: the host-only runtime's
// "device" memory, or any ordinary memory. Sums (reduce-scatter, all-reduce) are done in fp32 in
// rank order, (((r0 + r1) + r2) + ...), and bf16 / fp16 results are rounded once at the end (round
// to nearest even), so results are deterministic and do not depend on timing. In-place calls are
// allowed as NCCL allows them: AllGather with send == recv + rank * count * element bytes,
// ReduceScatter with recv == send + rank * count * element bytes, AllReduce always (in place by
// definition).
//
// Every rank of a group must make the same calls (operation, count, type) in the same order, as
// with NCCL. A call whose operation, count or type differs between ranks fails on every rank with
// InvalidArgument (nothing is copied). A rank that does not arrive within `timeout` breaks the
// group: the ranks waiting get FailedPrecondition, and so does every later call on any rank of the
// group (as an aborted NCCL communicator does): make a new group.
//
// Thread safety: one call at a time per Collective object (as NCCL); the objects of a group are
// meant to be used from different threads at once. Each object must outlive its calls; the group's
// shared state lives as long as any of its objects.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "common/status.h"
#include "offload/collective.h"
#include "gpu/gpu_runtime.h"

namespace memplan::offload {

// `world_size` (>= 1) collectives, element r being rank r's. `runtime` (not owned; null: the
// process-wide host-only runtime) names where buffers live; it must be host-addressable
// (InvalidArgument for a runtime with a real device: this collective reads buffers with the CPU).
Result<std::vector<std::unique_ptr<Collective>>> CreateThreadGroupCollectives(
    int world_size, gpu::Runtime* runtime = nullptr,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace memplan::offload
