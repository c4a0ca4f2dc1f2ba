#include "common/mutex.h"

#include <doctest/doctest.h>

#include <chrono>
#include <thread>

namespace memplan {
namespace {

struct Flag {
  Mutex mu;
  CondVar cv;
  bool set GUARDED_BY(mu) = false;
};

TEST_CASE("CondVar: a waiter wakes when another thread sets the condition and signals") {
  Flag flag;
  std::thread setter([&flag] {
    {
      MutexLock lock(&flag.mu);
      flag.set = true;
    }
    flag.cv.SignalAll();
  });
  {
    MutexLock lock(&flag.mu);
    while (!flag.set) flag.cv.Wait(&flag.mu);
    CHECK(flag.set);
  }
  setter.join();
}

TEST_CASE("CondVar: WaitUntil gives up at the deadline, still holding the mutex") {
  Flag flag;
  MutexLock lock(&flag.mu);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::milliseconds(20);
  bool signalled = true;
  while (!flag.set && (signalled = flag.cv.WaitUntil(&flag.mu, deadline))) {
  }
  CHECK_FALSE(signalled);
  CHECK(std::chrono::steady_clock::now() >= deadline);
  flag.set = true;  // held: the analysis and the mutex agree
  CHECK(flag.set);
}

TEST_CASE("MutexLock: Unlock lets another thread in, Lock takes the mutex back") {
  Flag flag;
  MutexLock lock(&flag.mu);
  lock.Unlock();
  std::thread other([&flag] {
    MutexLock inner(&flag.mu);
    flag.set = true;
  });
  other.join();
  lock.Lock();
  CHECK(flag.set);
}

TEST_CASE("ReaderMutexLock: readers share a SharedMutex") {
  SharedMutex mu;
  ReaderMutexLock first(&mu);
  bool second_got_in = false;
  std::thread reader([&mu, &second_got_in] {
    ReaderMutexLock second(&mu);  // would block forever were the first lock exclusive
    second_got_in = true;
  });
  reader.join();
  CHECK(second_got_in);
}

}  // namespace
}  // namespace memplan
