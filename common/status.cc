#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace memplan {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kDataLoss: return "DataLoss";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code())) + ": " + rep_->message;
}

Status Status::FromErrno(int err, std::string_view msg) {
  std::string text = std::string(msg) + ": " + std::strerror(err);
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOENT: code = StatusCode::kNotFound; break;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM: code = StatusCode::kResourceExhausted; break;
    case EAGAIN:
    case EINTR: code = StatusCode::kUnavailable; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    default: break;
  }
  return Status(code, text, err);
}

Status Status::WithPrefix(std::string_view prefix) const {
  if (ok()) return *this;
  std::string msg = std::string(prefix) + ": " + rep_->message;
  return Status(rep_->code, msg, rep_->sys_errno);
}

}  // namespace memplan
