// The engine's parameter path: see engine_params.h.
//
// Note [fp32 working parameters]
// With params.dtype fp32 the working copy the trainer computes with is the master weights
// themselves, so there is no 16-bit copy to make: the optimizer runs with HalfDtype::kNone (the
// NVMe swapper's buffers then have no half section) and the write-back hands the sub-group's
// updated fp32 values, as the optimizer left them, to ParamSwapper::WriteFloat(). Every tier then
// holds 4 bytes per element (the pinned arena, the NVMe chunks "hp.<chunk>", the GPU copies and
// the budgets, all in bytes, follow ElementBytes(dtype)), and a fetched parameter equals
// ReadMasterWeights() bit for bit after every Step() and after a resume.
//
// Note [What a store holds]
// The optimizer store outlives its process (resume), and its states are meaningful only for the
// parameters that wrote them. Its element count alone cannot tell another registration with the
// same count (two layers defined in the other order, a renamed or reshaped parameter): a resume
// would put one parameter's weights and moments on another, silently (issue 30 H3). So the store
// records the registration (Identity(): every parameter's name, shape, frozen flag and the
// trainer's dtype, in order), written by OptimizerSwapper::Create() before its first commit, and a
// resume compares it with this engine's, refusing the first difference by name. A store made by an
// older memplan records none: it is accepted on its element count, with a note in the recovery
// report. A live store, of another process or another engine of this one, is refused as in use
// (RefuseLiveStore in engine_home.cc: the store's flock), never taken for a crashed run's.
//
// Note [Frozen parameters]
// A frozen parameter is in the ParamSwapper like any other (fetched, gathered, on its tier) but not
// in the optimizer. The swapper's partition is laid out trainable parameters first, in
// registration order, then the frozen ones, so the optimizer's sub-groups cover a prefix of it,
// [0, optimizer_elements), with no holes: nothing of the optimizer (its NVMe store, its pinned
// buffers, the gradient scratch and staging, sized by the largest trainable shard) grows with a
// frozen base. The frozen part starts at a chunk boundary (ParamSwapper::Pad()), so the NVMe
// write-back of the last trainable sub-group never touches a chunk holding frozen values; those
// are written once, in Start(), from their init (with resume too: they never change, and their
// init gives them again), and never after. ParamIds stay the registration indices; swap_id maps
// them to the swapper's.
#include "offload/engine_params.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/json.h"

namespace memplan::offload::internal {
namespace {

constexpr uint32_t kMaxGroups = 1024;  // ParamSpec::group's bound

}  // namespace

Result<ParamId> ParamPath::Register(const ParamSpec& spec) {
  if (spec.name.empty() || spec.module.empty()) {
    return Status::InvalidArgument("engine: a parameter needs a name and a module");
  }
  if (!spec.init) return Status::InvalidArgument("engine: parameter " + spec.name + " has no init");
  uint64_t numel = 1;
  for (int64_t d : spec.shape) {
    if (d <= 0) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " has a dimension " +
                                     std::to_string(d));
    }
    if (numel > (uint64_t{1} << 40) / static_cast<uint64_t>(d)) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " is implausibly large");
    }
    numel *= static_cast<uint64_t>(d);
  }
  for (const ParamSpec& other : specs) {
    if (other.name == spec.name) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " registered twice");
    }
  }
  if (spec.group >= kMaxGroups) {
    return Status::InvalidArgument("engine: parameter " + spec.name + " is in group " +
                                   std::to_string(spec.group) + "; groups are 0 .. " +
                                   std::to_string(kMaxGroups - 1));
  }
  groups = std::max(groups, spec.group + 1);
  specs.push_back(spec);
  numels.push_back(numel);
  total_elements += numel;
  return static_cast<ParamId>(specs.size() - 1);
}

// Lays out the partition: trainable parameters first, then the frozen ones from a chunk boundary
// (Note [Frozen parameters]); fills swap_id, spec_of, trainable_params and the frozen counts of
// `stats`. InvalidArgument when every parameter is frozen.
Result<PartitionLayout> ParamPath::LayOutPartition(EngineStats& stats) {
  const Schedule& sc = options.schedule;
  const int world = stats.world_size;
  swap_id.assign(specs.size(), 0);
  spec_of.clear();
  uint64_t total = 0, frozen_total = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].frozen != (pass == 1)) continue;
      swap_id[i] = static_cast<ParamId>(spec_of.size());
      spec_of.push_back(i);
      (pass == 0 ? total : frozen_total) += ShardElements(numels[i], world);
      if (pass == 1) {
        ++stats.frozen_params;
        stats.frozen_elements += numels[i];
      }
    }
  }
  trainable_params = specs.size() - stats.frozen_params;
  if (total == 0) {
    return Status::InvalidArgument("engine: every parameter is frozen; nothing to train");
  }
  PartitionLayout out;
  out.total = total;
  out.frozen_begin = frozen_total == 0 ? total
                                       : (total + sc.sub_group_elements - 1) /
                                             sc.sub_group_elements * sc.sub_group_elements;
  out.partition = out.frozen_begin + frozen_total;
  return out;
}

// Parameters on NVMe: their store under `nvme_dir`/params, for `partition` elements, and the
// pinned staging buffers. The working copies are derived from the master weights, so the store
// is made afresh each run; one left by a crashed run is removed first (FailedPrecondition unless
// this is a resume). ResourceExhausted when the staging buffers exceed pinned_budget_bytes.
Status ParamPath::OpenParamStore(const std::string& nvme_dir, uint64_t partition) {
  const Schedule& sc = options.schedule;
  const std::string dir = nvme_dir + "/params";
  if (::access((dir + "/" + nvme::SwapStore::kDataFileName).c_str(), F_OK) == 0) {
    // A live store (this process's or another's) says so, with or without resume.
    MEMPLAN_RETURN_IF_ERROR(RefuseLiveStore(dir, "parameter"));
    if (!options.resume) {
      return Status::FailedPrecondition(
          "engine: " + dir +
          " holds a parameter store from an earlier run; start with resume, "
          "or remove it");
    }
    for (const char* name : {nvme::SwapStore::kDataFileName, nvme::SwapStore::kIndexFileName,
                             nvme::SwapStore::kLockFileName}) {
      ::unlink((dir + "/" + name).c_str());
    }
  }
  nvme::SwapStoreOptions so;
  so.directory = dir;
  so.direct = sc.nvme_direct;
  so.backend = sc.nvme_backend;
  so.backend_options.queue_depth = sc.nvme_queue_depth;
  so.engine_options.block_size = sc.nvme_block_size;
  so.engine_options.threads = sc.nvme_io_threads;
  // A parameter is read with the checksum blocks it touches: small blocks keep that extra
  // reading and hashing small (this store is made afresh each run: no format to keep).
  so.checksum_block_bytes = uint32_t{64} << 10;
  const uint64_t chunks = (partition + sc.sub_group_elements - 1) / sc.sub_group_elements;
  so.capacity_bytes = partition * static_cast<uint64_t>(ElementBytes(sc.param_dtype)) +
                      chunks * (uint64_t{64} << 10) + (uint64_t{1} << 20);
  MEMPLAN_ASSIGN_OR_RETURN(param_store, nvme::SwapStore::Open(so));
  PinnedPoolOptions pool;
  pool.slot_bytes = sc.param_buffer_bytes;
  pool.slot_count = sc.param_buffer_count;
  pool.budget_bytes = sc.param_buffer_bytes * sc.param_buffer_count;
  if (sc.pinned_budget_bytes > 0 && pool.budget_bytes > sc.pinned_budget_bytes) {
    return Status::ResourceExhausted(
        "engine: the parameter staging buffers need " + std::to_string(pool.budget_bytes) +
        " pinned bytes; pinned_budget_bytes is " + std::to_string(sc.pinned_budget_bytes));
  }
  MEMPLAN_ASSIGN_OR_RETURN(staging, PinnedPool::Create(pool, runtime));
  // Every parameter read lands in these slots: registered, io_uring skips pinning their pages
  // per request. A refusal (RLIMIT_MEMLOCK) only costs that.
  (void)param_store->RegisterBuffers(
      nvme::RegistrationRegions(staging->memory().data(), staging->memory().size()));
  return Status::Ok();
}

// The parameter swapper, on the schedule's parameter tier (its NVMe store under `nvme_dir`),
// holding every parameter where `layout` puts it.
Status ParamPath::CreateParamSwapper(const std::string& nvme_dir,
                                     const PartitionLayout& partition) {
  const Schedule& sc = options.schedule;
  ParamSwapperOptions po;
  po.tier = sc.param_tier;
  po.dtype = sc.param_dtype;
  po.persistence_threshold = sc.persistence_threshold;
  po.prefetch_bytes = sc.prefetch_bytes;
  po.max_live_bytes = sc.max_live_bytes;
  po.chunk_elements = sc.sub_group_elements;
  po.runtime = runtime;
  po.collective = options.collective;
  po.staging_slots = sc.param_buffer_count;
  if (sc.param_tier == Tier::kNvme) {
    MEMPLAN_RETURN_IF_ERROR(OpenParamStore(nvme_dir, partition.partition));
    po.store = param_store.get();
    po.staging = staging.get();
  }
  MEMPLAN_ASSIGN_OR_RETURN(params, ParamSwapper::Create(po));
  for (size_t k = 0; k < spec_of.size(); ++k) {
    const size_t i = spec_of[k];
    const ParamSpec& p = specs[i];
    if (k == trainable_params && partition.frozen_begin > partition.total) {
      MEMPLAN_RETURN_IF_ERROR(params->Pad(partition.frozen_begin - partition.total));
    }
    MEMPLAN_ASSIGN_OR_RETURN(ParamId id, params->Add(p.name, p.module, numels[i]));
    for (const std::string& m : p.also_used_by) MEMPLAN_RETURN_IF_ERROR(params->AddUse(id, m));
  }
  return params->Finalize();
}

// Writes the working copies of the trainable parameters from the optimizer's master weights
// (after Start(), which may have resumed, and after an abandoned step).
Status ParamPath::WriteWorkingCopies(OptimizerHome& optimizer) {
  const Schedule& sc = options.schedule;
  const HalfDtype half_dtype = ToHalf(sc.param_dtype);
  const uint64_t sg_elems = optimizer.sub_group_elements();
  std::vector<float> master(std::min(sg_elems, optimizer.SubGroupSize(0)));
  std::vector<uint16_t> half(half_dtype == HalfDtype::kNone ? 0 : master.size());
  for (uint64_t sg = 0; sg < optimizer.sub_group_count(); ++sg) {
    const uint64_t n = optimizer.SubGroupSize(sg);
    std::span<float> m(master.data(), n);
    MEMPLAN_RETURN_IF_ERROR(optimizer.ReadParams(sg, m));
    if (half_dtype == HalfDtype::kNone) {
      MEMPLAN_RETURN_IF_ERROR(params->WriteFloat(sg * sg_elems, m));
      continue;
    }
    std::span<uint16_t> h(half.data(), n);
    MEMPLAN_RETURN_IF_ERROR(converter->ConvertToHalf(m, h, half_dtype));
    MEMPLAN_RETURN_IF_ERROR(params->WriteHalf(sg * sg_elems, h));
  }
  return Status::Ok();
}

// The frozen parameters' working copies, from their init, once (Note [Frozen parameters]): they
// have no master weights for WriteWorkingCopies() to derive them from.
// `fill` (partition coordinates): their values; null: their init.
Status ParamPath::WriteFrozenWorkingCopies(
    const PartitionLayout& partition,
    const std::function<Status(uint64_t, std::span<float>)>& fill) {
  const Schedule& sc = options.schedule;
  const HalfDtype half_dtype = ToHalf(sc.param_dtype);
  std::vector<float> master;
  std::vector<uint16_t> half;
  for (uint64_t at = partition.frozen_begin; at < partition.partition;
       at += sc.sub_group_elements) {
    const uint64_t n = std::min(sc.sub_group_elements, partition.partition - at);
    if (master.size() < n) master.resize(n);
    std::span<float> m(master.data(), n);
    MEMPLAN_RETURN_IF_ERROR(fill ? fill(at, m) : Fill(at, m));
    if (half_dtype == HalfDtype::kNone) {
      MEMPLAN_RETURN_IF_ERROR(params->WriteFloat(at, m));
      continue;
    }
    if (half.size() < n) half.resize(n);
    std::span<uint16_t> h(half.data(), n);
    MEMPLAN_RETURN_IF_ERROR(converter->ConvertToHalf(m, h, half_dtype));
    MEMPLAN_RETURN_IF_ERROR(params->WriteHalf(at, h));
  }
  return Status::Ok();
}

// Calls part(i, e, piece) for the pieces of partition elements [first, first + out.size()) that
// are elements [e, e + piece.size()) of parameter specs[i] (this rank's shard of it: Note [ZeRO-3
// partitions] in param_swapper.cc), and zeros the padding past each parameter's end. With world
// size 1 the partition is the flat space.
template <typename PartFn>
Status ParamPath::ForEachPiece(uint64_t first, std::span<float> out, PartFn&& part) {
  const uint64_t end = first + out.size();
  // The parameter holding `first`: the last with partition offset <= first.
  size_t lo = 0, hi = spec_of.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (params->PartitionOffset(static_cast<ParamId>(mid)) <= first) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const auto rank = static_cast<uint64_t>(params->rank());
  for (size_t k = lo; k < spec_of.size(); ++k) {
    const auto id = static_cast<ParamId>(k);
    const size_t i = spec_of[k];
    const uint64_t local = params->PartitionOffset(id), shard = params->ShardSize(id);
    if (local >= end) break;
    const uint64_t a = std::max(first, local), b = std::min(end, local + shard);
    if (a >= b) continue;
    // Partition elements [a, b) are the parameter's elements [e, e + (b - a)).
    const uint64_t e = rank * shard + (a - local);
    const uint64_t numel = params->Numel(id);
    std::span<float> dst = out.subspan(a - first, b - a);
    const uint64_t real = e >= numel ? 0 : std::min(b - a, numel - e);
    if (real > 0) MEMPLAN_RETURN_IF_ERROR(part(i, e, dst.first(real)));
    std::fill(dst.begin() + static_cast<int64_t>(real), dst.end(), 0.0f);
  }
  return Status::Ok();
}

// Fills partition elements [first, first + out.size()) from the parameters' init functions.
Status ParamPath::Fill(uint64_t first, std::span<float> out) {
  return ForEachPiece(first, out, [this](size_t i, uint64_t e, std::span<float> piece) {
    return specs[i].init(e, piece).WithPrefix("initialising parameter " + specs[i].name);
  });
}

// Fills partition elements [first, first + out.size()) of `array` from a StateFiller (Note
// [Optimizer state in checkpoints]): shard-relative offsets, as Shard() describes them.
Status ParamPath::FillFrom(const StateFiller& fill, int array, uint64_t first,
                           std::span<float> out) {
  const auto rank = static_cast<uint64_t>(params->rank());
  return ForEachPiece(first, out, [&](size_t i, uint64_t e, std::span<float> piece) {
    const uint64_t shard = params->ShardSize(swap_id[i]);
    return fill(static_cast<ParamId>(i), array, e - rank * shard, piece)
        .WithPrefix("loading parameter " + specs[i].name);
  });
}

// Writes an updated sub-group's working copy back to the parameters' tier: the optimizer's
// 16-bit copy, or for fp32 the master weights themselves.
Status ParamPath::WriteBack(const SubGroupUpdate& u) {
  if (options.schedule.param_dtype == ElementType::kFloat32) {
    return params->WriteFloat(u.first_element, u.params);
  }
  return params->WriteHalf(u.first_element, u.half_params);
}

// Note [What a store holds]: the registration, in order, as the optimizer store records it.
std::string ParamPath::Identity() const {
  nlohmann::json list = nlohmann::json::array();
  for (const ParamSpec& p : specs) list.push_back({p.name, p.shape, p.frozen, p.dtype});
  return nlohmann::json{{"format", "memplan-registration"}, {"version", 1}, {"params", list}}
      .dump();
}

// Refuses a resume onto a store written for another registration, naming the first difference
// (Note [What a store holds]). A store that records none (an older memplan's) is accepted on
// its element count alone, with a note in `report`.
Status ParamPath::CheckIdentity(const std::string& stored, const std::string& dir,
                                RecoveryReport* report) const {
  if (stored.empty()) {
    if (report != nullptr) {
      report->notes.push_back(dir +
                              ": the store records no parameter names or shapes (written by an "
                              "older memplan); only its element count was checked");
    }
    return Status::Ok();
  }
  auto parsed = ParseJson(stored, dir + " identity");
  const nlohmann::json* list = nullptr;
  if (parsed.ok() && parsed->is_object() && parsed->contains("params") &&
      (*parsed)["params"].is_array()) {
    list = &(*parsed)["params"];
  }
  if (list == nullptr) return Status::DataLoss("engine: " + dir + ": unreadable identity record");
  auto describe = [](const nlohmann::json& p) {
    if (!p.is_array() || p.size() != 4) return std::string("(unreadable)");
    std::string text = "'" + p[0].get<std::string>() + "' (shape [";
    for (size_t d = 0; d < p[1].size(); ++d) {
      text += (d ? ", " : "") + std::to_string(p[1][d].get<int64_t>());
    }
    text += "], ";
    text += p[2].get<bool>() ? "frozen" : "trainable";
    const std::string dtype = p[3].get<std::string>();
    if (!dtype.empty()) text += ", " + dtype;
    return text + ")";
  };
  const std::string why =
      "; resuming would train each parameter on another's weights and optimizer states. "
      "Register the parameters as the run that wrote the store did (same names, order, shapes, "
      "dtypes and frozen set), or start without resume";
  const nlohmann::json mine = nlohmann::json::parse(Identity())["params"];
  try {
    for (size_t k = 0; k < std::max(list->size(), mine.size()); ++k) {
      if (k >= list->size()) {
        return Status::InvalidArgument(
            "engine: resume refused: the store in " + dir + " holds " +
            std::to_string(list->size()) + " parameters; this model registers " +
            std::to_string(mine.size()) + ", the first extra one " + describe(mine[k]) + why);
      }
      if (k >= mine.size()) {
        return Status::InvalidArgument(
            "engine: resume refused: the store in " + dir + " holds " +
            std::to_string(list->size()) + " parameters; this model registers " +
            std::to_string(mine.size()) + ", none for the store's " + describe((*list)[k]) + why);
      }
      if ((*list)[k] != mine[k]) {
        return Status::InvalidArgument("engine: resume refused: parameter #" + std::to_string(k) +
                                       " is " + describe((*list)[k]) + " in the store in " + dir +
                                       " and " + describe(mine[k]) + " in this model" + why);
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::DataLoss("engine: " + dir + ": unreadable identity record: " + e.what());
  }
  return Status::Ok();
}

uint64_t ParamPath::LargestTrainableShard() const {
  uint64_t largest = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].frozen) largest = std::max(largest, params->ShardSize(swap_id[i]));
  }
  return largest;
}

}  // namespace memplan::offload::internal
