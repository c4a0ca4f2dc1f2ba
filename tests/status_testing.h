// REQUIRE_OK / CHECK_OK: doctest assertions on a Status or Result<T> that print the Status
// ("IoError: pwrite ...: No space left on device") when it is not OK, where REQUIRE(x.ok())
// prints only "false". Header-only.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "common/status.h"

namespace memplan::testing {

// "OK", or the error as Status::ToString() writes it; for another type with ok() (a scratch
// directory that could not be made), just whether it is.
template <typename T>
std::string StatusText(const T& value) {
  if constexpr (requires { value.status().ToString(); }) {
    return value.status().ToString();
  } else if constexpr (requires { value.ToString(); }) {
    return value.ToString();
  } else {
    return value.ok() ? "OK" : "not OK";
  }
}

}  // namespace memplan::testing

// The status is bound to a reference first, so `expr` is evaluated once and a temporary lives
// until the assertion has printed it.
#define MEMPLAN_ASSERT_OK_(assertion, expr)                          \
  do {                                                               \
    const auto& memplan_ok_ = (expr);                                \
    INFO(#expr " is ", ::memplan::testing::StatusText(memplan_ok_)); \
    assertion(memplan_ok_.ok());                                     \
  } while (0)

#define REQUIRE_OK(expr) MEMPLAN_ASSERT_OK_(REQUIRE, expr)
#define CHECK_OK(expr) MEMPLAN_ASSERT_OK_(CHECK, expr)
