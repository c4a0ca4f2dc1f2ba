// Hostile model files through LoadModel, the entry point `memplan estimate --model FILE` uses:
// deep nesting, invalid UTF-8, a 10 MB config and one over the size limit. Each must end in a
// clear error naming the file (or, for a big but valid file, a result) in bounded time, never a
// crash or an allocation sized by the input's claims. Lying safetensors lengths and offsets,
// overflowing shape products and negative or zero dims are covered beside their readers
// (safetensors_test.cc, shape_list_test.cc, hf_families_decoder_test.cc).
#include <doctest/doctest.h>
#include <unistd.h>

#include <ctime>
#include <string>

#include "estimator/model_source.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

using testing::TempDir;

constexpr char kLlama[] = R"("model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32)";

struct Timed {
  Result<ModelInventory> result = Status::Internal("unset");
  double seconds = 0;
};

// Note [CPU time, not wall time]: the bound guards against super-linear parsing, which shows as
// CPU time; wall time also counts whatever else the machine runs (a sanitizer build on a loaded
// CI host took 17 s of wall time for 3 s of CPU), so the limits are on this process's CPU time.
double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

Timed Load(const std::string& path) {
  const double start = CpuSeconds();
  Timed t;
  t.result = LoadModel(path, ModelClassChoice::kFromArchitectures);
  t.seconds = CpuSeconds() - start;
  return t;
}

// Sanitizer builds parse many times slower, and scripts/test.sh's AddressSanitizer build compiles
// the test files at -O0, whose copies of the JSON library's templates the linker keeps for the
// library too (the top-level CMakeLists.txt): the 10 MB config below took 24 s of CPU there, under
// 10 at -O1. The bounds scale; super-linear parsing of 10 MB would still take far longer.
constexpr double kSlowdown = memplan::testing::kSanitizerBuild ? 5 : 1;

// The error's message, which must start with `path`; the load must have failed within 5 s.
std::string ErrorOf(const std::string& path) {
  Timed t = Load(path);
  CHECK(t.seconds < 5.0 * kSlowdown);
  REQUIRE_FALSE(t.result.ok());
  const std::string message = t.result.status().message();
  CHECK(message.rfind(path, 0) == 0);
  return message;
}

TEST_CASE("hostile input: a config.json nested 100000 deep is refused before parsing") {
  TempDir tmp("memplan_hostile_");
  const std::string nested = "{" + std::string(kLlama) + ", \"x\": " + std::string(100000, '[') +
                             std::string(100000, ']') + "}";
  const std::string path = tmp.Write("config.json", nested).string();
  CHECK(ErrorOf(path) == path + ": JSON nested 100001 levels deep (limit 64)");
  // As deep as a shape list's limit, through the same entry point.
  const std::string deep_list = "{\"w\": " + std::string(65, '[') + std::string(65, ']') + "}";
  const std::string list = tmp.Write("shapes.json", deep_list).string();
  CHECK(ErrorOf(list) == list + ": JSON nested 66 levels deep (limit 64)");
}

TEST_CASE("hostile input: invalid UTF-8 in a config.json or a shape list is an error naming it") {
  TempDir tmp("memplan_hostile_");
  for (const std::string& bad : {std::string("\xff\xfe"), std::string("\xc0\xaf"),  // overlong
                                 std::string("\xed\xa0\x80"),                       // surrogate
                                 std::string("ab\xe2\x82")}) {                      // truncated
    CAPTURE(bad.size());
    const std::string config =
        tmp.Write("config.json",
                  "{" + std::string(kLlama) + ", \"architectures\": [\"Llama" + bad + "\"]}")
            .string();
    std::string error = ErrorOf(config);
    CHECK(error.find(": invalid JSON") != std::string::npos);
    CHECK(error.find("UTF-8") != std::string::npos);
    const std::string list =
        tmp.Write("shapes.json", "{\"layer" + bad + ".weight\": [4, 4]}").string();
    error = ErrorOf(list);
    CHECK(error.find(": invalid JSON") != std::string::npos);
    CHECK(error.find("UTF-8") != std::string::npos);
  }
}

TEST_CASE("hostile input: a 10 MB config.json loads in bounded time") {
  TempDir tmp("memplan_hostile_");
  // Real configs can carry big label maps; 400,000 labels is about 10 MB of JSON. A sanitizer
  // build, which checks the memory and not the time, loads a tenth of each file: this case was 34 s
  // of scripts/test.sh's AddressSanitizer run (Note [CI time] there).
  const int labels_count = memplan::testing::kSanitizerBuild ? 40000 : 400000;
  const size_t big = memplan::testing::kSanitizerBuild ? size_t{1} << 20 : size_t{10} << 20;
  std::string labels;
  for (int i = 0; i < labels_count; ++i) {
    labels +=
        (i ? ", \"" : "\"") + std::to_string(i) + "\": \"label number " + std::to_string(i) + "\"";
  }
  const std::string text = "{" + std::string(kLlama) + ", \"id2label\": {" + labels + "}}";
  REQUIRE(text.size() > big);
  const std::string path = tmp.Write("config.json", text).string();
  Timed t = Load(path);
  REQUIRE_MESSAGE(t.result.ok(), t.result.status().ToString());
  CHECK(t.result->tensors.size() == 291);
  CHECK(t.seconds < 10.0 * kSlowdown);

  // 10 MB of one string, and 10 MB that is not JSON at all (a tenth of each under a sanitizer).
  const std::string blob =
      "{" + std::string(kLlama) + ", \"notes\": \"" + std::string(big, 'x') + "\"}";
  const std::string blob_path = tmp.Write("blob.json", blob).string();
  t = Load(blob_path);
  CHECK_OK(t.result);
  CHECK(t.seconds < 10.0 * kSlowdown);
  const std::string junk = tmp.Write("junk.json", std::string(big, '{')).string();
  CHECK(ErrorOf(junk).find("levels deep") != std::string::npos);
}

TEST_CASE("hostile input: a model file over the size limit is refused without reading it") {
  TempDir tmp("memplan_hostile_");
  // Sparse: 1 GiB of nothing costs no disk, and must not cost memory or time either.
  const std::string path = tmp.Write("config.json", "{" + std::string(kLlama) + "}").string();
  REQUIRE(::truncate(path.c_str(), off_t{1} << 30) == 0);
  std::string error = ErrorOf(path);
  CHECK(error.find("-byte limit") != std::string::npos);
}

}  // namespace
}  // namespace memplan::estimator
