// The step-time model: how long one optimizer step of a training setup takes on a cluster, split
// into compute, communication, host/NVMe transfers and the optimizer, with the model FLOPs (MFU)
// and the hardware FLOPs (HFU) it does. Every constant is a named physical quantity in
// TimeConstants, so that measured runs can refit them (issue 22's calibration).
//
// Note [Step-time model]
// A step is ga micro-batches of b sequences of s tokens on each GPU, then the optimizer.
//
// Compute, per micro-batch and per transformer layer, as the GPU's kernels run it:
//   GEMMs: every Linear of the layer (from the model inventory; MoE experts at top_k/E of the
//     tokens; LoRA: frozen base weights skip the weight-gradient GEMM) as an M x K x N product with
//     M = b s tokens, timed by the roofline: the larger of 2MKN / (peak x gemm_efficiency) and the
//     bytes of its three operands / (HBM x hbm_efficiency). Forward 1 GEMM per weight, backward 2
//     (input and weight gradients), full recompute 1 more. Small M (small micro-batches or
//     sequences) makes the operand bytes matter: that is the micro-batch x sequence dependence, and
//     narrow layers (small K, N) are hit the same way. Each output tile also pays a fixed prologue
//     and epilogue (loading the pipeline, writing the tile): its main loop runs K / (K +
//     gemm_k_overhead) of the time, normalised so that a K = 8192 GEMM runs at gemm_efficiency.
//   Attention core (QK^T, PV): 4 b s s_eff d FLOPs forward per layer (d = heads x head_dim,
//     s_eff = s/2 causal with memory-efficient attention, which skips masked blocks; s for eager
//     attention and encoders), backward 2.5x forward for FlashAttention (it recomputes the scores)
//     and 2x for eager, at peak x attention_efficiency (FlashAttention-2's published fraction).
//     Eager attention also streams its b a s^2 score tensors (eager_score_passes times).
//   Elementwise kernels (norms, activations, residual adds, rotary, dropout): memory-bound; the
//     bytes they move are elementwise_traffic times the activation bytes the layer keeps without
//     checkpointing (estimator::EstimateMemory's activation_bytes_per_layer), at HBM speed.
//   Host: each layer costs launch_s_per_layer of host time per pass (kernel launches through the
//     PyTorch dispatcher), plus sharded_hook_s per pass under ZeRO-3 / FSDP (the per-module fetch
//     and release hooks); the GPU waits when the host is slower (max of the two per layer).
//   Output layer: the LM head GEMM, and the fp32 logits (b s V x 4 bytes) streamed logits_passes
//     times (upcast, log-softmax, loss, its gradient). QLoRA: each NF4 weight is dequantised to
//     16 bits before each use (forward, backward, recompute): dequant_bytes_per_param through HBM.
//
// Collectives (NCCL ring): an all-gather or reduce-scatter of S bytes over d GPUs takes
//   S (d-1)/d / min(GPU link x link_efficiency, node network x network_efficiency) (the network
//   only when d spans nodes; with one NIC per GPU, the ring's node-crossing hops share the node's
//   network, so the node's bandwidth is the limit) + collective_latency_s per call; an all-reduce
//   is twice that. Gradients are reduced in their 16-bit dtype (fp32 with fp32 training).
//     ZeRO-0 (DDP): all-reduce of the gradients once per step (no_sync while accumulating),
//       overlapping the last backward pass.
//     ZeRO-1: reduce-scatter once per step (overlapping the last backward), all-gather of the
//       updated 16-bit parameters after the optimizer step (serial).
//     ZeRO-2: reduce-scatter every micro-batch (overlapping backward), the all-gather after the
//     step. ZeRO-3 / FSDP FULL_SHARD: per micro-batch, all-gather of the 16-bit parameters for
//     forward
//       (overlapping forward, the first layer exposed) and again for backward (the recompute
//       reuses it: stage3_max_reuse_distance / FSDP's backward prefetch), and the reduce-scatter of
//       the gradients (overlapping backward, the last layer exposed).
//     Hybrid sharding (FSDP HYBRID_SHARD, DeepSpeed MiCS with the shard group = one node): the
//       same within each node over the GPU links, plus an all-reduce of each GPU's gradient shard
//       across nodes per micro-batch over the network (overlapping backward).
//   A collective overlapped with compute still slows it: NCCL's kernels take SMs and HBM
//   bandwidth, so overlap_interference of the overlapped time is added to compute.
//
// Host transfers (PCIe x16 at pcie_efficiency; gpus_per_pcie_switch GPUs of a node share one host
//   link, as in DGX-class servers; unpinned memory at unpinned_factor of that):
//     optimizer offload: each micro-batch's gradient partition goes down in fp32 (4 B/param:
//       torch converts on the GPU before a non-blocking device-to-host copy), overlapping
//       backward; after the CPU step the partition comes back in 16 bits (2 B/param), serial.
//     parameter offload (ZeRO-3): the 16-bit partition comes up for forward and for backward,
//       pipelined with the all-gathers (the slower of the two counts), the first layer exposed;
//       with the optimizer on the GPU the updated partition goes back down after the step (serial).
// CPU optimizer (serial after backward): the node's trainable parameters at the node's CPU Adam
//   rate (`bench adam`, or the prior of Cluster::CpuAdamParamsPerS) plus the host passes around
//   it (unscale and clip, fp32 -> 16-bit conversion: cpu_extra_bytes_per_param) at the memory
//   bandwidth that rate implies (cpu_adam_bytes_per_param per parameter).
// NVMe: optimizer offload reads and writes the fp32 master weights and optimizer states once per
//   step, pipelined with the CPU optimizer (the larger of the two); parameter offload reads the
//   16-bit parameters per micro-batch for forward and backward (overlapping compute) and writes
//   them after the step.
// GPU optimizer (not offloaded): a memory-bound pass over the local partition of the master
//   weights, optimizer states and gradients (bytes per parameter by optimizer and precision),
//   plus the gradient-norm pass for clipping.
// Fixed per step: step_fixed_s (data loader, loss synchronisation, zero_grad, scheduler).
//
// MFU counts the model's FLOPs, 6N + 12 L s d per token (N the parameters of every matmul, the LM
// head included and the embedding lookup not; LoRA: 4N + 6N_adapters, since frozen weights get no
// weight gradient), with the non-causal attention term as PaLM and Megatron count it, over the
// peak; HFU adds what recomputation runs again (2N + 4 L s d for full
// checkpointing, 4 L s d for selective). Neither counts elementwise work.
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"

namespace memplan::planner {

// The model's constants. Each is one physical quantity; DefaultTimeConstants() (step_time.cc) says
// where each default comes from. Per-GPU figures (peak FLOPs, HBM and link bandwidth, GEMM and
// attention efficiency) are in GpuSpec.
struct TimeConstants {
  double hbm_efficiency = 0;       // achieved / peak HBM bandwidth of streaming kernels
  double gemm_k_overhead = 0;      // GEMM tile prologue/epilogue, in K elements (K / (K + this))
  double elementwise_traffic = 0;  // bytes moved by elementwise kernels per activation byte kept
  double eager_score_passes = 0;   // times eager attention streams its score tensors
  double logits_passes = 0;        // times the fp32 logits are streamed (forward + backward)
  double dequant_bytes_per_param = 0;  // QLoRA: HBM bytes per NF4 weight per dequantisation
  double launch_s_per_layer = 0;    // host seconds per transformer layer per pass (eager kernels)
  double sharded_hook_s = 0;        // host seconds per layer per pass for ZeRO-3 / FSDP hooks
  double link_efficiency = 0;       // NCCL bus bandwidth / GPU link peak (NVLink or PCIe P2P)
  double network_efficiency = 0;    // NCCL bus bandwidth / node network line rate
  double collective_latency_s = 0;  // per collective call
  double overlap_interference = 0;  // compute slowdown per second of overlapped collective
  double pcie_efficiency = 0;       // achieved / x16 line rate, pinned memory
  double unpinned_factor = 0;       // pageable host memory: this fraction of the pinned rate
  double cpu_adam_bytes_per_param = 0;   // host memory bytes CPU Adam moves per parameter
  double cpu_extra_bytes_per_param = 0;  // other host passes per offloaded parameter per step
  double gpu_clip_bytes_per_param = 0;   // gradient-norm pass for clipping, per parameter
  double step_fixed_s = 0;               // host work per optimizer step outside the model
  // GEMM efficiency against the micro-batch: a GEMM of M rows (micro-batch x sequence tokens)
  // runs at gemm_efficiency x M / (M + gemm_tokens_half) of its compute roofline (wave
  // quantisation and launch overheads that the operand-bytes roofline misses). 0 (the default)
  // leaves the roofline alone; `memplan calibrate` fits it from runs at several micro-batch x
  // sequence sizes.
  double gemm_tokens_half = 0;
  // Fraction of the host transfers that can overlap compute (gradient copies, parameter
  // fetches) and of the CPU optimizer / NVMe pipeline that actually does: the rest is exposed.
  // 1 (the default) is the ideal overlap of Note [Step-time model]; `memplan calibrate` fits it.
  double offload_overlap = 1;
  // The CPU optimizer's speed as measured runs see it, over the node's rate (`bench adam` or the
  // prior of Cluster::CpuAdamParamsPerS): 1 (the default) unless calibrated.
  double cpu_adam_factor = 1;
};
const TimeConstants& DefaultTimeConstants();

// One Linear as the time model sees it: K x N weight applied to `token_fraction` of the tokens.
struct Gemm {
  double k = 0, n = 0;
  double token_fraction = 1;  // MoE experts: top_k / experts; dense: 1
  bool frozen = false;        // no weight gradient (LoRA base weights)
  bool quantized = false;     // QLoRA NF4 weight, dequantised before use
  double count = 1;           // how many such Linears (all layers together)
};

// What the time model needs from a model, computed once per search (ModelShapeFor).
struct ModelShape {
  double params = 0;           // N, all parameters (tied once)
  double trainable = 0;        // trained parameters (N, or the LoRA adapters)
  double layers = 0;           // transformer blocks, encoder + decoder
  double hidden = 0;           // h
  double attention_width = 0;  // heads x head_dim
  double heads = 0;            // query heads
  double vocab = 0;
  double seq_len = 0;  // s
  bool causal = true;  // decoder-only (FlashAttention skips the masked half)
  bool flash_attention = true;
  std::vector<Gemm> layer_gemms;  // the Linears inside the transformer layers, all layers
  std::vector<Gemm> head_gemms;   // outside the layers: the LM head (tied or not), poolers
  double activation_bytes_per_token_layer = 0;  // kept without checkpointing, one layer
  double quantized_params = 0;                  // QLoRA: NF4 weights
  int64_t param_tensors = 0;                    // parameter tensors (optimizer launch overhead)
};

// Shapes from the inventory for `setup` (LoRA targets, QLoRA, flash attention, seq_len resolved).
// Errors: an inventory without architecture, estimator failures.
Result<ModelShape> ModelShapeFor(const estimator::ModelInventory& inventory,
                                 const estimator::TrainingSetup& setup);

// How the ZeRO-3 family shards (setup.zero_stage == 3 only).
enum class Sharding {
  kFull,    // over all GPUs (ZeRO-3, FSDP FULL_SHARD)
  kHybrid,  // within each node, replicated across nodes (FSDP HYBRID_SHARD, DeepSpeed MiCS)
};

// Predicted step time, each part in seconds.
struct StepTime {
  double compute_s = 0;       // the GPU's forward/backward work (interference of overlap included)
  double comm_s = 0;          // collectives, total
  double pcie_s = 0;          // host <-> GPU transfers, total
  double optimizer_s = 0;     // optimizer step: CPU (offloaded) or GPU, with clipping
  double nvme_s = 0;          // NVMe reads and writes, total
  double exposed_comm_s = 0;  // the part of comm_s not hidden behind compute
  double exposed_offload_s = 0;    // the part of pcie_s + nvme_s not hidden (optimizer phase aside)
  double exposed_optimizer_s = 0;  // the optimizer phase (CPU or GPU) and fixed per-step costs
  double total_s = 0;
  std::string bound;  // "compute", "communication", "PCIe", "CPU optimizer", "NVMe"
  // Work done per step per GPU.
  double model_flops = 0;     // for MFU (see Note [Step-time model])
  double hardware_flops = 0;  // model FLOPs + recomputation (HFU)
  // Components of compute_s, for people and for calibration.
  double gemm_s = 0, attention_s = 0, elementwise_s = 0, host_wait_s = 0;
};

// The step time of `setup` for `global_batch` sequences over the cluster; `pinned`: host buffers
// are pinned; `sharding` for ZeRO-3.
StepTime PredictStepTime(const ModelShape& model, const Cluster& cluster,
                         const estimator::TrainingSetup& setup, int64_t global_batch, bool pinned,
                         Sharding sharding = Sharding::kFull,
                         const TimeConstants& constants = DefaultTimeConstants());

// Peak dense FLOPs of the GPU for the precision (TF32 for fp32 where the GPU has it).
double PeakFlops(const GpuSpec& gpu, estimator::Precision precision);

}  // namespace memplan::planner
