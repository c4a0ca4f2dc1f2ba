#include "estimator/memory_model.h"

#include <algorithm>
#include <array>
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

// Note [Items from the step model]
// Where the step model runs the setup's code (Note [The step model]), what the step allocates
// around the model states is its, not the per-layer formulas': the items activations,
// activation_recompute, backward_workspace, logits_and_loss, loss_log_softmax, logits_grad, the
// autocast weight copies, QLoRA's dequantization workspace and the first layer's gradients give
// way to the step model's categories, each with its bytes per phase (the moment of each phase's
// peak, so that a phase's items add up to the step model's peak of that phase):
//   forward         the higher of the step model's forward and loss peaks
//   backward        its backward peak
//   backward_end    its optimizer-step peak without the optimizer's temporaries (every gradient
//                   made, nothing else in flight)
//   optimizer_step  its optimizer-step peak
// The model states stay the items' (DeepSpeed's partitions, FSDP's shards, offload), as do the
// buffers the step model does not run: DeepSpeed's buckets and gathered parameters, FSDP's
// unsharded units, NVMe swap buffers, the fp32 gradient copies of a DeepSpeed step. Where the
// step model lays the states out itself (a plain PyTorch loop; torchtitan's FSDP2 shards, its
// collective buffers and its gradients), its layout replaces the items' for the gradients and
// the optimizer's temporaries too, and whatever its per-tensor layout adds over the items'
// states is one item, state_layout. Every setup the step model refuses keeps the formulas.

struct StepUse {
  bool plain_grads = false;  // the step makes the .grad tensors (no persistent gradients)
  bool own_states = false;   // the step laid out the parameters and optimizer states itself
  bool titan = false;
  uint64_t given_gradients = 0;
  uint64_t given_states = 0;  // the items' parameters and optimizer states (StepStates')
};

// The step model's categories at each of the memory model's phases (kPhases order).
std::array<StepBytes, 4> StepCategoriesByPhase(const StepModel& step) {
  auto at = [&](StepPhase p) { return step.phases[static_cast<size_t>(p)]; };
  const StepPhasePeak fwd = at(StepPhase::kForward), loss = at(StepPhase::kLoss);
  std::array<StepBytes, 4> out{};
  out[0] = (loss.bytes > fwd.bytes ? loss : fwd).categories;
  out[1] = at(StepPhase::kBackward).categories;
  out[3] = at(StepPhase::kOptimizerStep).categories;
  out[2] = out[3];
  out[2][static_cast<size_t>(StepCategory::kOptimizerTransients)] = 0;
  return out;
}

void UseStepModel(const StepModel& step, const StepUse& use, Builder* out) {
  std::vector<std::string> drop = {"activations",
                                   "activation_recompute",
                                   "backward_workspace",
                                   "logits_and_loss",
                                   "loss_log_softmax",
                                   "logits_grad",
                                   "autocast_weight_copies",
                                   "autocast_recompute_copies",
                                   "qlora_dequant_workspace",
                                   "grads_first_layer"};
  if (use.plain_grads) drop.push_back("grads");
  if (use.own_states) drop.push_back("optimizer_step_transient");
  if (use.titan) {
    for (const char* n : {"grads", "fsdp_unsharded_params", "fsdp_unit_grads"}) drop.push_back(n);
  }
  const Wide item_states = use.given_states;
  Builder kept;
  kept.overflow = out->overflow;
  for (size_t i = 0; i < out->items.size(); ++i) {
    const MemoryItem& item = out->items[i];
    if (std::find(drop.begin(), drop.end(), item.name) != drop.end()) {
      // What the item held off the GPU stays (none of these has any today).
      if (item.cpu_bytes == 0 && item.nvme_bytes == 0 && item.pinned_bytes == 0) continue;
      MemoryItem off = item;
      off.gpu_bytes = 0;
      kept.items.push_back(off);
      kept.allocs.push_back(out->allocs[i]);
      continue;
    }
    kept.items.push_back(item);
    kept.allocs.push_back(out->allocs[i]);
  }
  const std::array<StepBytes, 4> by_phase = StepCategoriesByPhase(step);
  auto cat = [&](size_t p, StepCategory c) { return Wide{by_phase[p][static_cast<size_t>(c)]}; };
  // An item of `bytes(p)` in each phase p (kPhases order), live where it is not zero.
  auto add_by_phase = [&](std::string name, std::string description, Alloc alloc, auto bytes_at) {
    std::vector<uint64_t> bytes(4, 0);
    unsigned phases = 0;
    uint64_t most = 0;
    for (size_t p = 0; p < 4; ++p) {
      bytes[p] = static_cast<uint64_t>(bytes_at(p));
      if (bytes[p] > 0) phases |= kPhases[p];
      most = std::max(most, bytes[p]);
    }
    if (most == 0) return;
    kept.Add(std::move(name), std::move(description), most, 0, 0, 0, phases, alloc);
    kept.items.back().gpu_phase_bytes = std::move(bytes);
  };
  auto add = [&](std::string name, std::string description, StepCategory c, Wide minus,
                 Alloc alloc) {
    add_by_phase(std::move(name), std::move(description), alloc, [&](size_t p) {
      const Wide v = cat(p, c);
      return v > minus ? v - minus : Wide{0};
    });
  };
  const Alloc tr = Alloc::kTransient;
  add("activations",
      "what the forward keeps for backward and the tensors in flight, recomputation included "
      "(the step model: the framework's ops, per phase)",
      StepCategory::kActivations, 0, tr);
  add("temporaries", "what backward makes besides the gradients it keeps (the step model)",
      StepCategory::kTemporaries, 0, tr);
  if (use.plain_grads || use.titan) {
    add("grads", "gradients as backward makes them, set to None after each step (the step model)",
        StepCategory::kGradients, 0, Alloc::kOnce);
  } else {
    add("grads_in_flight", "gradients made but not yet added into the kept ones (the step model)",
        StepCategory::kGradients, use.given_gradients, tr);
  }
  if (use.own_states) {
    add("optimizer_step_transient", "temporaries of the optimizer step (the step model)",
        StepCategory::kOptimizerTransients, 0, tr);
  }
  add("communication", "FSDP2's all-gather and reduce-scatter buffers between modules",
      StepCategory::kCommunication, 0, tr);
  add("cublas_workspace_and_batch", "the cuBLAS workspace, the input ids and the labels",
      StepCategory::kOther, 0, Alloc::kOnce);
  add("buffers", "the model's registered buffers (rotary frequencies, position ids)",
      StepCategory::kBuffers, 0, Alloc::kOnce);
  if (use.own_states) {
    // The step model's states over the items': per-tensor rounding and, under FSDP2, the shards'
    // padding and the units all-gathered at the moment of each phase's peak.
    add_by_phase(use.titan ? "fsdp_unsharded_params" : "state_layout",
                 use.titan ? "FSDP2's unsharded parameters of the units in flight, and the shards' "
                             "padding (the step model)"
                           : "the model states' per-tensor allocation rounding beyond the items "
                             "above (the step model's layout)",
                 use.titan ? Alloc::kTransient : Alloc::kOnce, [&](size_t p) {
                   const Wide v =
                       cat(p, StepCategory::kParameters) + cat(p, StepCategory::kOptimizerStates);
                   return v > item_states ? v - item_states : Wide{0};
                 });
  }
  *out = std::move(kept);
}

// The setup as far as the step model reads it (Note [Reusing a step]): what sizes DeepSpeed's
// and FSDP's buffers, offload, accumulation and (but for torchtitan's FSDP2) the cluster reach
// it only through StepStates, whose flags join the key.
std::string StepKey(const TrainingSetup& s, const StepStates& st) {
  TrainingSetup k = s;
  const TrainingSetup d;
  k.zero_stage = d.zero_stage;
  k.fsdp = d.fsdp;
  k.grad_accum = d.grad_accum;
  k.gradient_as_bucket_view = d.gradient_as_bucket_view;
  k.offload_optimizer = d.offload_optimizer;
  k.offload_param = d.offload_param;
  k.reduce_bucket_size = d.reduce_bucket_size;
  k.allgather_bucket_size = d.allgather_bucket_size;
  k.overlap_comm = d.overlap_comm;
  k.stage3_prefetch_bucket_size = d.stage3_prefetch_bucket_size;
  k.stage3_param_persistence_threshold = d.stage3_param_persistence_threshold;
  k.stage3_max_live_parameters = d.stage3_max_live_parameters;
  k.sub_group_size = d.sub_group_size;
  k.pin_memory = d.pin_memory;
  k.param_buffer_count = d.param_buffer_count;
  k.param_buffer_size = d.param_buffer_size;
  k.param_max_in_cpu = d.param_max_in_cpu;
  k.optimizer_buffer_count = d.optimizer_buffer_count;
  k.aio_block_size = d.aio_block_size;
  k.aio_queue_depth = d.aio_queue_depth;
  k.aio_intra_op_parallelism = d.aio_intra_op_parallelism;
  k.cuda_context_bytes = d.cuda_context_bytes;
  if (s.framework != Framework::kTorchtitan) {
    k.gpus_per_node = d.gpus_per_node;
    k.num_nodes = d.num_nodes;
  }
  std::string key = ToJson(k).dump();
  key += st.plain_gradients ? " kept" : " consumed";
  key += st.torch_optimizer ? " torch-optimizer" : " other-optimizer";
  key += st.from_inventory ? " own-states" : " given-states";
  return key;
}

}  // namespace
}  // namespace memplan::estimator::mm

namespace memplan::estimator {

struct StepCacheAccess {
  static Result<StepModel> Run(const ModelInventory& inventory, const TrainingSetup& s,
                               const StepStates& st, StepModelCache* cache) {
    // The inventory too, though a cache serves one: a misuse costs a run, not a wrong answer.
    const std::string key = inventory.name + " " + std::to_string(inventory.tensors.size()) + " " +
                            std::to_string(inventory.buffers.size()) + " " + mm::StepKey(s, st);
    StepModelCache::Run run;
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(cache->mu_);
      auto it = cache->runs_.find(key);
      if (it != cache->runs_.end()) {
        run = it->second;
        found = true;
        ++cache->hits_;
      }
    }
    if (!found) {
      // Run outside the lock: another search may run the same setup meanwhile; the first kept
      // wins, and both are the same.
      run.states = st;
      Result<StepModel> sim = SimulateStep(inventory, s, st);
      if (sim.ok()) {
        run.step = std::move(sim).value();
      } else {
        run.error = sim.status();
      }
      std::lock_guard<std::mutex> lock(cache->mu_);
      cache->runs_.emplace(key, run);
    }
    if (!run.step.has_value()) return run.error;
    return MoveToStates(*std::move(run.step), run.states, st, s.framework);
  }
};

size_t StepModelCache::runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_.size();
}

size_t StepModelCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

}  // namespace memplan::estimator

namespace memplan::estimator::mm {
namespace {

Result<StepModel> RunStep(const ModelInventory& inventory, const TrainingSetup& s,
                          const StepStates& st, StepModelCache* cache) {
  if (cache == nullptr) return SimulateStep(inventory, s, st);
  return StepCacheAccess::Run(inventory, s, st, cache);
}

// Phase totals and the peak (Note [Phases]); the CUDA context and the allocator margin are added
// to each phase's GPU total and reported as items.
void TotalPhases(const ItemContext& c, Builder* out, MemoryEstimate* m) {
  const Wide context = U(c.s.cuda_context_bytes);
  // The step model's replay of the caching allocator (Note [The caching allocator's reserve]),
  // where it ran: what its segments hold beyond the live blocks (the margin a step needs), and
  // what it reserves with room to spare; the 10% rule for both otherwise.
  std::optional<Wide> held, reserved;
  if (m->step.has_value()) {
    const StepModel& st = *m->step;
    const Wide live = st.allocator_allocated_bytes;
    held = st.held_bytes > live ? Wide{st.held_bytes} - live : Wide{0};
    reserved = st.reserved_bytes > live ? Wide{st.reserved_bytes} - live : Wide{0};
  }
  Wide peak_margin = 0;
  for (Phase phase : kPhases) {
    PhaseTotals totals;
    totals.phase = PhaseName(phase);
    Wide gpu = 0, cpu = 0, nvme = 0, pinned = 0, transient = 0;
    for (size_t i = 0; i < out->items.size(); ++i) {
      const MemoryItem& item = out->items[i];
      if ((item.phases & phase) == 0) continue;
      const Wide item_gpu = item.GpuBytesIn(phase);
      if (out->allocs[i] == Alloc::kTransient) transient += item_gpu;
      gpu += item_gpu;
      cpu += item.cpu_bytes;
      nvme += item.nvme_bytes;
      pinned += item.pinned_bytes;
    }
    const Wide margin = held.has_value() ? *held : Scale(transient, kAllocatorMargin);
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
    m->peak.gpu_reserved_bytes = std::max(
        m->peak.gpu_reserved_bytes, Saturate(gpu + (reserved.has_value() ? *reserved : margin)));
    m->peak.cpu_bytes = std::max(m->peak.cpu_bytes, totals.cpu_bytes);
    m->peak.nvme_bytes = std::max(m->peak.nvme_bytes, totals.nvme_bytes);
    m->peak.pinned_bytes = std::max(m->peak.pinned_bytes, totals.pinned_bytes);
    m->phases.push_back(totals);
  }
  out->Add("cuda_context", "CUDA context, runtime and kernels (per GPU process)", context, 0, 0, 0,
           kAllPhases);
  out->Add("allocator_margin",
           held.has_value()
               ? "what the caching allocator's segments hold beyond its live blocks, the step's "
                 "allocations replayed through its rules (more is reserved where the GPU has "
                 "room: peak.gpu_reserved_bytes)"
               : "caching-allocator rounding and fragmentation: 10% of the activations and "
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

// `step`: the step model ran the setup, and its categories are the items' (Note [Items from the
// step model]).
std::vector<std::string> Notes(const ItemContext& c, bool step) {
  std::vector<std::string> notes = {
      "Peak is the largest of four phases (end of forward; first layer of backward with its "
      "recompute; end of backward; optimizer step), per tier; the GPU peak's phase is reported.",
      step ? "What the step allocates around the model states (activations, backward's "
             "temporaries, gradients as backward makes them, the optimizer's temporaries) is the "
             "step model's: the framework's training code run op by op, with what autograd saves "
             "and frees (Note [The step model]), per phase."
           : "Activations per layer follow Korthikanti et al. 2022 (sbh(34 + 5as/h) for a GPT-3 "
             "layer), with each term derived from the model: GQA key/value width, gated MLP (4 "
             "f-wide tensors), MoE top-k, dropout masks only where dropout is on, flash "
             "attention, tensor and sequence parallelism.",
      "Gradients that outlive the step (DeepSpeed's partitions, FSDP's shards, DDP's buckets, "
      "accumulation) are counted in every phase; a plain loop's appear as backward makes them.",
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
      step ? "The allocator margin is what the CUDA caching allocator's segments that hold a live "
             "block keep beyond it, from replaying the step's allocations through its rules "
             "(Note [The caching allocator's reserve]); on a GPU with room to spare it reserves "
             "more (peak.gpu_reserved_bytes)."
           : "The allocator margin (10%) applies to activations and per-step temporaries only; "
             "model states allocated once at start-up are counted as allocated (Note [Allocator "
             "margin]).");
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

// `step`: also run the step model and take what the step allocates from it (Note [Items from the
// step model]); `cache`, when given, keeps its runs for the next call (Note [Reusing a step]):
// the comparison's eleven rows and the planner's hundreds of configurations need only a few.
Result<MemoryEstimate> EstimateWith(const ModelInventory& inventory, const TrainingSetup& input,
                                    const InventoryFacts* known, const ModelCounts* counts,
                                    bool step = true, StepModelCache* cache = nullptr) {
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
    const bool plain = c.PlainGradients();
    st.persistent_gradients = plain ? 0 : gpu_of("grads") + gpu_of("ddp_grad_buckets");
    st.plain_gradients = plain;
    // FSDP's flat parameters (FSDP1) step as the items count them (optimizer_step_transient);
    // torchtitan's FSDP2 shards as the step model lays them out.
    st.torch_optimizer = (s.zero_stage == 0 && !c.Fsdp()) || s.framework == Framework::kTorchtitan;
    st.from_inventory = s.zero_stage == 0 && !c.Fsdp();
    const uint64_t tokens = static_cast<uint64_t>(s.micro_batch) * static_cast<uint64_t>(s.seq_len);
    // The batch: input_ids and labels, int64; a sequence classifier's labels are one per
    // sequence (Note [Encoder classifiers in the step model]).
    const uint64_t labels = inventory.model_class == "sequence_classification"
                                ? static_cast<uint64_t>(s.micro_batch)
                                : tokens;
    st.other =
        CublasWorkspaceBytes(s.GpuSm()) + AllocatorRound(tokens * 8) + AllocatorRound(labels * 8);
    Result<StepModel> sim = RunStep(inventory, s, st, cache);
    if (sim.ok()) {
      m.step = std::move(sim).value();
      StepUse use;
      use.titan = s.framework == Framework::kTorchtitan;
      use.plain_grads = plain;
      use.own_states = st.from_inventory || use.titan;
      use.given_gradients = st.persistent_gradients;
      use.given_states = st.parameters + st.optimizer_states;
      UseStepModel(*m.step, use, &out);
    } else {
      m.step_error = sim.status().message();
      m.step_unmodelled = sim.status().code() == StatusCode::kUnimplemented;
    }
  }
  TotalPhases(c, &out, &m);
  m.items = std::move(out.items);
  m.constants = Constants(c, input);
  m.notes = Notes(c, m.step.has_value());
  // What the step model assumed, where its figures are the estimate's.
  if (m.step.has_value()) m.notes.insert(m.notes.end(), m.step->notes.begin(), m.step->notes.end());
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
  // The step model runs once per kind of gradient handling, not per row (Note [Reusing a step]).
  StepModelCache cache;
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
    Result<MemoryEstimate> m = EstimateWith(inventory, s, &*facts, nullptr, /*step=*/true, &cache);
    if (!m.ok()) return m.status();
    row.valid = true;
    row.peak = m->peak;
    Phase peak_phase = kPhaseForward;
    for (Phase p : kPhases) {
      if (PhaseName(p) == m->peak.phase) peak_phase = p;
    }
    // What the step keeps and makes around the states at the peak: the step model's
    // activations and temporaries, or the formulas' activation, recompute and logits items.
    for (const MemoryItem& item : m->items) {
      if (item.name == "activations" || item.name == "activation_recompute" ||
          item.name == "temporaries" || item.name.rfind("logits", 0) == 0) {
        row.activations_gpu_bytes += item.GpuBytesIn(peak_phase);
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

uint64_t MemoryItem::GpuBytesIn(Phase phase) const {
  if ((phases & phase) == 0) return 0;
  if (gpu_phase_bytes.empty()) return gpu_bytes;
  for (size_t p = 0; p < gpu_phase_bytes.size() && p < std::size(kPhases); ++p) {
    if (kPhases[p] == phase) return gpu_phase_bytes[p];
  }
  return gpu_bytes;
}

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
                                      const ModelCounts& counts, StepModelCache* cache) {
  return mm::EstimateWith(inventory, input, nullptr, &counts, /*step=*/true, cache);
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
