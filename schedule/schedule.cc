#include "schedule/schedule.h"

#include "common/json.h"

namespace memplan::offload {

Status Schedule::Validate() const {
  if ((param_tier == Tier::kNvme || optimizer_tier == Tier::kNvme) && nvme_path.empty()) {
    return Status::InvalidArgument("schedule: nvme.path is needed when a tier is nvme");
  }
  if (optimizer_tier == Tier::kGpu) {
    return Status::InvalidArgument(
        "schedule: optimizer.tier gpu is not run by the engine (its optimizer is the CPU one); "
        "use cpu or nvme");
  }
  if (prefetch_bytes == 0) return Status::InvalidArgument("schedule: params.prefetch_bytes is 0");
  if (max_live_bytes == 0) return Status::InvalidArgument("schedule: params.max_live_bytes is 0");
  if (param_buffer_bytes < 4096 || param_buffer_bytes % 4096 != 0) {
    return Status::InvalidArgument(
        "schedule: params.buffer_bytes must be a positive multiple of "
        "4096");
  }
  if (param_buffer_count < 2) {
    return Status::InvalidArgument("schedule: params.buffer_count must be at least 2");
  }
  if (sub_group_elements == 0 || sub_group_elements % 1024 != 0) {
    return Status::InvalidArgument(
        "schedule: optimizer.sub_group_elements must be a positive multiple of 1024");
  }
  if (optimizer_buffer_count < 2) {
    return Status::InvalidArgument("schedule: optimizer.buffer_count must be at least 2");
  }
  if (optimizer_state_slots != 1 && optimizer_state_slots != 2) {
    return Status::InvalidArgument(
        "schedule: optimizer.state_slots must be 1 (states rewritten in place: half the drive "
        "space, no resume after a crash mid-step) or 2 (crash-safe), not " +
        std::to_string(optimizer_state_slots));
  }
  if (optimizer_threads < 0 || optimizer_threads > 4096) {
    return Status::InvalidArgument("schedule: optimizer.threads must be in 0..4096");
  }
  if (nvme_block_size < 4096 || nvme_block_size % 4096 != 0 || nvme_block_size > (64u << 20)) {
    return Status::InvalidArgument(
        "schedule: nvme.block_size must be a multiple of 4096, at most "
        "64 MiB");
  }
  if (nvme_io_threads < 1 || nvme_io_threads > 64) {
    return Status::InvalidArgument("schedule: nvme.intra_op_parallelism must be in 1..64");
  }
  if (nvme_queue_depth < 1 || nvme_queue_depth > 4096) {
    return Status::InvalidArgument("schedule: nvme.queue_depth must be in 1..4096");
  }
  return Status::Ok();
}

nlohmann::ordered_json ToOrderedJson(const Schedule& s) {
  nlohmann::ordered_json j;
  j["version"] = Schedule::kVersion;
  j["params"] = {{"tier", std::string(TierName(s.param_tier))},
                 {"dtype", std::string(ElementTypeName(s.param_dtype))},
                 {"persistence_threshold", s.persistence_threshold},
                 {"prefetch_bytes", s.prefetch_bytes},
                 {"max_live_bytes", s.max_live_bytes},
                 {"buffer_bytes", s.param_buffer_bytes},
                 {"buffer_count", s.param_buffer_count}};
  j["optimizer"] = {{"tier", std::string(TierName(s.optimizer_tier))},
                    {"name", std::string(SwapOptimizerName(s.optimizer))},
                    {"sub_group_elements", s.sub_group_elements},
                    {"buffer_count", s.optimizer_buffer_count},
                    {"threads", s.optimizer_threads},
                    {"state_slots", s.optimizer_state_slots},
                    {"durability", std::string(DurabilityName(s.optimizer_durability))}};
  j["nvme"] = {{"path", s.nvme_path},
               {"backend", std::string(nvme::BackendKindName(s.nvme_backend))},
               {"block_size", s.nvme_block_size},
               {"queue_depth", s.nvme_queue_depth},
               {"intra_op_parallelism", s.nvme_io_threads},
               {"direct", s.nvme_direct}};
  j["pinned_budget_bytes"] = s.pinned_budget_bytes;
  return j;
}

nlohmann::json ToJson(const Schedule& s) { return nlohmann::json(ToOrderedJson(s)); }

Result<Schedule> ScheduleFromJson(const nlohmann::json& j, const std::string& source) {
  const std::string where = source.empty() ? std::string("schedule") : source;
  const JsonFieldReader r(j, where);
  MEMPLAN_RETURN_IF_ERROR(
      r.CheckKeys({"version", "params", "optimizer", "nvme", "pinned_budget_bytes"}));
  int version = Schedule::kVersion;
  MEMPLAN_RETURN_IF_ERROR(r.Integer("version", &version));
  if (version != Schedule::kVersion) {
    return r.Error("version",
                   std::to_string(version) + " is not supported (this memplan reads version 1)");
  }
  Schedule s;
  if (r.Has("params")) {
    const JsonFieldReader p = r.Child("params");
    MEMPLAN_RETURN_IF_ERROR(p.CheckKeys({"tier", "dtype", "persistence_threshold", "prefetch_bytes",
                                         "max_live_bytes", "buffer_bytes", "buffer_count"}));
    MEMPLAN_RETURN_IF_ERROR(p.Enum("tier", ParseTier, &s.param_tier));
    MEMPLAN_RETURN_IF_ERROR(p.Enum("dtype", ParseElementType, &s.param_dtype));
    MEMPLAN_RETURN_IF_ERROR(p.Integer("persistence_threshold", &s.persistence_threshold));
    MEMPLAN_RETURN_IF_ERROR(p.Integer("prefetch_bytes", &s.prefetch_bytes));
    MEMPLAN_RETURN_IF_ERROR(p.Integer("max_live_bytes", &s.max_live_bytes));
    MEMPLAN_RETURN_IF_ERROR(p.Integer("buffer_bytes", &s.param_buffer_bytes));
    MEMPLAN_RETURN_IF_ERROR(p.Integer("buffer_count", &s.param_buffer_count));
  }
  if (r.Has("optimizer")) {
    const JsonFieldReader o = r.Child("optimizer");
    MEMPLAN_RETURN_IF_ERROR(o.CheckKeys({"tier", "name", "sub_group_elements", "buffer_count",
                                         "threads", "state_slots", "durability"}));
    MEMPLAN_RETURN_IF_ERROR(o.Enum("tier", ParseTier, &s.optimizer_tier));
    MEMPLAN_RETURN_IF_ERROR(o.Enum("name", ParseSwapOptimizer, &s.optimizer));
    MEMPLAN_RETURN_IF_ERROR(o.Integer("sub_group_elements", &s.sub_group_elements));
    MEMPLAN_RETURN_IF_ERROR(o.Integer("buffer_count", &s.optimizer_buffer_count));
    MEMPLAN_RETURN_IF_ERROR(o.Integer("threads", &s.optimizer_threads));
    MEMPLAN_RETURN_IF_ERROR(o.Integer("state_slots", &s.optimizer_state_slots));
    MEMPLAN_RETURN_IF_ERROR(o.Enum("durability", ParseDurability, &s.optimizer_durability));
  }
  if (r.Has("nvme")) {
    const JsonFieldReader n = r.Child("nvme");
    MEMPLAN_RETURN_IF_ERROR(n.CheckKeys(
        {"path", "backend", "block_size", "queue_depth", "intra_op_parallelism", "direct"}));
    MEMPLAN_RETURN_IF_ERROR(n.Name("path", &s.nvme_path));
    MEMPLAN_RETURN_IF_ERROR(n.Enum("backend", nvme::ParseBackendKind, &s.nvme_backend));
    MEMPLAN_RETURN_IF_ERROR(n.Integer("block_size", &s.nvme_block_size));
    MEMPLAN_RETURN_IF_ERROR(n.Integer("queue_depth", &s.nvme_queue_depth));
    MEMPLAN_RETURN_IF_ERROR(n.Integer("intra_op_parallelism", &s.nvme_io_threads));
    MEMPLAN_RETURN_IF_ERROR(n.Bool("direct", &s.nvme_direct));
  }
  MEMPLAN_RETURN_IF_ERROR(r.Integer("pinned_budget_bytes", &s.pinned_budget_bytes));
  // Validate()'s messages say "schedule: ..." already: prefix only another source's name.
  Status valid = s.Validate();
  if (!valid.ok() && where != "schedule") valid = valid.WithPrefix(where);
  MEMPLAN_RETURN_IF_ERROR(valid);
  return s;
}

}  // namespace memplan::offload
