#include "estimator/memory_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "estimator/memory_model_internal.h"

namespace memplan::estimator::mm {
namespace {

Result<ParamFacts> Facts(const ModelInventory& inventory, const TrainingSetup& setup) {
  ParamFacts f;
  const Wide threshold = U(setup.stage3_param_persistence_threshold);
  std::vector<const TensorInfo*> targets;
  if (setup.lora_rank > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(targets, LoraTargetTensors(inventory, setup));
  }
  for (const TensorInfo& t : inventory.tensors) {
    if (t.role == TensorRole::kHead && t.IsLinearWeight()) f.head_grad += t.numel;
    if (!t.tied_to.empty()) continue;
    f.total += t.numel;
    if (t.numel <= threshold) f.persistent += t.numel;
    // QLoRA stores the Linear weights of the blocks in NF4 (Note [Tensor roles]).
    if (!t.block.empty() && t.IsLinearWeight()) {
      f.quantizable += t.numel;
      f.largest_quantized = std::max<Wide>(f.largest_quantized, t.numel);
    }
    if (t.role == TensorRole::kHead && t.IsLinearWeight()) f.head += t.numel;
    if (setup.lora_rank == 0) {
      f.factored += t.shape.size() >= 2
                        ? U(t.shape[0]) + U(t.numel / std::max<int64_t>(t.shape[0], 1))
                        : static_cast<Wide>(t.numel);
      f.largest_trainable_tensor = std::max<Wide>(f.largest_trainable_tensor, t.numel);
    }
  }
  const Wide r = U(setup.lora_rank);
  // Per block: which of q/k/v are adapted, their input width and adapted output width.
  struct QkvLora {
    unsigned parts = 0;
    Wide input = 0, output = 0;
  };
  std::map<std::string, QkvLora> qkv_by_block;
  for (const TensorInfo* t : targets) {
    // A [r, in] and B [out, r] whichever way the weight is stored (Linear [out, in], Conv1D
    // [in, out]): r * (in + out).
    const Wide a = r * U(t->shape[1]), b = r * U(t->shape[0]);
    f.lora += a + b;
    // The input width: Linear weights are [out, in], GPT-2's Conv1D weights [in, out].
    const Wide in_width = U(t->InFeatures());
    const Wide out_width = U(t->OutFeatures());
    f.lora_input_width += in_width;
    const unsigned part = QkvParts(t->role);
    if (part == 0) {
      f.litgpt_lora_input_width += in_width;
    } else {
      QkvLora& q = qkv_by_block[t->block];
      q.parts |= part;
      q.input = in_width;
      q.output += out_width;
    }
    for (Wide m : {a, b}) {
      if (m <= threshold) f.lora_persistent += m;
      f.largest_trainable_tensor = std::max(f.largest_trainable_tensor, m);
    }
    f.factored += (r + U(t->shape[1])) + (U(t->shape[0]) + r);
  }
  for (const auto& [block, q] : qkv_by_block) {
    f.litgpt_lora_input_width += q.input;
    if (q.parts != 7) f.litgpt_lora_padded_width += q.output;
  }
  return f;
}

// Phase totals and the peak (Note [Phases]); the CUDA context and the allocator margin are added
// to each phase's GPU total and reported as items.
void TotalPhases(const ItemContext& c, Builder* out, MemoryEstimate* m) {
  const Wide context = U(c.s.cuda_context_bytes);
  Wide peak_margin = 0;
  for (Phase phase : kPhases) {
    PhaseTotals totals;
    totals.phase = PhaseName(phase);
    Wide gpu = 0, cpu = 0, nvme = 0, pinned = 0, transient = 0;
    for (size_t i = 0; i < out->items.size(); ++i) {
      const MemoryItem& item = out->items[i];
      if ((item.phases & phase) == 0) continue;
      if (out->allocs[i] == Alloc::kTransient) transient += item.gpu_bytes;
      gpu += item.gpu_bytes;
      cpu += item.cpu_bytes;
      nvme += item.nvme_bytes;
      pinned += item.pinned_bytes;
    }
    const Wide margin = Scale(transient, kAllocatorMargin);
    totals.gpu_allocated_bytes = Saturate(gpu);
    totals.gpu_bytes = Saturate(gpu + margin + context);
    totals.cpu_bytes = Saturate(cpu);
    totals.nvme_bytes = Saturate(nvme);
    totals.pinned_bytes = Saturate(pinned);
    if (totals.gpu_bytes > m->peak.gpu_bytes || m->peak.phase.empty()) {
      m->peak.gpu_bytes = totals.gpu_bytes;
      m->peak.phase = totals.phase;
      peak_margin = margin;
    }
    m->peak.cpu_bytes = std::max(m->peak.cpu_bytes, totals.cpu_bytes);
    m->peak.nvme_bytes = std::max(m->peak.nvme_bytes, totals.nvme_bytes);
    m->peak.pinned_bytes = std::max(m->peak.pinned_bytes, totals.pinned_bytes);
    m->phases.push_back(totals);
  }
  out->Add("cuda_context", "CUDA context, runtime and kernels (per GPU process)", context, 0, 0, 0,
           kAllPhases);
  out->Add("allocator_margin",
           "caching-allocator rounding and fragmentation: 10% of the activations and "
           "temporaries at the peak phase",
           peak_margin, 0, 0, 0, kAllPhases);
}

std::vector<ModelConstant> Constants(const ItemContext& c, const TrainingSetup& input) {
  const TrainingSetup& s = c.s;
  const Activations& act = c.act;
  const bool fp32 = s.precision == Precision::kFp32;
  return {
      {"activation_element_bytes", fp32 ? 4.0 : 2.0, "bytes",
       "activations are kept in the compute dtype (Korthikanti et al. 2022 count 16-bit)"},
      {"dropout_mask_bytes", kDropoutMaskBytes, "bytes/element",
       "PyTorch dropout keeps a bool mask (Korthikanti: 1 byte)"},
      {"flash_lse_bytes", kFlashLseBytes, "bytes per head per token",
       "FlashAttention keeps fp32 log-sum-exp statistics instead of the s x s scores"},
      {"working_param_bytes", static_cast<double>(c.w), "bytes/param",
       fp32 ? "fp32 training" : "16-bit working copy (mixed or pure precision)"},
      {"master_param_bytes", c.mixed ? 4.0 : 0.0, "bytes/param",
       "fp32 master weights in mixed precision (ZeRO paper: part of K = 12)"},
      {"optimizer_state_bytes", static_cast<double>(OptimizerStateBytes(s, 1 << 20, 0)) / (1 << 20),
       "bytes/param",
       "adamw 8 (m, v fp32), adam8bit 2 + fp32 absmax per 256-element block per state, sgd and "
       "lion 4, adafactor 4 + factored rows/cols; halved states in bf16-pure (REFERENCE 4)"},
      {"nf4_bits_per_param", c.frozen_quantized > 0 ? c.nf4_bits : 0.0, "bits",
       "QLoRA NF4: 4-bit codes + fp32 absmax per 64 (4.5); double quantisation 4.127"},
      {"overlap_comm_factor",
       s.zero_stage >= 1 && s.zero_stage <= 2 && s.OverlapComm() ? kOverlapCommFactor : 1.0,
       "x bucket bytes",
       "ZeRO-1/2: the Hugging Face DeepSpeed guide's overlap_comm rule (about 4.5x the bucket "
       "sizes); ZeRO-3 allocates one flat reduce bucket (stage3.py IPG buffer)"},
      {"logits_forward_bytes",
       act.logits_forward_per_logit > 0 ? act.logits_forward_per_logit
                                        : (act.logits_forward > 0 && s.loss != Loss::kFused
                                               ? kLogitsForwardFp32Bytes + (fp32 ? 0 : 2)
                                               : 0.0),
       "bytes per logit", "compute-dtype logits, fp32 upcast and log-softmax kept by the loss"},
      {"logits_backward_bytes", act.logits_backward > 0 ? kLogitsBackwardBytes : 0.0,
       "bytes per logit", "fp32 gradients of log-probabilities and logits at backward start"},
      {"cuda_context_bytes", static_cast<double>(s.cuda_context_bytes), "bytes",
       "measured 1,343 MiB on a V100 (Hugging Face, model memory anatomy); GPU/driver dependent"},
      {"allocator_margin_fraction", kAllocatorMargin, "of activations and temporaries",
       "PyTorch caching allocator: reserved exceeds allocated by block rounding and "
       "fragmentation where blocks come and go every step; start-up model states excluded"},
      {"seq_len", static_cast<double>(s.seq_len), "tokens",
       input.seq_len > 0 ? "given" : "default: min(max_position_embeddings, 2048), else 512"},
  };
}

std::vector<std::string> Notes(const ItemContext& c) {
  std::vector<std::string> notes = {
      "Peak is the largest of four phases (end of forward; first layer of backward with its "
      "recompute; end of backward; optimizer step), per tier; the GPU peak's phase is reported.",
      "Activations per layer follow Korthikanti et al. 2022 (sbh(34 + 5as/h) for a GPT-3 layer), "
      "with each term derived from the model: GQA key/value width, gated MLP (4 f-wide tensors), "
      "MoE top-k, dropout masks only where dropout is on, flash attention, tensor and sequence "
      "parallelism.",
      "Gradients are counted in every phase (DeepSpeed keeps its gradient partitions allocated; "
      "accumulation carries them through the forward pass).",
      "Tensor parallelism divides all parameters by tp (norms and biases are in fact replicated).",
      "Encoder-decoder models: the decoder sequence is as long as the encoder's (`seq_len`).",
      "CPU, NVMe and pinned bytes are per node (all local ranks); GPU bytes are per GPU. Model "
      "loading (a full copy per rank without zero.Init) is not included.",
  };
  if (c.s.zero_stage == 0 && c.master) {
    notes.push_back(
        "ZeRO-0 in mixed precision is counted like DeepSpeed's: 16-bit working weights and "
        "gradients plus fp32 master weights (`autocast` counts torch.autocast over fp32 "
        "parameters instead).");
  }
  const TrainingSetup& s = c.s;
  notes.push_back(
      "The allocator margin (10%) applies to activations and per-step temporaries only; model "
      "states allocated once at start-up are counted as allocated (Note [Allocator margin]).");
  if (UpcastingNorm(c.arch) && s.precision != Precision::kFp32) {
    notes.push_back(
        "The norms keep their input in fp32 (Transformers' LlamaRMSNorm and its copies upcast "
        "before normalising), and the normalised tensor when their weight trains.");
  }
  if (c.lora) {
    notes.push_back(
        "LoRA: only the adapters (" + std::to_string(static_cast<uint64_t>(c.f.lora)) +
        " parameters) train; the frozen Linears keep no input for a weight gradient (autograd's "
        "mm saves its input only when the weight requires grad), each adapter keeps its dropout "
        "mask and input" +
        (s.qlora ? "; bitsandbytes' MatMul4Bit keeps every quantised Linear's input "
                   "(ctx.tensors = (A, B)) and dequantises one 16-bit weight at a time"
                 : std::string()) +
        ".");
  }
  if ((s.zero_stage == 0 || c.Fsdp()) && !c.Offloaded() && !c.fsdp_offload) {
    std::string how = s.fused_optimizer        ? "fused (in place, no temporaries)"
                      : s.foreach && !c.Fsdp() ? "foreach (one state-sized temporary per step)"
                                               : "a per-tensor loop (temporaries of the largest "
                                                 "tensor; FSDP's FlatParameters get no foreach)";
    notes.push_back("The optimizer step runs PyTorch's " + how +
                    " implementation (torch/optim/adam.py); `foreach` and `fused_optimizer` "
                    "choose.");
  }
  if (s.optimizer == Optimizer::kSgd) {
    notes.push_back(s.sgd_momentum > 0
                        ? "SGD with momentum keeps one momentum buffer per parameter."
                        : "SGD without momentum (PyTorch's default) keeps no optimizer state.");
  }
  if (s.autocast) {
    notes.push_back(
        "torch.autocast over fp32 parameters: fp32 weights and gradients stepped directly (no "
        "master copy, no fp32 gradient copy), plus autocast's 16-bit weight copies through "
        "forward and backward.");
  }
  if (s.zero_stage == 0 && s.DataParallel() > 1) {
    notes.push_back(
        s.gradient_as_bucket_view
            ? "DDP with gradient_as_bucket_view: the gradients are views of the reducer's buckets."
            : "DDP keeps its gradient buckets, a second copy of the gradients "
              "(gradient_as_bucket_view off, PyTorch's default).");
  }
  if (s.zero_stage == 3) {
    notes.push_back(
        "ZeRO-3: one flat reduce bucket of reduce_bucket_size elements (contiguous_gradients); "
        "the optimizer step converts one sub-group (<= sub_group_size elements) of gradients "
        "to fp32 at a time (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group).");
    if (c.Offloaded()) {
      notes.push_back(
          "ZeRO-3 with an offloaded optimizer keeps the 16-bit gradient partition in host memory; "
          "the fp32 gradients go to an fp32 buffer in host memory (cpu) or are swapped out to "
          "NVMe with the optimizer state (nvme: stage3.py partition_grads -> "
          "swap_out_gradients).");
    }
    if (s.offload_param == OffloadDevice::kNvme || s.offload_optimizer == OffloadDevice::kNvme) {
      notes.push_back(
          "NVMe: a partition of at least max(1 MiB, aio.block_size) bytes gets a swap file of its "
          "own (1 KiB aligned), a smaller one stays in host memory (swappable_tensor); a tied "
          "output head built inside zero.Init leaves a file of its own; with offload_param nvme "
          "the trainable 16-bit partitions also live in a pinned flat host buffer of up to "
          "offload_param.max_in_cpu elements (stage3.py "
          "_create_param_groups_fp16_flat_cpu_memory). Measured with DeepSpeed 0.19 "
          "(bench/deepspeed_nvme_truth.py).");
    }
  }
  if (c.Fsdp()) {
    notes.push_back(
        c.FsdpName() +
        ": each rank keeps its shard of the flat parameters, gradients and optimizer "
        "states (parameters and gradients in fp32 under mixed precision, on the CPU with CPU "
        "offload, where the optimizer then steps); a wrapped unit (the largest repeated block) is "
        "gathered in the compute dtype while it runs" +
        (s.fsdp != c.fsdp ? std::string("; with one data-parallel rank FSDP uses NO_SHARD, which "
                                        "keeps every gathered unit on the GPU from forward to "
                                        "backward (torch/distributed/fsdp/_init_utils.py)")
                          : std::string()) +
        ".");
  }
  if (s.framework == Framework::kLitGpt) {
    notes.push_back(
        "Lit-GPT: LoRA on the fused QKV Linear keeps one dropout per block input and, when only "
        "some of q/k/v are adapted, the zero-padded update (index_copy's source); the fused QKV "
        "output stays alive through the value view beside the roped query and key; the head runs "
        "in 128-position chunks that Fabric converts to fp32 for the loss" +
        (s.qlora ? std::string("; QLoRA quantises every Linear, the head included, from fp16 "
                               "copies, so dequantising makes an fp16 and a bf16 copy")
                 : std::string()) +
        ".");
  }
  if (s.TorchBefore(1, 11)) {
    notes.push_back("PyTorch " + s.torch_version +
                    ": softmax and log_softmax keep their input as well as their output for "
                    "backward (fixed in 1.11, pytorch#64000).");
  }
  if (ActivationExtraTensors(c.arch.hidden_act) > 0 && s.framework == Framework::kTransformers) {
    notes.push_back("The MLP activation '" + c.arch.hidden_act +
                    "' is a Python formula in Transformers (transformers/activations.py); autograd "
                    "keeps " +
                    std::to_string(ActivationExtraTensors(c.arch.hidden_act)) +
                    " intermediate tensors of the MLP width besides its input.");
  }
  if (s.tp > 1) {
    notes.push_back(s.sequence_parallel
                        ? "Sequence parallelism splits the norm and dropout activations over tp."
                        : "Tensor parallelism without sequence parallelism replicates the norm and "
                          "dropout activations on every tp rank.");
  }
  if (s.checkpointing == Checkpointing::kSelective) {
    notes.push_back(
        "Selective recompute drops the core attention and recomputes it in backward, as "
        "Megatron's does, with or without flash attention (Korthikanti et al. 2022).");
  }
  return notes;
}

// The facts of an inventory that do not depend on the ZeRO stage or offload, computed once for
// all rows of a comparison: a per-expert DeepSeek-V3 has 45,000 tensors.
struct InventoryFacts {
  ParamFacts f;
  ModelCounts counts;
};

// `counts` is CountParams(inventory) when the caller has it, else nullptr.
Result<InventoryFacts> FactsFor(const ModelInventory& inventory, const TrainingSetup& s,
                                const ModelCounts* counts) {
  InventoryFacts out;
  MEMPLAN_ASSIGN_OR_RETURN(out.f, Facts(inventory, s));
  if (out.f.total == 0) {
    return Status::InvalidArgument(inventory.name + ": the model has no parameters");
  }
  if (counts != nullptr) {
    out.counts = *counts;
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(out.counts, CountParams(inventory));
  }
  return out;
}

// `step`: also run the step model (the comparison rows, which report the itemised peak only,
// skip it: eleven step simulations of a 47,000-tensor MoE would cost 300 ms).
Result<MemoryEstimate> EstimateWith(const ModelInventory& inventory, const TrainingSetup& input,
                                    const InventoryFacts* known, const ModelCounts* counts,
                                    bool step = true) {
  MEMPLAN_RETURN_IF_ERROR(input.ValidateFor(inventory));
  TrainingSetup s = input;
  s.seq_len = s.SeqLenFor(&*inventory.arch);
  InventoryFacts computed;
  if (known == nullptr) {
    MEMPLAN_ASSIGN_OR_RETURN(computed, FactsFor(inventory, s, counts));
    known = &computed;
  }
  const ParamFacts& f = known->f;

  ItemContext c(inventory, s, f, known->counts);
  c.lora = s.lora_rank > 0;
  c.mixed = Mixed(s.precision);
  c.master = c.mixed && !s.autocast;
  c.w = s.precision == Precision::kFp32 ? 4 : 2;
  c.param_bytes = s.autocast ? 4 : c.w;
  c.grad_bytes = s.autocast ? 4 : c.w;
  c.t = U(s.tp);
  c.d = U(s.DataParallel());
  c.g = U(s.gpus_per_node);
  c.trainable = c.lora ? f.lora : f.total;
  const bool litgpt = s.framework == Framework::kLitGpt;
  c.frozen_quantized = c.lora && s.qlora ? f.quantizable + (litgpt ? f.head : 0) : 0;
  c.largest_quantized = std::max(f.largest_quantized, litgpt ? f.head : Wide{0});
  c.fsdp = s.EffectiveFsdp();
  c.fsdp_offload = c.Fsdp() && s.offload_param == OffloadDevice::kCpu;
  c.fsdp_param_bytes = s.precision == Precision::kBf16Pure ? 2 : 4;
  if (c.Fsdp()) c.master = false;  // FSDP's sharded parameters are the fp32 copy
  c.largest_unit = c.TpShare(c.counts.largest_block_params > 0 ? c.counts.largest_block_params
                                                               : f.largest_trainable_tensor);
  c.nf4_bits = s.double_quant ? kNf4DoubleQuantBits : kNf4Bits;
  c.half = HalfName(s.precision);
  c.opt_where = std::string(OffloadDeviceName(s.offload_optimizer));
  c.act = CountActivations(inventory, s, f);

  Builder out;
  MEMPLAN_RETURN_IF_ERROR(AddItems(c, &out));
  if (out.overflow) {
    return Status::OutOfRange(inventory.name +
                              ": the memory needed overflows 2^62 bytes; check "
                              "`micro_batch` and `seq_len`");
  }
  MemoryEstimate m;
  m.setup = s;
  m.params_total = static_cast<uint64_t>(f.total);
  m.trainable_params = static_cast<uint64_t>(c.trainable);
  m.lora_params = static_cast<uint64_t>(f.lora);
  m.activation_bytes_per_layer = Saturate(c.act.per_layer);
  TotalPhases(c, &out, &m);
  if (step) {
    // The step model (Note [The step model]) over the model states the items above place.
    StepStates st;
    auto gpu_of = [&](std::string_view name) {
      uint64_t b = 0;
      for (const MemoryItem& item : out.items) {
        if (item.name == name) b += item.gpu_bytes;
      }
      return b;
    };
    st.parameters = gpu_of("params_working") + gpu_of("params_quantized") + gpu_of("params_master");
    for (const TensorInfo& b : inventory.buffers) {
      st.buffers += AllocatorRound(b.numel * static_cast<uint64_t>(DTypeBits(b.dtype) / 8));
    }
    st.optimizer_states = gpu_of("optimizer_states");
    // Gradients set to None each step (zero_grad's default from PyTorch 2.0), as the items count
    // them (Note [Gradient storage]).
    const bool plain = s.zero_stage == 0 && !c.Fsdp() && s.DataParallel() == 1 &&
                       s.grad_accum == 1 && !s.TorchBefore(2, 0);
    st.persistent_gradients = plain ? 0 : gpu_of("grads") + gpu_of("ddp_grad_buckets");
    st.plain_gradients = plain;
    st.torch_optimizer = s.zero_stage == 0 || c.Fsdp();
    st.from_inventory = s.zero_stage == 0 && !c.Fsdp();
    const uint64_t tokens = static_cast<uint64_t>(s.micro_batch) * static_cast<uint64_t>(s.seq_len);
    st.other = CublasWorkspaceBytes(s.GpuSm()) + 2 * AllocatorRound(tokens * 8);
    Result<StepModel> sim = SimulateStep(inventory, s, st);
    if (sim.ok()) {
      m.step = std::move(sim).value();
    } else {
      m.step_error = sim.status().message();
      m.step_unmodelled = sim.status().code() == StatusCode::kUnimplemented;
    }
  }
  m.items = std::move(out.items);
  m.constants = Constants(c, input);
  m.notes = Notes(c);
  return m;
}

Result<std::vector<ComparisonRow>> Compare(const ModelInventory& inventory,
                                           const TrainingSetup& setup, const ModelCounts* counts) {
  struct Combo {
    int stage;
    OffloadDevice opt, param;
  };
  using D = OffloadDevice;
  const Combo combos[] = {{0, D::kNone, D::kNone}, {1, D::kNone, D::kNone}, {1, D::kCpu, D::kNone},
                          {2, D::kNone, D::kNone}, {2, D::kCpu, D::kNone},  {3, D::kNone, D::kNone},
                          {3, D::kCpu, D::kNone},  {3, D::kCpu, D::kCpu},   {3, D::kNvme, D::kNone},
                          {3, D::kNvme, D::kCpu},  {3, D::kNvme, D::kNvme}};
  std::vector<ComparisonRow> rows;
  std::optional<InventoryFacts> facts;  // the same for every row: computed at the first
  for (const Combo& c : combos) {
    TrainingSetup s = setup;
    s.zero_stage = c.stage;
    s.offload_optimizer = c.opt;
    s.offload_param = c.param;
    ComparisonRow row;
    row.zero_stage = c.stage;
    row.offload_optimizer = c.opt;
    row.offload_param = c.param;
    Status valid = s.Validate();
    if (!valid.ok()) {
      row.reason = valid.message();
      rows.push_back(row);
      continue;
    }
    if (!facts.has_value()) {
      MEMPLAN_RETURN_IF_ERROR(s.ValidateFor(inventory));
      MEMPLAN_ASSIGN_OR_RETURN(facts, FactsFor(inventory, s, counts));
    }
    Result<MemoryEstimate> m = EstimateWith(inventory, s, &*facts, nullptr, /*step=*/false);
    if (!m.ok()) return m.status();
    row.valid = true;
    row.peak = m->peak;
    Phase peak_phase = kPhaseForward;
    for (Phase p : kPhases) {
      if (PhaseName(p) == m->peak.phase) peak_phase = p;
    }
    for (const MemoryItem& item : m->items) {
      if ((item.phases & peak_phase) != 0 &&
          (item.name == "activations" || item.name == "activation_recompute" ||
           item.name.rfind("logits", 0) == 0)) {
        row.activations_gpu_bytes += item.gpu_bytes;
      }
    }
    rows.push_back(row);
  }
  return rows;
}

}  // namespace
}  // namespace memplan::estimator::mm

namespace memplan::estimator {

using mm::Saturate;
using mm::Wide;

std::string PhaseName(Phase phase) {
  switch (phase) {
    case kPhaseForward: return "forward";
    case kPhaseBackward: return "backward";
    case kPhaseBackwardEnd: return "backward_end";
    case kPhaseOptimizerStep: return "optimizer_step";
    case kAllPhases: return "all";
  }
  return "?";
}

uint64_t ZeroPaperBytesPerGpu(uint64_t params, uint64_t gpus, int stage, uint64_t k) {
  const Wide p = params, n = std::max<uint64_t>(gpus, 1);
  Wide bytes = 0;
  switch (stage) {
    case 0: bytes = (4 + k) * p; break;
    case 1: bytes = 4 * p + k * p / n; break;
    case 2: bytes = 2 * p + (2 + k) * p / n; break;
    default: bytes = (4 + k) * p / n; break;
  }
  return Saturate(bytes);
}

Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& input) {
  return mm::EstimateWith(inventory, input, nullptr, nullptr);
}

Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& input,
                                      const ModelCounts& counts, bool step_model) {
  return mm::EstimateWith(inventory, input, nullptr, &counts, step_model);
}

Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup) {
  return mm::Compare(inventory, setup, nullptr);
}

Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup,
                                                     const ModelCounts& counts) {
  return mm::Compare(inventory, setup, &counts);
}

}  // namespace memplan::estimator
