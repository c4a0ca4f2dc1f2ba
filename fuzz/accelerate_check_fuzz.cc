// libFuzzer entry point: each input goes through AccelerateCheckOne in fuzz/fuzz_targets.cc.
// Seeds: fuzz/corpus/accelerate_check/. Crashes found: fuzz/regressions/accelerate_check/.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memplan::Status broken = memplan::fuzz::AccelerateCheckOne(
      std::string_view(reinterpret_cast<const char*>(data), size));
  if (!broken.ok()) {
    std::fprintf(stderr, "%s\n", broken.ToString().c_str());
    std::abort();
  }
  return 0;
}
