#include "planner/capacity.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "common/byte_size.h"
#include "common/strings.h"
#include "common/printable.h"
#include "estimator/estimate.h"
#include "estimator/training_setup.h"
#include "planner/plan_request.h"

namespace memplan::planner {
namespace {

// "6.2 days", "14.0 h", "35 min".
std::string Duration(double hours) {
  if (!std::isfinite(hours)) return "-";
  if (hours >= 48) return FormatDouble("%.1f days", hours / 24);
  if (hours >= 1) return FormatDouble("%.1f h", hours);
  return FormatDouble("%.0f min", hours * 60);
}

// "1T", "300B", "2.5M" tokens.
std::string Tokens(double v) {
  if (v >= 1e12) return FormatDouble("%.4g", v / 1e12) + "T";
  if (v >= 1e9) return FormatDouble("%.4g", v / 1e9) + "B";
  if (v >= 1e6) return FormatDouble("%.4g", v / 1e6) + "M";
  return FormatDouble("%.0f", v);
}

// "1,234,567" for money and GPU-hours.
std::string Thousands(double v) {
  if (!std::isfinite(v)) return "-";
  std::string digits = FormatDouble("%.0f", std::round(v));
  std::string out;
  const size_t start = digits[0] == '-' ? 1 : 0;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > start && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

Result<int64_t> ParseCount(const std::string& part, const std::string& flag) {
  const std::string t = Trim(part);
  if (t.empty() || t.size() > 9 ||
      !std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return Status::InvalidArgument(flag + " '" + part +
                                   "': expected GPU counts such as 8, 8-512 or 8,16,64");
  }
  const int64_t v = std::stoll(t);
  if (v < 1 || v > (int64_t{1} << 20)) {
    return Status::InvalidArgument(flag + " " + t + ": a GPU count must be in [1, 1048576]");
  }
  return v;
}

// The cluster a point runs on.
Cluster PointCluster(const CapacityRequest& request, const GpuOffer& offer, int64_t gpus) {
  Cluster c = request.node;
  c.gpu = offer.gpu;
  if (gpus <= offer.gpus_per_node) {
    c.nodes = 1;
    c.gpus_per_node = gpus;
  } else {
    c.nodes = gpus / offer.gpus_per_node;
    c.gpus_per_node = offer.gpus_per_node;
  }
  return c;
}

bool Better(double a, double b, double tie) { return a < b * (1 - tie); }

}  // namespace

Status CapacityRequest::Validate() const {
  if (offers.empty()) return Status::InvalidArgument("`offers`: no GPU type given");
  for (const GpuOffer& o : offers) {
    Cluster c;
    c.gpu = o.gpu;
    MEMPLAN_RETURN_IF_ERROR(c.Validate());
    if (!std::isfinite(o.price_per_gpu_hour) || o.price_per_gpu_hour < 0 ||
        o.price_per_gpu_hour > 1e6) {
      return Status::InvalidArgument("`price_per_gpu_hour` for " + o.gpu.name +
                                     ": a price per GPU-hour must be in [0, 1e6]");
    }
    if (o.gpus_per_node < 1 || o.gpus_per_node > 1024) {
      return Status::InvalidArgument("`gpus_per_node` for " + o.gpu.name +
                                     " must be in [1, 1024], got " +
                                     std::to_string(o.gpus_per_node));
    }
  }
  std::set<std::string> names;
  for (const GpuOffer& o : offers) {
    if (!names.insert(o.gpu.name).second) {
      return Status::InvalidArgument("`offers`: '" + o.gpu.name + "' given twice");
    }
  }
  if (gpu_counts.empty()) return Status::InvalidArgument("`gpu_counts`: no GPU count given");
  for (int64_t g : gpu_counts) {
    if (g < 1 || g > (int64_t{1} << 20)) {
      return Status::InvalidArgument("`gpu_counts`: a GPU count must be in [1, 1048576]");
    }
  }
  if (!(std::isfinite(max_train_hours) && max_train_hours >= 0 && max_train_hours < 1e9)) {
    return Status::InvalidArgument(
        "`max_train_hours` must be a finite deadline >= 0, below 1e9 hours");
  }
  if (!(std::isfinite(tokens) && tokens > 0 && tokens < 1e18)) {
    return Status::InvalidArgument("`tokens` must be a positive number of tokens below 1e18");
  }
  if (threads < 0) return Status::InvalidArgument("threads must be >= 0");
  return search.Validate();
}

Result<std::vector<int64_t>> ParseGpuCounts(const std::string& text, const std::string& flag) {
  std::set<int64_t> counts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string part = text.substr(start, comma - start);
    const size_t dash = part.find('-');
    if (dash == std::string::npos) {
      MEMPLAN_ASSIGN_OR_RETURN(int64_t v, ParseCount(part, flag));
      counts.insert(v);
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(int64_t lo, ParseCount(part.substr(0, dash), flag));
      MEMPLAN_ASSIGN_OR_RETURN(int64_t hi, ParseCount(part.substr(dash + 1), flag));
      if (hi < lo) {
        return Status::InvalidArgument(flag + " '" + Trim(part) + "': the range is empty");
      }
      for (int64_t v = lo; v <= hi; v *= 2) counts.insert(v);
      counts.insert(hi);
    }
    if (counts.size() > 4096) {
      return Status::InvalidArgument(flag + ": more than 4096 GPU counts");
    }
    start = comma + 1;
  }
  return std::vector<int64_t>(counts.begin(), counts.end());
}

Result<double> ParseTokenCount(const std::string& text, const std::string& flag) {
  const std::string t = Trim(text);
  auto bad = [&] {
    return Status::InvalidArgument(flag + " '" + text +
                                   "': expected a token count such as 1T, 300B, 2.5M or 1e12");
  };
  if (t.empty()) return bad();
  double scale = 1;
  std::string number = t;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(t.back())));
  if (last == 'K' || last == 'M' || last == 'B' || last == 'G' || last == 'T') {
    scale = last == 'K' ? 1e3 : last == 'M' ? 1e6 : (last == 'B' || last == 'G') ? 1e9 : 1e12;
    number = t.substr(0, t.size() - 1);
  }
  // The one decimal grammar (common/byte_size.h): no hexadecimal, no inf or nan; a number out of
  // a double's range reaches the range check below, like any other out of range.
  const std::optional<double> parsed = ParseDecimalNumber(number);
  if (!parsed) return bad();
  double v = *parsed * scale;
  if (!std::isfinite(v) || v <= 0 || v >= 1e18) {
    return Status::InvalidArgument(flag + " '" + text + "': must be in (0, 1e18) tokens");
  }
  return v;
}

namespace {

// A price per GPU-hour: a decimal number (common/byte_size.h's one grammar: "0x10" is not 16) in
// [0, 1e6]; one too small for a double (1e-400) is 0, as any tiny price rounds.
Result<double> ParsePrice(const std::string& text, const std::string& what) {
  const std::optional<double> v = ParseDecimalNumber(text);
  if (!v) {
    return Status::InvalidArgument("`price_per_gpu_hour` " + what + ": '" + Printable(text) +
                                   "' is not a price per GPU-hour (a decimal number: 2.5, 0.8)");
  }
  if (!std::isfinite(*v) || *v < 0 || *v > 1e6) {
    return Status::InvalidArgument("`price_per_gpu_hour` " + what + ": " + Printable(text) +
                                   " is not in [0, 1e6] per GPU-hour");
  }
  return *v;
}

}  // namespace

Result<std::vector<GpuOffer>> ChooseOffers(std::vector<GpuOffer> offers,
                                           const std::vector<std::string>& names,
                                           int64_t gpus_per_node,
                                           const std::vector<std::string>& prices) {
  if (!names.empty()) {
    // The names pick (and order) the types: a file's type keeps its figures and price.
    std::vector<GpuOffer> chosen;
    for (const std::string& name : names) {
      auto same = std::find_if(offers.begin(), offers.end(),
                               [&](const GpuOffer& o) { return o.gpu.name == name; });
      if (same != offers.end()) {
        chosen.push_back(*same);
        continue;
      }
      MEMPLAN_ASSIGN_OR_RETURN(GpuSpec gpu, FindGpuPreset(name));
      GpuOffer offer;
      offer.gpu = gpu;
      chosen.push_back(offer);
    }
    offers = std::move(chosen);
  }
  if (offers.empty()) {
    return Status::InvalidArgument(
        "no GPU type given: use `offers` a100-80,h100-80,... or `cluster` FILE with a 'gpus' "
        "list");
  }
  if (gpus_per_node > 0) {
    for (GpuOffer& o : offers) o.gpus_per_node = gpus_per_node;
  }
  // Each type's price is given once: "a100-80=1,a100-80=2" (or "a100=1,a100-80=2", the same
  // type) is refused like `--gpu a100-80,a100-80`, not resolved by order. A bare price is every
  // other type's, wherever it stands in the list.
  std::optional<double> every;
  std::vector<const GpuOffer*> priced;
  for (const std::string& price : prices) {
    const size_t eq = price.find('=');
    if (eq == std::string::npos) {
      if (offers.size() > 1 && prices.size() == 1) {
        return Status::InvalidArgument(
            "`price_per_gpu_hour` " + Printable(price) +
            ": with several GPU types give "
            "TYPE=PRICE for each (`price_per_gpu_hour` a100-80=1.8,h100-80=2.9)");
      }
      if (every) {
        return Status::InvalidArgument("`price_per_gpu_hour` " + Printable(price) +
                                       ": a price for every GPU type is given twice");
      }
      MEMPLAN_ASSIGN_OR_RETURN(every, ParsePrice(price, "for every GPU type"));
      continue;
    }
    const std::string name = price.substr(0, eq);
    auto it = std::find_if(offers.begin(), offers.end(),
                           [&](const GpuOffer& o) { return o.gpu.name == name; });
    if (it == offers.end()) {
      // A preset alias ("h100") names the type its preset resolves to.
      auto preset = FindGpuPreset(name);
      if (preset.ok()) {
        it = std::find_if(offers.begin(), offers.end(),
                          [&](const GpuOffer& o) { return o.gpu.name == preset->name; });
      }
    }
    if (it == offers.end()) {
      return Status::InvalidArgument("`price_per_gpu_hour` " + Printable(price) + ": '" +
                                     Printable(name) + "' is not one of the GPU types searched");
    }
    if (std::find(priced.begin(), priced.end(), &*it) != priced.end()) {
      return Status::InvalidArgument("`price_per_gpu_hour` " + Printable(price) + ": " +
                                     it->gpu.name + " is given a price twice");
    }
    priced.push_back(&*it);
    MEMPLAN_ASSIGN_OR_RETURN(it->price_per_gpu_hour,
                             ParsePrice(price.substr(eq + 1), Printable(name)));
  }
  if (every) {
    for (GpuOffer& o : offers) {
      if (std::find(priced.begin(), priced.end(), &o) == priced.end()) {
        o.price_per_gpu_hour = *every;
      }
    }
  }
  return offers;
}

Result<std::vector<GpuOffer>> OffersFromJson(const nlohmann::json& json, const std::string& source,
                                             Cluster* node) {
  if (!json.is_object()) {
    return Status::InvalidArgument(source + ": a cluster must be a JSON object");
  }
  const bool list = json.contains("gpus");
  if (list == json.contains("gpu")) {
    return Status::InvalidArgument(
        source + (list ? ": give 'gpus' (the GPU types to choose from) or 'gpu', not both"
                       : ": missing 'gpus' (a list of GPU presets or objects)"));
  }
  nlohmann::json entries = list ? json["gpus"] : nlohmann::json::array({json["gpu"]});
  if (!entries.is_array() || entries.empty() || entries.size() > 64) {
    return Status::InvalidArgument(source + ": 'gpus' must be a list of 1 to 64 GPU types");
  }
  // The node settings: the file less its GPUs, read as a cluster file with the first GPU.
  nlohmann::json rest = json;
  rest.erase(list ? "gpus" : "gpu");
  std::vector<GpuOffer> offers;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string where = source + ": gpus[" + std::to_string(i) + "]";
    nlohmann::json gpu = entries[i];
    GpuOffer offer;
    bool node_size_given = false;
    if (gpu.is_object()) {
      if (auto it = gpu.find("price_per_gpu_hour"); it != gpu.end()) {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0) {
          return Status::InvalidArgument(where + ".price_per_gpu_hour: expected a number >= 0");
        }
        offer.price_per_gpu_hour = it->get<double>();
        gpu.erase("price_per_gpu_hour");
      }
      if (auto it = gpu.find("gpus_per_node"); it != gpu.end()) {
        if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > 1024) {
          return Status::InvalidArgument(where +
                                         ".gpus_per_node: expected an integer in [1, 1024]");
        }
        offer.gpus_per_node = it->get<int64_t>();
        node_size_given = true;
        gpu.erase("gpus_per_node");
      }
    }
    nlohmann::json cluster = rest;
    cluster["gpu"] = gpu;
    auto parsed = ClusterFromJson(cluster, where);
    if (!parsed.ok()) return parsed.status();
    // The file's gpus_per_node is the node size of every type that does not give its own.
    if (!node_size_given && rest.contains("gpus_per_node")) {
      offer.gpus_per_node = parsed->gpus_per_node;
    }
    offer.gpu = parsed->gpu;
    if (i == 0 && node != nullptr) *node = *parsed;
    offers.push_back(std::move(offer));
  }
  return offers;
}

namespace {

// The fewest GPUs, the fastest and the cheapest of the points that fit (Note [Capacity search]);
// returns whether any point that fits has a price.
bool ChooseAnswers(const CapacityRequest& request, CapacityResult* out) {
  CapacityResult& result = *out;
  const double tie = 0.01;
  bool any_price = false;
  for (const CapacityPoint& p : result.points) any_price = any_price || (p.fits && p.priced);
  result.cheapest_by_gpu_hours = !any_price;
  for (size_t i = 0; i < result.points.size(); ++i) {
    const CapacityPoint& p = result.points[i];
    if (!p.fits) continue;
    if (!result.fastest) {
      result.fastest = i;
    } else {
      const CapacityPoint& f = result.points[*result.fastest];
      if (Better(p.train_hours, f.train_hours, tie) ||
          (!Better(f.train_hours, p.train_hours, tie) && p.gpus < f.gpus)) {
        result.fastest = i;
      }
    }
    if (request.max_train_hours > 0 && p.train_hours > request.max_train_hours) continue;
    if (!result.fewest || p.gpus < result.points[*result.fewest].gpus ||
        (p.gpus == result.points[*result.fewest].gpus &&
         p.train_hours < result.points[*result.fewest].train_hours)) {
      result.fewest = i;
    }
    if (any_price && !p.priced) continue;
    const double value = any_price ? p.cost : p.gpu_hours;
    if (!result.cheapest) {
      result.cheapest = i;
    } else {
      const CapacityPoint& c = result.points[*result.cheapest];
      const double best = any_price ? c.cost : c.gpu_hours;
      if (Better(value, best, tie) ||
          (!Better(best, value, tie) && p.train_hours < c.train_hours)) {
        result.cheapest = i;
      }
    }
  }

  return any_price;
}

// What the answer assumes, said with it.
void AddAssumptions(const CapacityRequest& request, bool any_price, CapacityResult* out) {
  CapacityResult& result = *out;
  if (request.max_train_hours > 0) {
    result.assumptions.push_back(
        "Deadline " + Duration(request.max_train_hours) +
        ": the fewest GPUs and the cheapest are chosen among the points that train within it.");
  }
  result.assumptions.insert(
      result.assumptions.begin(),
      {
          "Each GPU type x count is one `memplan plan` search (the whole ZeRO x offload x "
          "checkpointing x micro-batch grid) with the same job and node settings; counts above the "
          "node size run on whole nodes.",
          "Time to train = " + Tokens(request.tokens) +
              " tokens / the best plan's tokens per second (the step-time model's prediction, not "
              "a measurement; no restarts, evaluation or checkpoint saves).",
          any_price ? std::string("Cost = time to train x GPUs x the price per GPU-hour given; GPU "
                                  "types without a price are not candidates for the cheapest.")
                    : std::string("No price given (`price_per_gpu_hour`): the cheapest is "
                                  "the fewest GPU-hours."),
      });
  if (result.points.size() > static_cast<size_t>(result.searches)) {
    result.assumptions.push_back(
        "Points that cannot run (not whole nodes, a global batch the count does not divide, a "
        "precision the GPU lacks) are listed with the reason and not searched.");
  }
  if (!request.search.calibration_note.empty()) {
    result.assumptions.push_back("Step-time constants calibrated from measured runs: " +
                                 request.search.calibration_note + ".");
  }
}

}  // namespace

Result<CapacityResult> PlanCapacity(const estimator::ModelInventory& inventory, const Job& job,
                                    const CapacityRequest& request) {
  MEMPLAN_RETURN_IF_ERROR(request.Validate());
  MEMPLAN_RETURN_IF_ERROR(job.ValidateFor(inventory));
  if (!inventory.arch) {
    return Status::InvalidArgument(inventory.name + ": capacity planning needs the architecture");
  }
  CapacityResult result;
  for (size_t o = 0; o < request.offers.size(); ++o) {
    for (int64_t g : request.gpu_counts) {
      CapacityPoint p;
      p.offer = o;
      p.gpu = request.offers[o].gpu.name;
      p.gpus = g;
      const Cluster c = PointCluster(request, request.offers[o], g);
      p.nodes = c.nodes;
      p.gpus_per_node = c.gpus_per_node;
      p.priced = request.offers[o].price_per_gpu_hour > 0;
      result.points.push_back(p);
    }
  }
  // Each point's search, on a few threads; errors are kept per point and the first one (in point
  // order) that is not about the point itself fails the whole request.
  std::vector<Status> errors(result.points.size(), Status::Ok());
  std::vector<std::optional<PlanResult>> found(result.points.size());
  std::atomic<size_t> next{0};
  // One model: the step model's runs serve every point (Note [Reusing a step]).
  const auto step_cache = std::make_shared<estimator::StepModelCache>();
  auto work = [&] {
    for (size_t i = next++; i < result.points.size(); i = next++) {
      CapacityPoint& p = result.points[i];
      const GpuOffer& offer = request.offers[p.offer];
      if (p.gpus > offer.gpus_per_node && p.gpus % offer.gpus_per_node != 0) {
        p.reason = std::to_string(p.gpus) + " GPUs are not whole nodes of " +
                   std::to_string(offer.gpus_per_node);
        continue;
      }
      if (job.global_batch % p.gpus != 0) {
        p.reason = "the global batch of " + std::to_string(job.global_batch) +
                   " sequences is not a multiple of " + std::to_string(p.gpus) + " GPUs";
        continue;
      }
      Job point_job = job;
      // Note [Plan defaults] step 2, per GPU type.
      if (request.fp16_fallback && job.setup.precision == estimator::Precision::kBf16Mixed) {
        point_job.setup.precision = DefaultPrecision(offer.gpu);
      }
      if (PeakFlops(offer.gpu, point_job.setup.precision) <= 0) {
        p.reason = offer.gpu.name + " has no " +
                   std::string(estimator::PrecisionName(point_job.setup.precision)) + " support";
        continue;
      }
      const Cluster c = PointCluster(request, offer, p.gpus);
      SearchOptions options = request.search;
      if (offer.time_constants) options.time_constants = *offer.time_constants;
      options.step_cache = step_cache;
      auto r = SearchPlans(inventory, c, point_job, options);
      if (!r.ok()) {
        errors[i] = r.status().WithPrefix(p.gpu + " x " + std::to_string(p.gpus));
        continue;
      }
      found[i] = std::move(*r);
    }
  };
  int threads =
      request.threads > 0
          ? request.threads
          : static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  threads = std::max(1, std::min<int>(threads, static_cast<int>(result.points.size())));
  {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
  }
  for (const Status& s : errors) {
    if (!s.ok()) return s;
  }
  for (size_t i = 0; i < result.points.size(); ++i) {
    CapacityPoint& p = result.points[i];
    if (!found[i]) continue;
    PlanResult& r = *found[i];
    ++result.searches;
    result.configurations += r.configurations;
    p.configurations = r.configurations;
    if (result.seq_len == 0) result.seq_len = r.seq_len;
    if (r.plans.empty()) {
      p.reason = r.rejected.empty() ? "no configuration fits"
                                    : "nothing fits; closest " + r.rejected.front().plan + ": " +
                                          r.rejected.front().reason;
      continue;
    }
    p.fits = true;
    p.plan = r.plans.front();
    const double price = request.offers[p.offer].price_per_gpu_hour;
    p.train_hours = request.tokens / p.plan->tokens_per_s / 3600;
    p.gpu_hours = p.train_hours * static_cast<double>(p.gpus);
    p.cost = p.gpu_hours * price;
  }

  const bool any_price = ChooseAnswers(request, &result);
  AddAssumptions(request, any_price, &result);
  return result;
}

namespace {

nlohmann::json PointJson(const CapacityPoint& p, const CapacityRequest& request) {
  const GpuOffer& offer = request.offers[p.offer];
  nlohmann::json j = {{"gpu", p.gpu},
                      {"gpus", p.gpus},
                      {"nodes", p.nodes},
                      {"gpus_per_node", p.gpus_per_node},
                      {"fits", p.fits},
                      {"price_per_gpu_hour",
                       p.priced ? nlohmann::json(offer.price_per_gpu_hour) : nlohmann::json()}};
  if (!p.fits) {
    j["reason"] = p.reason;
    return j;
  }
  j["plan"] = ToJson(*p.plan);
  j["plan"]["tokens_per_s_per_gpu"] = p.plan->tokens_per_s / static_cast<double>(p.gpus);
  j["step_time_s"] = p.plan->time.total_s;
  j["tokens_per_s"] = p.plan->tokens_per_s;
  j["train_hours"] = p.train_hours;
  j["train_days"] = p.train_hours / 24;
  j["gpu_hours"] = p.gpu_hours;
  j["cost"] = p.priced ? nlohmann::json(p.cost) : nlohmann::json();
  return j;
}

std::string PointLine(const CapacityPoint& p, bool with_plan) {
  std::string line = std::to_string(p.gpus) + " x " + p.gpu + " (" + std::to_string(p.nodes) +
                     (p.nodes == 1 ? " node" : " nodes") + " of " +
                     std::to_string(p.gpus_per_node) + "): " + Duration(p.train_hours) + ", " +
                     Thousands(p.gpu_hours) + " GPU-hours" +
                     (p.priced ? ", cost " + Thousands(p.cost) : std::string());
  if (with_plan && p.plan) {
    line += "\n      " + p.plan->family + ", " +
            std::string(estimator::CheckpointingName(p.plan->setup.checkpointing)) +
            " checkpointing, micro-batch " + std::to_string(p.plan->setup.micro_batch) + " x " +
            std::to_string(p.plan->setup.grad_accum) + " accumulation; step " +
            FormatDouble("%.2f s", p.plan->time.total_s) + ", " +
            FormatDouble("%.0f", p.plan->tokens_per_s / static_cast<double>(p.gpus)) +
            " tokens/s/GPU, MFU " + FormatDouble("%.0f%%", p.plan->mfu * 100);
  }
  return line;
}

}  // namespace

nlohmann::json ToJson(const CapacityResult& r, const CapacityRequest& request, const Job& job) {
  nlohmann::json offers = nlohmann::json::array();
  for (const GpuOffer& o : request.offers) {
    offers.push_back(
        {{"gpu", o.gpu.name},
         {"description", o.gpu.description},
         {"memory_bytes", o.gpu.memory_bytes},
         {"bf16_flops", o.gpu.bf16_flops},
         {"fp16_flops", o.gpu.fp16_flops},
         {"gpus_per_node", o.gpus_per_node},
         {"price_per_gpu_hour",
          o.price_per_gpu_hour > 0 ? nlohmann::json(o.price_per_gpu_hour) : nlohmann::json()}});
  }
  nlohmann::json points = nlohmann::json::array();
  for (const CapacityPoint& p : r.points) points.push_back(PointJson(p, request));
  auto pick = [&](const std::optional<size_t>& i) {
    return i ? PointJson(r.points[*i], request) : nlohmann::json();
  };
  nlohmann::json node = ToJson(request.node);
  node.erase("gpu");
  node.erase("nodes");
  node.erase("gpus_per_node");
  node.erase("world_size");
  return {{"job", ToJson(job, r.seq_len)},
          {"tokens", request.tokens},
          {"deadline_hours", request.max_train_hours > 0 ? nlohmann::json(request.max_train_hours)
                                                         : nlohmann::json()},
          {"node", node},
          {"offers", offers},
          {"gpu_counts", request.gpu_counts},
          {"fewest_gpus", pick(r.fewest)},
          {"fastest", pick(r.fastest)},
          {"cheapest", pick(r.cheapest)},
          {"cheapest_by", r.cheapest_by_gpu_hours ? "gpu_hours" : "cost"},
          {"points", points},
          {"searches", r.searches},
          {"configurations", r.configurations},
          {"assumptions", r.assumptions}};
}

std::string FormatCapacityText(const CapacityResult& r, const CapacityRequest& request,
                               const Job& job) {
  estimator::TrainingSetup fixed = job.setup;
  fixed.seq_len = r.seq_len;
  std::string out = estimator::SetupLine(fixed, /*searched=*/true) + "\n";
  out += "Capacity for " + job.model + ": " + Tokens(request.tokens) + " tokens" +
         (request.max_train_hours > 0 ? " within " + Duration(request.max_train_hours)
                                      : std::string()) +
         ", global batch " + std::to_string(job.global_batch) + " x " + std::to_string(r.seq_len) +
         " tokens; " + std::to_string(request.offers.size()) + " GPU type(s) x " +
         std::to_string(request.gpu_counts.size()) + " count(s): " + std::to_string(r.searches) +
         " searched, " + std::to_string(r.configurations) + " configurations evaluated.\n\n";
  if (!r.fastest) {
    out += "No GPU type and count fits.\n";
  } else {
    if (r.fewest) {
      out += "Fewest GPUs: " + PointLine(r.points[*r.fewest], true) + "\n";
    }
    out += "Fastest:     " + PointLine(r.points[*r.fastest], true) + "\n";
    if (r.cheapest) {
      out += std::string(r.cheapest_by_gpu_hours ? "Cheapest (fewest GPU-hours; no price given): "
                                                 : "Cheapest:    ") +
             PointLine(r.points[*r.cheapest], true) + "\n";
    }
    if (!r.fewest) {
      out += "Nothing trains within " + Duration(request.max_train_hours) +
             ": the fastest above is the closest.\n";
    }
  }
  out += "\n";
  char line[512];
  std::snprintf(line, sizeof(line), "%-10s %6s %5s  %-44s %8s %10s %11s %12s %14s\n", "gpu", "gpus",
                "nodes", "plan", "step s", "tok/s/GPU", "train", "GPU-hours", "cost");
  out += line;
  for (const CapacityPoint& p : r.points) {
    if (!p.fits) {
      std::snprintf(line, sizeof(line), "%-10s %6lld %5lld  ", p.gpu.c_str(),
                    static_cast<long long>(p.gpus), static_cast<long long>(p.nodes));
      out += line + std::string("does not fit: ") + p.reason + "\n";
      continue;
    }
    std::snprintf(line, sizeof(line), "%-10s %6lld %5lld  %-44s %8.2f %10.0f %11s %12s %14s\n",
                  p.gpu.c_str(), static_cast<long long>(p.gpus), static_cast<long long>(p.nodes),
                  p.plan->family.substr(0, 44).c_str(), p.plan->time.total_s,
                  p.plan->tokens_per_s / static_cast<double>(p.gpus),
                  Duration(p.train_hours).c_str(), Thousands(p.gpu_hours).c_str(),
                  p.priced ? Thousands(p.cost).c_str() : "-");
    out += line;
  }
  out += "\nAssumptions:\n";
  for (const std::string& a : r.assumptions) out += "  - " + a + "\n";
  return out;
}

}  // namespace memplan::planner
