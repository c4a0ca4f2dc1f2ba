// The CPU optimizers against PyTorch (fixtures made by testdata/make_adam_fixtures.py), on every
// ISA this CPU runs and with 1 and 2 threads; the 16-bit output's rounding; option checking.
#include "offload/cpu_optimizer.h"
#include "offload/cpu_optimizer_internal.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "offload/half.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

const std::string kTestdata = std::string(MEMPLAN_SOURCE_DIR) + "/offload/testdata/";

// The same stream as draw() in make_adam_fixtures.py: exact fp32 values (k - 2^23) * 2^exponent.
std::vector<float> Draw(uint64_t seed, size_t count, int exponent) {
  std::vector<float> out(count);
  uint64_t state = seed;
  for (size_t i = 0; i < count; ++i) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    int64_t k = static_cast<int64_t>(z >> 40) - (int64_t{1} << 23);
    out[i] = static_cast<float>(k) * std::ldexp(1.0f, exponent);
  }
  return out;
}

std::vector<float> Grad(uint64_t seed, int step, size_t size) {
  return Draw(seed * 1000003 + step, size, -24 - (step % 4));
}

struct Fixture {
  std::string name;
  std::string optimizer;
  uint64_t seed = 0;
  nlohmann::json options;
  std::map<std::string, std::vector<float>> arrays;
};

struct Fixtures {
  size_t size = 0;
  int steps = 0;
  std::vector<Fixture> cases;
};

Fixtures LoadFixtures() {
  Fixtures fixtures;
  std::ifstream manifest_file(kTestdata + "optimizer_fixtures.json");
  REQUIRE_MESSAGE(manifest_file.good(), "cannot open the fixtures in " << kTestdata);
  nlohmann::json manifest = nlohmann::json::parse(manifest_file);
  fixtures.size = manifest["size"].get<size_t>();
  fixtures.steps = manifest["steps"].get<int>();
  for (const auto& entry : manifest["cases"]) {
    Fixture fixture;
    fixture.name = entry["name"].get<std::string>();
    fixture.optimizer = entry["optimizer"].get<std::string>();
    fixture.seed = entry["seed"].get<uint64_t>();
    fixture.options = entry["options"];
    std::ifstream bin(kTestdata + fixture.name + ".bin", std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(bin)),
                            std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() == entry["arrays"].size() * fixtures.size * sizeof(float));
    size_t offset = 0;
    for (const auto& array : entry["arrays"]) {
      std::vector<float> values(fixtures.size);
      std::memcpy(values.data(), bytes.data() + offset, fixtures.size * sizeof(float));
      offset += fixtures.size * sizeof(float);
      fixture.arrays[array.get<std::string>()] = std::move(values);
    }
    fixtures.cases.push_back(std::move(fixture));
  }
  return fixtures;
}

std::vector<Isa> AvailableIsas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (IsaAvailable(isa)) isas.push_back(isa);
  }
  return isas;
}

std::unique_ptr<CpuOptimizer> MakeOptimizer(Isa isa, int threads) {
  CpuOptimizerOptions options;
  options.isa = isa;
  options.threads = threads;
  // Small tiles, so 1003 elements make several and a second thread gets some of them.
  options.tile_elements = 128;
  auto optimizer = CpuOptimizer::Create(options);
  REQUIRE_MESSAGE(optimizer.ok(), optimizer.status().ToString());
  return std::move(*optimizer);
}

// The states after running `fixture`'s optimizer for `steps` steps.
struct RunOutput {
  std::map<std::string, std::vector<float>> arrays;
  std::vector<uint16_t> half;
};

RunOutput Run(const Fixture& fixture, size_t size, int steps, Isa isa, int threads,
              double grad_scale = 1.0, HalfDtype half_dtype = HalfDtype::kNone) {
  auto optimizer = MakeOptimizer(isa, threads);
  const nlohmann::json& o = fixture.options;
  RunOutput out;
  std::vector<float>& params = out.arrays["params"];
  params = Draw(fixture.seed, size, -23);
  std::vector<float> state_a(size, 0.0f);
  std::vector<float> state_b(size, 0.0f);
  std::vector<float> state_c(size, 0.0f);
  if (half_dtype != HalfDtype::kNone) out.half.assign(size, 0);
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> grads = Grad(fixture.seed, step, size);
    // Scaled by a power of two, so unscaling by grad_scale gives back the very same gradient.
    for (float& g : grads) g = static_cast<float>(g * grad_scale);
    Status status;
    if (fixture.optimizer == "adamw" || fixture.optimizer == "adam") {
      AdamOptions adam;
      adam.lr = o["lr"];
      adam.beta1 = o["betas"][0];
      adam.beta2 = o["betas"][1];
      adam.eps = o["eps"];
      adam.weight_decay = o["weight_decay"];
      adam.decoupled = fixture.optimizer == "adamw";
      adam.amsgrad = o.value("amsgrad", false);
      adam.grad_scale = grad_scale;
      AdamTensors tensors;
      tensors.params = params;
      tensors.grads = grads;
      tensors.exp_avg = state_a;
      tensors.exp_avg_sq = state_b;
      if (adam.amsgrad) tensors.max_exp_avg_sq = state_c;
      tensors.half_params = out.half;
      tensors.half_dtype = half_dtype;
      status = optimizer->AdamStep(adam, step, tensors);
    } else if (fixture.optimizer == "sgd") {
      SgdOptions sgd;
      sgd.lr = o["lr"];
      sgd.momentum = o["momentum"];
      sgd.dampening = o.value("dampening", 0.0);
      sgd.weight_decay = o["weight_decay"];
      sgd.nesterov = o.value("nesterov", false);
      sgd.grad_scale = grad_scale;
      status = optimizer->SgdStep(sgd, step, params, grads, state_a, out.half, half_dtype);
    } else {
      REQUIRE(fixture.optimizer == "lion");
      LionOptions lion;
      lion.lr = o["lr"];
      lion.beta1 = o["betas"][0];
      lion.beta2 = o["betas"][1];
      lion.weight_decay = o["weight_decay"];
      lion.grad_scale = grad_scale;
      status = optimizer->LionStep(lion, step, params, grads, state_a, out.half, half_dtype);
    }
    REQUIRE_MESSAGE(status.ok(), status.ToString());
  }
  if (fixture.optimizer == "sgd") {
    out.arrays["momentum_buffer"] = state_a;
  } else {
    out.arrays["exp_avg"] = state_a;
    if (fixture.optimizer != "lion") out.arrays["exp_avg_sq"] = state_b;
    if (o.value("amsgrad", false)) out.arrays["max_exp_avg_sq"] = state_c;
  }
  return out;
}

// The relative error of a whole array: max_i |got_i - want_i| / max_i |want_i| (a NaN anywhere
// counts as infinite). Not element by element: where a value crosses zero its own magnitude is no
// scale for rounding differences, and PyTorch's vectorised add/addcmul round differently from its
// scalar path (and from ours) by an ulp here and there, which on an element near zero is a large
// relative error of a tiny absolute one.
double MaxRelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double max_diff = 0;
  double max_want = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(diff <= max_diff)) max_diff = diff;  // NaN sticks
    max_want = std::max(max_want, std::fabs(static_cast<double>(want[i])));
  }
  if (std::isnan(max_diff)) return INFINITY;
  return max_want == 0 ? (max_diff == 0 ? 0 : INFINITY) : max_diff / max_want;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE(
    "cpu optimizers match PyTorch within 1e-6 relative error over 100 "
    "steps, every ISA") {
  Fixtures fixtures = LoadFixtures();
  REQUIRE(fixtures.cases.size() >= 6);
  for (const Fixture& fixture : fixtures.cases) {
    RunOutput reference;
    for (Isa isa : AvailableIsas()) {
      for (int threads : {1, 2}) {
        CAPTURE(fixture.name);
        CAPTURE(IsaName(isa));
        CAPTURE(threads);
        RunOutput out = Run(fixture, fixtures.size, fixtures.steps, isa, threads);
        for (const auto& [name, want] : fixture.arrays) {
          const std::string& array = name;  // clang 14's lambdas cannot capture a binding
          CAPTURE(array);
          REQUIRE(out.arrays.count(name) == 1);
          double error = MaxRelativeError(out.arrays[name], want);
          CHECK(error <= 1e-6);
        }
        // Note [Bit-identical ISAs]; and each element is updated on its own,
        // whatever the tiles.
        if (reference.arrays.empty()) {
          reference = out;
        } else {
          for (const auto& [name, values] : reference.arrays) {
            const std::string& array = name;
            CAPTURE(array);
            CHECK(SameBits(out.arrays[name], values));
          }
        }
      }
    }
  }
}

TEST_CASE("grad_scale unscales the gradients before the step") {
  Fixtures fixtures = LoadFixtures();
  for (const Fixture& fixture : fixtures.cases) {
    CAPTURE(fixture.name);
    RunOutput plain = Run(fixture, fixtures.size, 5, BestIsa(), 1);
    RunOutput scaled = Run(fixture, fixtures.size, 5, BestIsa(), 1, 1024.0);
    CHECK(SameBits(scaled.arrays["params"], plain.arrays["params"]));
  }
}

TEST_CASE("the half copy is the updated params rounded, on every ISA") {
  Fixtures fixtures = LoadFixtures();
  for (const Fixture& fixture : fixtures.cases) {
    for (HalfDtype dtype : {HalfDtype::kBf16, HalfDtype::kFp16}) {
      for (Isa isa : AvailableIsas()) {
        CAPTURE(fixture.name);
        CAPTURE(IsaName(isa));
        CAPTURE(HalfDtypeName(dtype));
        RunOutput out = Run(fixture, fixtures.size, 3, isa, 2, 1.0, dtype);
        const std::vector<float>& params = out.arrays["params"];
        size_t mismatches = 0;
        for (size_t i = 0; i < params.size(); ++i) {
          uint16_t want =
              dtype == HalfDtype::kBf16 ? FloatToBf16(params[i]) : FloatToFp16(params[i]);
          if (out.half[i] != want) ++mismatches;
        }
        CHECK(mismatches == 0);
      }
    }
  }
}

float Bits(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST_CASE("bf16 and fp16 round to nearest even and keep NaN, on every ISA") {
  struct Case {
    float value;
    uint16_t bf16;
    uint16_t fp16;
  };
  const std::vector<Case> cases = {
      {1.0f, 0x3f80, 0x3c00},
      {-2.0f, 0xc000, 0xc000},
      {-0.0f, 0x8000, 0x8000},
      {Bits(0x3f808000), 0x3f80, 0x3c04},     // 1 + 2^-8: bf16 tie, rounds to even (down)
      {Bits(0x3f818000), 0x3f82, 0x3c0c},     // 1 + 3 * 2^-8: bf16 tie, rounds to even (up)
      {Bits(0x3f808001), 0x3f81, 0x3c04},     // just above the tie: up
      {1.0f + 0x1p-11f, 0x3f80, 0x3c00},      // fp16 tie, to even (down)
      {1.0f + 3 * 0x1p-11f, 0x3f80, 0x3c02},  // fp16 tie, to even (up)
      {65504.0f, 0x4780, 0x7bff},             // largest fp16
      {65519.0f, 0x4780, 0x7bff},             // below the half-way point to 65536
      {65520.0f, 0x4780, 0x7c00},             // the half-way point: to even, which is infinity
      {Bits(0x7f7fffff), 0x7f80, 0x7c00},     // largest float: bf16 rounds up to infinity
      {INFINITY, 0x7f80, 0x7c00},
      {-INFINITY, 0xff80, 0xfc00},
      {0x1p-14f, 0x3880, 0x0400},      // smallest normal fp16
      {0x1p-24f, 0x3380, 0x0001},      // smallest subnormal fp16
      {0x1p-25f, 0x3300, 0x0000},      // half of it: tie, to even (zero)
      {3 * 0x1p-25f, 0x33c0, 0x0002},  // 1.5 steps: tie, to even (2)
      {1e-8f, 0x322c, 0x0000},
      {Bits(0x7fc00000), 0x7fc0, 0x7e00},  // quiet NaN
      {Bits(0x7f800001), 0x7fc0, 0x7e00},  // signalling NaN: quieted, not turned into infinity
      {Bits(0xffa00000), 0xffe0, 0xff00},  // negative NaN with payload: sign and top bits kept
  };
  std::vector<float> values;
  for (const Case& c : cases) values.push_back(c.value);
  for (Isa isa : AvailableIsas()) {
    CAPTURE(IsaName(isa));
    auto optimizer = MakeOptimizer(isa, 1);
    // Padded to a whole vector so the vector path, not only the scalar tail, sees every case.
    std::vector<float> padded = values;
    while (padded.size() % 16 != 0 || padded.size() < 32)
      padded.push_back(values[padded.size() % values.size()]);
    std::vector<uint16_t> bf16(padded.size());
    std::vector<uint16_t> fp16(padded.size());
    REQUIRE_OK(optimizer->ConvertToHalf(padded, bf16, HalfDtype::kBf16));
    REQUIRE_OK(optimizer->ConvertToHalf(padded, fp16, HalfDtype::kFp16));
    for (size_t i = 0; i < padded.size(); ++i) {
      const Case& c = cases[i % cases.size()];
      CAPTURE(i);
      CAPTURE(std::bit_cast<uint32_t>(c.value));
      CHECK(bf16[i] == c.bf16);
      CHECK(fp16[i] == c.fp16);
      CHECK(FloatToBf16(c.value) == c.bf16);
      CHECK(FloatToFp16(c.value) == c.fp16);
    }
  }
  // Round trips of what is representable.
  CHECK(Bf16ToFloat(0x3f82) == 1.015625f);
  CHECK(Fp16ToFloat(0x0001) == 0x1p-24f);
  CHECK(Fp16ToFloat(0x7bff) == 65504.0f);
  CHECK(std::isnan(Fp16ToFloat(0x7e00)));
}

TEST_CASE(
    "every ISA converts a sweep of bit patterns exactly as the scalar "
    "reference") {
  std::vector<float> values;
  // A prime stride visits every exponent, both signs, subnormals, infinities and NaNs.
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 4099) values.push_back(Bits(bits));
  for (HalfDtype dtype : {HalfDtype::kBf16, HalfDtype::kFp16}) {
    std::vector<uint16_t> want(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      want[i] = dtype == HalfDtype::kBf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]);
    }
    for (Isa isa : AvailableIsas()) {
      CAPTURE(IsaName(isa));
      CAPTURE(HalfDtypeName(dtype));
      auto optimizer = MakeOptimizer(isa, 2);
      std::vector<uint16_t> got(values.size());
      REQUIRE_OK(optimizer->ConvertToHalf(values, got, dtype));
      size_t mismatches = 0;
      for (size_t i = 0; i < values.size(); ++i) mismatches += got[i] != want[i];
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE(
    "bad options and mismatched spans are refused without touching the "
    "tensors") {
  auto optimizer = MakeOptimizer(Isa::kScalar, 1);
  std::vector<float> p(10, 1.0f), g(10, 1.0f), m(10, 0.0f), v(10, 0.0f), short_v(9, 0.0f);
  AdamTensors tensors;
  tensors.params = p;
  tensors.grads = g;
  tensors.exp_avg = m;
  tensors.exp_avg_sq = v;
  AdamOptions adam;
  CHECK_OK(optimizer->AdamStep(adam, 1, tensors));
  std::vector<float> after = p;

  AdamOptions bad = adam;
  bad.lr = -1;
  CHECK(optimizer->AdamStep(bad, 2, tensors).code() == StatusCode::kInvalidArgument);
  // lr 0 (a warm-up's first step) is a step, as in torch: the moments move, the weights do not.
  AdamOptions zero = adam;
  zero.lr = 0;
  const std::vector<float> params_before = p;
  CHECK_OK(optimizer->AdamStep(zero, 2, tensors));
  CHECK(SameBits(p, params_before));
  bad = adam;
  bad.beta2 = 1.0;
  CHECK(optimizer->AdamStep(bad, 2, tensors).code() == StatusCode::kInvalidArgument);
  bad = adam;
  bad.grad_scale = 0;
  CHECK(optimizer->AdamStep(bad, 2, tensors).code() == StatusCode::kInvalidArgument);
  bad = adam;
  bad.amsgrad = true;  // without max_exp_avg_sq
  CHECK(optimizer->AdamStep(bad, 2, tensors).code() == StatusCode::kInvalidArgument);
  CHECK(optimizer->AdamStep(adam, 0, tensors).code() == StatusCode::kInvalidArgument);
  AdamTensors wrong = tensors;
  wrong.exp_avg_sq = short_v;
  Status status = optimizer->AdamStep(adam, 2, wrong);
  CHECK(status.code() == StatusCode::kInvalidArgument);
  CHECK(status.message().find("exp_avg_sq") != std::string::npos);
  wrong = tensors;
  wrong.half_dtype = HalfDtype::kBf16;  // but no half_params
  CHECK(optimizer->AdamStep(adam, 2, wrong).code() == StatusCode::kInvalidArgument);
  CHECK(SameBits(p, after));

  SgdOptions sgd;
  sgd.nesterov = true;
  sgd.dampening = 0.5;
  CHECK(sgd.Validate().code() == StatusCode::kInvalidArgument);
  CpuOptimizerOptions options;
  options.threads = 0;
  CHECK(CpuOptimizer::Create(options).status().code() == StatusCode::kInvalidArgument);
}

// Gradients as a mixed-precision backward leaves them: the fixtures' gradients rounded to 16
// bits, with the values a real run meets at the edges (zeros of both signs, subnormals, the
// largest finite, infinities, NaN).
std::vector<uint16_t> HalfGrads(const std::vector<float>& grads, HalfDtype dtype) {
  std::vector<uint16_t> out(grads.size());
  // fp16 holds far less range: scale into it (a loss scale does the same).
  const float into = dtype == HalfDtype::kFp16 ? 0x1p14f : 1.0f;
  for (size_t i = 0; i < grads.size(); ++i) {
    const float g = grads[i] * into;
    out[i] = dtype == HalfDtype::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
  }
  const std::vector<uint16_t> edges =
      dtype == HalfDtype::kBf16 ? std::vector<uint16_t>{0x0000, 0x8000, 0x0001, 0x807f, 0x7f7f,
                                                        0xff7f, 0x7f80, 0xff80, 0x7fc0, 0x7f81}
                                : std::vector<uint16_t>{0x0000, 0x8000, 0x0001, 0x83ff, 0x7bff,
                                                        0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01};
  for (size_t k = 0; k < edges.size() && 37 * k + 5 < out.size(); ++k) out[37 * k + 5] = edges[k];
  return out;
}

TEST_CASE("16-bit gradients: the fused step is the step on the converted gradients, bit for bit") {
  const size_t n = 1003;  // vector bodies, tiles for two threads, and a scalar tail
  for (HalfDtype grad_dtype : {HalfDtype::kBf16, HalfDtype::kFp16}) {
    for (bool amsgrad : {false, true}) {
      for (bool decoupled : {true, false}) {
        for (double grad_scale : {1.0, 3.0}) {
          CAPTURE(HalfDtypeName(grad_dtype));
          CAPTURE(amsgrad);
          CAPTURE(decoupled);
          CAPTURE(grad_scale);
          AdamOptions options;
          options.lr = 1e-3;
          options.weight_decay = 0.1;
          options.decoupled = decoupled;
          options.amsgrad = amsgrad;
          options.grad_scale = grad_scale;
          for (Isa isa : AvailableIsas()) {
            for (int threads : {1, 2}) {
              CAPTURE(IsaName(isa));
              CAPTURE(threads);
              auto optimizer = MakeOptimizer(isa, threads);
              // fused: 16-bit gradients in; plain: the same gradients converted to fp32 first.
              std::vector<float> p_fused = Draw(7, n, -23), p_plain = p_fused;
              std::vector<float> m_fused(n, 0), m_plain(n, 0), v_fused(n, 0), v_plain(n, 0),
                  x_fused(n, 0), x_plain(n, 0);
              std::vector<uint16_t> h_fused(n, 0), h_plain(n, 0);
              for (int step = 1; step <= 5; ++step) {
                const std::vector<uint16_t> half = HalfGrads(Grad(7, step, n), grad_dtype);
                std::vector<float> converted(n);
                for (size_t i = 0; i < n; ++i) {
                  converted[i] =
                      grad_dtype == HalfDtype::kBf16 ? Bf16ToFloat(half[i]) : Fp16ToFloat(half[i]);
                }
                AdamTensors fused;
                fused.params = p_fused;
                fused.half_grads = half;
                fused.grad_dtype = grad_dtype;
                fused.exp_avg = m_fused;
                fused.exp_avg_sq = v_fused;
                if (amsgrad) fused.max_exp_avg_sq = x_fused;
                fused.half_params = h_fused;
                fused.half_dtype = HalfDtype::kBf16;
                AdamTensors plain = fused;
                plain.params = p_plain;
                plain.half_grads = {};
                plain.grad_dtype = HalfDtype::kNone;
                plain.grads = converted;
                plain.exp_avg = m_plain;
                plain.exp_avg_sq = v_plain;
                if (amsgrad) plain.max_exp_avg_sq = x_plain;
                plain.half_params = h_plain;
                REQUIRE_OK(optimizer->AdamStep(options, step, fused));
                REQUIRE_OK(optimizer->AdamStep(options, step, plain));
              }
              CHECK(SameBits(p_fused, p_plain));
              CHECK(SameBits(m_fused, m_plain));
              CHECK(SameBits(v_fused, v_plain));
              CHECK(SameBits(x_fused, x_plain));
              CHECK(h_fused == h_plain);
              // The edge values reached the update: infinities and NaN make NaN parameters.
              CHECK(std::count_if(p_fused.begin(), p_fused.end(),
                                  [](float x) { return std::isnan(x); }) > 0);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("a step larger than the cache streams its 16-bit copy, with the same bits on every ISA") {
  // Note [Streaming the 16-bit copy]: past kStreamHalfMinBytes the SIMD kernels store the copy
  // non-temporally from its first 32-byte-aligned element on. The copy here starts 3 elements
  // into its allocation (6 bytes past alignment), so the unaligned head, the streamed body and the
  // scalar tail all run, and their bits must equal the scalar kernel's, which never streams.
  const size_t n = internal::kStreamHalfMinBytes / sizeof(uint16_t) + 37;
  AdamOptions options;
  options.lr = 1e-3;
  options.weight_decay = 0.1;
  struct Out {
    std::vector<float> p, m, v;
    std::vector<uint16_t> half;
  };
  auto run = [&](Isa isa) {
    auto optimizer = MakeOptimizer(isa, 2);
    Out out{Draw(11, n, -23), std::vector<float>(n, 0), std::vector<float>(n, 0), {}};
    std::vector<uint16_t> storage(n + 3, 0);
    std::span<uint16_t> half(storage.data() + 3, n);
    for (int step = 1; step <= 2; ++step) {
      const std::vector<uint16_t> grads = HalfGrads(Grad(11, step, n), HalfDtype::kBf16);
      AdamTensors t;
      t.params = out.p;
      t.half_grads = grads;
      t.grad_dtype = HalfDtype::kBf16;
      t.exp_avg = out.m;
      t.exp_avg_sq = out.v;
      t.half_params = half;
      t.half_dtype = HalfDtype::kBf16;
      REQUIRE_OK(optimizer->AdamStep(options, step, t));
    }
    out.half.assign(half.begin(), half.end());
    return out;
  };
  const Out want = run(Isa::kScalar);
  size_t rounded_wrong = 0;
  for (size_t i = 0; i < n; ++i) rounded_wrong += want.half[i] != FloatToBf16(want.p[i]);
  CHECK(rounded_wrong == 0);
  for (Isa isa : AvailableIsas()) {
    if (isa == Isa::kScalar) continue;
    CAPTURE(IsaName(isa));
    const Out got = run(isa);
    CHECK(SameBits(got.p, want.p));
    CHECK(SameBits(got.m, want.m));
    CHECK(SameBits(got.v, want.v));
    CHECK(got.half == want.half);
  }
}

TEST_CASE("16-bit gradients: fp32 or 16-bit, one of them, of the right size") {
  auto optimizer = MakeOptimizer(BestIsa(), 1);
  std::vector<float> p(8, 1.0f), g(8, 0.5f), m(8, 0), v(8, 0);
  std::vector<uint16_t> h(8, 0x3f00), short_h(7, 0);
  AdamTensors t;
  t.params = p;
  t.exp_avg = m;
  t.exp_avg_sq = v;
  t.grads = g;
  t.half_grads = h;
  t.grad_dtype = HalfDtype::kBf16;
  Status both = optimizer->AdamStep(AdamOptions{}, 1, t);
  CHECK(both.code() == StatusCode::kInvalidArgument);
  CHECK(both.message().find("not both") != std::string::npos);
  t.grads = {};
  t.grad_dtype = HalfDtype::kNone;
  CHECK(optimizer->AdamStep(AdamOptions{}, 1, t).message().find("grad_dtype") != std::string::npos);
  t.grad_dtype = HalfDtype::kFp16;
  t.half_grads = short_h;
  CHECK(optimizer->AdamStep(AdamOptions{}, 1, t).message().find("half_grads") != std::string::npos);
  CHECK(p == std::vector<float>(8, 1.0f));  // nothing touched
  t.half_grads = h;
  t.grad_dtype = HalfDtype::kBf16;
  REQUIRE_OK(optimizer->AdamStep(AdamOptions{}, 1, t));
  CHECK(p[0] < 1.0f);  // 0x3f00 is bf16 0.5
}

TEST_CASE("bias_correction off uses the raw moments") {
  auto optimizer = MakeOptimizer(BestIsa(), 1);
  std::vector<float> p(1, 1.0f), g(1, 0.5f), m(1, 0.0f), v(1, 0.0f);
  AdamTensors tensors;
  tensors.params = p;
  tensors.grads = g;
  tensors.exp_avg = m;
  tensors.exp_avg_sq = v;
  AdamOptions adam;
  adam.weight_decay = 0;
  adam.bias_correction = false;
  REQUIRE_OK(optimizer->AdamStep(adam, 1, tensors));
  // m = 0.05, v = 0.00025: p = 1 - 1e-3 * 0.05 / (sqrt(0.00025) + 1e-8), about 1 - 3.1623e-3.
  CHECK(p[0] == doctest::Approx(1.0 - 1e-3 * 0.05 / (std::sqrt(0.00025) + 1e-8)).epsilon(1e-6));
}

}  // namespace
}  // namespace memplan::offload
