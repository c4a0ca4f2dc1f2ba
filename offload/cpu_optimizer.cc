#include "offload/cpu_optimizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/enum_names.h"
#include "common/mutex.h"
#include "offload/cpu_optimizer_internal.h"

#if MEMPLAN_OFFLOAD_X86
#include <cpuid.h>
#endif

namespace memplan::offload {

// Note [AdamW formula]
// torch.optim.AdamW (1.13, single-tensor path), with t the 1-based step:
//   p = p * (1 - lr * wd)                      (AdamW; Adam instead: g = g + wd * p)
//   m = m * beta1 + (1 - beta1) * g
//   v = v * beta2 + (1 - beta2) * g * g
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps  (eps outside the bias correction)
//   p = p + (-lr / (1 - beta1^t)) * m / denom
// The scalars (1 - lr*wd, 1 - beta1, lr / (1 - beta1^t), sqrt(1 - beta2^t), ...) are computed in
// double, as Python does, and rounded to float once, as PyTorch does when a Python float meets an
// fp32 tensor; the element-wise work is fp32. With amsgrad, v in denom is max(v_max, v), and v_max
// is stored. Doing the same operations in the same order is what lets the tests hold us to 1e-6
// relative error against PyTorch rather than a loose tolerance.

namespace {

std::string Describe(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

Status CheckRange(const char* name, double value, double low, bool low_open, double high,
                  bool high_open) {
  bool ok = std::isfinite(value) && (low_open ? value > low : value >= low) &&
            (high_open ? value < high : value <= high);
  if (ok) return Status::Ok();
  std::string range = std::string(low_open ? "(" : "[") + Describe(low) + ", " +
                      (std::isinf(high) ? "inf" : Describe(high)) + (high_open ? ")" : "]");
  return Status::InvalidArgument(std::string(name) + ": must be in " + range + ", got " +
                                 Describe(value));
}

constexpr double kInf = HUGE_VAL;

// AdamOptions::grad_scale's range: > 0, +inf (gradients times 0) or NaN (gradients NaN).
Status CheckGradScale(double value) {
  if (value > 0 || std::isnan(value)) return Status::Ok();
  return Status::InvalidArgument("grad_scale: must be > 0, got " + Describe(value));
}

#if MEMPLAN_OFFLOAD_X86
// clang 14's __builtin_cpu_supports does not know "f16c"; CPUID leaf 1 says it in both compilers.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool CpuHas(Isa isa) {
#if MEMPLAN_OFFLOAD_X86
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

using AdamKernel = void (*)(const internal::AdamKernelArgs&, size_t, size_t);
using HalfKernel = void (*)(const float*, uint16_t*, HalfDtype, size_t, size_t);

AdamKernel AdamKernelFor(Isa isa) {
#if MEMPLAN_OFFLOAD_X86
  if (isa == Isa::kAvx512) return internal::AdamAvx512;
  if (isa == Isa::kAvx2) return internal::AdamAvx2;
#endif
  (void)isa;
  return internal::AdamScalar;
}

HalfKernel HalfKernelFor(Isa isa) {
#if MEMPLAN_OFFLOAD_X86
  if (isa == Isa::kAvx512) return internal::ToHalfAvx512;
  if (isa == Isa::kAvx2) return internal::ToHalfAvx2;
#endif
  (void)isa;
  return internal::ToHalfScalar;
}

Status CheckSize(const char* name, size_t size, size_t expected) {
  if (size == expected) return Status::Ok();
  return Status::InvalidArgument(std::string(name) + ": " + std::to_string(size) +
                                 " elements, expected " + std::to_string(expected) +
                                 " (as many as params)");
}

Status CheckHalf(std::span<uint16_t> half, HalfDtype dtype, size_t expected) {
  if (dtype == HalfDtype::kNone) {
    if (half.empty()) return Status::Ok();
    return Status::InvalidArgument("half_params given but half_dtype is none");
  }
  return CheckSize("half_params", half.size(), expected);
}

constexpr EnumName<Isa> kIsas[] = {
    {Isa::kScalar, "scalar"}, {Isa::kAvx2, "avx2"}, {Isa::kAvx512, "avx512"}};

Status CheckStep(int64_t step) {
  if (step >= 1) return Status::Ok();
  return Status::InvalidArgument("step: must be >= 1 (1-based), got " + std::to_string(step));
}

}  // namespace

std::string_view IsaName(Isa isa) {
  std::string_view name = NameOf(kIsas, isa);
  return name == "?" ? "unknown" : name;
}

Result<Isa> ParseIsa(std::string_view name) { return ParseName(kIsas, name, "ISA"); }

bool IsaAvailable(Isa isa) { return CpuHas(isa); }

Isa BestIsa() {
  if (IsaAvailable(Isa::kAvx512)) return Isa::kAvx512;
  if (IsaAvailable(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

std::string_view HalfDtypeName(HalfDtype dtype) {
  switch (dtype) {
    case HalfDtype::kNone: return "fp32";
    case HalfDtype::kBf16: return "bf16";
    case HalfDtype::kFp16: return "fp16";
  }
  return "unknown";
}

Status AdamOptions::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(CheckRange("lr", lr, 0, false, kInf, true));  // 0: as torch (warm-up)
  MEMPLAN_RETURN_IF_ERROR(CheckRange("beta1", beta1, 0, false, 1, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("beta2", beta2, 0, false, 1, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("eps", eps, 0, true, kInf, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("weight_decay", weight_decay, 0, false, kInf, true));
  return CheckGradScale(grad_scale);
}

Status SgdOptions::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(CheckRange("lr", lr, 0, false, kInf, true));  // 0: as torch (warm-up)
  MEMPLAN_RETURN_IF_ERROR(CheckRange("momentum", momentum, 0, false, kInf, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("dampening", dampening, 0, false, 1, false));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("weight_decay", weight_decay, 0, false, kInf, true));
  MEMPLAN_RETURN_IF_ERROR(CheckGradScale(grad_scale));
  if (nesterov && (momentum <= 0 || dampening != 0)) {
    return Status::InvalidArgument("nesterov: needs momentum > 0 and dampening 0");
  }
  return Status::Ok();
}

Status LionOptions::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(CheckRange("lr", lr, 0, false, kInf, true));  // 0: as torch (warm-up)
  MEMPLAN_RETURN_IF_ERROR(CheckRange("beta1", beta1, 0, false, 1, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("beta2", beta2, 0, false, 1, true));
  MEMPLAN_RETURN_IF_ERROR(CheckRange("weight_decay", weight_decay, 0, false, kInf, true));
  return CheckGradScale(grad_scale);
}

Status CpuOptimizerOptions::Validate() const {
  if (threads < 1 || threads > 4096) {
    return Status::InvalidArgument("threads: must be in [1, 4096], got " + std::to_string(threads));
  }
  if (tile_elements == 0 || tile_elements > (uint64_t{1} << 40)) {
    return Status::InvalidArgument("tile_elements: must be in [1, 2^40], got " +
                                   std::to_string(tile_elements));
  }
  if (isa.has_value() && !IsaAvailable(*isa)) {
    return Status::InvalidArgument("isa: " + std::string(IsaName(*isa)) +
                                   " is not supported by this CPU or build");
  }
  return Status::Ok();
}

// A fixed set of worker threads that, with the caller, split [0, n) into tiles handed out through
// an atomic counter: a thread slowed by the rest of the machine simply takes fewer tiles. Threads
// are started once, so a step costs two condition-variable hand-offs, not thread creation. Run() is
// called by one thread at a time (CpuOptimizer's contract).
class TilePool {
 public:
  using TileFn = std::function<void(size_t begin, size_t end)>;

  explicit TilePool(int workers) {
    workers_.reserve(workers);
    for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~TilePool() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    start_cv_.SignalAll();
    for (std::thread& worker : workers_) worker.join();
  }

  TilePool(const TilePool&) = delete;
  TilePool& operator=(const TilePool&) = delete;

  void Run(size_t n, size_t tile, const TileFn& fn) {
    if (workers_.empty() || n <= tile) {
      fn(0, n);
      return;
    }
    {
      MutexLock lock(&mu_);
      fn_ = &fn;
      n_ = n;
      tile_ = tile;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    start_cv_.SignalAll();
    Drain(fn, n, tile);
    MutexLock lock(&mu_);
    while (busy_ != 0) done_cv_.Wait(&mu_);
    fn_ = nullptr;
  }

 private:
  void Drain(const TileFn& fn, size_t n, size_t tile) {
    for (;;) {
      size_t begin = next_.fetch_add(tile, std::memory_order_relaxed);
      if (begin >= n) return;
      fn(begin, std::min(n, begin + tile));
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      const TileFn* fn;
      size_t n;
      size_t tile;
      {
        MutexLock lock(&mu_);
        while (!stop_ && generation_ == seen) start_cv_.Wait(&mu_);
        if (stop_) return;
        seen = generation_;
        fn = fn_;
        n = n_;
        tile = tile_;
      }
      Drain(*fn, n, tile);
      bool last;
      {
        MutexLock lock(&mu_);
        last = --busy_ == 0;
      }
      if (last) done_cv_.Signal();
    }
  }

  Mutex mu_;
  CondVar start_cv_;
  CondVar done_cv_;
  const TileFn* fn_ GUARDED_BY(mu_) = nullptr;  // valid until busy_ drops to 0
  size_t n_ GUARDED_BY(mu_) = 0;
  size_t tile_ GUARDED_BY(mu_) = 0;
  int busy_ GUARDED_BY(mu_) = 0;
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<size_t> next_{0};
  std::vector<std::thread> workers_;
};

CpuOptimizer::CpuOptimizer(Isa isa, int threads, uint64_t tile_elements)
    : isa_(isa),
      threads_(threads),
      tile_elements_(tile_elements),
      pool_(std::make_unique<TilePool>(threads - 1)) {}

CpuOptimizer::~CpuOptimizer() = default;

Result<std::unique_ptr<CpuOptimizer>> CpuOptimizer::Create(const CpuOptimizerOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  // Tiles start on 64-element boundaries so every vector loop runs whole vectors except at the end.
  uint64_t tile = (options.tile_elements + 63) / 64 * 64;
  return std::unique_ptr<CpuOptimizer>(
      new CpuOptimizer(options.isa.value_or(BestIsa()), options.threads, tile));
}

Status CpuOptimizer::AdamStep(const AdamOptions& options, int64_t step,
                              const AdamTensors& tensors) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(CheckStep(step));
  size_t n = tensors.params.size();
  const bool half_grads = tensors.grad_dtype != HalfDtype::kNone;
  if (half_grads) {
    if (!tensors.grads.empty()) {
      return Status::InvalidArgument("grads: give fp32 grads or 16-bit half_grads, not both");
    }
    MEMPLAN_RETURN_IF_ERROR(CheckSize("half_grads", tensors.half_grads.size(), n));
  } else {
    if (!tensors.half_grads.empty()) {
      return Status::InvalidArgument("half_grads given but grad_dtype is none");
    }
    MEMPLAN_RETURN_IF_ERROR(CheckSize("grads", tensors.grads.size(), n));
  }
  MEMPLAN_RETURN_IF_ERROR(CheckSize("exp_avg", tensors.exp_avg.size(), n));
  MEMPLAN_RETURN_IF_ERROR(CheckSize("exp_avg_sq", tensors.exp_avg_sq.size(), n));
  if (options.amsgrad) {
    MEMPLAN_RETURN_IF_ERROR(CheckSize("max_exp_avg_sq", tensors.max_exp_avg_sq.size(), n));
  } else if (!tensors.max_exp_avg_sq.empty()) {
    return Status::InvalidArgument("max_exp_avg_sq given but amsgrad is off");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckHalf(tensors.half_params, tensors.half_dtype, n));

  // Note [AdamW formula].
  double t = static_cast<double>(step);
  double bias_correction1 = options.bias_correction ? 1.0 - std::pow(options.beta1, t) : 1.0;
  double bias_correction2 = options.bias_correction ? 1.0 - std::pow(options.beta2, t) : 1.0;
  internal::AdamKernelArgs args{};
  args.params = tensors.params.data();
  args.grads = half_grads ? nullptr : tensors.grads.data();
  args.half_grads = half_grads ? tensors.half_grads.data() : nullptr;
  args.grad_dtype = tensors.grad_dtype;
  args.exp_avg = tensors.exp_avg.data();
  args.exp_avg_sq = tensors.exp_avg_sq.data();
  args.max_exp_avg_sq = options.amsgrad ? tensors.max_exp_avg_sq.data() : nullptr;
  args.half_dtype = tensors.half_dtype;
  args.half = tensors.half_dtype == HalfDtype::kNone ? nullptr : tensors.half_params.data();
  args.stream_half = args.half != nullptr && n * sizeof(uint16_t) >= internal::kStreamHalfMinBytes;
  args.amsgrad = options.amsgrad;
  args.scale_grads = options.grad_scale != 1.0;
  args.inv_grad_scale = static_cast<float>(1.0 / options.grad_scale);
  args.l2 = !options.decoupled && options.weight_decay != 0;
  args.l2_decay = static_cast<float>(options.weight_decay);
  args.decoupled = options.decoupled && options.weight_decay != 0;
  args.decay = static_cast<float>(1.0 - options.lr * options.weight_decay);
  args.beta1 = static_cast<float>(options.beta1);
  args.one_minus_beta1 = static_cast<float>(1.0 - options.beta1);
  args.beta2 = static_cast<float>(options.beta2);
  args.one_minus_beta2 = static_cast<float>(1.0 - options.beta2);
  args.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  args.eps = static_cast<float>(options.eps);
  args.neg_step_size = static_cast<float>(-(options.lr / bias_correction1));

  AdamKernel kernel = AdamKernelFor(isa_);
  pool_->Run(n, tile_elements_, [&](size_t begin, size_t end) { kernel(args, begin, end); });
  return Status::Ok();
}

Status CpuOptimizer::SgdStep(const SgdOptions& options, int64_t step, std::span<float> params,
                             std::span<const float> grads, std::span<float> momentum_buffer,
                             std::span<uint16_t> half_params, HalfDtype half_dtype) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(CheckStep(step));
  size_t n = params.size();
  MEMPLAN_RETURN_IF_ERROR(CheckSize("grads", grads.size(), n));
  bool use_momentum = options.momentum != 0;
  if (use_momentum)
    MEMPLAN_RETURN_IF_ERROR(CheckSize("momentum_buffer", momentum_buffer.size(), n));
  MEMPLAN_RETURN_IF_ERROR(CheckHalf(half_params, half_dtype, n));

  // torch.optim.SGD (1.13): d = g + wd * p; buf = d on the first step, else buf * momentum + (1 -
  // dampening) * d; d = nesterov ? d + momentum * buf : buf; p += -lr * d.
  const float inv_grad_scale = static_cast<float>(1.0 / options.grad_scale);
  const bool scale_grads = options.grad_scale != 1.0;
  const float weight_decay = static_cast<float>(options.weight_decay);
  const bool decay = options.weight_decay != 0;
  const float momentum = static_cast<float>(options.momentum);
  const float keep = static_cast<float>(1.0 - options.dampening);
  const float neg_lr = static_cast<float>(-options.lr);
  const bool first = step == 1;
  float* p = params.data();
  const float* g = grads.data();
  float* buf = momentum_buffer.data();
  uint16_t* half = half_dtype == HalfDtype::kNone ? nullptr : half_params.data();
  pool_->Run(n, tile_elements_, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float d = g[i];
      if (scale_grads) d = d * inv_grad_scale;
      if (decay) d = d + weight_decay * p[i];
      if (use_momentum) {
        float b = first ? d : buf[i] * momentum + keep * d;
        buf[i] = b;
        d = options.nesterov ? d + momentum * b : b;
      }
      p[i] = p[i] + neg_lr * d;
      if (half != nullptr) half[i] = internal::ToHalf(p[i], half_dtype);
    }
  });
  return Status::Ok();
}

Status CpuOptimizer::LionStep(const LionOptions& options, int64_t step, std::span<float> params,
                              std::span<const float> grads, std::span<float> exp_avg,
                              std::span<uint16_t> half_params, HalfDtype half_dtype) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(CheckStep(step));
  size_t n = params.size();
  MEMPLAN_RETURN_IF_ERROR(CheckSize("grads", grads.size(), n));
  MEMPLAN_RETURN_IF_ERROR(CheckSize("exp_avg", exp_avg.size(), n));
  MEMPLAN_RETURN_IF_ERROR(CheckHalf(half_params, half_dtype, n));

  const float inv_grad_scale = static_cast<float>(1.0 / options.grad_scale);
  const bool scale_grads = options.grad_scale != 1.0;
  const float decay = static_cast<float>(1.0 - options.lr * options.weight_decay);
  const bool decoupled = options.weight_decay != 0;
  const float beta1 = static_cast<float>(options.beta1);
  const float one_minus_beta1 = static_cast<float>(1.0 - options.beta1);
  const float beta2 = static_cast<float>(options.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - options.beta2);
  const float neg_lr = static_cast<float>(-options.lr);
  float* p = params.data();
  const float* g = grads.data();
  float* m = exp_avg.data();
  uint16_t* half = half_dtype == HalfDtype::kNone ? nullptr : half_params.data();
  pool_->Run(n, tile_elements_, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float grad = g[i];
      if (scale_grads) grad = grad * inv_grad_scale;
      float param = decoupled ? p[i] * decay : p[i];
      float c = m[i] * beta1 + one_minus_beta1 * grad;
      // sign() as torch.sign: 0 stays 0 (so does NaN, which propagates through the add).
      float sign = c > 0 ? 1.0f : (c < 0 ? -1.0f : c);
      param = param + neg_lr * sign;
      p[i] = param;
      m[i] = m[i] * beta2 + one_minus_beta2 * grad;
      if (half != nullptr) half[i] = internal::ToHalf(param, half_dtype);
    }
  });
  return Status::Ok();
}

Status CpuOptimizer::ConvertToHalf(std::span<const float> src, std::span<uint16_t> dst,
                                   HalfDtype dtype) {
  if (dtype == HalfDtype::kNone) return Status::InvalidArgument("dtype: must be bf16 or fp16");
  MEMPLAN_RETURN_IF_ERROR(CheckSize("dst", dst.size(), src.size()));
  HalfKernel kernel = HalfKernelFor(isa_);
  pool_->Run(src.size(), tile_elements_,
             [&](size_t begin, size_t end) { kernel(src.data(), dst.data(), dtype, begin, end); });
  return Status::Ok();
}

void GradientNormParts::Add(const GradientNormParts& other) {
  sum_squares += other.sum_squares;
  sum_abs += other.sum_abs;
  max_abs = std::max(max_abs, other.max_abs);
  nan += other.nan;
  inf += other.inf;
}

Result<double> GradientNormParts::Norm(double p) const {
  MEMPLAN_RETURN_IF_ERROR(ValidateNormType(p));
  if (nan > 0) return std::numeric_limits<double>::quiet_NaN();
  if (inf > 0) return kInf;
  if (p == 1) return sum_abs;
  if (p == 2) return std::sqrt(sum_squares);
  return max_abs;
}

Status ValidateNormType(double norm_type) {
  if (norm_type == 1 || norm_type == 2 || norm_type == kInf) return Status::Ok();
  return Status::InvalidArgument("norm_type: must be 1, 2 or inf, got " + Describe(norm_type));
}

GradientNormParts MeasureGradients(std::span<const float> grads) {
  // Eight independent partial sums: the additions of one do not wait for the previous one's, and
  // the order of every addition is fixed, so the result does not depend on the compiler's
  // vectorisation. A non-finite element is counted, and left out of the sums (whose NaN would
  // otherwise hide whether it was a NaN or an inf).
  constexpr size_t kLanes = 8;
  double squares[kLanes] = {}, abs[kLanes] = {}, max[kLanes] = {};
  GradientNormParts out;
  const size_t n = grads.size();
  const size_t whole = n / kLanes * kLanes;
  const float* g = grads.data();
  bool finite = true;
  for (size_t i = 0; i < whole; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      const double x = g[i + k];
      const double a = std::fabs(x);
      squares[k] += x * x;
      abs[k] += a;
      max[k] = a > max[k] ? a : max[k];
    }
  }
  for (size_t k = 0; k < kLanes; ++k) finite = finite && std::isfinite(squares[k]);
  auto count = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const double x = g[i];
      if (std::isnan(x)) {
        ++out.nan;
      } else if (std::isinf(x)) {
        ++out.inf;
      } else {
        out.sum_squares += x * x;
        out.sum_abs += std::fabs(x);
        out.max_abs = std::max(out.max_abs, std::fabs(x));
      }
    }
  };
  if (!finite) {
    // A NaN or an inf among the whole lanes (rare: an overflowed fp16 step): count element by
    // element, in order. Finite fp32 squares cannot overflow a double, so this is the only cause.
    count(0, n);
    return out;
  }
  for (size_t k = 0; k < kLanes; ++k) {
    out.sum_squares += squares[k];
    out.sum_abs += abs[k];
    out.max_abs = std::max(out.max_abs, max[k]);
  }
  count(whole, n);
  return out;
}

}  // namespace memplan::offload
