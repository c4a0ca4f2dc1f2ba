// Clang thread-safety annotations: which mutex guards a field, which lock a function expects held.
//
// Note [Thread-safety analysis]
// With clang and -Wthread-safety (on in every clang build, see cmake/MemplanOptions.cmake), the
// compiler checks at each access that a GUARDED_BY field is read or written with its mutex held,
// that a REQUIRES function is called with the lock held, and that every lock taken is released on
// every path. The analysis is local to one function and knows only the annotated lock types, so
// the code locks through memplan::Mutex / MutexLock (common/mutex.h), never std::mutex: libstdc++'s
// std::mutex carries no annotations. On compilers without the attributes (gcc builds the Release
// stage) the macros expand to nothing and the code is unchanged.
//
// NO_THREAD_SAFETY_ANALYSIS turns the check off for one function; each use says why on its line.
// The names follow LevelDB's port/thread_annotations.h and clang's documentation.
#pragma once

#if defined(__clang__)
#define MEMPLAN_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MEMPLAN_THREAD_ANNOTATION(x)
#endif

// On a class: its objects are locks (a capability named `x`, e.g. "mutex").
#define CAPABILITY(x) MEMPLAN_THREAD_ANNOTATION(capability(x))
// On a class: an RAII lock that acquires in its constructor and releases in its destructor.
#define SCOPED_CAPABILITY MEMPLAN_THREAD_ANNOTATION(scoped_lockable)

// On a field: read and written only with `x` held.
#define GUARDED_BY(x) MEMPLAN_THREAD_ANNOTATION(guarded_by(x))
// On a pointer field: what it points to is read and written only with `x` held.
#define PT_GUARDED_BY(x) MEMPLAN_THREAD_ANNOTATION(pt_guarded_by(x))

// On a mutex: locked only after (before) the listed ones. Documentation; clang checks it only with
// -Wthread-safety-beta.
#define ACQUIRED_AFTER(...) MEMPLAN_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define ACQUIRED_BEFORE(...) MEMPLAN_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))

// On a function: callers hold the lock(s) exclusively (shared), and still hold them on return.
#define REQUIRES(...) MEMPLAN_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) MEMPLAN_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))

// On a function: it takes (gives back) the lock(s); with no argument, the object's own.
#define ACQUIRE(...) MEMPLAN_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) MEMPLAN_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) MEMPLAN_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) MEMPLAN_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) MEMPLAN_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))

// On a function: callers must not hold the lock(s) (it takes them itself).
#define EXCLUDES(...) MEMPLAN_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

// On a function: tells the analysis, without checking, that the lock is held from here on.
#define ASSERT_CAPABILITY(x) MEMPLAN_THREAD_ANNOTATION(assert_capability(x))
// On a function: it returns a reference to the lock `x`.
#define RETURN_CAPABILITY(x) MEMPLAN_THREAD_ANNOTATION(lock_returned(x))

// On a function: no checking inside it. Each use gives its reason (Note [Thread-safety analysis]).
#define NO_THREAD_SAFETY_ANALYSIS MEMPLAN_THREAD_ANNOTATION(no_thread_safety_analysis)
