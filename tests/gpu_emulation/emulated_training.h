// A trainer for the emulated GPU tests: the offload engine driven the way a PyTorch trainer drives
// it, with "kernels" that read parameters and write gradients late, on a compute stream of their
// own, the gradients in memory from a caching allocator that reuses a freed block at once. The
// same trainer runs on the host-only runtime (kernels run when launched, nothing is late), which
// gives the reference every emulated run must equal bit for bit.
//
// Test code; header-only; include as "emulated_training.h".
#pragma once

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gpu_emulation.h"
#include "offload/engine.h"
#include "offload/half.h"
#ifdef MEMPLAN_TEST_OLD_API
#include "old_api.h"
#endif

namespace memplan::emulated {

using offload::ElementType;

// Where kernels run: on the emulated GPU, a non-blocking stream of `device` with its own caching
// allocator; on the host, inline.
class Compute {
 public:
  Compute(bool cuda, int device) : cuda_(cuda), device_(device) {
    if (!cuda_) return;
    REQUIRE(cudaSetDevice(device_) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) == cudaSuccess);
    allocator_ = std::make_unique<gpu_emulation::CachingAllocator>(device_);
  }
  ~Compute() {
    if (!cuda_) return;
    (void)cudaStreamSynchronize(stream_);
    allocator_.reset();
    (void)cudaStreamDestroy(stream_);
  }
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;

  bool cuda() const { return cuda_; }
  gpu::Stream stream() const { return gpu::Stream{stream_}; }
  // How long each kernel takes (a kernel that runs late makes a missing order show).
  void set_kernel_us(int us) { kernel_us_ = us; }

  void Launch(std::function<void()> body) {
    if (!cuda_) {
      body();
      return;
    }
    const int us = kernel_us_;
    gpu_emulation::LaunchKernel(stream_, [body = std::move(body), us] {
      if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
      body();
    });
  }
  // Inside a kernel: the memory behind a device pointer.
  void* View(const void* ptr, uint64_t bytes) const {
    return cuda_ ? gpu_emulation::DeviceView(ptr, bytes) : const_cast<void*>(ptr);
  }
  void* Allocate(uint64_t bytes) {
    if (!cuda_) return ::operator new (bytes, std::align_val_t{256});
    void* p = allocator_->Allocate(bytes, stream_);
    REQUIRE(p != nullptr);
    return p;
  }
  void Free(void* p) {
    if (!cuda_) {
      ::operator delete (p, std::align_val_t{256});
      return;
    }
    allocator_->Free(p);
  }
  // tensor.record_stream(stream)
  void RecordStream(void* p, gpu::Stream stream) {
    if (cuda_) allocator_->RecordStream(p, static_cast<cudaStream_t>(stream.handle));
  }
  void Synchronize() {
    if (cuda_) REQUIRE(cudaStreamSynchronize(stream_) == cudaSuccess);
  }
  uint64_t peak_allocated_bytes() const { return cuda_ ? allocator_->peak_allocated_bytes() : 0; }

 private:
  const bool cuda_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  int kernel_us_ = 0;
  std::unique_ptr<gpu_emulation::CachingAllocator> allocator_;
};

// The calls whose stream argument the issue added. Built with MEMPLAN_TEST_OLD_API they make the
// calls the API had before (no stream), so that the same tests run against that code and show
// what they catch.
inline Status ReleaseOn(offload::Engine& e, const std::string& module, gpu::Stream s) {
#ifdef MEMPLAN_TEST_OLD_API
  (void)s;
  return e.Release(module);
#else
  return e.Release(module, s);
#endif
}
inline Status GradReadyOn(offload::Engine& e, offload::ParamId p, const void* g, ElementType t,
                          gpu::Stream s) {
#ifdef MEMPLAN_TEST_OLD_API
  (void)s;
  return e.GradReady(p, g, t);
#else
  return e.GradReady(p, g, t, s);
#endif
}
inline gpu::Stream GradientStreamOf(offload::Engine& e) {
#ifdef MEMPLAN_TEST_OLD_API
  (void)e;
  return gpu::Stream{};
#else
  return e.GradientStream();
#endif
}

struct Module {
  std::string name;
  std::vector<uint64_t> numels;  // its parameters' element counts
};

struct TrainOptions {
  int steps = 3;
  int micro_steps = 1;  // gradient accumulation: backward passes per step
  ElementType grad_type = ElementType::kFloat32;
  bool pass_stream = true;    // give Release/GradReady the compute stream (else {})
  bool record_stream = true;  // record each gradient on the engine's gradient stream
  int kernel_us = 300;        // how long each kernel takes on the emulated GPU
  int rank = 0;               // mixed into the gradients, so that ranks differ
};

inline float ParamInit(uint64_t param, uint64_t i) {
  return 0.02f * static_cast<float>(static_cast<int64_t>((param * 131 + i * 17) % 101) - 50) /
         50.0f;
}

inline float Load(const std::byte* p, ElementType type) {
  uint16_t h;
  switch (type) {
    case ElementType::kFloat32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case ElementType::kBFloat16: std::memcpy(&h, p, 2); return offload::Bf16ToFloat(h);
    case ElementType::kFloat16: std::memcpy(&h, p, 2); return offload::Fp16ToFloat(h);
  }
  return 0;
}

inline void Store(std::byte* p, ElementType type, float v) {
  uint16_t h;
  switch (type) {
    case ElementType::kFloat32: std::memcpy(p, &v, 4); return;
    case ElementType::kBFloat16:
      h = offload::FloatToBf16(v);
      std::memcpy(p, &h, 2);
      return;
    case ElementType::kFloat16:
      h = offload::FloatToFp16(v);
      std::memcpy(p, &h, 2);
      return;
  }
}

// Registers the model's parameters; returns their ids, module by module.
inline std::vector<std::vector<offload::ParamId>> Register(offload::Engine& engine,
                                                           const std::vector<Module>& model) {
  std::vector<std::vector<offload::ParamId>> ids;
  uint64_t n = 0;
  for (const Module& m : model) {
    ids.emplace_back();
    for (uint64_t numel : m.numels) {
      const uint64_t param = n++;
      offload::ParamSpec spec{m.name + ".w" + std::to_string(ids.back().size()),
                              m.name,
                              {static_cast<int64_t>(numel)},
                              [param](uint64_t first, std::span<float> out) {
                                for (size_t k = 0; k < out.size(); ++k) {
                                  out[k] = ParamInit(param, first + k);
                                }
                                return Status::Ok();
                              },
                              {}};
      auto id = engine.AddParameter(spec);
      REQUIRE_MESSAGE(id.ok(), id.status().ToString());
      ids.back().push_back(*id);
    }
  }
  return ids;
}

// Trains on a started engine, the way memplan.torch does: forward fetches and releases each
// module after launching kernels that read its parameters; backward fetches in reverse, launches
// kernels that read the parameters and the forward's activations and write the gradients into
// allocator memory, hands each gradient over, records it on the gradient stream and frees it at
// once, and releases the module. With micro_steps > 1 the gradients are summed on the device over
// the micro-steps and handed over at the last one.
inline Status Train(offload::Engine& engine, Compute& compute, const std::vector<Module>& model,
                    const std::vector<std::vector<offload::ParamId>>& ids, ElementType param_dtype,
                    const TrainOptions& o, int first_step = 0) {
  compute.set_kernel_us(o.kernel_us);
  const gpu::Stream none{};
  const gpu::Stream stream = o.pass_stream ? compute.stream() : none;
  const auto pb = static_cast<uint64_t>(offload::ElementBytes(param_dtype));
  const auto gb = static_cast<uint64_t>(offload::ElementBytes(o.grad_type));
  auto acts = std::make_shared<std::vector<float>>(model.size(), 0.0f);  // kernels' only
  const float rank_term = 1e-3f * static_cast<float>(o.rank);
  for (int step = first_step; step < first_step + o.steps; ++step) {
    std::vector<std::vector<void*>> sums(model.size());  // accumulated gradients
    for (int micro = 0; micro < o.micro_steps; ++micro) {
      for (size_t m = 0; m < model.size(); ++m) {
        MEMPLAN_RETURN_IF_ERROR(engine.Fetch(model[m].name));
        for (size_t k = 0; k < ids[m].size(); ++k) {
          MEMPLAN_ASSIGN_OR_RETURN(void* w, engine.DevicePointer(ids[m][k]));
          const uint64_t n = model[m].numels[k];
          compute.Launch([&compute, acts, m, k, w, n, pb, param_dtype] {
            const auto* v = static_cast<const std::byte*>(compute.View(w, n * pb));
            float a = k == 0 ? 0.0f : (*acts)[m];
            for (uint64_t i = 0; i < n; ++i) a += Load(v + i * pb, param_dtype) * (1 + i % 5);
            (*acts)[m] = a * 1e-3f;
          });
        }
        MEMPLAN_RETURN_IF_ERROR(ReleaseOn(engine, model[m].name, stream));
      }
      const bool last = micro + 1 == o.micro_steps;
      for (size_t m = model.size(); m-- > 0;) {
        MEMPLAN_RETURN_IF_ERROR(engine.Fetch(model[m].name));
        sums[m].resize(ids[m].size(), nullptr);
        for (size_t k = 0; k < ids[m].size(); ++k) {
          MEMPLAN_ASSIGN_OR_RETURN(void* w, engine.DevicePointer(ids[m][k]));
          const uint64_t n = model[m].numels[k];
          const bool first = sums[m][k] == nullptr;
          if (first) sums[m][k] = compute.Allocate(n * gb);
          void* g = sums[m][k];
          const ElementType gt = o.grad_type;
          compute.Launch(
              [&compute, acts, m, w, g, n, pb, gb, gt, param_dtype, first, step, rank_term] {
                const auto* v = static_cast<const std::byte*>(compute.View(w, n * pb));
                auto* out = static_cast<std::byte*>(compute.View(g, n * gb));
                for (uint64_t i = 0; i < n; ++i) {
                  const float grad =
                      Load(v + i * pb, param_dtype) * 0.25f + (*acts)[m] * 1e-2f +
                      static_cast<float>((i * 7 + static_cast<uint64_t>(step)) % 11) * 1e-3f +
                      rank_term;
                  Store(out + i * gb, gt, first ? grad : Load(out + i * gb, gt) + grad);
                }
              });
          if (!last) continue;
          MEMPLAN_RETURN_IF_ERROR(GradReadyOn(engine, ids[m][k], g, gt, stream));
          if (o.record_stream) compute.RecordStream(g, GradientStreamOf(engine));
          compute.Free(g);  // as torch drops the gradient: its memory is reused at once
        }
        MEMPLAN_RETURN_IF_ERROR(ReleaseOn(engine, model[m].name, stream));
      }
    }
    offload::AdamOptions adam;
    adam.lr = 1e-2;
    MEMPLAN_RETURN_IF_ERROR(engine.Step(offload::SwapStepOptions(adam)));
  }
  return Status::Ok();
}

// Every parameter's fp32 master weights.
inline std::vector<std::vector<float>> MasterWeights(
    offload::Engine& engine, const std::vector<Module>& model,
    const std::vector<std::vector<offload::ParamId>>& ids) {
  std::vector<std::vector<float>> out;
  for (size_t m = 0; m < model.size(); ++m) {
    for (size_t k = 0; k < ids[m].size(); ++k) {
      out.emplace_back(model[m].numels[k]);
      Status read = engine.ReadMasterWeights(ids[m][k], out.back());
      REQUIRE_MESSAGE(read.ok(), read.ToString());
    }
  }
  return out;
}

// Number of elements that differ, bit for bit.
inline uint64_t Differences(const std::vector<std::vector<float>>& a,
                            const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  uint64_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].size() == b[i].size());
    for (size_t k = 0; k < a[i].size(); ++k) {
      diff += std::memcmp(&a[i][k], &b[i][k], 4) != 0 ? 1 : 0;
    }
  }
  return diff;
}

}  // namespace memplan::emulated
