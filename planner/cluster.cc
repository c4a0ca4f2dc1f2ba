#include "planner/cluster.h"

#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "common/byte_size.h"
#include "common/json.h"
#include "common/printable.h"

namespace memplan::planner {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// A rate for an error message: "1e+06", "0", "nan".
std::string FormatRate(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

// A GPU as JSON (plan's "cluster.gpu"): every field under its own name. Reading a GPU back goes
// through GpuFromJson's checks instead.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(GpuSpec, name, description, memory_bytes, bf16_flops, fp16_flops,
                                   fp32_flops, hbm_bytes_per_s, link_bytes_per_s, pcie_gen,
                                   mfu_prior, gemm_efficiency, attention_efficiency,
                                   node_network_bytes_per_s, gpus_per_pcie_switch)

const std::vector<GpuSpec>& GpuPresets() {
  // Memory: the total the driver reports (nvidia-smi), in MiB. FLOPs: dense tensor-core peaks
  // from NVIDIA's datasheets (GeForce: fp16 with fp32 accumulation). Links: per direction.
  // gemm_efficiency: sustained cuBLAS bf16/fp16 GEMM rate / dense peak (A100 ~270 of 312
  // TFLOPS, H100 SXM ~700 of 989 at 700 W, V100 ~95 of 125, Ada/Ampere GeForce ~75%);
  // attention_efficiency: FlashAttention-2's forward + backward rate / peak (Dao 2023: ~190 of
  // 312 TFLOPS causal on A100; ~350 of 989 on H100, where FA2 is not Hopper-tuned; V100 has no
  // FlashAttention-2: its memory-efficient SDPA kernels reach about 40%).
  // node_network_bytes_per_s: the reference server's network per direction: DGX A100 and A800
  // HGX 8 x 200 Gb/s HDR, DGX H100/H200 8 x 400 Gb/s NDR, DGX-1V 4 x 100 Gb/s EDR, PCIe servers
  // (L40S) 2 x 200 Gb/s, workstations (GeForce) 25 Gb/s Ethernet.
  // gpus_per_pcie_switch: DGX A100/H100 put two GPUs behind each PCIe switch's host uplink.
  auto gpu = [](const char* name, const char* description, uint64_t memory, double bf16,
                double fp16, double fp32, double hbm, double link, int pcie, double mfu,
                double gemm, double attention, double network, int per_switch) {
    GpuSpec g;
    g.name = name;
    g.description = description;
    g.memory_bytes = memory;
    g.bf16_flops = bf16;
    g.fp16_flops = fp16;
    g.fp32_flops = fp32;
    g.hbm_bytes_per_s = hbm;
    g.link_bytes_per_s = link;
    g.pcie_gen = pcie;
    g.mfu_prior = mfu;
    g.gemm_efficiency = gemm;
    g.attention_efficiency = attention;
    g.node_network_bytes_per_s = network;
    g.gpus_per_pcie_switch = per_switch;
    return g;
  };
  static const auto* kPresets = new std::vector<GpuSpec>{
      gpu("v100-16", "NVIDIA V100 16GB SXM2", 16160 * kMiB, 0, 125e12, 15.7e12, 900e9, 150e9, 3,
          0.40, 0.76, 0.40, 50e9, 2),
      gpu("v100-32", "NVIDIA V100 32GB SXM2", 32510 * kMiB, 0, 125e12, 15.7e12, 900e9, 150e9, 3,
          0.40, 0.76, 0.40, 50e9, 2),
      gpu("a100-40", "NVIDIA A100 40GB SXM4", 40960 * kMiB, 312e12, 312e12, 156e12, 1555e9, 300e9,
          4, 0.45, 0.80, 0.50, 200e9, 2),
      gpu("a100-80", "NVIDIA A100 80GB SXM4", 81920 * kMiB, 312e12, 312e12, 156e12, 2039e9, 300e9,
          4, 0.45, 0.80, 0.50, 200e9, 2),
      gpu("a800-80", "NVIDIA A800 80GB SXM4 (NVLink 400 GB/s)", 81920 * kMiB, 312e12, 312e12,
          156e12, 2039e9, 200e9, 4, 0.45, 0.80, 0.50, 200e9, 2),
      gpu("h100-80", "NVIDIA H100 80GB SXM5", 81559 * kMiB, 989e12, 989e12, 494.5e12, 3350e9, 450e9,
          5, 0.40, 0.62, 0.35, 400e9, 2),
      // torchtitan's benchmark GPU (Grand Teton): H100 SXM with 96 GB HBM2e at 2.4 TB/s and a
      // 500 W power limit; its peak is "between SXM and NVL" (989 and 835 TFLOPS): the midpoint.
      gpu("h100-96", "NVIDIA H100 96GB HBM2e SXM, 500 W (Grand Teton)", 98304 * kMiB, 912e12,
          912e12, 456e12, 2400e9, 450e9, 5, 0.40, 0.62, 0.35, 400e9, 2),
      gpu("h200", "NVIDIA H200 141GB SXM", 143771 * kMiB, 989e12, 989e12, 494.5e12, 4800e9, 450e9,
          5, 0.40, 0.62, 0.35, 400e9, 2),
      gpu("l40s", "NVIDIA L40S 48GB (PCIe, no NVLink)", 46068 * kMiB, 362e12, 362e12, 181e12, 864e9,
          25e9, 4, 0.35, 0.65, 0.45, 50e9, 1),
      gpu("rtx3090", "NVIDIA GeForce RTX 3090 24GB", 24576 * kMiB, 71e12, 71e12, 35.6e12, 936e9,
          25e9, 4, 0.35, 0.75, 0.50, 3.125e9, 1),
      gpu("rtx4090", "NVIDIA GeForce RTX 4090 24GB (no P2P)", 24564 * kMiB, 165.2e12, 165.2e12,
          82.6e12, 1008e9, 20e9, 4, 0.35, 0.75, 0.50, 3.125e9, 1),
      // Capacity-planning presets (issue 22). Cloud GPUs in PCIe servers (no NVLink) reach each
      // other over PCIe P2P; their node network is the reference instance's (AWS g4dn/g5/g6
      // .48xlarge/metal: 100 Gb/s, 8 GPUs). gemm_efficiency of power-capped cards (T4 70 W, L4
      // 72 W, A10G 300 W at lower clocks) is below the big parts': clocks fall under sustained
      // tensor-core load.
      // A10G (AWS g5): 24 GB GDDR6 at 600 GB/s, PCIe Gen4; no public NVIDIA datasheet: AWS's A10
      // variant with ~70 dense bf16/fp16 tensor TFLOPS (vs A10's 125; Baseten's A10 vs A10G spec
      // comparison), 35 TF32; the driver reports 23028 MiB.
      gpu("a10g", "NVIDIA A10G 24GB (AWS g5, PCIe)", 23028 * kMiB, 70e12, 70e12, 35e12, 600e9, 25e9,
          4, 0.35, 0.70, 0.45, 12.5e9, 1),
      // L4: NVIDIA L4 datasheet: 24 GB GDDR6 at 300 GB/s, bf16/fp16 121 dense TFLOPS (242 with
      // sparsity), TF32 60, PCIe Gen4 x16, 72 W; the driver reports 23034 MiB.
      gpu("l4", "NVIDIA L4 24GB (PCIe, 72 W)", 23034 * kMiB, 121e12, 121e12, 60e12, 300e9, 25e9, 4,
          0.30, 0.60, 0.40, 12.5e9, 1),
      // T4: NVIDIA T4 datasheet: 16 GB GDDR6 at 320 GB/s, fp16 mixed-precision 65 TFLOPS, no bf16,
      // FP32 8.1 (no TF32), PCIe Gen3 x16, 70 W; the driver reports 15360 MiB.
      gpu("t4", "NVIDIA T4 16GB (PCIe, 70 W, no bf16)", 15360 * kMiB, 0, 65e12, 8.1e12, 320e9, 12e9,
          3, 0.25, 0.55, 0.35, 12.5e9, 1),
      // B200: NVIDIA DGX B200 datasheet: 8 x B200, 1.44 TB HBM3e in all (the driver reports
      // 183359 MiB each), bf16 2.25 dense PFLOPS per GPU (72 PFLOPS FP8 training / 8 / 2 x 0.5
      // for sparsity), TF32 1.1 PFLOPS, HBM 7.7 TB/s (7680-bit bus at 3996 MHz as the driver
      // reports; the datasheet says 8), NVLink 5 1.8 TB/s per GPU (900 GB/s per direction),
      // PCIe Gen5, 8 x 400 Gb/s ConnectX-7 per node. Efficiencies as H100's (same cuBLAS
      // generation gap to peak, FlashAttention-2 not Blackwell-tuned).
      gpu("b200", "NVIDIA B200 180GB SXM (HGX/DGX B200)", 183359 * kMiB, 2250e12, 2250e12, 1100e12,
          7700e9, 900e9, 5, 0.40, 0.62, 0.35, 400e9, 2),
      // H200 NVL: NVIDIA H200 NVL datasheet: 141 GB HBM3e at 4.8 TB/s, bf16/fp16 835 dense TFLOPS
      // (1,671 with sparsity), TF32 418, PCIe Gen5, 600 W; 2- or 4-way NVLink bridges (900 GB/s per
      // GPU). In the usual 8-GPU server the ring crosses PCIe Gen5 between the two 4-way NVLink
      // groups, so the ring's link is PCIe (63 GB/s per direction); node network as the 2-8-5-200
      // enterprise reference design's 4 x 400 Gb/s east-west.
      gpu("h200-nvl", "NVIDIA H200 NVL 141GB (PCIe, 4-way NVLink bridges)", 143771 * kMiB, 835e12,
          835e12, 418e12, 4800e9, 63e9, 5, 0.40, 0.62, 0.35, 200e9, 2),
      // MI300X: AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, bf16/fp16 1,307.4 dense
      // TFLOPS, TF32 653.7, PCIe Gen5; 7 Infinity Fabric links of 64 GB/s per direction to the
      // other 7 GPUs of the platform (448 GB/s per GPU, fully connected); 8 x 400 Gb/s per node
      // in the reference platform. gemm_efficiency 0.5: hipBLASLt bf16 GEMMs sustain ~650 of the
      // 1,307 TFLOPS in published MI300X training benchmarks; attention 0.3 (CK FlashAttention-2).
      gpu("mi300x", "AMD Instinct MI300X 192GB (OAM, Infinity Fabric)", 196608 * kMiB, 1307.4e12,
          1307.4e12, 653.7e12, 5300e9, 448e9, 5, 0.35, 0.50, 0.30, 400e9, 2),
  };
  return *kPresets;
}

// Note [GPU names]
// A GPU as people write it and as nvidia-smi prints it ("NVIDIA H100 80GB HBM3",
// "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB", "h100-80gb"), in the presets' spelling: lower
// case, words joined by '-', the vendor's and series' words dropped, "80GB" read as "80", and the
// SXM form factor and the memory type dropped (every preset of a name is the SXM part unless its
// name says otherwise). A PCIe or NVL card ("NVIDIA H100 PCIe", "H100 NVL") keeps its word, so it
// matches no preset and the error lists them: its memory, rates and links are another GPU's.
std::string PresetSpelling(std::string_view name) {
  static const std::set<std::string> kDropped = {"nvidia", "tesla", "geforce", "amd",  "instinct",
                                                 "sxm",    "sxm2",  "sxm4",    "sxm5", "hbm2",
                                                 "hbm2e",  "hbm3",  "hbm3e",   "oam"};
  std::string text = Lower(name);
  for (char& c : text) {
    if (c == ' ' || c == '_' || c == '\t') c = '-';
  }
  std::string out;
  std::istringstream words(text);
  for (std::string word; std::getline(words, word, '-');) {
    if (word.empty() || kDropped.count(word) > 0) continue;
    const size_t digits = word.find_first_not_of("0123456789");
    if (digits != std::string::npos && digits > 0 && word.substr(digits) == "gb") {
      word.resize(digits);
    }
    out += (out.empty() ? "" : "-") + word;
  }
  return out;
}

Result<GpuSpec> FindGpuPreset(std::string_view name) {
  std::string key = PresetSpelling(name);
  static const std::pair<const char*, const char*> kAliases[] = {
      {"a100", "a100-80"},     {"a800", "a800-80"},      {"h100", "h100-80"},
      {"v100", "v100-32"},     {"4090", "rtx4090"},      {"3090", "rtx3090"},
      {"rtx-4090", "rtx4090"}, {"rtx-3090", "rtx3090"},  {"h200-141", "h200"},
      {"l40s-48", "l40s"},     {"a100-80gb", "a100-80"}, {"a100-40gb", "a100-40"},
      {"b200-180", "b200"},    {"h200nvl", "h200-nvl"},  {"mi300", "mi300x"},
      {"a10g-24", "a10g"},
  };
  for (const auto& [alias, target] : kAliases) {
    if (key == alias) key = target;
  }
  std::string names;
  for (const GpuSpec& g : GpuPresets()) {
    if (g.name == key) return g;
    names += (names.empty() ? "" : ", ") + g.name;
  }
  return Status::InvalidArgument("`gpu` '" + std::string(name) + "': not a known GPU; presets: " +
                                 names + " (or give a cluster JSON file with the GPU's figures)");
}

std::string GpuAliasNote(std::string_view name) {
  auto picked = FindGpuPreset(name);
  if (!picked.ok() || PresetSpelling(name) == picked->name) return "";
  const std::string family = picked->name.substr(0, picked->name.find('-'));
  std::string others;
  for (const GpuSpec& g : GpuPresets()) {
    if (g.name != picked->name && g.name.substr(0, g.name.find('-')) == family) {
      others += (others.empty() ? "" : ", ") + g.name;
    }
  }
  if (others.empty()) return "";
  const double gib = static_cast<double>(picked->memory_bytes) / static_cast<double>(kGiB);
  char memory[32];
  std::snprintf(memory, sizeof memory, "%.1f GiB", gib);
  return "--gpu " + std::string(name) + " is the " + picked->name + " preset (" + memory +
         "); for another card of this GPU give its preset: " + others;
}

double Cluster::PcieLineBytesPerS() const {
  const int gen = PcieGen();
  return gen <= 3 ? 16e9 : gen == 4 ? 32e9 : gen == 5 ? 63e9 : 121e9;
}

double Cluster::PcieBytesPerS() const { return PcieLineBytesPerS() * kPcieEfficiency; }

double Cluster::InterNodeBytesPerS() const {
  return inter_node_bytes_per_s > 0 ? inter_node_bytes_per_s : gpu.node_network_bytes_per_s;
}

double Cluster::NvmeReadBytesPerS() const {
  return nvme_read_bytes_per_s > 0 ? nvme_read_bytes_per_s : kNvmeReadPrior;
}
double Cluster::NvmeWriteBytesPerS() const {
  return nvme_write_bytes_per_s > 0 ? nvme_write_bytes_per_s : kNvmeWritePrior;
}

double Cluster::CpuAdamParamsPerS() const {
  if (cpu_adam_params_per_s > 0) return cpu_adam_params_per_s;
  const double cores = static_cast<double>(cpu_cores > 0 ? cpu_cores : 16);
  return std::min(cores * kCpuAdamPerCorePrior, kCpuAdamNodePrior);
}

Status Cluster::Validate() const {
  if (nodes < 1 || nodes > (1 << 20)) {
    return Status::InvalidArgument("`nodes` must be in [1, 1048576], got " + std::to_string(nodes));
  }
  if (gpus_per_node < 1 || gpus_per_node > 1024) {
    return Status::InvalidArgument("`gpus_per_node` must be in [1, 1024], got " +
                                   std::to_string(gpus_per_node));
  }
  if (gpu.memory_bytes == 0) return Status::InvalidArgument("GPU '" + gpu.name + "': memory is 0");
  if (!(gpu.fp16_flops > 0) && !(gpu.bf16_flops > 0)) {
    return Status::InvalidArgument("GPU '" + gpu.name + "': no fp16 or bf16 FLOPs given");
  }
  if (!(gpu.mfu_prior > 0 && gpu.mfu_prior <= 1)) {
    return Status::InvalidArgument("GPU '" + gpu.name + "': mfu_prior must be in (0, 1]");
  }
  if (pcie_gen != 0 && (pcie_gen < 3 || pcie_gen > 6)) {
    return Status::InvalidArgument("`pcie_gen` must be 3, 4, 5 or 6, got " +
                                   std::to_string(pcie_gen));
  }
  if (cpu_cores < 0) return Status::InvalidArgument("`cpu_cores` must be >= 0");
  // Note [Rate floors]: every rate below divides a byte or FLOP count in the time model. A rate
  // of 0 (or 1e-300) would give an infinite step, 0 tokens/s and `null` in JSON, and rank every
  // plan as equal; a rate beyond any hardware would hide every cost. So each is checked against a
  // floor and a ceiling far outside real machines (a PCIe Gen1 lane, a CPU core's FLOPs; 1000x
  // the fastest GPU). Rates with a prior take 0 as "not given, use the prior".
  struct Rate {
    const char* name;
    double value;
    bool zero_means_prior;
    double floor, ceiling;
  };
  constexpr double kMinBytesPerS = 1e6, kMaxBytesPerS = 1e15;
  constexpr double kMinFlops = 1e9, kMaxFlops = 1e19;
  const Rate rates[] = {
      {"inter_node_bytes_per_s (`inter_node_bw`)", inter_node_bytes_per_s, true, kMinBytesPerS,
       kMaxBytesPerS},
      {"nvme_read_bytes_per_s", nvme_read_bytes_per_s, true, kMinBytesPerS, kMaxBytesPerS},
      {"nvme_write_bytes_per_s", nvme_write_bytes_per_s, true, kMinBytesPerS, kMaxBytesPerS},
      {"cpu_adam_params_per_s", cpu_adam_params_per_s, true, 1e3, 1e15},
      {"gpu.link_bytes_per_s", gpu.link_bytes_per_s, false, kMinBytesPerS, kMaxBytesPerS},
      {"gpu.hbm_bytes_per_s", gpu.hbm_bytes_per_s, false, kMinBytesPerS, kMaxBytesPerS},
      {"gpu.node_network_bytes_per_s", gpu.node_network_bytes_per_s, false, kMinBytesPerS,
       kMaxBytesPerS},
      {"gpu.bf16_flops", gpu.bf16_flops, true, kMinFlops, kMaxFlops},
      {"gpu.fp16_flops", gpu.fp16_flops, true, kMinFlops, kMaxFlops},
      {"gpu.fp32_flops", gpu.fp32_flops, true, kMinFlops, kMaxFlops},
  };
  for (const Rate& r : rates) {
    if (r.zero_means_prior && r.value == 0) continue;
    if (!std::isfinite(r.value) || r.value < r.floor || r.value > r.ceiling) {
      return Status::InvalidArgument("GPU '" + gpu.name + "': " + r.name + " must be " +
                                     (r.zero_means_prior ? "0 (not given) or " : "") + "between " +
                                     FormatRate(r.floor) + " and " + FormatRate(r.ceiling) +
                                     ", got " + FormatRate(r.value));
    }
  }
  if (nodes > 1 && !(InterNodeBytesPerS() > 0)) {
    return Status::InvalidArgument("`inter_node_bw` must be > 0 with more than one node");
  }
  for (double v : {gpu.gemm_efficiency, gpu.attention_efficiency}) {
    if (!(v > 0 && v <= 1)) {
      return Status::InvalidArgument(
          "GPU '" + gpu.name + "': gemm_efficiency and attention_efficiency must be in (0, 1]");
    }
  }
  if (gpu.gpus_per_pcie_switch < 1 || gpu.gpus_per_pcie_switch > 64) {
    return Status::InvalidArgument("GPU '" + gpu.name + "': gpus_per_pcie_switch must be 1-64");
  }
  return Status::Ok();
}

Result<NvmeBenchReading> NvmeBenchFromJson(const nlohmann::json& bench, const std::string& source) {
  auto best = bench.is_object() ? bench.find("best") : bench.end();
  if (!bench.is_object() || best == bench.end() || !best->is_object()) {
    return Status::InvalidArgument(
        source + ": no 'best' result (is it `memplan bench nvme --format json` output?)");
  }
  const JsonFieldReader fields(*best, source, "best.");
  auto rate = [&](const char* key, double* out) -> Status {
    if (!fields.Has(key) || best->at(key).is_null()) return Status::Ok();  // not measured
    MEMPLAN_RETURN_IF_ERROR(fields.Number(key, out));
    if (!(*out > 0)) {
      return fields.Error(key, "must be a positive number, got " + best->at(key).dump());
    }
    return Status::Ok();
  };
  NvmeBenchReading reading;
  MEMPLAN_RETURN_IF_ERROR(rate("read_bytes_per_s", &reading.read_bytes_per_s));
  MEMPLAN_RETURN_IF_ERROR(rate("write_bytes_per_s", &reading.write_bytes_per_s));
  if (reading.read_bytes_per_s == 0 && reading.write_bytes_per_s == 0) {
    return Status::InvalidArgument(source +
                                   ": best has neither read_bytes_per_s nor "
                                   "write_bytes_per_s");
  }
  // The aio block is a hint: a setting of another type is passed over, not refused.
  if (auto aio = bench.find("aio"); aio != bench.end() && aio->is_object()) {
    const nlohmann::json& a = aio->contains("aio") ? (*aio)["aio"] : *aio;
    auto setting = [&](const char* key) -> std::optional<int64_t> {
      if (a.contains(key) && a[key].is_number_integer()) return a[key].get<int64_t>();
      return std::nullopt;
    };
    reading.aio_block_size = setting("block_size");
    reading.aio_queue_depth = setting("queue_depth");
    reading.aio_intra_op_parallelism = setting("intra_op_parallelism");
    if (reading.aio_intra_op_parallelism &&
        (*reading.aio_intra_op_parallelism < 1 || *reading.aio_intra_op_parallelism > 64)) {
      reading.aio_intra_op_parallelism.reset();
    }
  }
  if (auto p = bench.find("path"); p != bench.end() && p->is_string()) {
    // It becomes the plan's nvme_path (configs, scripts): a name, checked as one.
    MEMPLAN_RETURN_IF_ERROR(JsonFieldReader(bench, source).Name("path", &reading.path));
  }
  return reading;
}

Status ApplyNvmeBench(const nlohmann::json& bench, const std::string& source, Cluster* cluster) {
  MEMPLAN_ASSIGN_OR_RETURN(NvmeBenchReading reading, NvmeBenchFromJson(bench, source));
  if (reading.read_bytes_per_s > 0) cluster->nvme_read_bytes_per_s = reading.read_bytes_per_s;
  if (reading.write_bytes_per_s > 0) cluster->nvme_write_bytes_per_s = reading.write_bytes_per_s;
  cluster->nvme_bandwidth_source = "bench";
  if (reading.aio_block_size) cluster->aio_block_size = *reading.aio_block_size;
  if (reading.aio_queue_depth) cluster->aio_queue_depth = *reading.aio_queue_depth;
  if (reading.aio_intra_op_parallelism) {
    cluster->aio_intra_op_parallelism = *reading.aio_intra_op_parallelism;
  }
  if (cluster->nvme_path.empty()) cluster->nvme_path = reading.path;
  return Status::Ok();
}

Status ApplyAdamBench(const nlohmann::json& bench, const std::string& source, Cluster* cluster) {
  if (!bench.is_object()) return Status::InvalidArgument(source + ": not a JSON object");
  auto it = bench.find("params_per_s");
  if (it == bench.end() || !it->is_number() || !(it->get<double>() > 0)) {
    return Status::InvalidArgument(
        source + ": no positive 'params_per_s' (is it `memplan bench adam --format json` output?)");
  }
  double rate = it->get<double>();
  // The bench runs with `threads`; a node's optimizer uses its cores, but memory bandwidth caps
  // the gain, so scaling is only applied up to the 3e9 params/s cap of the prior.
  if (auto t = bench.find("threads"); t != bench.end() && t->is_number_integer() &&
                                      t->get<int64_t>() > 0 && cluster->cpu_cores > 0 &&
                                      t->get<int64_t>() < cluster->cpu_cores) {
    rate = std::max(rate, std::min(rate * static_cast<double>(cluster->cpu_cores) /
                                       static_cast<double>(t->get<int64_t>()),
                                   3e9));
  }
  cluster->cpu_adam_params_per_s = rate;
  cluster->cpu_adam_source = "bench";
  return Status::Ok();
}

nlohmann::json ToJson(const Cluster& c) {
  return {{"gpu", c.gpu},
          {"nodes", c.nodes},
          {"gpus_per_node", c.gpus_per_node},
          {"world_size", c.WorldSize()},
          {"cpu_memory_bytes", c.cpu_memory_bytes},
          {"cpu_cores", c.cpu_cores},
          {"pcie_gen", c.PcieGen()},
          {"pcie_bytes_per_s", c.PcieBytesPerS()},
          {"inter_node_bytes_per_s", c.InterNodeBytesPerS()},
          {"memlock_bytes", c.memlock_bytes},
          {"nvme_path", c.nvme_path},
          {"nvme_capacity_bytes", c.nvme_capacity_bytes},
          {"nvme_read_bytes_per_s", c.NvmeReadBytesPerS()},
          {"nvme_write_bytes_per_s", c.NvmeWriteBytesPerS()},
          {"nvme_bandwidth_source", c.nvme_bandwidth_source},
          {"cpu_adam_params_per_s", c.CpuAdamParamsPerS()},
          {"cpu_adam_source", c.cpu_adam_source}};
}

namespace {

// A finite number >= 0.
Status NonNegative(const JsonFieldReader& r, const char* key, double* out) {
  if (!r.Has(key)) return Status::Ok();
  double v = 0;
  MEMPLAN_RETURN_IF_ERROR(r.Number(key, &v));
  if (!std::isfinite(v) || v < 0) {
    return r.Error(key, "must be a number >= 0, got " + JsonFieldReader::Got(r.object().at(key)));
  }
  *out = v;
  return Status::Ok();
}

Result<GpuSpec> GpuFromJson(const nlohmann::json& j, const std::string& source) {
  if (j.is_string()) return FindGpuPreset(j.get<std::string>());
  if (!j.is_object()) {
    return Status::InvalidArgument(source + ": 'gpu' must be a preset name or an object");
  }
  const JsonFieldReader r(j, source, "gpu.");
  MEMPLAN_RETURN_IF_ERROR(r.CheckKeys(
      {"preset", "name", "description", "memory_bytes", "pcie_gen", "gpus_per_pcie_switch",
       "bf16_flops", "fp16_flops", "fp32_flops", "hbm_bytes_per_s", "link_bytes_per_s", "mfu_prior",
       "gemm_efficiency", "attention_efficiency", "node_network_bytes_per_s"}));
  GpuSpec g;
  if (r.Has("preset")) {
    std::string preset;
    MEMPLAN_RETURN_IF_ERROR(r.Name("preset", &preset));
    MEMPLAN_ASSIGN_OR_RETURN(g, FindGpuPreset(preset));
  }
  MEMPLAN_RETURN_IF_ERROR(r.Name("name", &g.name));
  MEMPLAN_RETURN_IF_ERROR(r.Name("description", &g.description));
  MEMPLAN_RETURN_IF_ERROR(r.ByteSize("memory_bytes", &g.memory_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.Integer("pcie_gen", &g.pcie_gen, 3, 6));
  MEMPLAN_RETURN_IF_ERROR(r.Integer("gpus_per_pcie_switch", &g.gpus_per_pcie_switch, 1, 64));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "bf16_flops", &g.bf16_flops));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "fp16_flops", &g.fp16_flops));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "fp32_flops", &g.fp32_flops));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "hbm_bytes_per_s", &g.hbm_bytes_per_s));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "link_bytes_per_s", &g.link_bytes_per_s));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "mfu_prior", &g.mfu_prior));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "gemm_efficiency", &g.gemm_efficiency));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "attention_efficiency", &g.attention_efficiency));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "node_network_bytes_per_s", &g.node_network_bytes_per_s));
  if (g.name.empty()) g.name = "custom";
  return g;
}

}  // namespace

Result<Cluster> ClusterFromJson(const nlohmann::json& json, const std::string& source) {
  if (!json.is_object())
    return Status::InvalidArgument(source + ": a cluster must be a JSON object");
  if (!json.contains("gpu")) return Status::InvalidArgument(source + ": missing 'gpu'");
  const JsonFieldReader r(json, source);
  // world_size and pcie_bytes_per_s are derived: ToJson writes them, and they are accepted and
  // ignored on input.
  MEMPLAN_RETURN_IF_ERROR(r.CheckKeys(
      {"gpu", "nodes", "gpus_per_node", "cpu_cores", "pcie_gen", "cpu_memory_bytes",
       "memlock_bytes", "nvme_capacity_bytes", "nvme_path", "nvme_bandwidth_source",
       "cpu_adam_source", "inter_node_bytes_per_s", "nvme_read_bytes_per_s",
       "nvme_write_bytes_per_s", "cpu_adam_params_per_s", "world_size", "pcie_bytes_per_s"}));
  Cluster c;
  MEMPLAN_ASSIGN_OR_RETURN(c.gpu, GpuFromJson(json.at("gpu"), source));
  MEMPLAN_RETURN_IF_ERROR(r.Integer<int64_t>("nodes", &c.nodes, 1, int64_t{1} << 20));
  MEMPLAN_RETURN_IF_ERROR(r.Integer<int64_t>("gpus_per_node", &c.gpus_per_node, 1, 1024));
  MEMPLAN_RETURN_IF_ERROR(r.Integer<int64_t>("cpu_cores", &c.cpu_cores, 0, int64_t{1} << 16));
  // 0: the GPU's own generation.
  MEMPLAN_RETURN_IF_ERROR(r.Integer("pcie_gen", &c.pcie_gen, 0, 6));
  if (c.pcie_gen != 0 && c.pcie_gen < 3) return r.Error("pcie_gen", "must be 0, 3, 4, 5 or 6");
  MEMPLAN_RETURN_IF_ERROR(r.ByteSize("cpu_memory_bytes", &c.cpu_memory_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.ByteSize("memlock_bytes", &c.memlock_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.ByteSize("nvme_capacity_bytes", &c.nvme_capacity_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.Name("nvme_path", &c.nvme_path));
  MEMPLAN_RETURN_IF_ERROR(r.Name("nvme_bandwidth_source", &c.nvme_bandwidth_source));
  MEMPLAN_RETURN_IF_ERROR(r.Name("cpu_adam_source", &c.cpu_adam_source));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "inter_node_bytes_per_s", &c.inter_node_bytes_per_s));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "nvme_read_bytes_per_s", &c.nvme_read_bytes_per_s));
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "nvme_write_bytes_per_s", &c.nvme_write_bytes_per_s));
  const bool rates = r.Has("nvme_read_bytes_per_s") || r.Has("nvme_write_bytes_per_s");
  if (rates && c.nvme_bandwidth_source == "prior") c.nvme_bandwidth_source = "given";
  MEMPLAN_RETURN_IF_ERROR(NonNegative(r, "cpu_adam_params_per_s", &c.cpu_adam_params_per_s));
  MEMPLAN_RETURN_IF_ERROR(c.Validate().WithPrefix(source));
  return c;
}

namespace {

// The CUDA driver API, loaded at run time so that the build needs no CUDA and a machine without
// a driver simply has no GPU.
struct CudaDriver {
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  using GetFn = int (*)(int*, int);
  using NameFn = int (*)(char*, int, int);
  using MemFn = int (*)(size_t*, int);
};

// GPUs seen through libcuda.so.1: count, name and memory of device 0.
bool ProbeCuda(int* count, std::string* name, uint64_t* memory, std::string* note) {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *note = "no CUDA driver (libcuda.so.1 not found): no GPU";
    return false;
  }
  auto init = reinterpret_cast<CudaDriver::InitFn>(::dlsym(lib, "cuInit"));
  auto get_count = reinterpret_cast<CudaDriver::CountFn>(::dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<CudaDriver::GetFn>(::dlsym(lib, "cuDeviceGet"));
  auto get_name = reinterpret_cast<CudaDriver::NameFn>(::dlsym(lib, "cuDeviceGetName"));
  auto total_mem = reinterpret_cast<CudaDriver::MemFn>(::dlsym(lib, "cuDeviceTotalMem_v2"));
  bool ok = false;
  int device = 0;
  char buffer[256] = {};
  size_t bytes = 0;
  if (init == nullptr || get_count == nullptr || get == nullptr || get_name == nullptr ||
      total_mem == nullptr) {
    *note = "CUDA driver lacks the device queries: no GPU";
  } else if (int rc = init(0); rc != 0) {
    *note = "cuInit failed (error " + std::to_string(rc) + "): no GPU";
  } else if (int rc2 = get_count(count); rc2 != 0 || *count <= 0) {
    *note = "CUDA reports no GPU";
    *count = 0;
  } else if (get(&device, 0) == 0 && get_name(buffer, sizeof(buffer) - 1, device) == 0 &&
             total_mem(&bytes, device) == 0) {
    *name = buffer;
    *memory = bytes;
    ok = true;
  } else {
    *note = "CUDA device query failed: no GPU";
  }
  ::dlclose(lib);
  return ok;
}

GpuSpec MatchGpu(const std::string& name, uint64_t memory) {
  const std::string n = Lower(name);
  const GpuSpec* best = nullptr;
  uint64_t best_gap = UINT64_MAX;
  for (const GpuSpec& g : GpuPresets()) {
    const std::string family = g.name.substr(0, g.name.find('-'));
    std::string token = family.rfind("rtx", 0) == 0 ? family.substr(3) : family;
    const bool name_match = n.find(token) != std::string::npos;
    const uint64_t gap =
        memory > g.memory_bytes ? memory - g.memory_bytes : g.memory_bytes - memory;
    // A name match wins; among those (or among all when none matches) the closest memory.
    const uint64_t score = (name_match ? 0 : uint64_t{1} << 62) + gap;
    if (score < best_gap) {
      best_gap = score;
      best = &g;
    }
  }
  GpuSpec g = *best;
  if (best_gap >= (uint64_t{1} << 62)) g.name = "detected (like " + g.name + ")";
  g.description = name;
  g.memory_bytes = memory;
  return g;
}

}  // namespace

Result<Cluster> DetectCluster(const std::string& nvme_path, std::string* gpu_note) {
  Cluster c;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemTotal: %llu kB", &kib) == 1) {
      c.cpu_memory_bytes = static_cast<uint64_t>(kib) * 1024;
      break;
    }
  }
  if (c.cpu_memory_bytes == 0) return Status::IoError("cannot read MemTotal from /proc/meminfo");
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  c.cpu_cores = cores > 0 ? cores : 0;
  rlimit limit{};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    c.memlock_bytes = std::max<uint64_t>(limit.rlim_cur, 1);
  }
  if (!nvme_path.empty()) {
    // The swap files go in this directory: a file or a device here would be measured as the
    // filesystem holding it and then given to DeepSpeed as its nvme_path, which it cannot use.
    struct stat st {};
    if (::stat(nvme_path.c_str(), &st) != 0) {
      return Status::FromErrno(errno, "`nvme_path` " + Printable(nvme_path));
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument("`nvme_path` " + Printable(nvme_path) +
                                     ": not a directory (the directory for the swap files)");
    }
    struct statvfs fs {};
    if (::statvfs(nvme_path.c_str(), &fs) != 0) {
      return Status::FromErrno(errno, "`nvme_path` " + Printable(nvme_path));
    }
    c.nvme_path = nvme_path;
    c.nvme_capacity_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  }
  int count = 0;
  std::string name;
  uint64_t memory = 0;
  std::string note;
  if (ProbeCuda(&count, &name, &memory, &note)) {
    c.gpu = MatchGpu(name, memory);
    c.gpus_per_node = count;
    note = "detected " + std::to_string(count) + " x " + name + " (" + FormatGiB(memory) +
           "), figures of preset " + c.gpu.name;
  }
  if (gpu_note != nullptr) *gpu_note = note;
  (void)kGiB;
  return c;
}

std::string FormatGiB(uint64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / 0x1p30);
  return text;
}

}  // namespace memplan::planner
