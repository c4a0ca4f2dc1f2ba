#include "planner/plan_request.h"

#include <string>
#include <utility>

#include "common/byte_size.h"
#include "common/json.h"

namespace memplan::planner {

using nlohmann::json;

Result<Memlock> Memlock::Parse(std::string_view text, std::string_view what) {
  Memlock m;
  if (text == "unlimited") {
    m.unlimited = true;
    return m;
  }
  MEMPLAN_ASSIGN_OR_RETURN(m.bytes, ParseByteSize(text, what));
  return m;
}

Result<Memlock> Memlock::FromJson(const json& object, const char* key, const std::string& where) {
  Memlock m;
  if (object.contains(key) && object.at(key) == "unlimited") {
    m.unlimited = true;
    return m;
  }
  MEMPLAN_RETURN_IF_ERROR(JsonFieldReader(object, where).ByteSize(key, &m.bytes));
  return m;
}

void ClusterSettings::ApplyTo(Cluster* c) const {
  if (gpus_per_node) c->gpus_per_node = *gpus_per_node;
  if (nodes) c->nodes = *nodes;
  if (cpu_memory_bytes) c->cpu_memory_bytes = *cpu_memory_bytes;
  if (cpu_cores) c->cpu_cores = *cpu_cores;
  if (pcie_gen) c->pcie_gen = *pcie_gen;
  if (inter_node_bytes_per_s) c->inter_node_bytes_per_s = *inter_node_bytes_per_s;
  if (memlock) c->memlock_bytes = memlock->ClusterBytes();
  if (nvme_path) c->nvme_path = *nvme_path;
  if (nvme_capacity_bytes) c->nvme_capacity_bytes = *nvme_capacity_bytes;
}

bool PlanRequest::HasGpu() const {
  return !node.gpu.empty() || (cluster.has_value() && cluster->gpu.memory_bytes > 0);
}

estimator::Precision DefaultPrecision(const GpuSpec& gpu) {
  return gpu.bf16_flops > 0 ? estimator::Precision::kBf16Mixed : estimator::Precision::kFp16Mixed;
}

Result<Sharding> ParseSharding(std::string_view text, std::string_view what) {
  if (text == "full") return Sharding::kFull;
  if (text == "hybrid") return Sharding::kHybrid;
  return Status::InvalidArgument(std::string(what) + " must be \"full\" or \"hybrid\"");
}

Result<Cluster> ResolveCluster(const PlanRequest& r) {
  Cluster c = r.cluster.value_or(Cluster{});
  if (!r.node.gpu.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(c.gpu, FindGpuPreset(r.node.gpu));
  }
  if (!r.HasGpu()) {
    return Status::InvalidArgument("no GPU given: give `gpu` (a preset) or `cluster`");
  }
  r.node.ApplyTo(&c);
  if (r.nvme_bench) {
    MEMPLAN_RETURN_IF_ERROR(ApplyNvmeBench(r.nvme_bench->document, r.nvme_bench->source, &c));
  }
  if (r.adam_bench) {
    MEMPLAN_RETURN_IF_ERROR(ApplyAdamBench(r.adam_bench->document, r.adam_bench->source, &c));
  }
  MEMPLAN_RETURN_IF_ERROR(c.Validate());
  if (r.calibration) ApplyCalibration(*r.calibration, &c.gpu, nullptr);
  return c;
}

Status CheckBatch(const PlanRequest& r) {
  if ((r.global_batch > 0) == (r.global_batch_tokens > 0)) {
    return Status::InvalidArgument(
        "give exactly one of `global_batch` (samples) and `global_batch_tokens`");
  }
  return Status::Ok();
}

Result<Job> ResolveJob(const PlanRequest& r, const GpuSpec* gpu,
                       const estimator::ArchitectureInfo& arch) {
  MEMPLAN_RETURN_IF_ERROR(CheckBatch(r));
  Job job;
  job.model = r.model;
  job.setup = r.setup;
  estimator::TrainingSetup& s = job.setup;
  if (r.precision) {
    s.precision = *r.precision;
  } else {
    s.precision = gpu != nullptr ? DefaultPrecision(*gpu) : estimator::Precision::kBf16Mixed;
  }
  s.optimizer = r.optimizer.value_or(estimator::Optimizer::kAdamW);
  if (r.global_batch_tokens > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(job.global_batch,
                             SamplesFromTokens(r.global_batch_tokens, s.SeqLenFor(&arch)));
  } else {
    job.global_batch = r.global_batch;
  }
  return job;
}

SearchOptions ResolveSearch(const PlanRequest& r) {
  SearchOptions o = r.search;
  o.consider_8bit = !r.optimizer.has_value();
  if (r.calibration) ApplyCalibration(*r.calibration, nullptr, &o);
  return o;
}

Result<ResolvedPlan> Resolve(const PlanRequest& request, const estimator::ArchitectureInfo& arch) {
  ResolvedPlan out;
  MEMPLAN_ASSIGN_OR_RETURN(out.cluster, ResolveCluster(request));
  MEMPLAN_ASSIGN_OR_RETURN(out.job, ResolveJob(request, &out.cluster.gpu, arch));
  out.options = ResolveSearch(request);
  // The notes name the request's fields (Note [Field names in errors]); the CLI prints flags.
  if (const std::string alias = GpuAliasNote(request.node.gpu); !alias.empty()) {
    out.notes.push_back(alias.rfind("--gpu ", 0) == 0 ? "`gpu` " + alias.substr(6) : alias);
  }
  const int64_t gpus = request.node.gpus_per_node.value_or(0);
  if (gpus > 8 && out.cluster.nodes == 1) {
    // Issue 31 item 10: "--gpus 16" read as 16 in all.
    out.notes.push_back("`gpus` is GPUs per node: one node of " + std::to_string(gpus) +
                        " GPUs; for nodes of 8, give `gpus` 8 `nodes` " +
                        std::to_string((gpus + 7) / 8));
  }
  return out;
}

// ---- The JSON reader ---------------------------------------------------------------------------

namespace {

// The node keys of a plan or capacity request ("gpu", "gpus", "nodes" and "cluster" are the plan
// request's own: capacity spells GPU types and counts its own way).
constexpr std::string_view kNodeKeys[] = {"cpu_mem",   "cpu_cores",     "pcie_gen",     "memlock",
                                          "nvme_path", "nvme_capacity", "inter_node_bw"};
// The job keys of both.
constexpr std::string_view kJobKeys[] = {"global_batch", "global_batch_tokens", "setup",
                                         "gpu_margin", "allow_nvme"};
// The setup keys a plan request once took at the top level (read for one release).
constexpr std::string_view kFlatSetupKeys[] = {
    "precision",    "optimizer",         "lora_rank", "lora_targets",
    "qlora",        "flash_attention",   "foreach",   "fused_optimizer",
    "sgd_momentum", "sequence_parallel", "autocast",  "gradient_as_bucket_view",
    "seq_len",      "cuda_context_mib"};
// Plan only: the cluster and the what-if restrictions.
constexpr std::string_view kPlanOnlyKeys[] = {
    "cluster",           "gpu",           "gpus",          "nodes",       "zero_stage",
    "offload_optimizer", "offload_param", "checkpointing", "micro_batch", "sharding",
    "default_buffers"};
// Setup keys the search decides (or the cluster sets): refused inside a plan's "setup".
constexpr std::pair<std::string_view, std::string_view> kSearchedSetupKeys[] = {
    {"zero_stage", "the top-level \"zero_stage\" restricts the search"},
    {"offload_optimizer", "the top-level \"offload_optimizer\" restricts the search"},
    {"offload_param", "the top-level \"offload_param\" restricts the search"},
    {"checkpointing", "the top-level \"checkpointing\" restricts the search"},
    {"micro_batch", "the top-level \"micro_batch\" restricts the search"},
    {"grad_accum", "it follows from the global batch and the micro-batch"},
    {"gpus_per_node", "give the top-level \"gpus\""},
    {"num_nodes", "give the top-level \"nodes\""},
};

JsonFieldReader Fields(const json& request) { return JsonFieldReader(request, "request"); }

Status ReadNode(const json& request, ClusterSettings* n) {
  const JsonFieldReader f = Fields(request);
  if (request.contains("cpu_mem")) {
    uint64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.ByteSize("cpu_mem", &v));
    n->cpu_memory_bytes = v;
  }
  if (request.contains("cpu_cores")) {
    int64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Integer("cpu_cores", &v));
    n->cpu_cores = v;
  }
  if (request.contains("pcie_gen")) {
    int64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Integer("pcie_gen", &v));
    n->pcie_gen = static_cast<int>(v);
  }
  if (request.contains("memlock")) {
    MEMPLAN_ASSIGN_OR_RETURN(n->memlock, Memlock::FromJson(request, "memlock", "request"));
  }
  if (request.contains("nvme_path")) {
    std::string v;
    MEMPLAN_RETURN_IF_ERROR(f.Name("nvme_path", &v));
    n->nvme_path = v;
  }
  if (request.contains("nvme_capacity")) {
    uint64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.ByteSize("nvme_capacity", &v));
    n->nvme_capacity_bytes = v;
  }
  if (request.contains("inter_node_bw")) {
    double gbps = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Number("inter_node_bw", &gbps));
    if (!(gbps > 0 && gbps <= 1e6)) {
      return Status::InvalidArgument("request: \"inter_node_bw\" must be in (0, 1e6] GB/s");
    }
    n->inter_node_bytes_per_s = gbps * 1e9;
  }
  return Status::Ok();
}

// The old flattened setup keys, as the plan request read them before "setup" (same errors).
Status ReadFlatSetup(const json& request, PlanRequest* r, std::vector<std::string>* deprecations) {
  const JsonFieldReader f = Fields(request);
  estimator::TrainingSetup& s = r->setup;
  for (std::string_view key : kFlatSetupKeys) {
    if (!request.contains(key)) continue;
    const std::string k(key);
    if (request.contains("setup") && request.at("setup").is_object() &&
        request.at("setup").contains(k == "cuda_context_mib" ? "cuda_context_bytes" : k)) {
      return Status::InvalidArgument("request: \"" + k +
                                     "\" is given both at the top level and in \"setup\"");
    }
    const std::string instead = k == "cuda_context_mib"
                                    ? "\"setup\": {\"cuda_context_bytes\": MIB * 1048576}"
                                    : "\"setup\": {\"" + k + "\": ...}";
    deprecations->push_back("request: the top-level \"" + k + "\" is deprecated (read for one " +
                            "more release): write " + instead);
  }
  if (request.contains("precision")) {
    std::string precision;
    MEMPLAN_RETURN_IF_ERROR(f.String("precision", &precision));
    MEMPLAN_ASSIGN_OR_RETURN(r->precision, estimator::ParsePrecision(precision));
  }
  if (request.contains("optimizer")) {
    std::string optimizer;
    MEMPLAN_RETURN_IF_ERROR(f.String("optimizer", &optimizer));
    MEMPLAN_ASSIGN_OR_RETURN(r->optimizer, estimator::ParseOptimizer(optimizer));
  }
  MEMPLAN_RETURN_IF_ERROR(f.Integer("lora_rank", &s.lora_rank));
  if (request.contains("lora_targets")) {
    const json& t = request.at("lora_targets");
    if (!t.is_array()) return Status::InvalidArgument("request: \"lora_targets\" must be a list");
    for (const json& name : t) {
      if (!name.is_string()) {
        return Status::InvalidArgument("request: \"lora_targets\" must hold strings");
      }
      s.lora_targets.push_back(name.get<std::string>());
    }
  }
  MEMPLAN_RETURN_IF_ERROR(f.Bool("qlora", &s.qlora));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("flash_attention", &s.flash_attention));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("foreach", &s.foreach));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("fused_optimizer", &s.fused_optimizer));
  MEMPLAN_RETURN_IF_ERROR(f.Number("sgd_momentum", &s.sgd_momentum));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("sequence_parallel", &s.sequence_parallel));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("autocast", &s.autocast));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("gradient_as_bucket_view", &s.gradient_as_bucket_view));
  MEMPLAN_RETURN_IF_ERROR(f.Integer("seq_len", &s.seq_len));
  if (request.contains("cuda_context_mib")) {
    double mib = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Number("cuda_context_mib", &mib));
    if (!(mib >= 0 && mib <= 1048576)) {
      return Status::InvalidArgument("request: \"cuda_context_mib\" must be in [0, 1048576]");
    }
    s.cuda_context_bytes = static_cast<int64_t>(mib * 1048576.0);
  }
  return Status::Ok();
}

// "setup": TrainingSetup JSON (the estimate request's), less the keys the search decides.
Status ReadSetup(const json& request, PlanRequest* r) {
  if (!request.contains("setup")) return Status::Ok();
  const json& setup = request.at("setup");
  if (!setup.is_object()) {
    return Status::InvalidArgument("request: \"setup\" must be an object of training settings");
  }
  for (const auto& [key, why] : kSearchedSetupKeys) {
    if (setup.contains(key)) {
      return Status::InvalidArgument(
          "request: \"setup\": \"" + std::string(key) +
          "\" is chosen by the plan search, not given: " + std::string(why));
    }
  }
  MEMPLAN_ASSIGN_OR_RETURN(r->setup, estimator::TrainingSetupFromJson(setup));
  if (setup.contains("precision")) r->precision = r->setup.precision;
  if (setup.contains("optimizer")) r->optimizer = r->setup.optimizer;
  return Status::Ok();
}

Status ReadJob(const json& request, PlanRequest* r, std::vector<std::string>* deprecations) {
  const JsonFieldReader f = Fields(request);
  MEMPLAN_RETURN_IF_ERROR(ReadSetup(request, r));
  MEMPLAN_RETURN_IF_ERROR(ReadFlatSetup(request, r, deprecations));
  MEMPLAN_RETURN_IF_ERROR(f.Integer("global_batch", &r->global_batch));
  MEMPLAN_RETURN_IF_ERROR(f.Integer("global_batch_tokens", &r->global_batch_tokens));
  MEMPLAN_RETURN_IF_ERROR(f.Number("gpu_margin", &r->search.gpu_safety_fraction));
  MEMPLAN_RETURN_IF_ERROR(f.Bool("allow_nvme", &r->search.allow_nvme));
  return Status::Ok();
}

// "cluster", then "gpu", "gpus", "nodes" over it.
Status ReadCluster(const json& request, PlanRequest* r) {
  const JsonFieldReader f = Fields(request);
  if (request.contains("cluster")) {
    MEMPLAN_ASSIGN_OR_RETURN(r->cluster, ClusterFromJson(request.at("cluster"), "request.cluster"));
  }
  MEMPLAN_RETURN_IF_ERROR(f.String("gpu", &r->node.gpu));
  if (request.contains("gpus")) {
    int64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Integer("gpus", &v));
    r->node.gpus_per_node = v;
  }
  if (request.contains("nodes")) {
    int64_t v = 0;
    MEMPLAN_RETURN_IF_ERROR(f.Integer("nodes", &v));
    r->node.nodes = v;
  }
  return Status::Ok();
}

// The what-if keys: restrictions of the search.
Status ReadWhatIf(const json& request, SearchOptions* o) {
  const JsonFieldReader f = Fields(request);
  int64_t zero_stage = -1, micro_batch = 0;
  MEMPLAN_RETURN_IF_ERROR(f.Integer("zero_stage", &zero_stage));
  if (zero_stage < -1 || zero_stage > 3) {
    return Status::InvalidArgument("request: \"zero_stage\" must be 0-3");
  }
  o->only_stage = static_cast<int>(zero_stage);
  MEMPLAN_RETURN_IF_ERROR(f.Integer("micro_batch", &micro_batch));
  if (micro_batch < 0) return Status::InvalidArgument("request: \"micro_batch\" must be >= 1");
  o->only_micro_batch = micro_batch;
  std::string text;
  if (request.contains("offload_optimizer")) {
    MEMPLAN_RETURN_IF_ERROR(f.String("offload_optimizer", &text));
    MEMPLAN_ASSIGN_OR_RETURN(o->only_offload_optimizer, estimator::ParseOffloadDevice(text));
  }
  if (request.contains("offload_param")) {
    MEMPLAN_RETURN_IF_ERROR(f.String("offload_param", &text));
    MEMPLAN_ASSIGN_OR_RETURN(o->only_offload_param, estimator::ParseOffloadDevice(text));
  }
  if (request.contains("checkpointing")) {
    MEMPLAN_RETURN_IF_ERROR(f.String("checkpointing", &text));
    MEMPLAN_ASSIGN_OR_RETURN(o->only_checkpointing, estimator::ParseCheckpointing(text));
  }
  if (request.contains("sharding")) {
    MEMPLAN_RETURN_IF_ERROR(f.String("sharding", &text));
    MEMPLAN_ASSIGN_OR_RETURN(o->only_sharding, ParseSharding(text, "request: \"sharding\""));
  }
  bool default_buffers = false;
  MEMPLAN_RETURN_IF_ERROR(f.Bool("default_buffers", &default_buffers));
  o->tune_buffers = !default_buffers;
  return Status::Ok();
}

}  // namespace

std::vector<std::string> PlanRequestKeys() {
  std::vector<std::string> keys;
  for (auto list :
       {std::span<const std::string_view>(kNodeKeys), std::span<const std::string_view>(kJobKeys),
        std::span<const std::string_view>(kFlatSetupKeys),
        std::span<const std::string_view>(kPlanOnlyKeys)}) {
    for (std::string_view k : list) keys.emplace_back(k);
  }
  return keys;
}

Result<PlanRequest> PlanRequestFromJson(const json& request,
                                        std::initializer_list<std::string_view> also_allowed,
                                        std::vector<std::string>* deprecations) {
  std::vector<std::string> keys = PlanRequestKeys();
  for (std::string_view k : also_allowed) keys.emplace_back(k);
  MEMPLAN_RETURN_IF_ERROR(JsonFieldReader(request, "plan request").CheckKeys(keys));
  PlanRequest r;
  MEMPLAN_RETURN_IF_ERROR(ReadCluster(request, &r));
  MEMPLAN_RETURN_IF_ERROR(ReadNode(request, &r.node));
  MEMPLAN_RETURN_IF_ERROR(ReadJob(request, &r, deprecations));
  MEMPLAN_RETURN_IF_ERROR(ReadWhatIf(request, &r.search));
  return r;
}

Result<PlanRequest> CapacityJobFromJson(const json& request,
                                        std::initializer_list<std::string_view> also_allowed,
                                        std::vector<std::string>* deprecations) {
  std::vector<std::string> keys;
  for (std::string_view k : kNodeKeys) keys.emplace_back(k);
  for (std::string_view k : kJobKeys) keys.emplace_back(k);
  for (std::string_view k : also_allowed) keys.emplace_back(k);
  MEMPLAN_RETURN_IF_ERROR(JsonFieldReader(request, "capacity request").CheckKeys(keys));
  PlanRequest r;
  MEMPLAN_RETURN_IF_ERROR(ReadNode(request, &r.node));
  MEMPLAN_RETURN_IF_ERROR(ReadJob(request, &r, deprecations));
  return r;
}

}  // namespace memplan::planner
