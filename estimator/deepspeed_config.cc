#include "estimator/deepspeed_config.h"

#include <cmath>
#include <utility>

#include "common/checked_math.h"
#include "common/json.h"

namespace memplan::estimator {

namespace {

constexpr int64_t kMaxCount = TrainingSetup::kMaxCount;
constexpr int64_t kMaxBufferElements = TrainingSetup::kMaxBufferElements;

// Typed reads of one DeepSpeed config object with "auto" detection. `path` is the key's dotted
// path for errors ("zero_optimization.reduce_bucket_size").
class DsReader {
 public:
  DsReader(const nlohmann::json& j, std::string source, std::string prefix)
      : j_(j), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool Has(const char* key) const {
    return j_.is_object() && j_.contains(key) && !j_[key].is_null();
  }
  bool IsAuto(const char* key) const {
    return Has(key) && j_[key].is_string() && j_[key].get<std::string>() == "auto";
  }
  const nlohmann::json& At(const char* key) const { return j_[key]; }
  std::string Path(const char* key) const { return prefix_ + key; }

  Status Error(const char* key, const std::string& problem) const {
    return Status::InvalidArgument(source_ + ": '" + Path(key) + "' " + problem);
  }
  // "auto" with no way to fill it.
  Status AutoError(const char* key, const std::string& flag) const {
    return Error(key, "is \"auto\", which only the Hugging Face Trainer fills in; pass " + flag +
                          " to give its value");
  }

  // An integer in [lo, hi]; JSON floats with an integral value (5e8) are accepted.
  Status Int(const char* key, int64_t lo, int64_t hi, int64_t* out) const {
    if (!Has(key)) return Status::Ok();
    const nlohmann::json& v = j_[key];
    if (!v.is_number()) return Error(key, "must be a number, got " + v.dump());
    double d = v.get<double>();
    if (!std::isfinite(d) || std::floor(d) != d || d < static_cast<double>(lo) ||
        d > static_cast<double>(hi)) {
      return Error(key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                            "], got " + v.dump());
    }
    *out = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
    return Status::Ok();
  }
  Status Bool(const char* key, bool* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_boolean()) return Error(key, "must be true or false, got " + j_[key].dump());
    *out = j_[key].get<bool>();
    return Status::Ok();
  }
  Status String(const char* key, std::string* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_string()) return Error(key, "must be a string, got " + j_[key].dump());
    *out = j_[key].get<std::string>();
    return Status::Ok();
  }
  // A sub-object (absent: an empty object), refusing other types.
  Result<nlohmann::json> Object(const char* key) const {
    if (!Has(key)) return nlohmann::json::object();
    if (!j_[key].is_object()) return Error(key, "must be an object");
    return j_[key];
  }

 private:
  const nlohmann::json& j_;
  std::string source_;
  std::string prefix_;
};

// A bucket size that may be "auto": the Trainer fills it from the model width.
Status BucketSize(const DsReader& r, const char* key, int64_t hidden, double factor, int64_t* out) {
  if (r.IsAuto(key)) {
    if (hidden <= 0) {
      return r.Error(key, "is \"auto\" and the model's hidden size is unknown; give a number");
    }
    *out = static_cast<int64_t>(factor * static_cast<double>(hidden) * static_cast<double>(hidden));
    return Status::Ok();
  }
  return r.Int(key, 0, kMaxBufferElements, out);
}

Status Device(const DsReader& r, const char* key, OffloadDevice* out) {
  if (!r.Has(key)) return Status::Ok();
  std::string text;
  MEMPLAN_RETURN_IF_ERROR(r.String(key, &text));
  Result<OffloadDevice> device = ParseOffloadDevice(text);
  if (!device.ok())
    return r.Error(key, "must be \"none\", \"cpu\" or \"nvme\", got \"" + text + "\"");
  *out = *device;
  return Status::Ok();
}

// Whether the caller gave a setup field itself (its value then wins over the config's).
struct Supplied {
  const std::set<std::string>& fields;
  bool operator()(const char* field) const { return fields.count(field) > 0; }
};

Status ReadBatch(const DsReader& top, const Supplied& given, TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  if (top.IsAuto("train_micro_batch_size_per_gpu")) {
    if (!given("micro_batch"))
      return top.AutoError("train_micro_batch_size_per_gpu", "`micro_batch`");
  } else if (!given("micro_batch")) {
    MEMPLAN_RETURN_IF_ERROR(
        top.Int("train_micro_batch_size_per_gpu", 1, kMaxCount, &s.micro_batch));
  }
  if (top.IsAuto("gradient_accumulation_steps")) {
    if (!given("grad_accum")) return top.AutoError("gradient_accumulation_steps", "`grad_accum`");
  } else if (!given("grad_accum")) {
    MEMPLAN_RETURN_IF_ERROR(top.Int("gradient_accumulation_steps", 1, kMaxCount, &s.grad_accum));
  }
  return Status::Ok();
}

// fp16.enabled / bf16.enabled (older configs: "bfloat16").
Status ReadPrecision(const DsReader& top, const std::string& source, const Supplied& given,
                     TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json fp16, top.Object("fp16"));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json bf16, top.Object(top.Has("bf16") ? "bf16" : "bfloat16"));
  DsReader fp16_r(fp16, source, "fp16.");
  DsReader bf16_r(bf16, source, top.Has("bf16") ? "bf16." : "bfloat16.");
  if (!given("precision")) {
    if (fp16_r.IsAuto("enabled")) return fp16_r.AutoError("enabled", "`precision`");
    if (bf16_r.IsAuto("enabled")) return bf16_r.AutoError("enabled", "`precision`");
    bool fp16_on = false, bf16_on = false;
    MEMPLAN_RETURN_IF_ERROR(fp16_r.Bool("enabled", &fp16_on));
    MEMPLAN_RETURN_IF_ERROR(bf16_r.Bool("enabled", &bf16_on));
    if (fp16_on && bf16_on) {
      return Status::InvalidArgument(source +
                                     ": 'fp16.enabled' and 'bf16.enabled' are both true; "
                                     "DeepSpeed accepts one of them");
    }
    if (fp16_on) {
      s.precision = Precision::kFp16Mixed;
    } else if (bf16_on) {
      s.precision = Precision::kBf16Mixed;
    } else {
      // Neither enabled (or neither section at all): DeepSpeed trains in fp32.
      s.precision = Precision::kFp32;
    }
  }
  return Status::Ok();
}

Status ReadOptimizer(const DsReader& top, const std::string& source, const Supplied& given,
                     TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json opt, top.Object("optimizer"));
  DsReader opt_r(opt, source, "optimizer.");
  if (opt_r.Has("type") && !given("optimizer")) {
    std::string type;
    MEMPLAN_RETURN_IF_ERROR(opt_r.String("type", &type));
    std::string lower;
    for (char c : type)
      lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    if (lower == "adam" || lower == "adamw" || lower == "fusedadam" || lower == "cpuadam" ||
        lower == "onebitadam" || lower == "zerooneadam") {
      s.optimizer = Optimizer::kAdamW;
    } else if (lower == "lion" || lower == "fusedlion") {
      s.optimizer = Optimizer::kLion;
    } else {
      return opt_r.Error("type", "'" + type +
                                     "' is not an optimizer memplan models (Adam, AdamW, Lion; "
                                     "pass `optimizer` for others)");
    }
    // DeepSpeed builds its own kernels for these (runtime/engine.py _configure_basic_optimizer:
    // FusedAdam, FusedLion, CPU Adam), which update in place, unless params.torch_adam asks for
    // torch.optim's.
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json params, opt_r.Object("params"));
    DsReader params_r(params, source, "optimizer.params.");
    bool torch_adam = false;
    MEMPLAN_RETURN_IF_ERROR(params_r.Bool("torch_adam", &torch_adam));
    if (!given("fused_optimizer")) s.fused_optimizer = !torch_adam;
  }
  return Status::Ok();
}

// zero_optimization, its offload_optimizer and offload_param; `hidden` resolves "auto" sizes.
Status ReadZero(const DsReader& top, const std::string& source, const Supplied& given,
                int64_t hidden, TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json zero, top.Object("zero_optimization"));
  DsReader z(zero, source, "zero_optimization.");
  int64_t stage = s.zero_stage;
  for (const char* key :
       {"allgather_bucket_size", "stage3_max_live_parameters", "sub_group_size", "stage"}) {
    if (z.IsAuto(key)) {
      return z.Error(key,
                     "is \"auto\", which the Hugging Face Trainer does not fill either; "
                     "give a number");
    }
  }
  MEMPLAN_RETURN_IF_ERROR(z.Int("stage", 0, 3, &stage));
  if (!given("zero_stage")) s.zero_stage = static_cast<int>(stage);
  bool legacy_cpu_offload = false;
  MEMPLAN_RETURN_IF_ERROR(z.Bool("cpu_offload", &legacy_cpu_offload));
  if (legacy_cpu_offload && !given("offload_optimizer")) s.offload_optimizer = OffloadDevice::kCpu;
  if (z.Has("overlap_comm")) {
    bool overlap = false;
    MEMPLAN_RETURN_IF_ERROR(z.Bool("overlap_comm", &overlap));
    s.overlap_comm = overlap;
  }
  MEMPLAN_RETURN_IF_ERROR(BucketSize(z, "reduce_bucket_size", hidden, 1.0, &s.reduce_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(
      z.Int("allgather_bucket_size", 0, kMaxBufferElements, &s.allgather_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(
      BucketSize(z, "stage3_prefetch_bucket_size", hidden, 0.9, &s.stage3_prefetch_bucket_size));
  if (z.IsAuto("stage3_param_persistence_threshold")) {
    if (hidden <= 0) {
      return z.Error("stage3_param_persistence_threshold",
                     "is \"auto\" and the model's hidden size is unknown; give a number");
    }
    s.stage3_param_persistence_threshold = 10 * hidden;
  } else {
    MEMPLAN_RETURN_IF_ERROR(z.Int("stage3_param_persistence_threshold", 0, kMaxBufferElements,
                                  &s.stage3_param_persistence_threshold));
  }
  MEMPLAN_RETURN_IF_ERROR(
      z.Int("stage3_max_live_parameters", 0, kMaxBufferElements, &s.stage3_max_live_parameters));
  MEMPLAN_RETURN_IF_ERROR(z.Int("sub_group_size", 0, kMaxBufferElements, &s.sub_group_size));

  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json off_opt, z.Object("offload_optimizer"));
  DsReader oo(off_opt, source, "zero_optimization.offload_optimizer.");
  OffloadDevice optimizer_device = s.offload_optimizer;
  MEMPLAN_RETURN_IF_ERROR(Device(oo, "device", &optimizer_device));
  if (!given("offload_optimizer")) s.offload_optimizer = optimizer_device;
  MEMPLAN_RETURN_IF_ERROR(oo.Bool("pin_memory", &s.pin_memory));
  MEMPLAN_RETURN_IF_ERROR(oo.Int("buffer_count", 1, 1024, &s.optimizer_buffer_count));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json off_param, z.Object("offload_param"));
  DsReader op(off_param, source, "zero_optimization.offload_param.");
  OffloadDevice param_device = s.offload_param;
  MEMPLAN_RETURN_IF_ERROR(Device(op, "device", &param_device));
  if (!given("offload_param")) s.offload_param = param_device;
  bool param_pin = false;
  MEMPLAN_RETURN_IF_ERROR(op.Bool("pin_memory", &param_pin));
  s.pin_memory = s.pin_memory || param_pin;
  MEMPLAN_RETURN_IF_ERROR(op.Int("buffer_count", 1, 1024, &s.param_buffer_count));
  MEMPLAN_RETURN_IF_ERROR(op.Int("buffer_size", 0, kMaxBufferElements, &s.param_buffer_size));
  MEMPLAN_RETURN_IF_ERROR(op.Int("max_in_cpu", 0, kMaxBufferElements, &s.param_max_in_cpu));
  return Status::Ok();
}

Status ReadCheckpointingAndAio(const DsReader& top, const std::string& source,
                               const Supplied& given, TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  // Activation checkpointing: DeepSpeed's block configures deepspeed.checkpointing, which
  // checkpoints whole layers; its presence says the job checkpoints.
  if (top.Has("activation_checkpointing") && !given("checkpointing")) {
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json ac, top.Object("activation_checkpointing"));
    (void)ac;
    s.checkpointing = Checkpointing::kFull;
  }

  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json aio, top.Object("aio"));
  DsReader aio_r(aio, source, "aio.");
  MEMPLAN_RETURN_IF_ERROR(aio_r.Int("block_size", 1, kMaxBufferElements, &s.aio_block_size));
  MEMPLAN_RETURN_IF_ERROR(aio_r.Int("queue_depth", 1, 1 << 16, &s.aio_queue_depth));
  MEMPLAN_RETURN_IF_ERROR(aio_r.Int("intra_op_parallelism", 1, 64, &s.aio_intra_op_parallelism));
  return Status::Ok();
}

Status ReadTrainBatchSize(const DsReader& top, const Supplied& given, TrainingSetup* setup) {
  TrainingSetup& s = *setup;
  if (s.tp < 1 || s.WorldSize() % s.tp != 0) return Status::Ok();
  // train_batch_size = micro * accumulation * data-parallel world: DeepSpeed derives the micro
  // batch from it when train_micro_batch_size_per_gpu is absent, and checks it when both are set.
  // Its world is the GPUs / Ulysses' sequence_parallel_size, or data_parallel_size when both are
  // given (Note [The data-parallel world of the batch] in planner/check.cc).
  int64_t world = s.DataParallel();
  std::string ranks = " data-parallel GPUs";
  if (top.Has("sequence_parallel_size")) {
    int64_t sp = 1;
    MEMPLAN_RETURN_IF_ERROR(top.Int("sequence_parallel_size", 1, int64_t{1} << 40, &sp));
    int64_t dp = 0;
    if (top.Has("data_parallel_size")) {
      MEMPLAN_RETURN_IF_ERROR(top.Int("data_parallel_size", 1, int64_t{1} << 40, &dp));
      world = dp;
    } else if (world % sp != 0) {
      return top.Error("sequence_parallel_size", "is " + std::to_string(sp) +
                                                     ", which does not divide the " +
                                                     std::to_string(world) + " GPUs");
    } else {
      world /= sp;
    }
    ranks = " data-parallel ranks (sequence_parallel_size " + std::to_string(sp) + ")";
  }
  if (top.Has("train_batch_size") && !top.IsAuto("train_batch_size") &&
      !top.Has("train_micro_batch_size_per_gpu") && !given("micro_batch")) {
    int64_t total = 0;
    MEMPLAN_RETURN_IF_ERROR(top.Int("train_batch_size", 1, int64_t{1} << 50, &total));
    // --gpus x --nodes reach 2^40, the accumulation 2^24: the product is checked. Past 2^63 no
    // total can fill a micro-batch; the check below then reports the mismatch.
    const std::optional<int64_t> per_micro = CheckedMulInt64(s.grad_accum, world);
    s.micro_batch = per_micro ? std::max<int64_t>(1, total / *per_micro) : 1;
  }
  if (top.Has("train_batch_size") && !top.IsAuto("train_batch_size")) {
    int64_t total = 0;
    MEMPLAN_RETURN_IF_ERROR(top.Int("train_batch_size", 1, int64_t{1} << 50, &total));
    const std::optional<int64_t> product =
        CheckedProductInt64({s.micro_batch, s.grad_accum, world});
    const std::string want = product ? std::to_string(*product) : "more than 2^63";
    if (product != total) {
      return top.Error("train_batch_size", "is " + std::to_string(total) + " but micro batch " +
                                               std::to_string(s.micro_batch) + " x accumulation " +
                                               std::to_string(s.grad_accum) + " x " +
                                               std::to_string(world) + ranks + " = " + want);
    }
  }
  return Status::Ok();
}

}  // namespace

Status ApplyDeepSpeedConfig(const nlohmann::json& config, const std::string& source,
                            const std::set<std::string>& supplied, int64_t hidden,
                            TrainingSetup* setup) {
  if (!config.is_object()) {
    return Status::InvalidArgument(source + ": expected a JSON object (a DeepSpeed config)");
  }
  TrainingSetup s = *setup;
  const Supplied given{supplied};
  DsReader top(config, source, "");

  MEMPLAN_RETURN_IF_ERROR(ReadBatch(top, given, &s));
  MEMPLAN_RETURN_IF_ERROR(ReadPrecision(top, source, given, &s));
  MEMPLAN_RETURN_IF_ERROR(ReadOptimizer(top, source, given, &s));
  MEMPLAN_RETURN_IF_ERROR(ReadZero(top, source, given, hidden, &s));
  MEMPLAN_RETURN_IF_ERROR(ReadCheckpointingAndAio(top, source, given, &s));
  MEMPLAN_RETURN_IF_ERROR(ReadTrainBatchSize(top, given, &s));
  MEMPLAN_RETURN_IF_ERROR(s.Validate().WithPrefix(source));
  *setup = s;
  return Status::Ok();
}

}  // namespace memplan::estimator
