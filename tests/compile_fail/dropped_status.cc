// Must not compile (ctest compile_fail_dropped_status, WILL_FAIL): Status and Result are
// [[nodiscard]], so an error dropped on the floor is a build error with -Werror, not a silent bug.
#include "common/status.h"

memplan::Status MayFail() { return memplan::Status::IoError("disk"); }
memplan::Result<int> MayFailToo() { return 4; }

int main() {
#ifdef MEMPLAN_DROP_RESULT
  MayFailToo();
#else
  MayFail();
#endif
  return 0;
}
