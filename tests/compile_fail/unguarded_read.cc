// Must not compile under clang -Wthread-safety -Werror (ctest compile_fail_unguarded_read,
// WILL_FAIL): `count_` is GUARDED_BY(mu_), and Get reads it without the lock. With
// -DMEMPLAN_TAKE_LOCK it takes the lock and must compile (ctest compile_ok_unguarded_read).
#include "common/mutex.h"

class Counter {
 public:
  int Get() {
#ifdef MEMPLAN_TAKE_LOCK
    memplan::MutexLock lock(&mu_);
#endif
    return count_;
  }

 private:
  memplan::Mutex mu_;
  int count_ GUARDED_BY(mu_) = 0;
};

int main() {
  Counter counter;
  return counter.Get();
}
