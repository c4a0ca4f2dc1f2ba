// Mutex, SharedMutex and CondVar: std::mutex, std::shared_mutex and std::condition_variable with
// the clang thread-safety annotations of common/thread_annotations.h, so that -Wthread-safety can
// check every GUARDED_BY field (Note [Thread-safety analysis]). Same cost as the std types: each
// wraps one and adds nothing at run time. Modelled on LevelDB's port::Mutex and Abseil's Mutex.
//
//   Mutex mu_;
//   int count_ GUARDED_BY(mu_) = 0;
//   ...
//   MutexLock lock(&mu_);        // held to the end of the scope; lock.Unlock() / Lock() in between
//   while (count_ == 0) cv_.Wait(&mu_);
//
// A condition is waited for with an explicit loop around CondVar::Wait, not a predicate lambda:
// the analysis checks a lambda as a function of its own, which does not hold the lock.
//
// Thread safety: these are the synchronisation; any thread may use them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "common/thread_annotations.h"

namespace memplan {

class CondVar;

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }

  // Tells the analysis that this mutex is held, where it cannot see so itself (another object's
  // path to a mutex the caller holds). Checks nothing at run time: the caller states why it holds.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction. Unlock() and Lock() let a scope drop the lock
// around slow work (I/O, a callback) and take it back; the destructor releases it only if held.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() {
    mu_->Unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// Many readers or one writer.
class CAPABILITY("shared mutex") SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  void LockShared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds a SharedMutex exclusively (WriterMutexLock) or shared (ReaderMutexLock) for its scope.
class SCOPED_CAPABILITY WriterMutexLock {
 public:
  explicit WriterMutexLock(SharedMutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~WriterMutexLock() RELEASE() { mu_->Unlock(); }
  WriterMutexLock(const WriterMutexLock&) = delete;
  WriterMutexLock& operator=(const WriterMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

class SCOPED_CAPABILITY ReaderMutexLock {
 public:
  explicit ReaderMutexLock(SharedMutex* mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_->LockShared(); }
  ~ReaderMutexLock() RELEASE() { mu_->UnlockShared(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// A condition variable waited on with a Mutex held. Wakes may be spurious: wait in a loop.
//
// Note [Signal wakes every waiter]
// glibc's pthread_cond_signal can lose a wake-up: a waiter stays asleep although it was signalled
// and its condition holds (sourceware bug 25847, in every glibc from 2.25 until the condition
// variable fixes of early 2025; Debian 12's 2.36 has no backport of them). pthread_cond_broadcast
// does not lose one. A single hang in offload_test had that shape: the POSIX backend's reaper
// waited for a completion, and every I/O worker was asleep on its work condition (seen once in
// many runs, not reproduced on purpose, so not proven to be this bug). Every waiter in
// this code base re-checks its predicate under the mutex, so Signal() broadcasts: a wake-up too
// many costs a context switch, one lost hangs the process.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, blocks until signalled (or spuriously), and takes `mu` back before returning.
  void Wait(Mutex* mu) REQUIRES(*mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // `mu` stays held: the caller's MutexLock owns it
  }

  // As Wait, but gives up at `deadline`: false when it returned because the deadline passed.
  template <class Clock, class Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      REQUIRES(*mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool signalled = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }

  // Wakes at least one waiter: all of them (Note [Signal wakes every waiter]).
  void Signal() { cv_.notify_all(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace memplan
