// The engine's gradient path: see engine_gradients.h.
//
// Note [Reduce-scattered gradients]
// GradReady() gets the rank's whole gradient. It is copied into a device buffer of W * shard
// elements whose padding is zeroed, reduce-scattered in place (slot `rank` receives the sum over
// ranks of every rank's slot `rank`), and only that shard goes to the host, asynchronously as for
// world size 1; the buffer returns to a free list when that copy is done. The gradient thread then
// divides by W while converting to fp32: the optimizer sees the mean gradient over ranks, as with
// DeepSpeed's default averaging and PyTorch DDP, so hyperparameters tuned with the global batch's
// mean loss carry over. Summing first and dividing once, in fp32 (rather than dividing each rank's
// gradient before the sum, DeepSpeed's gradient_predivide_factor), costs no extra pass on the GPU
// and for W a power of two the division is exact: with the thread collective, whose fp32 sums run
// in rank order, W ranks then end bit for bit where one rank fed the mean gradient does. The price
// is that a 16-bit sum can overflow where every term does not (fp16 above 65504): scale the loss
// for that, as for fp16 training anyway. The reduce-scatter is synchronous (as every Collective
// call), so `device_grad` is free when GradReady() returns.
#include "offload/engine_gradients.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "offload/half.h"

namespace memplan::offload::internal {

Status GradientPath::Prepare(uint64_t pinned_used) {
  if (runtime->has_device()) MEMPLAN_RETURN_IF_ERROR(CreateGradientStaging(pinned_used));
  if (param_path.params->world_size() > 1) MEMPLAN_RETURN_IF_ERROR(AllocateGradientScratch());
  grad_given.assign(param_path.specs.size(), false);
  grads_missing = param_path.trainable_params;
  norm_parts.assign(optimizer.home->sub_group_count(), GradientNormParts());
  return Status::Ok();
}

void GradientPath::StartThread() {
  grad_worker = std::thread([this] { RunGradients(); });
}

// World size > 1: the reduce-scatter's scratch buffers and the padding's zeros (Note
// [Reduce-scattered gradients]), sized for the largest shard in any gradient type.
Status GradientPath::AllocateGradientScratch() {
  const auto world = static_cast<uint64_t>(param_path.params->world_size());
  const uint64_t largest = param_path.LargestTrainableShard();
  grad_scratch_bytes = largest * world * 4;
  for (int i = 0; i < 2; ++i) {
    MEMPLAN_ASSIGN_OR_RETURN(void* scratch, runtime->AllocateDevice(grad_scratch_bytes));
    grad_scratch_all.push_back(scratch);
    MutexLock lock(&grad_mu);
    grad_scratch_free.push_back(scratch);
  }
  const std::vector<std::byte> zeros(world * 4, std::byte{0});
  MEMPLAN_ASSIGN_OR_RETURN(grad_zeros, runtime->AllocateDevice(zeros.size()));
  MEMPLAN_ASSIGN_OR_RETURN(gpu::CopyTicket ticket,
                           runtime->CopyAsync(gpu::CopyDirection::kHostToDevice, grad_zeros,
                                              zeros.data(), zeros.size()));
  return runtime->Wait(ticket);
}

// The pinned staging of the gradients (Note [Asynchronous gradients]): kGradSlots slots of up to
// kMaxGradSlotBytes (less when the largest gradient is smaller, or when the pinned budget left
// after `pinned_used` bytes is short). ResourceExhausted when not even a page per slot fits the
// budget.
Status GradientPath::CreateGradientStaging(uint64_t pinned_used) {
  const Schedule& sc = options.schedule;
  const uint64_t largest = param_path.LargestTrainableShard() * 4;
  uint64_t slot = std::min(kMaxGradSlotBytes, (largest + kPageBytes - 1) / kPageBytes * kPageBytes);
  if (sc.pinned_budget_bytes > 0) {
    const uint64_t left =
        sc.pinned_budget_bytes > pinned_used ? sc.pinned_budget_bytes - pinned_used : 0;
    slot = std::min(slot, left / kGradSlots / kPageBytes * kPageBytes);
    if (slot < kPageBytes) {
      return Status::ResourceExhausted(
          "engine: pinned_budget_bytes " + std::to_string(sc.pinned_budget_bytes) + " leaves " +
          std::to_string(left) + " bytes after the other pinned buffers (" +
          std::to_string(pinned_used) + "); the gradient staging needs at least " +
          std::to_string(kGradSlots * kPageBytes));
    }
  }
  PinnedPoolOptions pool;
  pool.slot_bytes = slot;
  pool.slot_count = kGradSlots;
  pool.budget_bytes = slot * kGradSlots;
  MEMPLAN_ASSIGN_OR_RETURN(grad_staging, PinnedPool::Create(pool, runtime));
  return Status::Ok();
}

Status GradientPath::Give(ParamId param, const void* device_grad, ElementType type,
                          gpu::Stream stream) {
  {
    MutexLock lock(&grad_mu);
    if (!grad_error.ok()) return grad_error;
  }
  const ParamId sid = param_path.swap_id[param];
  const uint64_t first = param_path.params->PartitionOffset(sid);
  const uint64_t count = param_path.params->ShardSize(sid);
  const auto eb = static_cast<uint64_t>(ElementBytes(type));
  const std::byte* src = static_cast<const std::byte*>(device_grad);
  void* scratch = nullptr;
  if (param_path.params->world_size() == 1) {
    // The gradient may still be being computed on the trainer's stream (Note [Asynchronous
    // gradients]).
    MEMPLAN_RETURN_IF_ERROR(runtime->OrderAfter(gpu::CopyDirection::kDeviceToHost, stream));
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(scratch, ReduceScatterGradient(sid, device_grad, type, count, stream));
    src = static_cast<const std::byte*>(scratch) +
          static_cast<uint64_t>(param_path.params->rank()) * count * eb;
  }
  Status queued = QueueGradientCopies(param, type, first, src, count * eb, scratch);
  if (!queued.ok()) {
    // Part of the gradient may be queued already: the step cannot be completed.
    MutexLock lock(&grad_mu);
    if (grad_error.ok()) {
      grad_error = queued.WithPrefix("gradient of " + param_path.specs[param].name);
    }
    return grad_error;
  }
  grad_given[param] = true;
  --grads_missing;
  return Status::Ok();
}

// World size > 1: reduce-scatters `device_grad` (the parameter's whole gradient, `count`
// elements of `type` per rank's shard) across the ranks into a scratch buffer, after the
// trainer's work queued on `stream` (Note [Reduce-scattered gradients]). Returns the scratch
// buffer, whose slot `rank` then holds this rank's summed shard; the caller gives it back to
// grad_scratch_free (on failure it is back there already).
Result<void*> GradientPath::ReduceScatterGradient(ParamId param /* the swapper's id */,
                                                  const void* device_grad, ElementType type,
                                                  uint64_t count, gpu::Stream stream) {
  const auto eb = static_cast<uint64_t>(ElementBytes(type));
  const uint64_t n = param_path.params->Numel(param) * eb;
  const uint64_t shard = count * eb;
  const uint64_t full = shard * static_cast<uint64_t>(param_path.params->world_size());
  void* scratch = nullptr;
  {
    // At most two gradients are between their reduce-scatter and their copy to the host.
    MutexLock lock(&grad_mu);
    while (grad_scratch_free.empty() && grad_error.ok()) grad_cv.Wait(&grad_mu);
    if (!grad_error.ok()) return grad_error;
    scratch = grad_scratch_free.back();
    grad_scratch_free.pop_back();
  }
  Status status = [&]() -> Status {
    auto* base = static_cast<std::byte*>(scratch);
    MEMPLAN_RETURN_IF_ERROR(runtime->OrderAfter(gpu::CopyDirection::kDeviceToDevice, stream));
    MEMPLAN_ASSIGN_OR_RETURN(
        const gpu::CopyTicket copied,
        runtime->CopyAsync(gpu::CopyDirection::kDeviceToDevice, base, device_grad, n));
    gpu::CopyTicket zeroed;
    if (full > n) {
      MEMPLAN_ASSIGN_OR_RETURN(zeroed, runtime->CopyAsync(gpu::CopyDirection::kDeviceToDevice,
                                                          base + n, grad_zeros, full - n));
    }
    MEMPLAN_RETURN_IF_ERROR(runtime->Wait(copied));
    MEMPLAN_RETURN_IF_ERROR(runtime->Wait(zeroed));
    std::byte* mine = base + static_cast<uint64_t>(param_path.params->rank()) * shard;
    return options.collective->ReduceScatter(base, mine, count, type)
        .WithPrefix("reduce-scattering the gradient");
  }();
  if (!status.ok()) {
    {
      MutexLock lock(&grad_mu);
      grad_scratch_free.push_back(scratch);
    }
    grad_cv.SignalAll();
    return status;
  }
  reduce_scatter_bytes += full;
  return scratch;
}

// Queues the copies of `bytes` of a gradient at `src` (device memory, ordered for the
// device-to-host lane already) into staging slots, as jobs for the gradient thread; `first` is
// the partition element the first byte belongs to. `scratch` goes with the last job.
Status GradientPath::QueueGradientCopies(ParamId param, ElementType type, uint64_t first,
                                         const std::byte* src, uint64_t bytes, void* scratch) {
  if (!runtime->has_device()) {
    Status copied = CopyGradientToHost(param, type, first, src, bytes);
    if (scratch != nullptr) {  // read already
      {
        MutexLock lock(&grad_mu);
        grad_scratch_free.push_back(scratch);
      }
      grad_cv.SignalAll();
    }
    return copied;
  }
  const auto eb = static_cast<uint64_t>(ElementBytes(type));
  const uint64_t chunk = grad_staging->slot_bytes() / eb * eb;
  gpu::CopyTicket last;
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t len = std::min(chunk, bytes - done);
    GradJob job;
    job.param = param;
    job.type = type;
    job.first = first + done / eb;
    job.count = len / eb;
    const auto waited = std::chrono::steady_clock::now();
    MEMPLAN_ASSIGN_OR_RETURN(job.slot, grad_staging->Acquire());  // waits for the thread
    profile.stall_s += SecondsSince(waited);
    MEMPLAN_ASSIGN_OR_RETURN(
        job.ticket, runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, job.slot.data().data(),
                                       src + done, len));
    last = job.ticket;
    done += len;
    if (done == bytes) job.scratch = scratch;
    {
      MutexLock lock(&grad_mu);
      grad_jobs.push_back(std::move(job));
      d2h_bytes += len;
    }
    grad_cv.SignalAll();
  }
  return Status::Ok();
}

// The host-only runtime's QueueGradientCopies (Note [Asynchronous gradients]): the whole
// gradient into a recycled host buffer, copied before this returns.
Status GradientPath::CopyGradientToHost(ParamId param, ElementType type, uint64_t first,
                                        const std::byte* src, uint64_t bytes) {
  GradJob job;
  job.param = param;
  job.type = type;
  job.first = first;
  job.count = bytes / static_cast<uint64_t>(ElementBytes(type));
  {
    MutexLock lock(&grad_mu);
    const auto waited = std::chrono::steady_clock::now();
    while (grad_jobs.size() >= kGradSlots) grad_cv.Wait(&grad_mu);
    profile.stall_s += SecondsSince(waited);
    // The smallest recycled buffer that holds it: first fit would hand the largest gradient's
    // buffer to a small one and make the largest allocate (and fault in) a new one.
    size_t best = grad_free.size();
    for (size_t i = 0; i < grad_free.size(); ++i) {
      if (grad_free[i].size() >= bytes &&
          (best == grad_free.size() || grad_free[i].size() < grad_free[best].size())) {
        best = i;
      }
    }
    if (best < grad_free.size()) {
      job.host = std::move(grad_free[best]);
      grad_free.erase(grad_free.begin() + static_cast<int64_t>(best));
    }
  }
  if (job.host.size() < bytes) job.host.resize(bytes);
  MEMPLAN_ASSIGN_OR_RETURN(job.ticket, runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost,
                                                          job.host.data(), src, bytes));
  MEMPLAN_RETURN_IF_ERROR(runtime->Wait(job.ticket));
  {
    MutexLock lock(&grad_mu);
    grad_jobs.push_back(std::move(job));
    d2h_bytes += bytes;
  }
  grad_cv.SignalAll();
  return Status::Ok();
}

void GradientPath::RunGradients() {
  for (;;) {
    GradJob job;
    {
      MutexLock lock(&grad_mu);
      while (!grad_stop && grad_jobs.empty()) grad_cv.Wait(&grad_mu);
      if (grad_jobs.empty()) return;  // stopping, nothing left
      job = std::move(grad_jobs.front());
      grad_jobs.pop_front();
      grad_busy = true;
    }
    Status status = runtime->Wait(job.ticket);
    if (status.ok()) status = Accumulate(job);
    job.slot.Release();  // GradReady() may be waiting for it
    {
      MutexLock lock(&grad_mu);
      if (!status.ok() && grad_error.ok()) {
        grad_error = status.WithPrefix("gradient of " + param_path.specs[job.param].name);
      }
      if (!job.host.empty()) grad_free.push_back(std::move(job.host));
      if (job.scratch != nullptr) grad_scratch_free.push_back(job.scratch);
      grad_busy = false;
    }
    grad_cv.SignalAll();
  }
}

// Converts one copied gradient into the sub-group buffers; full sub-groups go to the optimizer.
Status GradientPath::Accumulate(const GradJob& job) {
  const uint64_t n = job.count;
  const int eb = ElementBytes(job.type);
  const uint64_t sg_elems = optimizer.home->sub_group_elements();
  const uint64_t first = job.first;
  const int world = param_path.params->world_size();
  uint64_t done = 0;
  while (done < n) {
    const uint64_t at = first + done;
    const uint64_t sg = at / sg_elems;
    const uint64_t in_sg = at - sg * sg_elems;
    const uint64_t size = optimizer.home->SubGroupSize(sg);
    const uint64_t len = std::min(n - done, size - in_sg);
    GradBuffer& buf = grad_buffers[sg];
    std::span<float> direct = optimizer.home->DirectGradients(sg);
    float* base = direct.data();
    if (base == nullptr) {
      if (buf.data.empty()) buf.data = TakeGradBuffer(size);
      base = buf.data.data();
    }
    float* dst = base + in_sg;
    const std::byte* src = job.data() + done * eb;
    // Slots are page-aligned, host buffers come from operator new: aligned for uint16_t.
    const auto* half = reinterpret_cast<const uint16_t*>(src);
    switch (job.type) {
      case ElementType::kFloat32: std::memcpy(dst, src, len * 4); break;
      case ElementType::kBFloat16:
        for (uint64_t k = 0; k < len; ++k) dst[k] = Bf16ToFloat(half[k]);
        break;
      case ElementType::kFloat16:
        for (uint64_t k = 0; k < len; ++k) dst[k] = Fp16ToFloat(half[k]);
        break;
    }
    if (world > 1) {  // the sum over ranks -> their mean (Note [Reduce-scattered gradients])
      const auto w = static_cast<float>(world);
      for (uint64_t k = 0; k < len; ++k) dst[k] = dst[k] / w;
    }
    buf.received += len;
    if (buf.received == size) {
      // Note [Clipping by the global norm]: every sub-group's gradients are measured once, whole.
      norm_parts[sg] = MeasureGradients(std::span<const float>(base, size));
      if (optimizer.overlap) {
        MEMPLAN_RETURN_IF_ERROR(optimizer.HandOver(sg, std::move(buf.data)));
      } else {
        MEMPLAN_RETURN_IF_ERROR(
            optimizer.home->WriteGradients(sg, std::span<const float>(base, size)));
        if (!buf.data.empty()) grad_buffer_free.push_back(std::move(buf.data));
      }
      grad_buffers.erase(sg);
    }
    done += len;
  }
  return Status::Ok();
}

// A sub-group gradient buffer of `size` elements: a recycled one of that size (the gradient
// thread's, or one the optimizer has read), else a new one. Taking any other size would allocate,
// fault in and zero 4 bytes an element again every step (the last sub-group is shorter).
std::vector<float> GradientPath::TakeGradBuffer(uint64_t size) {
  optimizer.TakeFreedBuffers(grad_buffer_free);
  for (size_t i = grad_buffer_free.size(); i-- > 0;) {
    if (grad_buffer_free[i].size() == size) {
      std::vector<float> out = std::move(grad_buffer_free[i]);
      grad_buffer_free[i] = std::move(grad_buffer_free.back());
      grad_buffer_free.pop_back();
      return out;
    }
  }
  return std::vector<float>(size);
}

// Completes the gradients of a parameter declared with NoGradient(): zeros into its partition
// range, through Accumulate(), so its sub-groups are whole; the segments then skip it. On the
// trainer's thread, after DrainGradients() (the gradient thread is idle).
Status GradientPath::FeedZeros(size_t spec) {
  const ParamId sid = param_path.swap_id[spec];
  const uint64_t first = param_path.params->PartitionOffset(sid),
                 count = param_path.params->ShardSize(sid);
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  GradJob job;
  job.param = static_cast<ParamId>(spec);
  job.type = ElementType::kFloat32;
  job.host.assign(std::min(count, kPiece) * 4, std::byte{0});
  for (uint64_t done = 0; done < count; done += job.count) {
    job.first = first + done;
    job.count = std::min(kPiece, count - done);
    MEMPLAN_RETURN_IF_ERROR(Accumulate(job));
  }
  return Status::Ok();
}

// Waits until every queued gradient is in the optimizer; returns the first failure.
Status GradientPath::DrainGradients() {
  MutexLock lock(&grad_mu);
  while (!grad_jobs.empty() || grad_busy) grad_cv.Wait(&grad_mu);
  return grad_error;
}

Result<GradientNormParts> GradientPath::NormOverRanks() {
  GradientNormParts mine;
  for (const GradientNormParts& part : norm_parts) mine.Add(part);
  if (param_path.params->world_size() > 1) return GatherNormParts(mine);
  return mine;
}

// World size > 1: the sum of every rank's pieces, in rank order (an all-gather of five 8-byte
// words a rank, moved as fp32 elements, never computed on).
Result<GradientNormParts> GradientPath::GatherNormParts(const GradientNormParts& mine) {
  constexpr uint64_t kWords = 5;
  const auto world = static_cast<uint64_t>(param_path.params->world_size());
  const auto rank = static_cast<uint64_t>(param_path.params->rank());
  std::vector<uint64_t> all(world * kWords, 0);
  const double doubles[3] = {mine.sum_squares, mine.sum_abs, mine.max_abs};
  std::memcpy(&all[rank * kWords], doubles, sizeof(doubles));
  all[rank * kWords + 3] = mine.nan;
  all[rank * kWords + 4] = mine.inf;
  const uint64_t bytes = kWords * 8;
  MEMPLAN_ASSIGN_OR_RETURN(void* device, runtime->AllocateDevice(world * bytes));
  Status status = [&]() -> Status {
    auto* base = static_cast<std::byte*>(device);
    MEMPLAN_ASSIGN_OR_RETURN(gpu::CopyTicket up,
                             runtime->CopyAsync(gpu::CopyDirection::kHostToDevice,
                                                base + rank * bytes, &all[rank * kWords], bytes));
    MEMPLAN_RETURN_IF_ERROR(runtime->Wait(up));
    MEMPLAN_RETURN_IF_ERROR(
        options.collective->AllGather(base + rank * bytes, base, bytes / 4, ElementType::kFloat32));
    MEMPLAN_ASSIGN_OR_RETURN(
        gpu::CopyTicket down,
        runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, all.data(), base, world * bytes));
    return runtime->Wait(down);
  }();
  Status freed = runtime->FreeDevice(device);
  MEMPLAN_RETURN_IF_ERROR(status.WithPrefix("engine: gathering the gradient norm"));
  MEMPLAN_RETURN_IF_ERROR(freed);
  GradientNormParts sum;
  for (uint64_t r = 0; r < world; ++r) {
    GradientNormParts part;
    double d[3];
    std::memcpy(d, &all[r * kWords], sizeof(d));
    part.sum_squares = d[0];
    part.sum_abs = d[1];
    part.max_abs = d[2];
    part.nan = all[r * kWords + 3];
    part.inf = all[r * kWords + 4];
    sum.Add(part);
  }
  return sum;
}

Status GradientPath::FirstError() const {
  MutexLock lock(&grad_mu);
  return grad_error;
}

void GradientPath::DropStep() {
  (void)DrainGradients();  // the step's gradients are dropped, a failed copy's included
  {
    MutexLock lock(&grad_mu);
    grad_error = Status::Ok();
  }
  for (auto& [sg, buf] : grad_buffers) {
    if (!buf.data.empty()) grad_buffer_free.push_back(std::move(buf.data));
  }
  grad_buffers.clear();
}

void GradientPath::ResetGiven() {
  std::fill(grad_given.begin(), grad_given.end(), false);
  grads_missing = param_path.trainable_params;
}

uint64_t GradientPath::d2h_bytes_total() const {
  MutexLock lock(&grad_mu);
  return d2h_bytes;
}

void GradientPath::StopGradients() {
  {
    MutexLock lock(&grad_mu);
    grad_stop = true;
  }
  grad_cv.SignalAll();
  if (grad_worker.joinable()) grad_worker.join();
}

void GradientPath::Close() {
  StopGradients();  // finishes the gradients queued (their copies may still be in flight)
  {
    MutexLock lock(&grad_mu);
    grad_jobs.clear();  // (none: StopGradients finished them)
  }
  grad_staging.reset();
  if (!grad_scratch_all.empty() || grad_zeros != nullptr) {
    (void)runtime->Synchronize();  // a copy may still read a scratch buffer
  }
  for (void* scratch : grad_scratch_all) (void)runtime->FreeDevice(scratch);
  grad_scratch_all.clear();
  {
    MutexLock lock(&grad_mu);
    grad_scratch_free.clear();
  }
  if (grad_zeros != nullptr) (void)runtime->FreeDevice(grad_zeros);
  grad_zeros = nullptr;
}

}  // namespace memplan::offload::internal
