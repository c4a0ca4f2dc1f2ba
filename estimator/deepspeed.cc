#include "estimator/deepspeed.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/checked_math.h"

namespace memplan::estimator {
namespace {

// Note [Reproducing Python's arithmetic]
// DeepSpeed computes in Python: integer products are exact big ints, `/` is true division to a
// double, `int*float` converts the int to the nearest double first, and int() truncates toward
// zero. Each helper below keeps that order of operations so results match to the byte, including
// for node counts whose reciprocal is inexact (1/3) and for counts above 2^53.

constexpr int64_t kMaxGpus = int64_t{1} << 20;

Status Overflow(const char* what) {
  return Status::OutOfRange(std::string("DeepSpeed estimate overflows 64 bits (") + what + ")");
}

// Exact integer product, as Python's big ints are.
Result<uint64_t> Mul(uint64_t a, uint64_t b, const char* what) {
  auto out = CheckedMul(a, b);
  if (!out) return Overflow(what);
  return *out;
}

// Python int() of a non-negative double.
Result<uint64_t> Truncate(double value, const char* what) {
  if (!std::isfinite(value) || value < 0 || value >= 18446744073709551616.0) {
    return Overflow(what);
  }
  return static_cast<uint64_t>(value);
}

// int(numerator / denominator) with Python's true division.
Result<uint64_t> TruncDiv(uint64_t numerator, uint64_t denominator, const char* what) {
  return Truncate(static_cast<double>(numerator) / static_cast<double>(denominator), what);
}

Result<uint64_t> AddBytes(uint64_t a, uint64_t b, const char* what) {
  auto out = CheckedAdd(a, b);
  if (!out) return Overflow(what);
  return *out;
}

// Python's max(int_a, float_b) then `params * that * factor`: the int wins ties (max returns its
// first argument unless the second is strictly greater), and the product with an int is exact
// before the float multiply.
Result<double> TimesMax(uint64_t params, uint64_t int_a, double float_b, double factor,
                        const char* what) {
  if (float_b > static_cast<double>(int_a)) {
    return static_cast<double>(params) * float_b * factor;
  }
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t exact, Mul(params, int_a, what));
  return static_cast<double>(exact) * factor;
}

void AppendLine(std::string* out, const char* format, double cpu, double gpu,
                const std::string& options) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), format, cpu, gpu, options.c_str());
  *out += buf;
}

constexpr double kGiB = 1073741824.0;  // DeepSpeed divides by 2**30 and prints "GB"

std::string Header(const DeepSpeedHardware& hw) {
  return "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with " +
         std::to_string(hw.nodes) + (hw.nodes > 1 ? " nodes, " : " node, ") +
         std::to_string(hw.gpus_per_node) + (hw.gpus_per_node > 1 ? " GPUs" : " GPU") +
         " per node.\n";
}

// Python's int(x / 1e6) for the "M total params" line.
std::string Millions(uint64_t params) {
  return std::to_string(static_cast<uint64_t>(static_cast<double>(params) / 1e6));
}

}  // namespace

Status DeepSpeedHardware::Validate() const {
  if (nodes < 1) return Status::InvalidArgument("`nodes` must be at least 1");
  if (gpus_per_node < 1) return Status::InvalidArgument("`gpus_per_node` must be at least 1");
  if (nodes > kMaxGpus || gpus_per_node > kMaxGpus || nodes * gpus_per_node > kMaxGpus) {
    return Status::InvalidArgument(
        "`nodes` x `gpus_per_node` is absurdly large (limit 1048576 GPUs)");
  }
  if (!std::isfinite(buffer_factor) || buffer_factor < 0 || buffer_factor > 1000) {
    return Status::InvalidArgument("`buffer_factor` must be a number between 0 and 1000");
  }
  return Status::Ok();
}

Result<Zero2Row> EstimateZero2(uint64_t total_params, const DeepSpeedHardware& hw,
                               bool offload_optimizer) {
  MEMPLAN_RETURN_IF_ERROR(hw.Validate());
  const uint64_t g = static_cast<uint64_t>(hw.gpus_per_node);
  const uint64_t total_gpus = static_cast<uint64_t>(hw.nodes) * g;
  const double f = hw.buffer_factor;
  Zero2Row row;
  row.offload_optimizer = offload_optimizer;
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t two_p, Mul(2, total_params, "2P"));
  if (offload_optimizer) {
    row.gpu_bytes = two_p;
    // cpu = P * max(4 * G, 16) * f: both arguments are ints here.
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t exact,
                             Mul(total_params, std::max<uint64_t>(4 * total_gpus, 16), "cpu"));
    MEMPLAN_ASSIGN_OR_RETURN(row.cpu_bytes, Truncate(static_cast<double>(exact) * f, "cpu"));
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t eighteen_p, Mul(18, total_params, "18P"));
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t shard, TruncDiv(eighteen_p, total_gpus, "18P/G"));
    MEMPLAN_ASSIGN_OR_RETURN(row.gpu_bytes, AddBytes(two_p, shard, "gpu"));
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t exact, Mul(total_params, 4 * g, "cpu"));
    MEMPLAN_ASSIGN_OR_RETURN(row.cpu_bytes, Truncate(static_cast<double>(exact) * f, "cpu"));
  }
  return row;
}

Result<Zero3Row> EstimateZero3(uint64_t total_params, uint64_t largest_layer_params,
                               const DeepSpeedHardware& hw, bool offload_param,
                               bool offload_optimizer, bool zero_init) {
  MEMPLAN_RETURN_IF_ERROR(hw.Validate());
  const uint64_t g = static_cast<uint64_t>(hw.gpus_per_node);
  const uint64_t total_gpus = static_cast<uint64_t>(hw.nodes) * g;
  const double gpus_factor = 1.0 / static_cast<double>(hw.nodes);
  const double f = hw.buffer_factor;
  Zero3Row row;
  row.offload_param = offload_param;
  row.offload_optimizer = offload_optimizer;
  row.zero_init = zero_init;
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t largest_layer_memory, Mul(4, largest_layer_params, "4L"));
  double cpu = 0;
  if (offload_optimizer) {
    // 18 bytes/param on CPU with params offloaded too, 16 without (fp16 params stay on GPU).
    const uint64_t per_param = offload_param ? 18 : 16;
    if (offload_param) {
      row.gpu_bytes = largest_layer_memory;
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(uint64_t two_p, Mul(2, total_params, "2P"));
      MEMPLAN_ASSIGN_OR_RETURN(uint64_t shard, TruncDiv(two_p, total_gpus, "2P/G"));
      MEMPLAN_ASSIGN_OR_RETURN(row.gpu_bytes, AddBytes(largest_layer_memory, shard, "gpu"));
    }
    if (zero_init) {
      // total_params * 18 * gpus_factor * f, left to right.
      MEMPLAN_ASSIGN_OR_RETURN(uint64_t exact, Mul(total_params, per_param, "cpu"));
      cpu = static_cast<double>(exact) * gpus_factor * f;
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(
          cpu,
          TimesMax(total_params, 4 * g, static_cast<double>(per_param) * gpus_factor, f, "cpu"));
    }
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t eighteen_p, Mul(18, total_params, "18P"));
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t shard, TruncDiv(eighteen_p, total_gpus, "18P/G"));
    MEMPLAN_ASSIGN_OR_RETURN(row.gpu_bytes, AddBytes(largest_layer_memory, shard, "gpu"));
    MEMPLAN_ASSIGN_OR_RETURN(uint64_t exact,
                             Mul(zero_init ? largest_layer_params : total_params, 4 * g, "cpu"));
    cpu = static_cast<double>(exact) * f;
  }
  MEMPLAN_ASSIGN_OR_RETURN(row.cpu_bytes, Truncate(cpu, "cpu"));
  return row;
}

Result<std::vector<Zero2Row>> Zero2Table(uint64_t total_params, const DeepSpeedHardware& hw) {
  std::vector<Zero2Row> rows;
  for (bool offload_optimizer : {true, false}) {
    MEMPLAN_ASSIGN_OR_RETURN(Zero2Row row, EstimateZero2(total_params, hw, offload_optimizer));
    rows.push_back(row);
  }
  return rows;
}

Result<std::vector<Zero3Row>> Zero3Table(uint64_t total_params, uint64_t largest_layer_params,
                                         const DeepSpeedHardware& hw) {
  std::vector<Zero3Row> rows;
  for (bool offload_optimizer : {true, false}) {
    for (bool offload_param : {true, false}) {
      if (!offload_optimizer && offload_param) continue;
      for (bool zero_init : {true, false}) {
        MEMPLAN_ASSIGN_OR_RETURN(
            Zero3Row row, EstimateZero3(total_params, largest_layer_params, hw, offload_param,
                                        offload_optimizer, zero_init));
        rows.push_back(row);
      }
    }
  }
  return rows;
}

std::string FormatZero2Text(uint64_t total_params, const DeepSpeedHardware& hw,
                            const std::vector<Zero2Row>& rows) {
  std::string out = Header(hw) + "SW: Model with " + Millions(total_params) +
                    "M total params.\n  per CPU  |  per GPU |   Options\n";
  for (const Zero2Row& row : rows) {
    AppendLine(&out, " %7.2fGB | %6.2fGB | %s\n", static_cast<double>(row.cpu_bytes) / kGiB,
               static_cast<double>(row.gpu_bytes) / kGiB,
               std::string("offload_optimizer=") + (row.offload_optimizer ? "cpu " : "none"));
  }
  return out;
}

std::string FormatZero3Text(uint64_t total_params, uint64_t largest_layer_params,
                            const DeepSpeedHardware& hw, const std::vector<Zero3Row>& rows) {
  std::string out = Header(hw) + "SW: Model with " + Millions(total_params) + "M total params, " +
                    Millions(largest_layer_params) +
                    "M largest layer params.\n  per CPU  |  per GPU |   Options\n";
  for (const Zero3Row& row : rows) {
    std::string options = std::string("offload_param=") + (row.offload_param ? "cpu " : "none") +
                          ", offload_optimizer=" + (row.offload_optimizer ? "cpu " : "none") +
                          ", zero_init=" + (row.zero_init ? "1" : "0");
    AppendLine(&out, " %7.2fGB | %6.2fGB | %s\n", static_cast<double>(row.cpu_bytes) / kGiB,
               static_cast<double>(row.gpu_bytes) / kGiB, options);
  }
  return out;
}

}  // namespace memplan::estimator
