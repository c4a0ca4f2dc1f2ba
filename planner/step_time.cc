#include "planner/step_time.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "estimator/memory_model.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;
using estimator::Optimizer;
using estimator::Precision;
using estimator::TrainingSetup;

// Time of one M x K x N GEMM: the roofline of Note [Step-time model], the larger of its compute at
// the tensor cores' sustained rate and its operands' bytes at HBM speed.
double GemmSeconds(double m, double k, double n, double elem_bytes, double flops_per_s,
                   double hbm_bytes_per_s, double k_overhead, double tokens_half) {
  if (m <= 0 || k <= 0 || n <= 0) return 0;
  const double tile = (k + k_overhead) / k * 8192 / (8192 + k_overhead);
  return std::max(2 * m * k * n * tile * (1 + tokens_half / m) / flops_per_s,
                  elem_bytes * (m * k + k * n + m * n) / hbm_bytes_per_s);
}

// Ring all-gather / reduce-scatter of `bytes` (the full tensor) over `ranks` GPUs, `nodes` of them
// spanning nodes, in `calls` collectives.
double GatherSeconds(double bytes, double ranks, double nodes, double calls, const Cluster& c,
                     const TimeConstants& k) {
  if (ranks <= 1 || bytes <= 0) return 0;
  double bw = c.gpu.link_bytes_per_s * k.link_efficiency;
  if (nodes > 1) bw = std::min(bw, c.InterNodeBytesPerS() * k.network_efficiency);
  return bytes * (ranks - 1) / ranks / bw + calls * k.collective_latency_s;
}

// Bytes per parameter of the GPU optimizer's memory-bound pass over the local partition: master
// weights and states read and written, the gradient read (after its conversion to fp32 in mixed
// precision), and the 16-bit working copy written.
double GpuOptimizerBytesPerParam(const TrainingSetup& s) {
  const bool mixed = s.precision == Precision::kFp16Mixed || s.precision == Precision::kBf16Mixed;
  const double master = s.precision == Precision::kBf16Pure ? 2 : 4;
  double state = 0;
  switch (s.optimizer) {
    case Optimizer::kAdamW: state = s.precision == Precision::kBf16Pure ? 4 : 8; break;
    case Optimizer::kAdam8bit: state = 2; break;
    case Optimizer::kSgd: state = s.sgd_momentum > 0 ? master : 0; break;
    case Optimizer::kLion: state = master; break;
    case Optimizer::kAdafactor: state = master; break;
  }
  double bytes = 2 * master + 2 * state + (mixed ? 4 : master);
  if (mixed) bytes += 2 + 4 + 2;  // 16-bit gradient -> fp32 copy, updated 16-bit weights written
  return bytes;
}

}  // namespace

// Where each default comes from.
const TimeConstants& DefaultTimeConstants() {
  static const TimeConstants kDefaults = [] {
    TimeConstants k;
    // Streaming kernels: STREAM-like copies reach 85-90% of HBM peak on A100/H100, eager PyTorch
    // elementwise kernels less.
    k.hbm_efficiency = 0.80;
    // Per output tile, the pipeline prologue and epilogue of a cuBLAS/CUTLASS GEMM cost about as
    // much as 256 K-steps of its main loop (narrow layers lose most).
    k.gemm_k_overhead = 256;
    // Bytes per activation byte kept: unfused elementwise kernels write each kept activation in
    // forward, read it in backward, write and read its gradient (4 passes), and stream about as
    // much again in temporaries they do not keep (RMSNorm's fp32 upcast and variance, SwiGLU's
    // product, rotary's rotate_half).
    k.elementwise_traffic = 8;
    // Eager attention: scale, mask, softmax and dropout over the b a s^2 scores, forward and
    // backward.
    k.eager_score_passes = 10;
    // fp32 logits: upcast, log-softmax, loss, and the same backward.
    k.logits_passes = 6;
    // QLoRA: 0.5-byte NF4 read and 2-byte bf16 written per weight per use (bitsandbytes
    // dequantize_4bit).
    k.dequant_bytes_per_param = 2.5;
    // Eager PyTorch launches ~40-70 kernels per transformer layer and pass at 6-10 us of host time
    // each.
    k.launch_s_per_layer = 4e-4;
    // ZeRO-3 / FSDP per-layer fetch/release hooks per pass (100-300 us in profiler traces).
    k.sharded_hook_s = 2e-4;
    // nccl-tests all-gather bus bandwidth: ~240 of 300 GB/s on DGX A100, ~370 of 450 on DGX H100.
    k.link_efficiency = 0.80;
    // nccl-tests bus bandwidth across nodes on InfiniBand / RoCE.
    k.network_efficiency = 0.85;
    // Per NCCL collective call: launch and ring latency at small sizes.
    k.collective_latency_s = 50e-6;
    // Seconds of compute lost per second of overlap: NCCL kernels occupy SMs (16-32 CTAs of
    // 108-132 SMs) and HBM bandwidth while a collective overlaps compute; overlapped matmuls run
    // 10-30% slower.
    k.overlap_interference = 0.25;
    // Pinned host memory, cudaMemcpyAsync, of the x16 line rate.
    k.pcie_efficiency = kPcieEfficiency;
    // Pageable memory is staged through a pinned bounce buffer.
    k.unpinned_factor = 0.5;
    // fp32 weight, gradient, m and v read; weight, m and v written (DeepSpeed cpu_adam).
    k.cpu_adam_bytes_per_param = 28;
    // ZeRO-Offload's other host passes: unscale and clip the fp32 gradients (read, write, norm)
    // and convert the updated weights to 16 bits for the upload.
    k.cpu_extra_bytes_per_param = 18;
    // The gradient-norm pass for clipping over the local fp32 gradients.
    k.gpu_clip_bytes_per_param = 4;
    // Per optimizer step: data loader, loss synchronisation, zero_grad, scheduler.
    k.step_fixed_s = 0.02;
    // The last three are neutral unless `memplan calibrate` fits them from measured runs: the
    // roofline GEMM, ideal overlap of host transfers and the CPU optimizer / NVMe pipeline, and
    // the CPU optimizer at the `bench adam` rate or the prior.
    k.gemm_tokens_half = 0;
    k.offload_overlap = 1;
    k.cpu_adam_factor = 1;
    return k;
  }();
  return kDefaults;
}

double PeakFlops(const GpuSpec& gpu, Precision precision) {
  switch (precision) {
    case Precision::kFp32: return gpu.fp32_flops > 0 ? gpu.fp32_flops : gpu.fp16_flops / 8;
    case Precision::kFp16Mixed: return gpu.fp16_flops;
    case Precision::kBf16Mixed:
    case Precision::kBf16Pure: return gpu.bf16_flops;
  }
  return gpu.fp16_flops;
}

Result<ModelShape> ModelShapeFor(const estimator::ModelInventory& inventory,
                                 const TrainingSetup& setup) {
  if (!inventory.arch) {
    return Status::InvalidArgument(inventory.name + ": the time model needs the architecture");
  }
  const estimator::ArchitectureInfo& arch = *inventory.arch;
  ModelShape m;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelCounts counts, estimator::CountParams(inventory));
  m.params = static_cast<double>(counts.params_total);
  m.layers = static_cast<double>(arch.layers + arch.decoder_layers);
  m.hidden = static_cast<double>(arch.hidden);
  m.heads = static_cast<double>(std::max<int64_t>(arch.heads, 1));
  m.attention_width = static_cast<double>(arch.heads * arch.head_dim);
  if (m.attention_width <= 0) m.attention_width = m.hidden;
  m.vocab = static_cast<double>(arch.vocab);
  m.seq_len = static_cast<double>(setup.SeqLenFor(&arch));
  m.causal = !arch.encoder_decoder && inventory.model_class != "masked_lm" &&
             inventory.model_type != "bert" && inventory.model_type != "roberta";
  m.flash_attention = setup.flash_attention;

  std::set<const estimator::TensorInfo*> targets;
  if (setup.lora_rank > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(auto list, estimator::LoraTargetTensors(inventory, setup));
    targets.insert(list.begin(), list.end());
  }
  const bool lora = setup.lora_rank > 0;
  const double r = static_cast<double>(setup.lora_rank);
  const double experts = static_cast<double>(std::max<int64_t>(arch.experts, 1));
  const double top_k =
      arch.experts > 0 ? static_cast<double>(std::max<int64_t>(arch.experts_per_token, 1)) : 1;
  bool has_head = false;
  double adapters = 0;
  for (const estimator::TensorInfo& t : inventory.tensors) {
    ++m.param_tensors;
    if (!t.tied_to.empty()) {
      // A tied LM head runs a GEMM with the embedding matrix (Note [Tensor roles]).
      if (t.role == estimator::TensorRole::kHead && t.IsLinearWeight()) {
        has_head = true;
        m.head_gemms.push_back(
            {static_cast<double>(arch.hidden), static_cast<double>(arch.vocab), 1, lora, false, 1});
      }
      continue;
    }
    // Every Linear runs a GEMM, and so does a router held as a bare Parameter (Transformers 5);
    // embedding tables are lookups (Note [Tensor roles]).
    const bool router = t.role == estimator::TensorRole::kRouter && !t.bias;
    if (t.shape.size() != 2 || !(t.IsLinearWeight() || router)) continue;
    Gemm g;
    g.k = static_cast<double>(t.InFeatures());
    g.n = static_cast<double>(t.OutFeatures());
    g.frozen = lora;
    const bool in_block = !t.block.empty();
    g.quantized = setup.qlora && in_block && t.IsLinearWeight();
    if (g.quantized) m.quantized_params += static_cast<double>(t.numel);
    const bool expert = t.role == estimator::TensorRole::kExpertUp ||
                        t.role == estimator::TensorRole::kExpertGate ||
                        t.role == estimator::TensorRole::kExpertGateUp ||
                        t.role == estimator::TensorRole::kExpertDown;
    if (arch.experts > 0 && expert) g.token_fraction = top_k / experts;
    if (targets.count(&t) > 0) {
      // The adapter: x A^T (K -> r) then B^T (r -> N), both trained.
      Gemm a{g.k, r, g.token_fraction, false, false, 1};
      Gemm b{r, g.n, g.token_fraction, false, false, 1};
      (in_block ? m.layer_gemms : m.head_gemms).push_back(a);
      (in_block ? m.layer_gemms : m.head_gemms).push_back(b);
      adapters += r * (g.k + g.n);
    }
    if (in_block) {
      m.layer_gemms.push_back(g);
    } else {
      if (t.role == estimator::TensorRole::kHead) has_head = true;
      m.head_gemms.push_back(g);
    }
  }
  // Identical Linears merged (the same shape in every layer).
  auto merge = [](std::vector<Gemm>* list) {
    std::vector<Gemm> out;
    for (const Gemm& x : *list) {
      auto same = std::find_if(out.begin(), out.end(), [&](const Gemm& y) {
        return y.k == x.k && y.n == x.n && y.token_fraction == x.token_fraction &&
               y.frozen == x.frozen && y.quantized == x.quantized;
      });
      if (same == out.end()) {
        out.push_back(x);
      } else {
        same->count += x.count;
      }
    }
    *list = std::move(out);
  };
  merge(&m.layer_gemms);
  merge(&m.head_gemms);
  // A causal LM whose head is tied and not listed uses the embedding matrix as its head.
  if (!has_head && (inventory.model_class == "causal_lm" || inventory.model_class == "masked_lm" ||
                    inventory.model_class == "seq2seq_lm")) {
    m.head_gemms.push_back(
        {static_cast<double>(arch.hidden), static_cast<double>(arch.vocab), 1, lora, false, 1});
  }
  m.trainable = lora ? adapters : m.params;

  // Activation bytes one layer keeps without checkpointing, per token (the elementwise traffic
  // is proportional to them).
  TrainingSetup probe = setup;
  probe.zero_stage = 0;
  probe.offload_optimizer = probe.offload_param = OffloadDevice::kNone;
  probe.gpus_per_node = probe.num_nodes = 1;
  probe.tp = 1;
  probe.sequence_parallel = false;
  probe.micro_batch = 1;
  probe.grad_accum = 1;
  probe.checkpointing = Checkpointing::kNone;
  probe.lora_rank = 0;
  probe.lora_targets.clear();
  probe.qlora = probe.double_quant = false;
  probe.autocast = false;
  if (probe.optimizer == Optimizer::kAdam8bit && probe.lora_rank > 0)
    probe.optimizer = Optimizer::kAdamW;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::MemoryEstimate e,
                           estimator::EstimateMemory(inventory, probe, counts,
                                                     /*step_model=*/false));
  m.activation_bytes_per_token_layer =
      static_cast<double>(e.activation_bytes_per_layer) / std::max(m.seq_len, 1.0);
  return m;
}

namespace {

// What every step of PredictStepTime reads: the run's sizes as doubles.
struct StepFacts {
  double d = 0;  // GPUs
  double g = 0;  // GPUs per node
  double nodes = 0;
  double ga = 0;      // micro-batches per step
  double w = 0;       // bytes of the working dtype
  double tokens = 0;  // per micro-batch
  double layers = 0;
  bool zero3 = false;
  // Checkpointing (Note [The step model]).
  bool full_ckpt = false, selective = false, op_ckpt = false;
  double full_frac = 0;  // the fraction of the layers full checkpointing recomputes
};

StepFacts FactsFor(const ModelShape& m, const Cluster& c, const TrainingSetup& s) {
  StepFacts f;
  f.d = static_cast<double>(c.WorldSize());
  f.g = static_cast<double>(c.gpus_per_node);
  f.nodes = static_cast<double>(c.nodes);
  f.ga = static_cast<double>(s.grad_accum);
  const bool fp32 = s.precision == Precision::kFp32;
  f.w = fp32 ? 4 : 2;
  f.tokens = static_cast<double>(s.micro_batch) * m.seq_len;
  // What each policy recomputes in backward (Note [The step model]): full, the whole forward of
  // the checkpointed blocks (every checkpoint_every-th: that fraction of the layers); selective,
  // the attention core; op (torchtitan's op-level SAC, torchtitan/models/llama3/
  // parallelize_llama.py _save_list), every other matmul and the elementwise ops, keeping the
  // attention outputs.
  f.full_ckpt = s.checkpointing == Checkpointing::kFull;
  f.selective = s.checkpointing == Checkpointing::kSelective;
  f.op_ckpt = s.checkpointing == Checkpointing::kOp;
  f.full_frac =
      f.full_ckpt ? 1.0 / static_cast<double>(std::max<int64_t>(s.checkpoint_every, 1)) : 0.0;
  f.zero3 = s.zero_stage == 3;
  f.layers = std::max(m.layers, 1.0);
  return f;
}

// One micro-batch's forward and backward on the GPU (host waits included).
struct MicroBatch {
  double fwd = 0, bwd = 0;
};

// Step "compute": GEMMs, attention, elementwise kernels and the head, one micro-batch; fills the
// step's gemm_s, attention_s, elementwise_s, host_wait_s and FLOP counts.
MicroBatch PredictCompute(const ModelShape& m, const Cluster& c, const TrainingSetup& s,
                          const TimeConstants& k, const StepFacts& f, StepTime* t) {
  const double ga = f.ga, w = f.w, tokens = f.tokens, layers = f.layers, full_frac = f.full_frac;
  const bool full_ckpt = f.full_ckpt, selective = f.selective, op_ckpt = f.op_ckpt;
  const double peak = PeakFlops(c.gpu, s.precision);
  const double gemm_rate = peak * c.gpu.gemm_efficiency;
  const double hbm = c.gpu.hbm_bytes_per_s * k.hbm_efficiency;
  // GEMMs of one layer: forward, backward (input and, unless frozen, weight gradients), recompute.
  double layer_fwd_gemm = 0, layer_bwd_gemm = 0;
  double layer_model_flops = 0;  // per layer, forward + backward, for MFU (6N-style)
  for (const Gemm& x : m.layer_gemms) {
    // All layers' Linears, averaged over the layers.
    const double rows = tokens * x.token_fraction;
    const double one =
        x.count / layers *
        GemmSeconds(rows, x.k, x.n, w, gemm_rate, hbm, k.gemm_k_overhead, k.gemm_tokens_half);
    layer_fwd_gemm += one;
    layer_bwd_gemm += (x.frozen ? 1 : 2) * one;
    layer_model_flops += x.count / layers * (x.frozen ? 4 : 6) * rows * x.k * x.n;
  }
  // Attention core.
  const double s_eff = m.causal && m.flash_attention ? m.seq_len / 2 : m.seq_len;
  const double attn_fwd_flops = 4 * tokens * s_eff * m.attention_width;
  const double attn_rate = peak * c.gpu.attention_efficiency;
  const double attn_fwd = attn_fwd_flops / attn_rate;
  const double attn_bwd = (m.flash_attention ? 2.5 : 2.0) * attn_fwd;
  double eager_scores = 0;
  if (!m.flash_attention) {
    // The b a s^2 score tensors in the activation dtype.
    eager_scores = k.eager_score_passes * tokens * m.seq_len * m.heads * w / hbm;
  }
  // Elementwise: forward third, backward two thirds of the traffic.
  const double elem = k.elementwise_traffic * m.activation_bytes_per_token_layer * tokens / hbm;
  const double elem_fwd = elem / 3, elem_bwd = 2 * elem / 3;
  const double dequant = m.quantized_params / layers * k.dequant_bytes_per_param / hbm;

  const double gpu_fwd = layer_fwd_gemm + attn_fwd + elem_fwd + eager_scores / 3 + dequant;
  double gpu_bwd = layer_bwd_gemm + attn_bwd + elem_bwd + 2 * eager_scores / 3 + dequant;
  if (full_ckpt) gpu_bwd += full_frac * gpu_fwd;
  if (selective) gpu_bwd += attn_fwd + eager_scores / 3;
  if (op_ckpt) gpu_bwd += layer_fwd_gemm / 2 + elem_fwd;
  const double host_pass = k.launch_s_per_layer + (f.zero3 ? k.sharded_hook_s : 0);
  const double fwd_layer = std::max(gpu_fwd, host_pass);
  const double bwd_layer = std::max(gpu_bwd, host_pass * (1 + full_frac));
  t->host_wait_s = ga * layers * ((fwd_layer - gpu_fwd) + (bwd_layer - gpu_bwd));

  // Output layer and head: GEMMs plus the fp32 logits.
  double head_fwd = 0, head_bwd = 0, head_model_flops = 0;
  for (const Gemm& x : m.head_gemms) {
    const double one = x.count * GemmSeconds(tokens * x.token_fraction, x.k, x.n, w, gemm_rate, hbm,
                                             k.gemm_k_overhead, k.gemm_tokens_half);
    head_fwd += one;
    head_bwd += (x.frozen ? 1 : 2) * one;
    head_model_flops += x.count * (x.frozen ? 4 : 6) * tokens * x.token_fraction * x.k * x.n;
  }
  const double logits = k.logits_passes * tokens * m.vocab * 4 / hbm;
  MicroBatch mb;
  mb.fwd = layers * fwd_layer + head_fwd + logits / 2;
  mb.bwd = layers * bwd_layer + head_bwd + logits / 2;

  const double gemm_re = full_ckpt ? full_frac : op_ckpt ? 0.5 : 0.0;
  const double attn_re = full_ckpt ? full_frac : selective ? 1.0 : 0.0;
  const double elem_re = full_ckpt ? full_frac : op_ckpt ? 1.0 : 0.0;
  t->gemm_s = ga * (layers * (layer_fwd_gemm + layer_bwd_gemm + gemm_re * layer_fwd_gemm) +
                    head_fwd + head_bwd);
  t->attention_s = ga * layers * (attn_fwd + attn_bwd + attn_re * attn_fwd + eager_scores);
  t->elementwise_s =
      ga * (layers * (elem + elem_re * elem_fwd + dequant * (2 + full_frac)) + logits);
  // FLOPs per GPU per step.
  const double attn_model = 12 * m.seq_len * m.attention_width * layers;  // per token, non-causal
  t->model_flops = ga * (layers * layer_model_flops + head_model_flops + tokens * attn_model);
  double recompute = 0;
  if (full_ckpt) {
    recompute = full_frac * ga * (layers * layer_model_flops / 3 + tokens * attn_model / 3);
  }
  // (frozen GEMMs do 4 of their 6 units; a third of 6 is their forward either way)
  if (selective) recompute = ga * tokens * attn_model / 3;
  if (op_ckpt) recompute = ga * layers * layer_model_flops / 6;
  t->hardware_flops = t->model_flops + recompute;
  return mb;
}

// The collectives of one step, by where they can hide.
struct Collectives {
  double fwd = 0, bwd = 0;  // per micro-batch, behind forward / backward
  double serial = 0;        // after the step (the post-step all-gather)
  double tail = 0;          // pipeline fill and drain
  double bwd_last = 0;      // only on the last micro-batch (ZeRO-0/1)
};

// Step "collectives": what each ZeRO stage gathers and reduces, and when.
Collectives PredictCollectives(const ModelShape& m, const Cluster& c, const TrainingSetup& s,
                               Sharding sharding, const TimeConstants& k, const StepFacts& f) {
  const double d = f.d, g = f.g, nodes = f.nodes, ga = f.ga, layers = f.layers;
  const double grads = m.trainable * f.w;  // gradients reduced in the working dtype
  const double params = m.params * f.w;
  Collectives out;
  if (d <= 1) return out;
  switch (s.zero_stage) {
    case 0:
      out.bwd_last = 2 * GatherSeconds(grads, d, nodes, layers, c, k);
      out.tail = out.bwd_last / layers;
      break;
    case 1:
      out.bwd_last = GatherSeconds(grads, d, nodes, layers, c, k);
      out.tail = out.bwd_last / layers;
      out.serial = GatherSeconds(params, d, nodes, 1, c, k);
      break;
    case 2:
      out.bwd = GatherSeconds(grads, d, nodes, layers, c, k);
      out.tail = ga * out.bwd / layers;
      out.serial = GatherSeconds(params, d, nodes, 1, c, k);
      break;
    default: {
      const bool hybrid = sharding == Sharding::kHybrid && nodes > 1;
      const double shard_ranks = hybrid ? g : d;
      const double shard_nodes = hybrid ? 1 : nodes;
      const double gather = GatherSeconds(params, shard_ranks, shard_nodes, layers, c, k);
      const double scatter = GatherSeconds(grads, shard_ranks, shard_nodes, layers, c, k);
      double replicas = 0;
      if (hybrid) {
        // Each GPU's gradient shard, all-reduced with its peers of the other nodes; the node's
        // GPUs share its network.
        const double shard = grads / g;
        replicas =
            2 * shard * (nodes - 1) / nodes * g / (c.InterNodeBytesPerS() * k.network_efficiency) +
            layers * k.collective_latency_s;
      }
      out.fwd = gather;
      out.bwd = gather + scatter + replicas;
      // The first layer's gather cannot be prefetched, the last reduce-scatter waits for the
      // last gradients.
      out.tail = ga * (gather + scatter + replicas) / layers;
      break;
    }
  }
  return out;
}

// The host streams of one step (PCIe and NVMe), by where they can hide.
struct HostStreams {
  double partition = 0;           // trainable parameters of this GPU's optimizer partition
  double per_node_trainable = 0;  // trainable parameters a node's CPU optimizer steps
  double pcie_bwd = 0, pcie_fwd_param = 0, pcie_bwd_param = 0, pcie_serial = 0;
  double nvme_fwd = 0, nvme_bwd = 0, nvme_serial_write = 0, nvme_optimizer_s = 0;
};

// Step "host transfers": gradients and parameters over PCIe, parameters and optimizer state to
// and from NVMe; fills the step's pcie_s and nvme_s.
HostStreams PredictHostStreams(const ModelShape& m, const Cluster& c, const TrainingSetup& s,
                               bool pinned, Sharding sharding, const TimeConstants& k,
                               const StepFacts& f, StepTime* t) {
  const double d = f.d, g = f.g, nodes = f.nodes, ga = f.ga, w = f.w;
  const bool zero3 = f.zero3;
  HostStreams h;
  // --- PCIe
  const double pcie_share =
      std::max(1.0, std::min(g, static_cast<double>(c.gpu.gpus_per_pcie_switch)));
  const double pcie =
      c.PcieLineBytesPerS() * k.pcie_efficiency / pcie_share * (pinned ? 1.0 : k.unpinned_factor);
  const double zero3_share = sharding == Sharding::kHybrid && zero3 && nodes > 1 ? g : d;
  h.partition = m.trainable / (s.zero_stage >= 1 ? (zero3 ? zero3_share : d) : 1);
  const double param_partition = m.params / (zero3 ? zero3_share : 1);
  const bool opt_off = s.offload_optimizer != OffloadDevice::kNone;
  const bool param_off = s.offload_param != OffloadDevice::kNone;
  if (opt_off) {
    h.pcie_bwd += 4 * h.partition / pcie;     // fp32 gradients down, every micro-batch
    h.pcie_serial += 2 * h.partition / pcie;  // 16-bit parameters up after the step
  }
  if (param_off) {
    h.pcie_fwd_param = w * param_partition / pcie;
    h.pcie_bwd_param = w * param_partition / pcie;
    if (!opt_off) h.pcie_serial += w * param_partition / pcie;  // updated partition back down
  }
  t->pcie_s = ga * (h.pcie_bwd + h.pcie_fwd_param + h.pcie_bwd_param) + h.pcie_serial;

  // --- NVMe
  h.per_node_trainable = m.trainable / (zero3 && sharding == Sharding::kHybrid ? 1 : nodes);
  if (s.offload_optimizer == OffloadDevice::kNvme) {
    const bool mixed = s.precision == Precision::kFp16Mixed || s.precision == Precision::kBf16Mixed;
    const double state_bytes = (mixed ? 4 : 0) + (s.optimizer == Optimizer::kLion ? 4 : 8);
    const double bytes = h.per_node_trainable * state_bytes;
    h.nvme_optimizer_s = bytes / c.NvmeReadBytesPerS() + bytes / c.NvmeWriteBytesPerS();
  }
  if (s.offload_param == OffloadDevice::kNvme) {
    const double node_params = m.params * w / nodes;
    h.nvme_fwd = node_params / c.NvmeReadBytesPerS();
    h.nvme_bwd = node_params / c.NvmeReadBytesPerS();
    h.nvme_serial_write = node_params / c.NvmeWriteBytesPerS();
  }
  t->nvme_s = h.nvme_optimizer_s + ga * (h.nvme_fwd + h.nvme_bwd) + h.nvme_serial_write;
  return h;
}

// Step "optimizer": the CPU optimizer (overlapped with its NVMe traffic as far as
// offload_overlap says) or the GPU's memory-bound pass; fills optimizer_s and returns the serial
// optimizer phase, the fixed host work per step included.
double PredictOptimizerPhase(const ModelShape& m, const Cluster& c, const TrainingSetup& s,
                             const TimeConstants& k, const HostStreams& h, StepTime* t) {
  double optimizer_phase = 0;
  if (s.offload_optimizer != OffloadDevice::kNone) {
    const double rate = c.CpuAdamParamsPerS() * k.cpu_adam_factor;
    const double cpu_step = h.per_node_trainable / rate;
    const double host_bw = rate * k.cpu_adam_bytes_per_param;
    const double extra = h.per_node_trainable * k.cpu_extra_bytes_per_param / host_bw;
    t->optimizer_s = cpu_step + extra;
    optimizer_phase = std::max(t->optimizer_s, h.nvme_optimizer_s) +
                      (1 - k.offload_overlap) * std::min(t->optimizer_s, h.nvme_optimizer_s);
  } else {
    const double hbm = c.gpu.hbm_bytes_per_s * k.hbm_efficiency;
    const double local = s.zero_stage >= 1 ? h.partition : m.trainable;
    t->optimizer_s = local * (GpuOptimizerBytesPerParam(s) + k.gpu_clip_bytes_per_param) / hbm;
    optimizer_phase = t->optimizer_s;
  }
  return optimizer_phase + k.step_fixed_s;
}

// Step "overlap": per micro-batch, forward hides the parameter gathers and fetches, backward the
// gradient reductions, gradient copies to the host and backward fetches. Links run concurrently
// (network/NVLink, PCIe, NVMe), so each window is exceeded by its slowest stream. Fills the
// step's compute, communication and exposed times and its total.
void PredictOverlap(const TrainingSetup& s, const TimeConstants& k, const StepFacts& f,
                    const MicroBatch& mb, const Collectives& comm, const HostStreams& h,
                    double optimizer_phase, StepTime* t) {
  const double ga = f.ga;
  const double fwd_window = mb.fwd, bwd_window = mb.bwd;
  auto exposed = [](double work, double window) { return std::max(0.0, work - window); };
  const double fwd_stream_comm = comm.fwd;
  const double fwd_stream_host = std::max(h.pcie_fwd_param, h.nvme_fwd);
  const double bwd_stream_comm = comm.bwd;
  const double bwd_stream_host = std::max(h.pcie_bwd + h.pcie_bwd_param, h.nvme_bwd);
  double exposed_comm = 0, exposed_host = 0, interference = 0;
  // Parameter fetches feed the gathers: the pipeline runs at the slower of the two.
  const double fwd_pipe = std::max(fwd_stream_comm, fwd_stream_host);
  const double bwd_pipe_comm = bwd_stream_comm;
  exposed_comm += ga * exposed(fwd_stream_comm, fwd_window);
  exposed_host +=
      ga * std::max(0.0, exposed(fwd_pipe, fwd_window) - exposed(fwd_stream_comm, fwd_window));
  exposed_comm += ga * exposed(bwd_pipe_comm, bwd_window);
  exposed_host +=
      ga * std::max(0.0, exposed(bwd_stream_host, bwd_window) - exposed(bwd_pipe_comm, bwd_window));
  // Imperfect overlap (offload_overlap < 1): that fraction of the host streams hidden behind
  // each window is exposed after all.
  exposed_host += (1 - k.offload_overlap) * ga *
                  (std::min(fwd_stream_host, fwd_window) + std::min(bwd_stream_host, bwd_window));
  // Only the last micro-batch reduces (ZeRO-0/1).
  exposed_comm += exposed(comm.bwd_last, bwd_window);
  interference +=
      ga * (std::min(fwd_stream_comm, fwd_window) + std::min(bwd_stream_comm, bwd_window)) +
      std::min(comm.bwd_last, bwd_window);
  interference *= k.overlap_interference;
  // Pipeline fill and drain: the first fetch and the last reduction.
  exposed_comm += comm.tail;
  if (s.offload_param != OffloadDevice::kNone) {
    exposed_host += ga * (h.pcie_fwd_param + h.nvme_fwd) / f.layers;
  }
  exposed_comm += comm.serial;
  exposed_host += h.pcie_serial + h.nvme_serial_write;

  t->compute_s = ga * (mb.fwd + mb.bwd) + interference;
  t->comm_s = ga * (comm.fwd + comm.bwd) + comm.bwd_last + comm.serial;
  t->exposed_comm_s = exposed_comm;
  t->exposed_offload_s = exposed_host;
  t->exposed_optimizer_s = optimizer_phase;
  t->total_s = t->compute_s + t->exposed_comm_s + t->exposed_offload_s + t->exposed_optimizer_s;
}

// What bounds the step: the largest of its exposed parts.
const char* BoundBy(const StepTime& t, bool opt_off, double nvme_optimizer_s) {
  struct Part {
    const char* name;
    double seconds;
  };
  const Part parts[] = {
      {"compute", t.compute_s},
      {"communication", t.exposed_comm_s},
      {t.nvme_s > t.pcie_s ? "NVMe" : "PCIe", t.exposed_offload_s},
      {opt_off ? (nvme_optimizer_s > t.optimizer_s ? "NVMe" : "CPU optimizer") : "optimizer",
       t.exposed_optimizer_s}};
  const Part* top = &parts[0];
  for (const Part& p : parts) {
    if (p.seconds > top->seconds) top = &p;
  }
  return top->name;
}

}  // namespace

StepTime PredictStepTime(const ModelShape& m, const Cluster& c, const TrainingSetup& s,
                         int64_t global_batch, bool pinned, Sharding sharding,
                         const TimeConstants& k) {
  (void)global_batch;
  const StepFacts f = FactsFor(m, c, s);
  StepTime t;
  const MicroBatch mb = PredictCompute(m, c, s, k, f, &t);
  const Collectives comm = PredictCollectives(m, c, s, sharding, k, f);
  const HostStreams host = PredictHostStreams(m, c, s, pinned, sharding, k, f, &t);
  const double optimizer_phase = PredictOptimizerPhase(m, c, s, k, host, &t);
  PredictOverlap(s, k, f, mb, comm, host, optimizer_phase, &t);
  t.bound = BoundBy(t, s.offload_optimizer != OffloadDevice::kNone, host.nvme_optimizer_s);
  return t;
}

}  // namespace memplan::planner
