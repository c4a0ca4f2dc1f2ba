// Status and Result<T>: the one error currency of memplan.
//
// Every fallible function below tools/ returns a Status (or a Result<T>, which holds either a value
// or a non-OK Status). No exception crosses a module boundary; code that calls a throwing
// third-party library catches at that boundary and converts. Only tools/ turns a Status into an
// exit code and a one-line message.
//
// Both are [[nodiscard]]: a dropped error does not compile (-Werror; tests/compile_fail); code
// that means to ignore one says so with (void).
//
// An OK Status holds no allocation and costs one pointer test. Messages are meant for users: they
// name the file and the field at fault ("config.json: field 'hidden_size': must be > 0, got -4").
//
// Thread safety: Status and Result are values; distinct objects may be used from any thread.
#pragma once

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace memplan {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // bad user input: a flag, a file's content
  kNotFound,            // a file, model or key that does not exist
  kIoError,             // the OS refused a read or write
  kOutOfRange,          // a number too large, an arithmetic overflow
  kFailedPrecondition,  // the system is not in a state to do this
  kResourceExhausted,   // memory, disk, a budget
  kUnimplemented,
  kDataLoss,     // stored data is corrupt or lost (checksum mismatch, torn write)
  kUnavailable,  // transient: the same call may succeed if retried (EAGAIN, EINTR)
  kInternal,     // a bug in memplan
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, msg}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, msg}; }
  static Status IoError(std::string msg) { return {StatusCode::kIoError, msg}; }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, msg}; }
  static Status FailedPrecondition(std::string msg) {
    return {StatusCode::kFailedPrecondition, msg};
  }
  static Status ResourceExhausted(std::string msg) { return {StatusCode::kResourceExhausted, msg}; }
  static Status Unimplemented(std::string msg) { return {StatusCode::kUnimplemented, msg}; }
  static Status DataLoss(std::string msg) { return {StatusCode::kDataLoss, msg}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, msg}; }
  // Maps an errno to a code (ENOENT -> NotFound, ENOSPC/EDQUOT/ENOMEM -> ResourceExhausted,
  // EAGAIN/EINTR -> Unavailable, EINVAL -> InvalidArgument, else IoError) with
  // "<msg>: <strerror>" as the message; the Status keeps the errno (sys_errno()).
  static Status FromErrno(int err, std::string_view msg);
  static Status Internal(std::string msg) { return {StatusCode::kInternal, msg}; }

  bool ok() const { return rep_ == nullptr; }
  // True for errors worth retrying unchanged (kUnavailable).
  bool retryable() const { return code() == StatusCode::kUnavailable; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The user-facing message; empty for OK.
  const std::string& message() const;
  // The errno of a Status made by FromErrno (kept through WithPrefix); 0 otherwise. Bindings give
  // it to their language's OS error (Python's OSError.errno).
  int sys_errno() const { return rep_ ? rep_->sys_errno : 0; }
  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithPrefix(std::string_view prefix) const;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    int sys_errno = 0;
  };
  Status(StatusCode code, std::string& msg, int sys_errno = 0)
      : rep_(std::make_shared<const Rep>(Rep{code, std::move(msg), sys_errno})) {}

  std::shared_ptr<const Rep> rep_;  // null when OK
};

// Holds a T or a non-OK Status. Constructing from an OK Status is a bug and yields kInternal.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status)                      // NOLINT(google-explicit-constructor)
      : v_(status.ok() ? Status::Internal("Result constructed from an OK Status")
                       : std::move(status)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  // Precondition: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace memplan

#define MEMPLAN_CONCAT_INNER_(a, b) a##b
#define MEMPLAN_CONCAT_(a, b) MEMPLAN_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define MEMPLAN_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::memplan::Status memplan_status_ = (expr);        \
    if (!memplan_status_.ok()) return memplan_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status from the enclosing function.
#define MEMPLAN_ASSIGN_OR_RETURN(lhs, expr) \
  MEMPLAN_ASSIGN_OR_RETURN_IMPL_(MEMPLAN_CONCAT_(memplan_result_, __LINE__), lhs, expr)
#define MEMPLAN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
