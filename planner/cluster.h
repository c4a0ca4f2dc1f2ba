// Cluster: the hardware a training job runs on, as the planner sees it. GPU presets (memory, peak
// 16-bit FLOPs, HBM and GPU-to-GPU link bandwidth), nodes, GPUs per node, host RAM and cores,
// PCIe generation, and the NVMe drive (path, capacity, bandwidth). Measured inputs replace priors:
// a `memplan bench nvme --format json` result gives the drive's bandwidth, a `memplan bench adam
// --format json` result the CPU optimizer's speed. A cluster is also a JSON document (ToJson /
// ClusterFromJson) and can be read off the local machine (DetectCluster).
//
// Sizes are bytes, bandwidths bytes per second (decimal, as vendors quote them), FLOPs per second.
//
// Thread safety: plain values and pure functions; DetectCluster reads the OS (and the CUDA driver
// when one is installed) and may be called from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memplan::planner {

struct GpuSpec {
  std::string name;             // preset key: "a100-80"
  std::string description;      // "NVIDIA A100 80GB SXM"
  uint64_t memory_bytes = 0;    // what the driver reports as total memory
  double bf16_flops = 0;        // dense peak, tensor cores; 0 = bf16 not supported
  double fp16_flops = 0;        // dense peak with fp32 accumulation
  double fp32_flops = 0;        // TF32 tensor-core peak where the GPU has it, else FP32
  double hbm_bytes_per_s = 0;   // device memory bandwidth
  double link_bytes_per_s = 0;  // GPU-to-GPU inside a node, per direction (NVLink or PCIe)
  int pcie_gen = 4;             // host link: 3, 4 or 5 (x16)
  double mfu_prior = 0.45;      // informational: MFU of large dense models (the time model
                                // derives its own, Note [Step-time model])
  // Fraction of the dense peak a large 16-bit cuBLAS GEMM sustains at the GPU's clocks under load.
  double gemm_efficiency = 0.75;
  // Fraction of the dense peak FlashAttention-2 sustains over forward + backward (causal FLOPs).
  double attention_efficiency = 0.5;
  // Per-node network of the GPU's reference server, per direction (DGX A100: 8 x 200 Gb/s).
  double node_network_bytes_per_s = 25e9;
  // GPUs of a node behind one PCIe switch, sharing its host link (2 in DGX-class servers).
  int gpus_per_pcie_switch = 1;
};

// The presets: v100-16, v100-32, a100-40, a100-80, a800-80, h100-80, h100-96, h200, l40s,
// rtx3090, rtx4090, a10g, l4, t4, b200, h200-nvl, mi300x (public datasheet figures, dense, no
// sparsity; each with its source beside it in cluster.cc).
const std::vector<GpuSpec>& GpuPresets();
// Case-insensitive; also accepts "a100" (-> a100-80), "h100", "v100" (-> v100-32), "4090", and
// the names nvidia-smi prints ("NVIDIA A100-SXM4-40GB" -> a100-40; Note [GPU names] in
// cluster.cc). Errors list the preset names.
Result<GpuSpec> FindGpuPreset(std::string_view name);
// When `name` is a short name that picks one of several presets of the same GPU ("a100" ->
// a100-80 while a100-40 exists), a sentence saying which it picked, its memory, and the others;
// empty for a full preset name, an unknown name, or a GPU with one preset. Issue 31 item 10: a
// silent choice of the 80 GB card misleads the owner of a 40 GB one.
std::string GpuAliasNote(std::string_view name);

struct Cluster {
  GpuSpec gpu;
  int64_t nodes = 1;
  int64_t gpus_per_node = 1;
  uint64_t cpu_memory_bytes = 0;  // host RAM per node; 0 = unknown (CPU limits not checked)
  int64_t cpu_cores = 0;          // per node; 0 = unknown (the CPU-optimizer prior assumes 16)
  int pcie_gen = 0;               // 0 = the GPU preset's
  // Network per node, per direction; 0 = the GPU preset's reference server
  // (GpuSpec::node_network_bytes_per_s).
  double inter_node_bytes_per_s = 0;
  // RLIMIT_MEMLOCK per process; 0 = unlimited or unknown (not checked).
  uint64_t memlock_bytes = 0;

  std::string nvme_path;             // empty: no NVMe offload possible
  uint64_t nvme_capacity_bytes = 0;  // free space for swap files per node; 0 = unknown
  double nvme_read_bytes_per_s = 0;  // 0 = prior (see kNvmeReadPrior)
  double nvme_write_bytes_per_s = 0;
  std::string nvme_bandwidth_source = "prior";  // "prior", "bench", "given"
  // aio block for DeepSpeed from a bench nvme result (block_size bytes, queue_depth); 0 = defaults.
  int64_t aio_block_size = 0;
  int64_t aio_queue_depth = 0;
  int64_t aio_intra_op_parallelism = 0;  // from a bench's aio block; 0: not measured

  double cpu_adam_params_per_s = 0;       // per node; 0 = prior (see CpuAdamParamsPerS)
  std::string cpu_adam_source = "prior";  // "prior" or "bench"

  int64_t WorldSize() const { return nodes * gpus_per_node; }
  int PcieGen() const { return pcie_gen > 0 ? pcie_gen : gpu.pcie_gen; }
  // Host-to-GPU bandwidth per GPU, per direction, pinned memory: 16 / 32 / 63 GB/s (Gen 3/4/5)
  // times kPcieEfficiency.
  double PcieBytesPerS() const;
  // The x16 line rate per direction: 16 / 32 / 63 / 121 GB/s (Gen 3/4/5/6).
  double PcieLineBytesPerS() const;
  // inter_node_bytes_per_s, or the GPU preset's node network when it is 0.
  double InterNodeBytesPerS() const;
  double NvmeReadBytesPerS() const;
  double NvmeWriteBytesPerS() const;
  // Measured, or the prior: kCpuAdamPerCorePrior per core (16 cores if unknown), at most
  // kCpuAdamNodePrior per node (memory-bandwidth bound).
  double CpuAdamParamsPerS() const;

  // Refuses non-positive counts, absurd sizes, a GPU without memory or FLOPs.
  Status Validate() const;
};

// Priors, stated in plan output.
constexpr double kNvmeReadPrior = 3.2e9;   // one Gen4 drive, DeepSpeed's aio after tuning: 3.7
constexpr double kNvmeWritePrior = 2.6e9;  // read / 3.2 write GB/s, less a margin for sustained use
constexpr double kPcieEfficiency = 0.8;    // achieved fraction of the x16 link (pinned memory)
// DeepSpeed's CPU Adam as published runs see it, per node: memory-bound at about 3.5e9
// parameters/s on two-socket servers (~100 GB/s of the 28 bytes it moves per parameter): between
// what DeepSpeed's ZenFlow core-binding study implies on 2 x EPYC 7742 (1.5B and 3B models with
// ZeRO-Offload) and the ZeRO-Offload paper's CPU-Adam latency on a DGX-2 (48 Xeon cores); and
// 1e8 per core below that (a loaded server gives each core ~3 GB/s of memory bandwidth, 28 bytes
// per parameter; memplan's own AVX-512 AdamW runs 2.8e8 params/s on one idle core).
constexpr double kCpuAdamPerCorePrior = 1e8;
constexpr double kCpuAdamNodePrior = 3.5e9;

// What a `memplan bench nvme --format json` report says, read by the one reader of that format
// (NvmeBenchFromJson) for `plan --nvme-bench` (ApplyNvmeBench) and `bench swap --nvme-json`.
struct NvmeBenchReading {
  double read_bytes_per_s = 0;   // best.read_bytes_per_s; 0: not measured (absent or null)
  double write_bytes_per_s = 0;  // best.write_bytes_per_s; 0: not measured
  // The "aio" block's settings where given as integers (older reports nest them in "aio.aio").
  std::optional<int64_t> aio_block_size;
  std::optional<int64_t> aio_queue_depth;
  std::optional<int64_t> aio_intra_op_parallelism;  // only when in 1..64
  std::string path;                                 // "path", "" when absent
};
// Refuses (naming `source`) a document without a "best" object, a measured direction that is not
// a positive number, and a "best" with neither direction.
Result<NvmeBenchReading> NvmeBenchFromJson(const nlohmann::json& bench, const std::string& source);

// Applies a `memplan bench nvme --format json` document: best.read_bytes_per_s and
// best.write_bytes_per_s (best_aio-agnostic), the aio block, and the path when none was given.
// Errors name `source` and the missing field.
Status ApplyNvmeBench(const nlohmann::json& bench, const std::string& source, Cluster* cluster);
// Applies a `memplan bench adam --format json` document: params_per_s (for the threads it ran
// with; scaled to cpu_cores when the bench used fewer threads).
Status ApplyAdamBench(const nlohmann::json& bench, const std::string& source, Cluster* cluster);

// JSON form: {"gpu": {...} or "a100-80", "nodes", "gpus_per_node", "cpu_memory_bytes",
// "cpu_cores", "pcie_gen", "inter_node_bytes_per_s", "memlock_bytes", "nvme_path",
// "nvme_capacity_bytes", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", ...}. FromJson
// accepts any subset (the GPU is required), sizes as numbers or strings ("80GiB"), and refuses
// unknown keys, naming them.
nlohmann::json ToJson(const Cluster& cluster);
Result<Cluster> ClusterFromJson(const nlohmann::json& json, const std::string& source);

// The local machine: RAM (/proc/meminfo MemTotal), online cores, RLIMIT_MEMLOCK, free space at
// `nvme_path` (statvfs; when given), and GPUs through the CUDA driver (libcuda.so.1, loaded at
// run time) when one is installed; any CUDA error means "no GPU" and `*gpu_note` says why. The
// GPU is matched to a preset by name and memory; an unknown GPU gets the preset closest in
// memory with its own memory size.
Result<Cluster> DetectCluster(const std::string& nvme_path, std::string* gpu_note);

// 85899345920 -> "80.0 GiB" (binary units, one decimal).
std::string FormatGiB(uint64_t bytes);

}  // namespace memplan::planner
