#include "common/mutex.h"

#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

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

TEST_CASE("CondVar: Signal wakes every waiter (Note [Signal wakes every waiter])") {
  // Three threads wait with a deadline; one Signal. Each counts whether a wake-up, not its
  // deadline, ended its wait. With notify_one two of them would sleep to the deadline.
  struct {
    Mutex mu;
    CondVar cv;
    bool set GUARDED_BY(mu) = false;
    int waiting GUARDED_BY(mu) = 0;
    int woken GUARDED_BY(mu) = 0;
  } flag;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      MutexLock lock(&flag.mu);
      ++flag.waiting;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      // Only the signal below makes this wait end before the deadline (spurious wake-ups
      // continue it).
      while (!flag.set && flag.cv.WaitUntil(&flag.mu, deadline)) {
      }
      if (flag.set) ++flag.woken;
    });
  }
  // Every waiter is inside its wait before the signal: each registers under the mutex it waits
  // with.
  for (;;) {
    MutexLock lock(&flag.mu);
    if (flag.waiting == 3) break;
    lock.Unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto start = std::chrono::steady_clock::now();
  {
    MutexLock lock(&flag.mu);
    flag.set = true;
  }
  flag.cv.Signal();
  for (std::thread& t : waiters) t.join();
  MutexLock lock(&flag.mu);
  CHECK(flag.woken == 3);
  // Woken by the signal, not by their deadlines.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
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
