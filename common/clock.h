// Seconds elapsed on the steady clock: the one helper every timed path (the engine's step
// profile, the swappers' waits) measures with. Any thread.
#pragma once

#include <chrono>

namespace memplan {

// Seconds from `start` to now, on the steady clock.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace memplan
