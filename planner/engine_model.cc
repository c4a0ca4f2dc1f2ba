#include "planner/engine_model.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/byte_size.h"
#include "schedule/schedule.h"

namespace memplan::planner {
namespace {

constexpr uint64_t kPage = 4096;
// offload/optimizer_swapper.cc: the page of header before each sub-group's state value, and the
// step's begin mark (one uint64_t) put before anything of it is written.
constexpr uint64_t kSlotHeaderBytes = 4096;
constexpr uint64_t kBegunMarkBytes = 8;
// offload/engine_gradients.h: the gradient staging (Note [Asynchronous gradients]).
constexpr uint64_t kGradSlots = 4;
constexpr uint64_t kMaxGradSlotBytes = uint64_t{4} << 20;
// offload/param_swapper.cc: a released parameter used again within this many modules is kept.
constexpr size_t kReuseModules = 2;

uint64_t Pages(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

uint64_t Shard(uint64_t numel, int world) {
  const auto w = static_cast<uint64_t>(world);
  return numel / w + (numel % w != 0 ? 1 : 0);
}

// The parameter swapper's bookkeeping of live and prefetched bytes (offload/param_swapper.cc:
// Fetch, Release, EndOfStep, PrefetchLocked, NextUseSoonLocked), without the transfers: which
// parameters are loaded when, and how many bytes are live, follow from the calls and the budgets
// alone.
class SwapperBookkeeping {
 public:
  struct Param {
    uint64_t bytes = 0;  // its GPU buffer
    uint64_t load = 0;   // what a fetch reads from the tier (this rank's shard)
    bool resident = false;
    bool live = false;
    bool prefetched = false;
    int uses = 0;
  };

  SwapperBookkeeping(std::vector<Param> params, std::vector<std::vector<size_t>> units,
                     uint64_t prefetch_bytes, uint64_t max_live_bytes)
      : p_(std::move(params)),
        units_(std::move(units)),
        units_of_(p_.size()),
        prefetch_(prefetch_bytes),
        max_live_(max_live_bytes) {
    for (size_t u = 0; u < units_.size(); ++u) {
      for (size_t id : units_[u]) units_of_[id].push_back(u);
    }
  }

  void Fetch(size_t unit) {
    if (recording_) {
      trace_.push_back(unit);
    } else {
      ++pos_;  // the same model, the same order: the trace is followed
    }
    for (size_t id : units_[unit]) {
      if (!p_[id].resident && !p_[id].live) Enqueue(id, /*prefetch=*/false);
    }
    if (!recording_) Prefetch(pos_);
    for (size_t id : units_[unit]) {
      Param& p = p_[id];
      ++p.uses;
      if (p.resident) continue;
      if (p.prefetched) {
        ahead_ -= p.bytes;
        p.prefetched = false;
      }
    }
  }

  void Release(size_t unit) {
    for (size_t id : units_[unit]) {
      Param& p = p_[id];
      --p.uses;
      if (p.resident || p.uses > 0) continue;
      if (NextUseSoon(id) && ahead_ + p.bytes <= prefetch_) {
        p.prefetched = true;
        ahead_ += p.bytes;
        continue;
      }
      Home(p);
    }
  }

  void EndOfStep() {
    for (Param& p : p_) {
      if (!p.resident && p.uses == 0 && p.live) Home(p);
    }
    recording_ = false;
    pos_ = 0;
  }

  uint64_t read_bytes() const { return read_; }
  void reset_read_bytes() { read_ = 0; }
  uint64_t peak_live_bytes() const { return peak_; }

 private:
  void Enqueue(size_t id, bool prefetch) {
    Param& p = p_[id];
    p.live = true;
    p.prefetched = prefetch;
    live_ += p.bytes;
    peak_ = std::max(peak_, live_);
    if (prefetch) ahead_ += p.bytes;
    read_ += p.load;
  }
  void Home(Param& p) {
    p.live = false;
    live_ -= p.bytes;
    if (p.prefetched) ahead_ -= p.bytes;
    p.prefetched = false;
  }
  bool NextUseSoon(size_t id) const {
    if (recording_) return false;
    const std::vector<size_t>& uses = units_of_[id];  // one unit, or a few for a tied one
    for (size_t i = pos_; i < std::min(trace_.size(), pos_ + kReuseModules); ++i) {
      if (std::find(uses.begin(), uses.end(), trace_[i]) != uses.end()) return true;
    }
    return false;
  }
  void Prefetch(size_t from) {
    for (size_t i = from; i < trace_.size(); ++i) {
      for (size_t id : units_[trace_[i]]) {
        const Param& p = p_[id];
        if (p.resident || p.live) continue;
        if (ahead_ + p.bytes > prefetch_ || live_ + p.bytes > max_live_) return;
        Enqueue(id, /*prefetch=*/true);
      }
    }
  }

  std::vector<Param> p_;
  std::vector<std::vector<size_t>> units_;
  std::vector<std::vector<size_t>> units_of_;  // per parameter: the units that use it
  uint64_t prefetch_, max_live_;
  std::vector<size_t> trace_;
  bool recording_ = true;
  size_t pos_ = 0;
  uint64_t live_ = 0, ahead_ = 0, peak_ = 0, read_ = 0;
};

uint64_t ParamElementBytes(const offload::Schedule& s) {
  return s.param_dtype == offload::ElementType::kFloat32 ? 4 : 2;
}

// The parameters as the engine registers them (tied tensors once, used by each unit naming them)
// and the fetch units in order of first use: memplan.torch's grouping (Note [Engine model]).
struct Registered {
  std::vector<SwapperBookkeeping::Param> params;
  std::vector<std::vector<size_t>> units;
  uint64_t largest_shard = 0;  // elements
};

// Registers the inventory's parameters; fills the prediction's geometry (params, fetch units,
// partition, resident bytes, the largest staged piece).
Result<Registered> RegisterParams(const offload::Schedule& s,
                                  const estimator::ModelInventory& inventory, int world,
                                  EnginePrediction* out) {
  const uint64_t eb = ParamElementBytes(s);
  Registered r;
  std::map<std::string, size_t> param_of, unit_of;
  uint64_t largest_piece = 0;
  const uint64_t chunk_bytes = s.sub_group_elements * eb;
  for (const estimator::TensorInfo& t : inventory.tensors) {
    if (t.numel == 0) continue;
    const std::string unit_name =
        !t.block.empty() ? t.block : (t.module.empty() ? std::string("<root>") : t.module);
    auto [unit_it, new_unit] = unit_of.emplace(unit_name, r.units.size());
    if (new_unit) r.units.emplace_back();
    std::vector<size_t>& unit = r.units[unit_it->second];
    size_t id = 0;
    auto tied = t.tied_to.empty() ? param_of.end() : param_of.find(t.tied_to);
    if (tied != param_of.end()) {
      id = tied->second;
    } else {
      SwapperBookkeeping::Param p;
      const uint64_t shard = Shard(t.numel, world);
      p.bytes = (world == 1 ? t.numel : shard * static_cast<uint64_t>(world)) * eb;
      p.load = s.param_tier == offload::Tier::kNvme ? shard * eb : 0;
      p.resident =
          (world == 1 && s.param_tier == offload::Tier::kGpu) || t.numel <= s.persistence_threshold;
      out->partition_elements += shard;
      r.largest_shard = std::max(r.largest_shard, shard);
      if (p.resident) {
        out->resident_param_bytes += p.bytes;
      } else if (s.param_tier == offload::Tier::kNvme) {
        largest_piece = std::max(largest_piece,
                                 std::min({shard * eb, chunk_bytes, Pages(s.param_buffer_bytes)}));
      }
      id = r.params.size();
      r.params.push_back(p);
      param_of[t.name] = id;
    }
    // A new parameter is in no unit yet; a tied one may be in this one already.
    if (tied == param_of.end() || std::find(unit.begin(), unit.end(), id) == unit.end()) {
      unit.push_back(id);
    }
  }
  if (r.params.empty()) {
    return Status::InvalidArgument("engine model: the model has no parameters");
  }
  out->params = r.params.size();
  out->fetch_units = r.units.size();
  out->largest_piece_bytes = largest_piece;
  const uint64_t sg = s.sub_group_elements;
  out->sub_groups = (out->partition_elements + sg - 1) / sg;
  return r;
}

// Pinned memory, as the engine allocates it, and the engine's refusals of a pinned budget too
// small for it.
Status PredictPinned(const offload::Schedule& s, const EngineRunOptions& run,
                     uint64_t largest_shard, EnginePrediction* out) {
  const uint64_t eb = ParamElementBytes(s);
  const uint64_t sg = s.sub_group_elements;
  const auto states = static_cast<uint64_t>(offload::SwapOptimizerStates(s.optimizer));
  if (s.param_tier == offload::Tier::kNvme) {
    out->param_staging_pinned_bytes = s.param_buffer_count * Pages(s.param_buffer_bytes);
    if (s.pinned_budget_bytes > 0 &&
        s.param_buffer_bytes * s.param_buffer_count > s.pinned_budget_bytes) {
      return Status::ResourceExhausted(
          "the engine refuses this schedule: the parameter staging buffers need " +
          std::to_string(s.param_buffer_bytes * s.param_buffer_count) +
          " pinned bytes; pinned_budget_bytes is " + std::to_string(s.pinned_budget_bytes));
    }
  }
  if (s.param_tier == offload::Tier::kCpu) {
    out->param_arena_pinned_bytes = Pages(out->partition_elements * eb);
  }
  if (s.optimizer_tier == offload::Tier::kNvme) {
    const uint64_t slot = Pages(kSlotHeaderBytes + (1 + states) * 4 * sg) + Pages(4 * sg) +
                          (eb == 2 ? Pages(2 * sg) : 0);
    out->optimizer_pinned_bytes = s.optimizer_buffer_count * slot;
    if (s.pinned_budget_bytes > 0 &&
        out->optimizer_pinned_bytes + out->param_staging_pinned_bytes > s.pinned_budget_bytes) {
      return Status::ResourceExhausted(
          "the engine refuses this schedule: the optimizer's pinned buffers (" +
          std::to_string(out->optimizer_pinned_bytes) + " bytes) and the parameter staging (" +
          std::to_string(out->param_staging_pinned_bytes) + ") exceed pinned_budget_bytes " +
          std::to_string(s.pinned_budget_bytes));
    }
  }
  if (run.gpu) {
    uint64_t slot = std::min(kMaxGradSlotBytes, Pages(largest_shard * 4));
    if (s.pinned_budget_bytes > 0) {
      const uint64_t used = out->param_staging_pinned_bytes + out->optimizer_pinned_bytes;
      const uint64_t left = s.pinned_budget_bytes > used ? s.pinned_budget_bytes - used : 0;
      slot = std::min(slot, left / kGradSlots / kPage * kPage);
      if (slot < kPage) {
        return Status::ResourceExhausted("the engine refuses this schedule: pinned_budget_bytes " +
                                         std::to_string(s.pinned_budget_bytes) + " leaves " +
                                         std::to_string(left) +
                                         " bytes for the gradient staging, which needs at least " +
                                         std::to_string(kGradSlots * kPage));
      }
    }
    out->gradient_staging_pinned_bytes = kGradSlots * slot;
  }
  out->pinned_bytes = out->param_staging_pinned_bytes + out->param_arena_pinned_bytes +
                      out->optimizer_pinned_bytes + out->gradient_staging_pinned_bytes;
  return Status::Ok();
}

// Parameter fetches: the swapper's bookkeeping over three steps (the first records the trace).
void PredictParamTraffic(const offload::Schedule& s, const EngineRunOptions& run,
                         Registered registered, EnginePrediction* out) {
  const std::vector<std::vector<size_t>>& units = registered.units;
  SwapperBookkeeping book(std::move(registered.params), units, s.prefetch_bytes, s.max_live_bytes);
  for (int step = 0; step < 3; ++step) {
    book.reset_read_bytes();
    for (uint32_t m = 0; m < run.micro_batches; ++m) {
      for (size_t u = 0; u < units.size(); ++u) {
        book.Fetch(u);
        book.Release(u);
      }
      for (size_t u = units.size(); u-- > 0;) {
        book.Fetch(u);
        book.Release(u);
      }
    }
    book.EndOfStep();
    if (step == 0) out->first_step_param_read_bytes = book.read_bytes();
  }
  out->param_read_bytes_per_step = book.read_bytes();
  out->peak_live_param_bytes = book.peak_live_bytes();
  if (s.param_tier == offload::Tier::kNvme) {
    out->param_write_bytes_per_step = out->partition_elements * ParamElementBytes(s);
  }
}

// The optimizer's NVMe traffic: each sub-group's state slot and gradients read, the new slot and
// the gradients written, and the step's begin mark.
void PredictOptimizerTraffic(const offload::Schedule& s, EnginePrediction* out) {
  if (s.optimizer_tier != offload::Tier::kNvme) return;
  const uint64_t partition = out->partition_elements;
  const uint64_t sg = s.sub_group_elements;
  const auto states = static_cast<uint64_t>(offload::SwapOptimizerStates(s.optimizer));
  for (uint64_t first = 0; first < partition; first += sg) {
    const uint64_t n = std::min(sg, partition - first);
    const uint64_t value = kSlotHeaderBytes + (1 + states) * 4 * n;
    out->optimizer_read_bytes_per_step += value + 4 * n;   // state slot, fp32 gradients
    out->optimizer_write_bytes_per_step += value + 4 * n;  // new state slot, gradients put
  }
  out->optimizer_write_bytes_per_step += kBegunMarkBytes;
}

// What the NVMe stores take on the drive, as the engine preallocates them: the parameter store
// (engine_params.cc: the partition in the working dtype, 64 KiB per sub-group-sized chunk, 1 MiB)
// and the optimizer's (OptimizerSwapper::RequiredStoreBytes: per sub-group, state_slots state
// values and the fp32 gradients, each rounded to 64 KiB, and 1 MiB).
void PredictStores(const offload::Schedule& s, EnginePrediction* out) {
  constexpr uint64_t kExtent = uint64_t{64} << 10, kMeta = uint64_t{1} << 20;
  auto round = [](uint64_t n, uint64_t to) { return (n + to - 1) / to * to; };
  const uint64_t partition = out->partition_elements;
  const uint64_t sg = s.sub_group_elements;
  const uint64_t chunks = (partition + sg - 1) / sg;
  if (s.param_tier == offload::Tier::kNvme) {
    out->param_store_bytes = partition * ParamElementBytes(s) + chunks * kExtent + kMeta;
  }
  if (s.optimizer_tier == offload::Tier::kNvme) {
    const auto states = static_cast<uint64_t>(offload::SwapOptimizerStates(s.optimizer));
    for (uint64_t first = 0; first < partition; first += sg) {
      const uint64_t n = std::min(sg, partition - first);
      out->optimizer_store_bytes +=
          s.optimizer_state_slots * round(kSlotHeaderBytes + (1 + states) * 4 * n, kExtent) +
          round(4 * n, kExtent);
    }
    out->optimizer_store_bytes += kMeta;
  }
  out->nvme_store_bytes = out->param_store_bytes + out->optimizer_store_bytes;
}

std::vector<std::string> Assumptions(const EngineRunOptions& run) {
  return {
      "memplan's offload engine (not DeepSpeed) running this schedule; Note [Engine model] in "
      "planner/engine_model.h",
      "every parameter trains (no frozen parameters, every parameter gets a gradient each step)",
      "fetch units as memplan.torch groups them (one per repeated block, one per other module), "
      "forward in the inventory's order and backward in reverse, " +
          std::to_string(run.micro_batches) + " micro-batch(es) per step",
      std::string("world size ") + std::to_string(run.world_size) +
          (run.gpu ? "; a GPU runtime (gradient staging pinned)"
                   : "; the host-only runtime (no gradient staging)")};
}

}  // namespace

Result<EnginePrediction> PredictEngine(const offload::Schedule& s,
                                       const estimator::ModelInventory& inventory,
                                       const EngineRunOptions& run) {
  if (run.world_size < 1) return Status::InvalidArgument("engine model: world_size < 1");
  if (run.micro_batches < 1) return Status::InvalidArgument("engine model: micro_batches < 1");
  if (s.sub_group_elements == 0 || s.prefetch_bytes == 0 || s.max_live_bytes == 0 ||
      s.param_buffer_bytes == 0 || s.param_buffer_count == 0 || s.optimizer_buffer_count == 0) {
    return Status::InvalidArgument("engine model: a size or count of the schedule is 0");
  }
  EnginePrediction out;
  MEMPLAN_ASSIGN_OR_RETURN(Registered registered,
                           RegisterParams(s, inventory, run.world_size, &out));
  const uint64_t largest_shard = registered.largest_shard;
  MEMPLAN_RETURN_IF_ERROR(PredictPinned(s, run, largest_shard, &out));
  PredictParamTraffic(s, run, std::move(registered), &out);
  PredictOptimizerTraffic(s, &out);
  PredictStores(s, &out);
  out.nvme_read_bytes_per_step = out.param_read_bytes_per_step + out.optimizer_read_bytes_per_step;
  out.nvme_write_bytes_per_step =
      out.param_write_bytes_per_step + out.optimizer_write_bytes_per_step;
  out.assumptions = Assumptions(run);
  return out;
}

nlohmann::ordered_json ToJson(const EnginePrediction& p) {
  nlohmann::ordered_json j;
  j["pinned_bytes"] = p.pinned_bytes;
  j["pinned"] = {{"param_staging_bytes", p.param_staging_pinned_bytes},
                 {"param_arena_bytes", p.param_arena_pinned_bytes},
                 {"optimizer_buffer_bytes", p.optimizer_pinned_bytes},
                 {"gradient_staging_bytes", p.gradient_staging_pinned_bytes}};
  j["nvme_read_bytes_per_step"] = p.nvme_read_bytes_per_step;
  j["nvme_write_bytes_per_step"] = p.nvme_write_bytes_per_step;
  j["nvme"] = {{"param_read_bytes_per_step", p.param_read_bytes_per_step},
               {"param_write_bytes_per_step", p.param_write_bytes_per_step},
               {"optimizer_read_bytes_per_step", p.optimizer_read_bytes_per_step},
               {"optimizer_write_bytes_per_step", p.optimizer_write_bytes_per_step},
               {"first_step_param_read_bytes", p.first_step_param_read_bytes},
               {"param_store_bytes", p.param_store_bytes},
               {"optimizer_store_bytes", p.optimizer_store_bytes}};
  j["nvme_store_bytes"] = p.nvme_store_bytes;
  j["peak_live_param_bytes"] = p.peak_live_param_bytes;
  j["resident_param_bytes"] = p.resident_param_bytes;
  j["params"] = p.params;
  j["partition_elements"] = p.partition_elements;
  j["sub_groups"] = p.sub_groups;
  j["fetch_units"] = p.fetch_units;
  j["largest_piece_bytes"] = p.largest_piece_bytes;
  j["assumptions"] = p.assumptions;
  return j;
}

std::string FormatEnginePrediction(const EnginePrediction& p, const std::string& schedule) {
  return "memplan's engine on " + schedule +
         " (predicted, per GPU process): " + FormatByteSize(p.pinned_bytes) + " pinned, NVMe " +
         FormatByteSize(p.nvme_read_bytes_per_step) + " read and " +
         FormatByteSize(p.nvme_write_bytes_per_step) + " written per step, " +
         FormatByteSize(p.nvme_store_bytes) + " of NVMe stores, at most " +
         FormatByteSize(p.peak_live_param_bytes) + " of fetched parameters on the GPU (" +
         FormatByteSize(p.resident_param_bytes) + " resident)\n";
}

}  // namespace memplan::planner
