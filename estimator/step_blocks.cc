#include "estimator/step_blocks.h"

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "estimator/step_ops.h"

namespace memplan::estimator::step {
namespace {

bool LinearRole(TensorRole r) {
  switch (r) {
    case TensorRole::kAttentionQ:
    case TensorRole::kAttentionK:
    case TensorRole::kAttentionV:
    case TensorRole::kAttentionQkv:
    case TensorRole::kAttentionKv:
    case TensorRole::kAttentionOut:
    case TensorRole::kAttentionQDown:
    case TensorRole::kAttentionKvDown:
    case TensorRole::kAttentionKvUp:
    case TensorRole::kMlpUp:
    case TensorRole::kMlpGate:
    case TensorRole::kMlpGateUp:
    case TensorRole::kMlpDown:
    case TensorRole::kSharedExpertGate: return true;
    default: return false;
  }
}

Wide Rounded(Wide numel, DT dt) {
  const Wide bytes = numel * static_cast<Wide>(Bytes(dt));
  return bytes == 0 ? 0 : std::max<Wide>(512, (bytes + 511) / 512 * 512);
}

}  // namespace

ModelRun::ModelRun(Graph& g, const ModelInventory& inventory, const TrainingSetup& setup)
    : g_(g), inv_(inventory), s_(setup), a_(*inventory.arch) {}

Status ModelRun::Prepare() {
  // What the step model does not run yet is refused, never run as something else.
  if (s_.checkpointing == Checkpointing::kSelective || s_.checkpointing == Checkpointing::kOp) {
    return Status::Unimplemented("the step model does not run " +
                                 std::string(CheckpointingName(s_.checkpointing)) +
                                 " checkpointing yet (none and full only)");
  }
  if (s_.loss == Loss::kFused) {
    return Status::Unimplemented("the step model does not run a fused linear cross-entropy yet");
  }
  if (s_.loss == Loss::kChunked && s_.framework == Framework::kTransformers) {
    return Status::Unimplemented(
        "the step model does not run a chunked loss under Transformers (its ForCausalLMLoss takes "
        "the full logits)");
  }
  if (s_.torch_compile) {
    return Status::Unimplemented("the step model does not run torch.compile's graphs yet");
  }
  // What TransformersForward refuses from the architecture alone, refused before the parameters
  // of a large model (DeepSeek-V3's 47,000 tensors) are laid out for nothing.
  if (s_.framework == Framework::kTransformers &&
      (!a_.causal || a_.encoder_decoder || a_.kv_lora_rank > 0 || inv_.model_type == "gpt_oss")) {
    return Status::Unimplemented("the step model runs Transformers' dense decoder LMs so far");
  }
  // One Linear per expert (checkpoints, Transformers 4): refused before thousands of expert
  // parameters are laid out (a per-expert Qwen3-235B has 18,000 of them).
  for (const TensorInfo& t : inv_.tensors) {
    const bool expert = t.role == TensorRole::kExpertUp || t.role == TensorRole::kExpertGate ||
                        t.role == TensorRole::kExpertGateUp || t.role == TensorRole::kExpertDown;
    if (expert && !t.bias && t.shape.size() == 2) {
      return Status::Unimplemented(
          "the step model does not run one Linear per expert (Transformers 4's layout); it runs "
          "experts fused as Transformers >= 5 builds them");
    }
  }
  switch (s_.precision) {
    case Precision::kFp32: pdt_ = DT::kF32; break;
    case Precision::kBf16Pure: pdt_ = DT::kBF16; break;
    case Precision::kFp16Mixed:
    case Precision::kBf16Mixed:
      adt_ = s_.precision == Precision::kFp16Mixed ? DT::kF16 : DT::kBF16;
      if (s_.autocast) {
        autocast_ = true;
        pdt_ = DT::kF32;
      } else {
        // DeepSpeed and FSDP run the model in the 16-bit dtype (module.half() / bfloat16()).
        pdt_ = adt_;
      }
      break;
  }
  g_.SetAutocast(autocast_, adt_);
  batch_ = static_cast<Wide>(s_.micro_batch);
  seq_ = static_cast<Wide>(s_.SeqLenFor(&a_));
  tokens_ = batch_ * seq_;

  const bool lora = s_.lora_rank > 0;
  // Tied tensors name their target; only those names are looked up (a 47,000-tensor MoE would
  // otherwise spend milliseconds building a map of every name).
  std::unordered_map<std::string_view, size_t> index;
  for (const TensorInfo& t : inv_.tensors) {
    if (!t.tied_to.empty()) index.emplace(t.tied_to, SIZE_MAX);
  }
  params_.resize(inv_.tensors.size());
  g_.Reserve(inv_.tensors.size() + 64);
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    if (!index.empty()) {
      auto it = index.find(t.name);
      if (it != index.end() && it->second == SIZE_MAX) it->second = i;
    }
    if (!t.tied_to.empty()) {
      auto it = index.find(t.tied_to);
      if (it == index.end() || it->second == SIZE_MAX) {
        return Status::InvalidArgument(inv_.name + ": " + t.name + " is tied to " + t.tied_to +
                                       ", which does not come before it");
      }
      params_[i] = params_[it->second];
      continue;
    }
    params_[i] = g_.Param(t.numel, pdt_, !lora);
  }
  // LoRA adapters: PEFT builds lora_A / lora_B in fp32 (autocast_adapter_dtype) beside the base.
  std::map<const TensorInfo*, std::pair<T, T>> adapters;
  std::vector<Wide> adapter_bytes;
  if (lora) {
    MEMPLAN_ASSIGN_OR_RETURN(auto targets, LoraTargetTensors(inv_, s_));
    const Wide r = static_cast<Wide>(s_.lora_rank);
    // PEFT keeps adapters in fp32 (autocast_adapter_dtype); torchtune and LitGPT build them in
    // the model's dtype.
    const DT adapter_dt = s_.framework == Framework::kTransformers ? DT::kF32 : pdt_;
    for (const TensorInfo* t : targets) {
      T a = g_.Param(r * static_cast<Wide>(t->InFeatures()), adapter_dt, true);
      T b = g_.Param(static_cast<Wide>(t->OutFeatures()) * r, adapter_dt, true);
      adapters[t] = {a, b};
      adapter_bytes.push_back(Rounded(r * static_cast<Wide>(t->InFeatures()), adapter_dt));
      adapter_bytes.push_back(Rounded(static_cast<Wide>(t->OutFeatures()) * r, adapter_dt));
    }
  }
  const int64_t layers = a_.layers;
  blocks_.assign(static_cast<size_t>(std::max<int64_t>(layers, 0)), BlockParams{});
  // Linear weights first, then their biases (a bias may precede no weight in the list).
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    const T p = params_[i];
    if (t.layer >= 0 && t.layer < layers && !t.block.empty()) {
      BlockParams& bp = blocks_[static_cast<size_t>(t.layer)];
      if (LinearRole(t.role) && t.IsLinearWeight()) {
        Lin& l = bp.lin[t.role];
        l.w = p;
        l.in = static_cast<Wide>(t.InFeatures());
        l.out = static_cast<Wide>(t.OutFeatures());
        auto it = adapters.find(&t);
        if (it != adapters.end()) {
          l.lora_a = it->second.first;
          l.lora_b = it->second.second;
        }
      } else if (t.role == TensorRole::kRouter && !t.bias) {
        bp.router.w = p;
        bp.router.in = static_cast<Wide>(t.shape.size() == 2 ? t.shape[1] : 0);
        bp.router.out = static_cast<Wide>(t.shape.empty() ? 0 : t.shape[0]);
      } else if (t.role == TensorRole::kExpertUp || t.role == TensorRole::kExpertGate ||
                 t.role == TensorRole::kExpertGateUp || t.role == TensorRole::kExpertDown) {
        bp.experts.push_back(p);
        bp.expert_params += t.numel;
        if (!t.bias && t.shape.size() == 3) {
          bp.expert[t.role] = p;
          // Transformers >= 5: gate_up_proj [E, 2F, h] and down_proj [E, h, F] (gpt-oss stores
          // them [E, in, out]).
          bp.expert_width[t.role] =
              static_cast<Wide>(inv_.model_type == "gpt_oss" ? t.shape[2] : t.shape[1]);
        }
      } else if (t.role == TensorRole::kNorm && !t.bias) {
        Norm n{p, T{}, static_cast<Wide>(t.numel)};
        (static_cast<int64_t>(t.numel) == a_.hidden ? bp.norms : bp.qk_norms).push_back(n);
      }
    } else if (t.block.empty()) {
      if (t.role == TensorRole::kEmbedding && !embedding_.ok()) embedding_ = p;
      if (t.role == TensorRole::kPositionEmbedding) position_embedding_ = p;
      if (t.role == TensorRole::kNorm && !t.bias) {
        final_norms_.push_back(Norm{p, T{}, static_cast<Wide>(t.numel)});
      }
      if (t.role == TensorRole::kHead && t.IsLinearWeight()) head_ = p;
      if (t.role == TensorRole::kHead && t.bias && t.kind == ModuleKind::kLinear) head_bias_ = p;
    }
  }
  // Biases, matched to their module's weight or norm.
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    if (!t.bias || t.layer < 0 || t.layer >= layers || t.block.empty()) continue;
    BlockParams& bp = blocks_[static_cast<size_t>(t.layer)];
    if (LinearRole(t.role) && bp.lin.count(t.role) > 0) bp.lin[t.role].b = params_[i];
    if (t.role == TensorRole::kNorm) {
      for (Norm& n : bp.norms) {
        if (!n.b.ok()) {
          n.b = params_[i];
          break;
        }
      }
    }
  }
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    if (t.bias && t.block.empty() && t.role == TensorRole::kNorm) {
      for (Norm& n : final_norms_) {
        if (!n.b.ok()) {
          n.b = params_[i];
          break;
        }
      }
    }
  }
  if (s_.framework == Framework::kLitGpt) {
    // LitGPT holds query, key and value as one Linear (attn.qkv) in every model; its LoRA on it
    // is one LoRAQKVLinear whose lora_A is [r x enabled parts, in] and lora_B [enabled out, r].
    auto has = [&](const char* name) {
      const auto& t = s_.lora_targets;
      return std::find(t.begin(), t.end(), name) != t.end();
    };
    const bool defaults = s_.lora_targets.empty();
    lora_q_ = lora && (defaults || has("query"));
    lora_k_ = lora && has("key");
    lora_v_ = lora && (defaults || has("value"));
    const Wide q = static_cast<Wide>(a_.heads * a_.head_dim);
    const Wide kvw = static_cast<Wide>(a_.kv_heads * a_.head_dim);
    const Wide h = static_cast<Wide>(a_.hidden);
    const Wide r = static_cast<Wide>(s_.lora_rank);
    for (BlockParams& bp : blocks_) {
      Lin l;
      l.in = h;
      l.out = q + 2 * kvw;
      if (bp.has(TensorRole::kAttentionQkv)) {
        l.w = bp.at(TensorRole::kAttentionQkv).w;
        l.b = bp.at(TensorRole::kAttentionQkv).b;
      } else {
        l.w = g_.Param(l.in * l.out, pdt_, !lora);
        const bool biased =
            bp.has(TensorRole::kAttentionQ) && bp.at(TensorRole::kAttentionQ).b.ok();
        if (biased) l.b = g_.Param(l.out, pdt_, !lora);
      }
      const int parts = (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0);
      if (parts > 0) {
        const Wide out = (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0);
        l.lora_a = g_.Param(r * static_cast<Wide>(parts) * h, pdt_, true);
        l.lora_b = g_.Param(out * r, pdt_, true);
        adapter_bytes.push_back(Rounded(r * static_cast<Wide>(parts) * h, pdt_));
        adapter_bytes.push_back(Rounded(out * r, pdt_));
      }
      // The separate query/key/value adapters LoraTargetTensors made are LitGPT's one adapter.
      for (TensorRole role : {TensorRole::kAttentionQ, TensorRole::kAttentionK,
                              TensorRole::kAttentionV, TensorRole::kAttentionQkv}) {
        if (!bp.has(role)) continue;
        Lin& sep = bp.lin[role];
        if (sep.lora_a.ok()) {
          sep.lora_a = T{};
          sep.lora_b = T{};
        }
      }
      litgpt_qkv_.push_back(l);
    }
    // Drop the bytes of the per-projection adapters replaced above: recount below from the
    // blocks' remaining adapters and the fused ones.
    adapter_bytes.clear();
    const Wide rr = r;
    for (const BlockParams& bp : blocks_) {
      for (const auto& [role, l] : bp.lin) {
        if (!l.lora_a.ok()) continue;
        adapter_bytes.push_back(Rounded(rr * l.in, pdt_));
        adapter_bytes.push_back(Rounded(l.out * rr, pdt_));
      }
    }
    for (const Lin& l : litgpt_qkv_) {
      if (!l.lora_a.ok()) continue;
      const int parts = (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0);
      const Wide out = (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0);
      adapter_bytes.push_back(Rounded(rr * static_cast<Wide>(parts) * h, pdt_));
      adapter_bytes.push_back(Rounded(out * rr, pdt_));
    }
  }

  // The family's block as Transformers writes it (transformers/models/<model_type>/).
  const std::string& type = inv_.model_type;
  fam_ = Family{};
  fam_.rotary = a_.rotary_dims > 0;
  fam_.rotary_dims = static_cast<Wide>(a_.rotary_dims);
  fam_.gated = a_.gated_mlp;
  const std::string& act = a_.hidden_act;
  fam_.act = act == "silu" || act == "swish" ? Family::Act::kSilu
             : act == "gelu_pytorch_tanh"    ? Family::Act::kGeluTanh
             : act == "gelu_new" || act == "gelu_fast" || act == "gelu_accurate"
                 ? Family::Act::kGeluNew
             : act == "relu" ? Family::Act::kRelu
                             : Family::Act::kGelu;
  fam_.norm = a_.norm_upcasts ? Family::NormKind::kRms : Family::NormKind::kLayer;
  if (type == "gemma" || type == "gemma2" || type == "gemma3_text") {
    fam_.norm = Family::NormKind::kRmsGemma;
    fam_.embedding_scale = true;
  }
  if (type == "gemma2" || type == "gemma3_text") fam_.layout = Family::Layout::kSandwich;
  if (type == "olmo2") {
    fam_.norm = Family::NormKind::kRmsOlmo;
    fam_.layout = Family::Layout::kPostNorm;
    fam_.qk_norm = Family::QkNorm::kFullRms;
  }
  if (type == "qwen3" || type == "qwen3_moe" || type == "gemma3_text") {
    fam_.qk_norm = Family::QkNorm::kHeadRms;
  }
  if (type == "phi") {
    fam_.layout = Family::Layout::kParallel;
    fam_.qk_norm = Family::QkNorm::kHeadLayer;
  }
  if (type == "gptj") fam_.layout = Family::Layout::kParallel;
  if (type == "falcon") {
    // FalconDecoderLayer: parallel attention reads one norm (two with the new decoder
    // architecture); ALiBi goes into the mask (FalconModel.forward).
    if (a_.parallel_attention) {
      fam_.layout =
          a_.cached_kv_heads > 0 ? Family::Layout::kParallelTwoNorms : Family::Layout::kParallel;
    }
    fam_.falcon_alibi = a_.alibi;
  }
  if (type == "bloom") {
    fam_.bloom_attention = true;
    fam_.embedding_norm = true;
  }
  if (type == "gpt_neox") fam_.layout = Family::Layout::kParallelTwoNorms;
  fam_.query_scaled = type == "opt";
  fam_.probs_to_value = type == "gpt2";
  fam_.learned_positions = a_.learned_positions;
  if (type == "gpt2" || type == "opt" || type == "starcoder2" || type == "phi" || type == "gptj") {
    fam_.resid_dropout = a_.hidden_dropout;
  }
  if (type != "opt") fam_.embedding_dropout = a_.embedding_dropout;

  if (!embedding_.ok()) {
    return Status::Unimplemented(inv_.name + ": the step model found no token embedding");
  }
  if (!head_.ok() && (inv_.model_class == "causal_lm")) {
    return Status::Unimplemented(inv_.name + ": the step model found no output head");
  }

  // Optimizer groups (Transformers' Trainer: weight decay for all but biases and norm weights,
  // get_decay_parameter_names), each tensor rounded, states in the parameter's dtype.
  Wide decay = 0, no_decay = 0;
  if (lora) {
    for (Wide b : adapter_bytes) {
      decay += b;
      largest_trainable_ = std::max(largest_trainable_, b);
    }
  } else {
    for (const TensorInfo& t : inv_.tensors) {
      if (!t.tied_to.empty()) continue;
      const Wide b = Rounded(t.numel, pdt_);
      largest_trainable_ = std::max(largest_trainable_, b);
      if (t.bias || t.role == TensorRole::kNorm) {
        no_decay += b;
      } else {
        decay += b;
      }
    }
  }
  if (s_.framework == Framework::kTransformers) {
    group_bytes_ = {decay, no_decay};
  } else {
    group_bytes_ = {decay + no_decay};
  }

  // The model states, tensor by tensor.
  quantized_base_ = lora && s_.qlora;
  for (const TensorInfo& t : inv_.tensors) {
    if (!t.tied_to.empty()) continue;
    if (quantized_base_ && !t.block.empty() && t.IsLinearWeight()) {
      const Wide n = t.numel;
      if (s_.framework == Framework::kTorchtune) {
        // torchao's NF4Tensor (torchao/dtypes/nf4tensor.py, to_nf4 with block 64, scaler block
        // 256): 4-bit codes, int8 scalers per block, fp32 factors per scaler block, the scaler
        // mean and the 16-entry NF4 table.
        parameter_bytes_ += Rounded((n + 1) / 2, DT::kU8) + Rounded((n + 63) / 64, DT::kI8) +
                            Rounded((n + 64 * 256 - 1) / (64 * 256), DT::kF32) +
                            Rounded(1, DT::kF32) + Rounded(16, DT::kF32);
      } else {
        // bitsandbytes Params4bit: packed codes and an fp32 absmax per 64 (double quantisation:
        // 8-bit absmax per 64 and an fp32 per 256 of those).
        parameter_bytes_ += Rounded((n + 1) / 2, DT::kU8);
        parameter_bytes_ += s_.double_quant ? Rounded((n + 63) / 64, DT::kU8) +
                                                  Rounded((n + 64 * 256 - 1) / (64 * 256), DT::kF32)
                                            : Rounded((n + 63) / 64, DT::kF32);
      }
      continue;
    }
    parameter_bytes_ += Rounded(t.numel, pdt_);
  }
  for (Wide b : adapter_bytes) parameter_bytes_ += b;
  if (s_.framework == Framework::kTorchtune) {
    // torchtune's RotaryPositionalEmbeddings cache: max_seq_len x head_dim fp32, and theta.
    // Qwen2's (torchtune/models/qwen2/_positional_embeddings.py build_rope_cache) caches
    // cat([cos, sin]) of the doubled frequencies: max_seq_len x 2 head_dim. The plain qwen2
    // builder shares one rope among the layers; lora_qwen2_self_attention makes one per layer.
    const bool qwen2 = inv_.model_type == "qwen2";
    const Wide width = static_cast<Wide>(a_.head_dim) * (qwen2 ? 2 : 1);
    const Wide ropes = qwen2 && lora ? static_cast<Wide>(std::max<int64_t>(a_.layers, 1)) : 1;
    buffer_bytes_ =
        ropes *
        (Rounded(static_cast<Wide>(std::max<int64_t>(a_.max_positions, 1)) * width, DT::kF32) +
         Rounded(static_cast<Wide>(a_.head_dim) / 2, DT::kF32));
  } else if (s_.framework == Framework::kLitGpt) {
    // LitGPT's GPT.rope_cache (litgpt/model.py): cos and sin buffers of max_seq_length x
    // rope_n_elem in fp32, max_seq_length set to the training sequence length by the recipes.
    buffer_bytes_ = 2 * Rounded(seq_ * static_cast<Wide>(a_.rotary_dims), DT::kF32);
  } else {
    for (const TensorInfo& b : inv_.buffers) {
      const bool floating =
          b.dtype == DType::kF32 || b.dtype == DType::kF16 || b.dtype == DType::kBF16;
      buffer_bytes_ +=
          Rounded(b.numel, floating ? pdt_ : (b.dtype == DType::kI64 ? DT::kI64 : DT::kF32));
    }
  }
  // torch.optim keeps states in each parameter's dtype: AdamW's exp_avg and exp_avg_sq, SGD's
  // momentum buffer, Lion's exp_avg.
  int states = 0;
  switch (s_.optimizer) {
    case Optimizer::kAdamW: states = 2; break;
    case Optimizer::kSgd: states = s_.sgd_momentum > 0 ? 1 : 0; break;
    case Optimizer::kLion: states = 1; break;
    case Optimizer::kAdafactor: states = 1; break;
    case Optimizer::kAdam8bit: states = 0; break;
  }
  if (lora) {
    for (Wide b : adapter_bytes) state_bytes_ += static_cast<Wide>(states) * b;
  } else {
    for (const TensorInfo& t : inv_.tensors) {
      if (t.tied_to.empty()) state_bytes_ += static_cast<Wide>(states) * Rounded(t.numel, pdt_);
    }
  }
  return Status::Ok();
}

bool ModelRun::Checkpointed(int layer) const {
  if (s_.checkpointing != Checkpointing::kFull) return false;
  const int64_t k = std::max<int64_t>(s_.checkpoint_every, 1);
  // Transformers' _set_gradient_checkpointing: `layer_index % every_n_layers == 0`.
  return layer % k == 0;
}

T ModelRun::BlockFor(int layer, T x) {
  switch (s_.framework) {
    case Framework::kTorchtune: return TorchtuneBlock(layer, x);
    case Framework::kLitGpt: return LitGptBlock(layer, x);
    default: return TransformersDecoderBlock(layer, x);
  }
}

T ModelRun::RunBlock(int layer, T x) {
  if (!Checkpointed(layer)) return BlockFor(layer, x);
  // torch.utils.checkpoint (use_reentrant=False): the forward keeps nothing of the block but
  // its input; the block's backward re-runs it first.
  g_.SetSaving(false);
  T out = BlockFor(layer, x);
  g_.SetSaving(true);
  g_.RecordCheckpoint(x, out, [this, layer](T in) { return BlockFor(layer, in); },
                      {cos_, sin_, mask_});
  return out;
}

// --- Transformers ----------------------------------------------------------------------------

T ModelRun::RmsNormalizedF32(const Norm& n, T x) {
  // The part the Transformers RMSNorms share: x in fp32, times rsqrt(mean(x^2) + eps).
  //   hidden_states = hidden_states.to(torch.float32)
  //   variance = hidden_states.pow(2).mean(-1, keepdim=True)
  //   hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
  T h = Cast(g_, x, DT::kF32);
  T p = Apply(g_, Unary::kPow, h);
  T var = MeanRows(g_, p, n.width);
  g_.Drop(p);
  T eps = Scale(g_, var);
  g_.Drop(var);
  T r = Apply(g_, Unary::kRsqrt, eps);
  g_.Drop(eps);
  T hn = Mul(g_, h, r);
  g_.Drop(h);
  g_.Drop(r);
  return hn;
}

T ModelRun::HfRmsNorm(const Norm& n, T x) {
  // LlamaRMSNorm.forward (transformers/models/llama/modeling_llama.py), and its copies:
  //   input_dtype = hidden_states.dtype
  //   hidden_states = hidden_states.to(torch.float32)
  //   variance = hidden_states.pow(2).mean(-1, keepdim=True)
  //   hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
  //   return self.weight * hidden_states.to(input_dtype)
  const DT in = g_.Dtype(x);
  T hn = RmsNormalizedF32(n, x);
  T hc = Cast(g_, hn, in);
  g_.Drop(hn);
  T out = Mul(g_, n.w, hc);
  g_.Drop(hc);
  return out;
}

T ModelRun::GemmaRmsNorm(const Norm& n, T x) {
  // GemmaRMSNorm.forward (models/gemma/modeling_gemma.py):
  //   output = self._norm(x.float())           # x * torch.rsqrt(x.pow(2).mean(-1) + eps)
  //   output = output * (1.0 + self.weight.float())
  //   return output.type_as(x)
  const DT in = g_.Dtype(x);
  T hn = RmsNormalizedF32(n, x);
  T wf = Cast(g_, n.w, DT::kF32);
  T w1 = Scale(g_, wf);  // 1.0 + weight
  g_.Drop(wf);
  T out = Mul(g_, hn, w1);
  g_.Drop(hn);
  g_.Drop(w1);
  T oc = Cast(g_, out, in);
  g_.Drop(out);
  return oc;
}

T ModelRun::OlmoRmsNorm(const Norm& n, T x) {
  // Olmo2RMSNorm.forward (models/olmo2/modeling_olmo2.py): the weight multiplied in fp32, then
  //   return (self.weight * hidden_states).to(input_dtype)
  const DT in = g_.Dtype(x);
  T hn = RmsNormalizedF32(n, x);
  T out = Mul(g_, n.w, hn);
  g_.Drop(hn);
  T oc = Cast(g_, out, in);
  g_.Drop(out);
  return oc;
}

T ModelRun::NormAny(const Norm& n, T x) {
  switch (fam_.norm) {
    case Family::NormKind::kRms: return HfRmsNorm(n, x);
    case Family::NormKind::kRmsGemma: return GemmaRmsNorm(n, x);
    case Family::NormKind::kRmsOlmo: return OlmoRmsNorm(n, x);
    case Family::NormKind::kLayer: return LayerNorm(g_, x, n.w, n.b, n.width);
  }
  return g_.Alias(x);
}

T ModelRun::ApplyRotary(T x) {
  // apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1); over the
  // first rotary_dims of each head only when partial (Phi, GPT-NeoX: rotated part cat with the
  // rest).
  const Wide d = static_cast<Wide>(a_.head_dim);
  const Wide rd = fam_.rotary_dims == 0 || fam_.rotary_dims >= d ? d : fam_.rotary_dims;
  T rot = rd == d ? g_.Alias(x) : Slice(g_, x, g_.Numel(x) / d * rd);
  T m1 = Mul(g_, rot, cos_);
  T x1 = Slice(g_, rot, g_.Numel(rot) / 2);
  T x2 = Slice(g_, rot, g_.Numel(rot) / 2);
  T n = Apply(g_, Unary::kNeg, x2);
  g_.Drop(x2);
  T c = Cat(g_, {n, x1});
  g_.Drop(n);
  g_.Drop(x1);
  T m2 = Mul(g_, c, sin_);
  g_.Drop(c);
  T out = Add(g_, m1, m2);
  g_.Drop(m1);
  g_.Drop(m2);
  g_.Drop(rot);
  if (rd == d) return out;
  T pass = Slice(g_, x, g_.Numel(x) / d * (d - rd));
  T full = Cat(g_, {out, pass});
  g_.Drop(out);
  g_.Drop(pass);
  return full;
}

T ModelRun::Activation(T x) {
  switch (fam_.act) {
    case Family::Act::kSilu: return Apply(g_, Unary::kSilu, x);
    case Family::Act::kGelu: return Apply(g_, Unary::kGelu, x);
    case Family::Act::kGeluTanh: return Apply(g_, Unary::kGeluTanh, x);
    case Family::Act::kRelu: return Apply(g_, Unary::kRelu, x);
    case Family::Act::kGeluNew: {
      // NewGELUActivation (transformers/activations.py), a Python formula:
      //   0.5 * input * (1.0 + torch.tanh(sqrt(2 / pi) * (input + 0.044715 * input ** 3)))
      T p = Apply(g_, Unary::kPow, x);  // an fp32 op under autocast: saves the fp32 copy
      T m1 = Scale(g_, p);
      g_.Drop(p);
      T a1 = Add(g_, x, m1);
      g_.Drop(m1);
      T m2 = Scale(g_, a1);
      g_.Drop(a1);
      T t = Apply(g_, Unary::kTanh, m2);
      g_.Drop(m2);
      T a2 = Scale(g_, t);  // 1.0 + tanh(...)
      g_.Drop(t);
      T half = Scale(g_, x);  // 0.5 * input
      T out = Mul(g_, half, a2);
      g_.Drop(half);
      g_.Drop(a2);
      return out;
    }
  }
  return g_.Alias(x);
}

T ModelRun::LoraLinear(const Lin& l, T x) {
  T y = Linear(g_, x, l.w, l.b, l.in, l.out);
  if (!l.lora_a.ok()) return y;
  // PEFT's lora.Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  T xc = Cast(g_, x, g_.Dtype(l.lora_a));
  T xa = Dropout(g_, xc, s_.LoraDropout());
  g_.Drop(xc);
  T ya = Linear(g_, xa, l.lora_a, T{}, l.in, r);
  g_.Drop(xa);
  T yb = Linear(g_, ya, l.lora_b, T{}, r, l.out);
  g_.Drop(ya);
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, y, ys);
  g_.Drop(y);
  g_.Drop(ys);
  return sum;
}

T ModelRun::BloomAttention(const BlockParams& bp, T h) {
  // BloomAttention.forward (models/bloom/modeling_bloom.py): the fused projection viewed as
  // query, key and value, the cache update, reshape to (batch x heads) x seq x head_dim (a copy
  // of the strided query), alibi.baddbmm(q, k^T), + mask, softmax in fp32 cast back, dropout,
  // bmm with v, _merge_heads (a copy), dense.
  const Wide heads = static_cast<Wide>(a_.heads), d = static_cast<Wide>(a_.head_dim);
  T qkv = LoraLinear(bp.at(TensorRole::kAttentionQkv), h);
  const Wide n = tokens_ * heads * d;
  T q = Slice(g_, qkv, n), k = Slice(g_, qkv, n), v = Slice(g_, qkv, n);
  g_.Drop(qkv);
  if (use_cache_) {
    T kc = Copy(g_, k), vc = Copy(g_, v);
    g_.Drop(k);
    g_.Drop(v);
    k = kc;
    v = vc;
    cache_.push_back(g_.Alias(k));
    cache_.push_back(g_.Alias(v));
  }
  T qr = Copy(g_, q);  // reshape of the strided view
  g_.Drop(q);
  T kr = use_cache_ ? g_.Alias(k) : Copy(g_, k);
  T vr = use_cache_ ? g_.Alias(v) : Copy(g_, v);
  g_.Drop(k);
  g_.Drop(v);
  T qc = AutocastIn(g_, qr), kc = AutocastIn(g_, kr);
  g_.Drop(qr);
  g_.Drop(kr);
  T scores = g_.New(batch_ * heads * seq_ * seq_, g_.Dtype(qc), true);
  g_.Record(Graph::Spec("Baddbmm", {qc, kc}, {scores}, {qc, kc}));
  g_.Drop(qc);
  g_.Drop(kc);
  T masked = Add(g_, scores, mask_);
  g_.Drop(scores);
  T probs = Softmax(g_, masked, DT::kF32);
  g_.Drop(masked);
  T pc = Cast(g_, probs, autocast_ ? adt_ : g_.Dtype(vr));
  g_.Drop(probs);
  T dropped = Dropout(g_, pc, a_.attention_dropout);
  g_.Drop(pc);
  T pa = AutocastIn(g_, dropped), va = AutocastIn(g_, vr);
  g_.Drop(dropped);
  g_.Drop(vr);
  T o = g_.New(batch_ * heads * seq_ * d, g_.Dtype(pa), true);
  g_.Record(Graph::Spec("Bmm(pv)", {pa, va}, {o}, {pa, va}));
  g_.Drop(pa);
  g_.Drop(va);
  T merged = Copy(g_, o);
  g_.Drop(o);
  T out = LoraLinear(bp.at(TensorRole::kAttentionOut), merged);
  g_.Drop(merged);
  return out;
}

T ModelRun::TransformersAttention(int layer, const BlockParams& bp, T h) {
  (void)layer;
  if (fam_.bloom_attention) return BloomAttention(bp, h);
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T q, k, v;
  if (bp.has(TensorRole::kAttentionQkv)) {
    // One projection split into query, key and value views (GPT-2's c_attn .split, Phi-3's
    // qkv[..., :q], GPT-NeoX's chunk): the views keep the whole output alive.
    T qkv = LoraLinear(bp.at(TensorRole::kAttentionQkv), h);
    const Wide qn = tokens_ * heads * d, kn = tokens_ * kv * d;
    q = Slice(g_, qkv, qn);
    k = Slice(g_, qkv, kn);
    v = Slice(g_, qkv, kn);
    g_.Drop(qkv);
  } else {
    q = LoraLinear(bp.at(TensorRole::kAttentionQ), h);
    k = LoraLinear(bp.at(TensorRole::kAttentionK), h);
    v = LoraLinear(bp.at(TensorRole::kAttentionV), h);
  }
  if (fam_.query_scaled) {
    T qs = Scale(g_, q);  // OPTAttention: q_proj(hidden_states) * self.scaling
    g_.Drop(q);
    q = qs;
  }
  if (fam_.qk_norm != Family::QkNorm::kNone && bp.qk_norms.size() >= 2) {
    auto norm = [&](const Norm& n, T t) {
      return fam_.qk_norm == Family::QkNorm::kHeadLayer ? LayerNorm(g_, t, n.w, n.b, n.width)
                                                        : HfRmsNorm(n, t);
    };
    T qn = norm(bp.qk_norms[0], q);
    g_.Drop(q);
    q = qn;
    T kn = norm(bp.qk_norms[1], k);
    g_.Drop(k);
    k = kn;
  }
  if (fam_.rotary) {
    T qr = ApplyRotary(q);
    g_.Drop(q);
    q = qr;
    T kr = ApplyRotary(k);
    g_.Drop(k);
    k = kr;
  }
  if (use_cache_) {
    // DynamicCache.update in training (use_cache from the config): the first update cats onto
    // an empty tensor of the key's dtype, copying key and value (the value promoted to it);
    // the cache holds them until the model's output is dropped.
    T kc = Copy(g_, k);
    g_.Drop(k);
    k = kc;
    T vc = g_.Dtype(v) == g_.Dtype(kc) ? Copy(g_, v) : Cast(g_, v, g_.Dtype(kc));
    g_.Drop(v);
    v = vc;
    cache_.push_back(g_.Alias(k));
    cache_.push_back(g_.Alias(v));
  }
  AttentionShape as;
  as.batch = batch_;
  as.heads = heads;
  as.kv_heads = kv;
  as.seq = as.kv_seq = seq_;
  as.head_dim = as.v_head_dim = d;
  as.dropout = a_.attention_dropout;
  as.mask = explicit_mask_;
  const DT cdt = autocast_ ? adt_ : g_.Dtype(q);
  T out;
  if (s_.flash_attention) {
    SdpaBackend backend;
    const int sm = s_.GpuSm();
    const bool half = Half(cdt);
    if (!half) {
      backend = SdpaBackend::kEfficient;
    } else if (explicit_mask_) {
      backend = sm >= 80 || cdt == DT::kF16 ? SdpaBackend::kEfficient : SdpaBackend::kMath;
    } else if (sm >= 90 && sm < 110) {
      backend = SdpaBackend::kCudnn;
    } else if (sm >= 80) {
      backend = SdpaBackend::kFlash;
    } else {
      backend = cdt == DT::kF16 ? SdpaBackend::kEfficient : SdpaBackend::kMath;
    }
    // sdpa_attention_forward: grouped keys and values go to SDPA as they are (enable_gqa) when
    // there is no mask (use_gqa_in_sdpa); otherwise repeat_kv copies them to every head.
    if (kv != heads && explicit_mask_) {
      T k2 = Copy(g_, k, g_.Numel(k) * (heads / kv));
      g_.Drop(k);
      k = k2;
      T v2 = Copy(g_, v, g_.Numel(v) * (heads / kv));
      g_.Drop(v);
      v = v2;
      as.kv_heads = heads;
    }
    T qc = AutocastIn(g_, q), kc = AutocastIn(g_, k), vc = AutocastIn(g_, v);
    T mask;
    if (fam_.falcon_alibi) {
      // The float ALiBi mask, cast by SDPA's autocast kernel (a copy per call under autocast).
      mask = AutocastIn(g_, mask_);
    } else if (explicit_mask_ && backend != SdpaBackend::kFlash) {
      // The boolean mask made additive in the query's dtype for the fused kernel, per call.
      mask = g_.New(batch_ * seq_ * seq_, cdt, false);
    }
    out = Sdpa(g_, backend, qc, kc, vc, as, mask);
    g_.Drop(mask);
    g_.Drop(qc);
    g_.Drop(kc);
    g_.Drop(vc);
    if (backend == SdpaBackend::kMath) {
      T o2 = Copy(g_, out);  // transpose(1, 2).contiguous()
      g_.Drop(out);
      out = o2;
    }
  } else {
    // eager_attention_forward: repeat_kv, q @ k^T * scaling, + mask, softmax (fp32), cast back,
    // dropout, @ v, transpose(1, 2).contiguous().
    const Wide groups = heads / std::max<Wide>(kv, 1);
    T k2 = groups > 1 ? Copy(g_, k, g_.Numel(k) * groups) : g_.Alias(k);
    T v2 = groups > 1 ? Copy(g_, v, g_.Numel(v) * groups) : g_.Alias(v);
    T qc = AutocastIn(g_, q), kc = AutocastIn(g_, k2);
    g_.Drop(k2);
    T scores = g_.New(batch_ * heads * seq_ * seq_, g_.Dtype(qc), true);
    g_.Record(Graph::Spec("Matmul(qk)", {qc, kc}, {scores}, {qc, kc}));
    g_.Drop(qc);
    g_.Drop(kc);
    T scaled = Scale(g_, scores);
    g_.Drop(scores);
    if (a_.attn_softcap > 0) {
      // Gemma-2: scores / softcap, tanh, * softcap.
      T d1 = Scale(g_, scaled);
      g_.Drop(scaled);
      T th = Apply(g_, Unary::kTanh, d1);
      g_.Drop(d1);
      scaled = Scale(g_, th);
      g_.Drop(th);
    }
    T masked = Add(g_, scaled, mask_);
    g_.Drop(scaled);
    // Llama's: softmax(..., dtype=torch.float32).to(query.dtype); GPT-2's: softmax(...) (an fp32
    // op under autocast), .type(value.dtype).
    T probs = Softmax(g_, masked, fam_.probs_to_value ? g_.Dtype(masked) : DT::kF32);
    g_.Drop(masked);
    T pc = Cast(g_, probs, fam_.probs_to_value ? g_.Dtype(v2) : g_.Dtype(q));
    g_.Drop(probs);
    T dropped = Dropout(g_, pc, a_.attention_dropout);
    g_.Drop(pc);
    T pa = AutocastIn(g_, dropped), va = AutocastIn(g_, v2);
    g_.Drop(dropped);
    g_.Drop(v2);
    T o = g_.New(batch_ * heads * seq_ * d, g_.Dtype(pa), true);
    g_.Record(Graph::Spec("Matmul(pv)", {pa, va}, {o}, {pa, va}));
    g_.Drop(pa);
    g_.Drop(va);
    out = Copy(g_, o);
    g_.Drop(o);
  }
  g_.Drop(q);
  g_.Drop(k);
  g_.Drop(v);
  T o = LoraLinear(bp.at(TensorRole::kAttentionOut), out);
  g_.Drop(out);
  return o;
}

T ModelRun::TransformersMoe(const BlockParams& bp, T h) {
  // The sparse MoE block of Transformers >= 5 (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
  // Qwen3MoeSparseMoeBlock): the router (a Linear, softmax in fp32, top-k), then the experts
  // through integrations/moe.py grouped_mm_experts_forward: the tokens gathered k times in
  // expert order, one grouped matmul into gate and up, act(gate) * up, one into down, weighted,
  // gathered back and summed over k; Qwen2-MoE adds its shared expert behind a sigmoid gate.
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  T logits = Linear(g_, h, bp.router.w, T{}, hw, experts);
  T probs = Softmax(g_, logits, DT::kF32);
  g_.Drop(logits);
  T top = g_.New(tokens_ * k, DT::kF32, g_.RequiresGrad(probs));
  T top_idx = g_.New(tokens_ * k, DT::kI64, false);
  g_.Record(Graph::Spec("TopK", {probs}, {top}, {top_idx}));
  g_.Drop(probs);
  g_.Drop(top_idx);
  const Wide S = tokens_ * k;
  // expert_ids sort, perm // k, inv_perm: indices the gathers keep.
  T perm = g_.New(S, DT::kI64, false);
  T src = g_.New(S, DT::kI64, false);
  T inv = g_.New(S, DT::kI64, false);
  T offs = g_.New(experts, DT::kI32, false);
  T sel = g_.New(S * hw, g_.Dtype(h), g_.RequiresGrad(h));
  g_.Record(Graph::Spec("Index", {h}, {sel}, {src}));
  T weights = g_.New(S, g_.Dtype(top), g_.RequiresGrad(top));
  g_.Record(Graph::Spec("Index", {top}, {weights}, {perm}));
  g_.Drop(top);
  const bool gated = bp.expert.count(TensorRole::kExpertGateUp) > 0;
  const T w_in =
      gated ? bp.expert.at(TensorRole::kExpertGateUp) : bp.expert.at(TensorRole::kExpertUp);
  const Wide in_width = gated ? bp.expert_width.at(TensorRole::kExpertGateUp)
                              : bp.expert_width.at(TensorRole::kExpertUp);
  T proj = g_.New(S * in_width, g_.Dtype(sel), true);
  g_.Record(Graph::Spec("GroupedMm", {sel, w_in}, {proj}, {sel, offs}));
  g_.Drop(sel);
  T act;
  if (gated) {
    T gate = Slice(g_, proj, g_.Numel(proj) / 2);
    T up = Slice(g_, proj, g_.Numel(proj) / 2);
    T ag = Activation(gate);
    g_.Drop(gate);
    act = Mul(g_, ag, up);
    g_.Drop(ag);
    g_.Drop(up);
  } else {
    act = Activation(proj);
  }
  g_.Drop(proj);
  const T w_out = bp.expert.at(TensorRole::kExpertDown);
  T down = g_.New(S * hw, g_.Dtype(act), true);
  g_.Record(Graph::Spec("GroupedMm", {act, w_out}, {down}, {act, offs}));
  g_.Drop(act);
  g_.Drop(offs);
  T weighted = Mul(g_, down, weights);
  g_.Drop(down);
  g_.Drop(weights);
  T back = g_.New(S * hw, g_.Dtype(weighted), true);
  g_.Record(Graph::Spec("Index", {weighted}, {back}, {inv}));
  g_.Drop(weighted);
  T out = g_.New(tokens_ * hw, g_.Dtype(back), true);
  g_.Record(Graph::Spec("Sum", {back}, {out}));
  g_.Drop(back);
  g_.Drop(perm);
  g_.Drop(src);
  g_.Drop(inv);
  if (bp.has(TensorRole::kMlpDown)) {
    // The shared expert: a dense MLP every token passes, Qwen2-MoE's behind sigmoid(gate(x)).
    T shared = TransformersMlp(bp, h);
    if (bp.has(TensorRole::kSharedExpertGate)) {
      T gl = LoraLinear(bp.at(TensorRole::kSharedExpertGate), h);
      T sg = Apply(g_, Unary::kSigmoid, gl);
      g_.Drop(gl);
      T gated_shared = Mul(g_, sg, shared);
      g_.Drop(sg);
      g_.Drop(shared);
      shared = gated_shared;
    }
    T sum = Add(g_, out, shared);
    g_.Drop(out);
    g_.Drop(shared);
    out = sum;
  }
  return out;
}

T ModelRun::TransformersMlp(const BlockParams& bp, T h) {
  if (bp.has(TensorRole::kMlpGateUp)) {
    // Phi3MLP.forward: gate, up = gate_up_proj(x).chunk(2); down_proj(up * act(gate)).
    T gu = LoraLinear(bp.at(TensorRole::kMlpGateUp), h);
    T gate = Slice(g_, gu, g_.Numel(gu) / 2);
    T up = Slice(g_, gu, g_.Numel(gu) / 2);
    g_.Drop(gu);
    T ag = Activation(gate);
    g_.Drop(gate);
    T m = Mul(g_, up, ag);
    g_.Drop(ag);
    g_.Drop(up);
    T down = LoraLinear(bp.at(TensorRole::kMlpDown), m);
    g_.Drop(m);
    return down;
  }
  if (fam_.gated) {
    // LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)).
    T gate = LoraLinear(bp.at(TensorRole::kMlpGate), h);
    T ag = Activation(gate);
    g_.Drop(gate);
    T up = LoraLinear(bp.at(TensorRole::kMlpUp), h);
    T m = Mul(g_, ag, up);
    g_.Drop(ag);
    g_.Drop(up);
    T down = LoraLinear(bp.at(TensorRole::kMlpDown), m);
    g_.Drop(m);
    return down;
  }
  // fc1 / c_fc / dense_h_to_4h, the activation, fc2 / c_proj / dense_4h_to_h.
  T up = LoraLinear(bp.at(TensorRole::kMlpUp), h);
  T a = Activation(up);
  g_.Drop(up);
  T down = LoraLinear(bp.at(TensorRole::kMlpDown), a);
  g_.Drop(a);
  return down;
}

T ModelRun::TransformersDecoderBlock(int layer, T x) {
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const double p = fam_.resid_dropout;
  auto dropped = [&](T t) {
    T d = Dropout(g_, t, p);
    g_.Drop(t);
    return d;
  };
  switch (fam_.layout) {
    case Family::Layout::kSequential: {
      // LlamaDecoderLayer.forward: x + attn(norm(x)), then + mlp(norm(.)); GPT-2, OPT and
      // Starcoder2 drop out each branch's output first.
      T h = NormAny(bp.norms[0], x);
      T attn = dropped(TransformersAttention(layer, bp, h));
      g_.Drop(h);
      T x2 = Add(g_, x, attn);
      g_.Drop(attn);
      T h2 = NormAny(bp.norms[1], x2);
      T m = dropped(bp.expert.empty() ? TransformersMlp(bp, h2) : TransformersMoe(bp, h2));
      g_.Drop(h2);
      T out = Add(g_, x2, m);
      g_.Drop(m);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kSandwich: {
      // Gemma2DecoderLayer / Gemma3DecoderLayer: norms before and after each branch.
      T h = NormAny(bp.norms[0], x);
      T attn = TransformersAttention(layer, bp, h);
      g_.Drop(h);
      T an = NormAny(bp.norms[1], attn);
      g_.Drop(attn);
      T x2 = Add(g_, x, an);
      g_.Drop(an);
      T h2 = NormAny(bp.norms[2], x2);
      T m = TransformersMlp(bp, h2);
      g_.Drop(h2);
      T mn = NormAny(bp.norms[3], m);
      g_.Drop(m);
      T out = Add(g_, x2, mn);
      g_.Drop(mn);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kPostNorm: {
      // Olmo2DecoderLayer: x + post_attention_layernorm(attn(x)), then + post_feedforward
      // norm of mlp(.).
      T attn = TransformersAttention(layer, bp, x);
      T an = NormAny(bp.norms[0], attn);
      g_.Drop(attn);
      T x2 = Add(g_, x, an);
      g_.Drop(an);
      T m = TransformersMlp(bp, x2);
      T mn = NormAny(bp.norms[1], m);
      g_.Drop(m);
      T out = Add(g_, x2, mn);
      g_.Drop(mn);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kParallel: {
      // PhiDecoderLayer, GPTJBlock: attention and MLP read the same norm of x;
      // attn + mlp + residual.
      T h = NormAny(bp.norms[0], x);
      T attn = dropped(TransformersAttention(layer, bp, h));
      T m = dropped(TransformersMlp(bp, h));
      g_.Drop(h);
      T s1 = Add(g_, attn, m);
      g_.Drop(attn);
      g_.Drop(m);
      T out = Add(g_, s1, x);
      g_.Drop(s1);
      return out;
    }
    case Family::Layout::kParallelTwoNorms: {
      // GPTNeoXLayer with use_parallel_residual: mlp(ln2(x)) + attn(ln1(x)) + x.
      T h = NormAny(bp.norms[0], x);
      T attn = dropped(TransformersAttention(layer, bp, h));
      g_.Drop(h);
      T h2 = NormAny(bp.norms[1], x);
      T m = dropped(TransformersMlp(bp, h2));
      g_.Drop(h2);
      T s1 = Add(g_, m, attn);
      g_.Drop(attn);
      g_.Drop(m);
      T out = Add(g_, s1, x);
      g_.Drop(s1);
      return out;
    }
  }
  return g_.Alias(x);
}

T ModelRun::CausalLmLoss(T hidden) {
  const Wide vocab = static_cast<Wide>(a_.vocab);
  const Wide h = static_cast<Wide>(a_.hidden);
  T logits = Linear(g_, hidden, head_, head_bias_, h, vocab);
  g_.SetPhase(StepPhase::kLoss);
  if (a_.final_softcap > 0) {
    // Gemma-2: logits / final_logit_softcapping, tanh, * final_logit_softcapping.
    T d1 = Scale(g_, logits);
    g_.Drop(logits);
    T th = Apply(g_, Unary::kTanh, d1);
    g_.Drop(d1);
    logits = Scale(g_, th);
    g_.Drop(th);
  }
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  // ForCausalLMLoss: logits.float(), labels padded and shifted, cross_entropy.
  T up = Cast(g_, logits, DT::kF32);
  T labels = g_.New(batch_ * (seq_ + 1), DT::kI64, false);
  T loss = CrossEntropy(g_, up, tokens_, vocab);
  g_.Drop(up);
  g_.Drop(labels);
  // The training loop keeps `.loss` only: the output (logits, cache) goes.
  g_.Drop(logits);
  return loss;
}

Status ModelRun::CheckFamily() const {
  auto missing = [&](const std::string& what) {
    return Status::Unimplemented(inv_.name + ": the step model expects " + what + " in every " +
                                 "block of a " + inv_.model_type + " model");
  };
  for (const BlockParams& bp : blocks_) {
    const bool fused = bp.has(TensorRole::kAttentionQkv);
    if (!fused && !(bp.has(TensorRole::kAttentionQ) && bp.has(TensorRole::kAttentionK) &&
                    bp.has(TensorRole::kAttentionV))) {
      return missing("query, key and value projections");
    }
    if (!bp.has(TensorRole::kAttentionOut)) return missing("an attention output projection");
    if (!bp.expert.empty()) {
      if (!bp.router.w.ok() || bp.expert.count(TensorRole::kExpertDown) == 0 ||
          (bp.expert.count(TensorRole::kExpertGateUp) == 0 &&
           bp.expert.count(TensorRole::kExpertUp) == 0)) {
        return missing("fused experts (gate_up_proj, down_proj) and a router");
      }
    } else if (!bp.experts.empty()) {
      return missing("experts fused as Transformers >= 5 builds them (not one Linear each)");
    } else if (!bp.has(TensorRole::kMlpDown)) {
      return missing("an MLP (dense or mixture of experts)");
    }
    if (bp.expert.empty() && !bp.has(TensorRole::kMlpGateUp) &&
        !(bp.has(TensorRole::kMlpUp) && (!fam_.gated || bp.has(TensorRole::kMlpGate)))) {
      return missing("the MLP's input projections");
    }
    size_t norms = 2;
    if (fam_.layout == Family::Layout::kSandwich) norms = 4;
    if (fam_.layout == Family::Layout::kParallel) norms = 1;
    if (bp.norms.size() < norms) return missing(std::to_string(norms) + " norms");
  }
  return Status::Ok();
}

Result<T> ModelRun::ForwardAndLoss() {
  switch (s_.framework) {
    case Framework::kTransformers: return TransformersForward();
    case Framework::kTorchtune: return TorchtuneForward();
    case Framework::kLitGpt: return LitGptForward();
    default: break;
  }
  return Status::Unimplemented("the step model does not run " +
                               std::string(FrameworkName(s_.framework)) + " yet");
}

Result<T> ModelRun::TransformersForward() {
  auto type_is = [&](const char* t) { return inv_.model_type == t; };
  if (!a_.causal || a_.encoder_decoder || a_.kv_lora_rank > 0 || type_is("gpt_oss") ||
      (a_.alibi && !fam_.bloom_attention && !fam_.falcon_alibi)) {
    return Status::Unimplemented("the step model runs Transformers' dense decoder LMs so far");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  const bool ckpt = s_.checkpointing == Checkpointing::kFull;
  use_cache_ = a_.use_cache && !ckpt;
  explicit_mask_ = ckpt && s_.flash_attention;
  const Wide h = static_cast<Wide>(a_.hidden);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  if (fam_.embedding_scale) {
    // GemmaModel: hidden_states * normalizer (a 0-dim tensor of the hidden states' dtype).
    T normalizer = g_.New(1, g_.Dtype(x), false);
    T xs = Mul(g_, x, normalizer);
    g_.Drop(normalizer);
    g_.Drop(x);
    x = xs;
  }
  if (fam_.learned_positions && position_embedding_.ok()) {
    // GPT-2 / OPT: inputs_embeds + position embeddings.
    T pos = Embedding(g_, position_embedding_, tokens_, h, pdt_);
    T xs = Add(g_, x, pos);
    g_.Drop(pos);
    g_.Drop(x);
    x = xs;
  }
  if (fam_.embedding_norm && final_norms_.size() >= 2) {
    // BloomModel: word_embeddings_layernorm(inputs_embeds).
    T xn = NormAny(final_norms_[0], x);
    g_.Drop(x);
    x = xn;
  }
  if (fam_.embedding_dropout > 0) {
    T xd = Dropout(g_, x, fam_.embedding_dropout);
    g_.Drop(x);
    x = xd;
  }
  if (ckpt) {
    // activation_checkpointing_enable -> enable_input_require_grads: the embedding output
    // requires grad (matters when the embedding is frozen, as with LoRA).
    g_.SetRequiresGrad(x, true);
  }
  if (fam_.rotary) {
    // The rotary embedding's forward: cos and sin (seq x rotary dims) in fp32, cast to x's dtype.
    const Wide d = fam_.rotary_dims > 0 ? fam_.rotary_dims : static_cast<Wide>(a_.head_dim);
    T c32 = g_.New(seq_ * d, DT::kF32, false);
    T s32 = g_.New(seq_ * d, DT::kF32, false);
    cos_ = Cast(g_, c32, g_.Dtype(x));
    sin_ = Cast(g_, s32, g_.Dtype(x));
    g_.Drop(c32);
    g_.Drop(s32);
  }
  if (fam_.falcon_alibi) {
    // FalconModel.forward: ALiBi slopes x positions / sqrt(head_dim), masked, as one float mask
    // (batch x heads x seq x seq) in the embeddings' dtype for every layer.
    explicit_mask_ = true;
    mask_ = g_.New(batch_ * static_cast<Wide>(a_.heads) * seq_ * seq_, g_.Dtype(x), false);
  } else if (!s_.flash_attention || explicit_mask_ || fam_.bloom_attention) {
    // The causal mask: boolean for SDPA, additive in the hidden states' dtype for eager.
    const bool boolean = s_.flash_attention && !fam_.bloom_attention;
    mask_ = g_.New(batch_ * seq_ * seq_, boolean ? DT::kBool : g_.Dtype(x), false);
  }
  for (int64_t i = 0; i < a_.layers; ++i) {
    g_.SetWhere("layer " + std::to_string(i));
    T next = RunBlock(static_cast<int>(i), x);
    g_.Drop(x);
    x = next;
  }
  g_.SetWhere("final norm");
  T hn = final_norms_.empty() ? g_.Alias(x) : NormAny(final_norms_.back(), x);
  g_.Drop(x);
  g_.Drop(cos_);
  g_.Drop(sin_);
  g_.Drop(mask_);
  g_.SetWhere("lm_head");
  T loss = CausalLmLoss(hn);
  g_.Drop(hn);
  g_.ClearAutocastCache();
  for (T c : cache_) g_.Drop(c);
  cache_.clear();
  return loss;
}

// --- torchtune ------------------------------------------------------------------------------

T ModelRun::TorchtuneRmsNorm(const Norm& n, T x) {
  // torchtune/modules/rms_norm.py: F.rms_norm(x.float(), weight=self.scale).to(x.dtype); the
  // fused kernel keeps its (fp32) input and an fp32 rstd per row.
  const DT in = g_.Dtype(x);
  T xf = Cast(g_, x, DT::kF32);
  T y = FusedRmsNorm(g_, xf, n.w, n.width);
  g_.Drop(xf);
  T out = Cast(g_, y, in);
  g_.Drop(y);
  return out;
}

T ModelRun::TorchtuneRope(T x) {
  // RotaryPositionalEmbeddings.forward (torchtune/modules/position_embeddings.py): x.float()
  // reshaped in pairs, multiplied with the cache (a buffer), stacked, flattened, type_as(x).
  // Only the cache is saved.
  T xf = Cast(g_, x, DT::kF32);
  T st = g_.New(g_.Numel(x), DT::kF32, g_.RequiresGrad(xf));
  g_.Record(Graph::Spec("Rope", {xf}, {st}));
  g_.Drop(xf);
  T out = Cast(g_, st, g_.Dtype(x));
  g_.Drop(st);
  return out;
}

T ModelRun::TorchtuneLinear(const Lin& l, T x) {
  T out;
  if (quantized_base_ && !g_.RequiresGrad(l.w)) {
    // LoRALinear with quantize_base / FrozenNF4Linear: torchao's LinearNF4 keeps the NF4
    // weight only; the weight is dequantized to the input's dtype for the matmul (and again in
    // backward).
    T wd = g_.New(l.in * l.out, g_.Dtype(x), false);
    out = g_.New(g_.Numel(x) / std::max<Wide>(l.in, 1) * l.out, g_.Dtype(x), g_.RequiresGrad(x));
    Graph::NodeSpec spec = Graph::Spec("LinearNF4", {x}, {out});
    spec.extra = {{l.in * l.out, g_.Dtype(x)}};
    g_.Record(std::move(spec));
    g_.Drop(wd);
  } else {
    out = Linear(g_, x, l.w, l.b, l.in, l.out);
  }
  if (!l.lora_a.ok()) return out;
  // LoRALinear.forward: out + (alpha / rank) * lora_b(lora_a(dropout(x))), dropout 0.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  T ya = Linear(g_, x, l.lora_a, T{}, l.in, r);
  T yb = Linear(g_, ya, l.lora_b, T{}, r, l.out);
  g_.Drop(ya);
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, out, ys);
  g_.Drop(out);
  g_.Drop(ys);
  return sum;
}

// --- Shared by the torchtune and LitGPT blocks, which call SDPA at query width ----------------

void ModelRun::ExpandKvToQueryHeads(Wide heads, Wide kv, T* k, T* v) {
  // Grouped-query attention repeated in Python before SDPA (torchtune's expand + flatten, LitGPT's
  // repeat_interleave): k and v copied at query width.
  if (kv == heads) return;
  for (T* t : {k, v}) {
    T wide = Copy(g_, *t, g_.Numel(*t) * (heads / kv));
    g_.Drop(*t);
    *t = wide;
  }
}

AttentionShape ModelRun::CausalShapeAtQueryWidth(Wide heads, Wide d) const {
  AttentionShape as;
  as.batch = batch_;
  as.heads = as.kv_heads = heads;
  as.seq = as.kv_seq = seq_;
  as.head_dim = as.v_head_dim = d;
  return as;
}

SdpaBackend ModelRun::CausalSdpaBackend(DT compute) const {
  // What SDPA's dispatcher picks for a causal call without a mask: fp32 runs the
  // memory-efficient kernel; half precision cuDNN on Hopper, flash from Ampere.
  const int sm = s_.GpuSm();
  return !Half(compute)         ? SdpaBackend::kEfficient
         : sm >= 90 && sm < 110 ? SdpaBackend::kCudnn
         : sm >= 80             ? SdpaBackend::kFlash
                                : SdpaBackend::kEfficient;
}

T ModelRun::TorchtuneBlock(int layer, T x) {
  // TransformerSelfAttentionLayer.forward: h = attn(sa_norm(x)) + x; h + mlp(mlp_norm(h)).
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T h = TorchtuneRmsNorm(bp.norms[0], x);
  // MultiHeadAttention.forward (torchtune/modules/attention.py).
  T q0 = TorchtuneLinear(bp.at(TensorRole::kAttentionQ), h);
  T q = TorchtuneRope(q0);
  g_.Drop(q0);
  T k0 = TorchtuneLinear(bp.at(TensorRole::kAttentionK), h);
  T v = TorchtuneLinear(bp.at(TensorRole::kAttentionV), h);
  g_.Drop(h);
  T k = TorchtuneRope(k0);
  g_.Drop(k0);
  // k.unsqueeze(2).expand(...).flatten(1, 2): copies at query width.
  ExpandKvToQueryHeads(heads, kv, &k, &v);
  const AttentionShape as = CausalShapeAtQueryWidth(heads, d);
  T att = Sdpa(g_, CausalSdpaBackend(g_.Dtype(q)), q, k, v, as, T{});
  g_.Drop(q);
  g_.Drop(k);
  g_.Drop(v);
  T o = TorchtuneLinear(bp.at(TensorRole::kAttentionOut), att);
  g_.Drop(att);
  T x2 = Add(g_, o, x);
  g_.Drop(o);
  // FeedForward.forward: w2(silu(w1(x)) * w3(x)).
  T h2 = TorchtuneRmsNorm(bp.norms[1], x2);
  T g1 = TorchtuneLinear(bp.at(TensorRole::kMlpGate), h2);
  T a = Apply(g_, Unary::kSilu, g1);
  g_.Drop(g1);
  T u = TorchtuneLinear(bp.at(TensorRole::kMlpUp), h2);
  g_.Drop(h2);
  T m = Mul(g_, a, u);
  g_.Drop(a);
  g_.Drop(u);
  T down = TorchtuneLinear(bp.at(TensorRole::kMlpDown), m);
  g_.Drop(m);
  T out = Add(g_, x2, down);
  g_.Drop(down);
  g_.Drop(x2);
  return out;
}

Result<T> ModelRun::TorchtuneForward() {
  if (!a_.causal || a_.encoder_decoder || a_.experts > 0 || !a_.gated_mlp || a_.rotary_dims == 0) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs torchtune's dense decoders (Llama, Qwen2, "
                                 "Mistral-shaped) only");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  for (int64_t i = 0; i < a_.layers; ++i) {
    g_.SetWhere("layer " + std::to_string(i));
    T next = RunBlock(static_cast<int>(i), x);
    g_.Drop(x);
    x = next;
  }
  g_.SetWhere("final norm");
  T hn = TorchtuneRmsNorm(final_norms_.back(), x);
  g_.Drop(x);
  g_.SetWhere("output");
  const Lin head{head_, head_bias_, h, vocab, T{}, T{}};
  // The recipe's _loss_step: labels shifted (hstack with the ignore cache), the loss, del
  // logits.
  T labels = g_.New(tokens_, DT::kI64, false);
  T loss;
  if (s_.loss == Loss::kChunked) {
    // TransformerDecoder.chunked_output: the output projection per chunk of the sequence;
    // CEWithChunkedOutputLoss: each chunk's logits.float() into cross_entropy (sum).
    const Wide chunks = static_cast<Wide>(s_.loss_chunks > 0 ? s_.loss_chunks : 8);
    std::vector<T> logits;
    for (Wide c = 0; c < chunks; ++c) {
      T part = Slice(g_, hn, g_.Numel(hn) / chunks);
      logits.push_back(Linear(g_, part, head.w, head.b, h, vocab));
      g_.Drop(part);
    }
    g_.SetPhase(StepPhase::kLoss);  // the model's forward returns
    g_.Drop(hn);
    for (T lc : logits) {
      T up = Cast(g_, lc, DT::kF32);
      T l = CrossEntropy(g_, up, tokens_ / chunks, vocab);
      g_.Drop(up);
      if (!loss.ok()) {
        loss = l;
      } else {
        T sum = Add(g_, loss, l);
        g_.Drop(loss);
        g_.Drop(l);
        loss = sum;
      }
    }
    for (T lc : logits) g_.Drop(lc);
  } else {
    // TransformerDecoder.unembed: self.output(h).float().
    T lg = Linear(g_, hn, head.w, head.b, h, vocab);
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    T up = Cast(g_, lg, DT::kF32);
    g_.Drop(lg);
    loss = CrossEntropy(g_, up, tokens_, vocab);
    g_.Drop(up);
  }
  g_.Drop(labels);
  return loss;
}

// --- LitGPT ---------------------------------------------------------------------------------

T ModelRun::LitGptRmsNorm(const Norm& n, T x) {
  // litgpt/model.py RMSNorm.forward:
  //   x = x.float(); norm_x = torch.mean(x * x, dim=-1, keepdim=True)
  //   x_normed = x * torch.rsqrt(norm_x + eps); return (x_normed * weight.float()).to(dtype)
  const DT in = g_.Dtype(x);
  T xf = Cast(g_, x, DT::kF32);
  T sq = Mul(g_, xf, xf);
  T mean = MeanRows(g_, sq, n.width);
  g_.Drop(sq);
  T eps = Scale(g_, mean);
  g_.Drop(mean);
  T r = Apply(g_, Unary::kRsqrt, eps);
  g_.Drop(eps);
  T xn = Mul(g_, xf, r);
  g_.Drop(xf);
  g_.Drop(r);
  T wf = Cast(g_, n.w, DT::kF32);
  T y = Mul(g_, xn, wf);
  g_.Drop(xn);
  g_.Drop(wf);
  T out = Cast(g_, y, in);
  g_.Drop(y);
  return out;
}

T ModelRun::LitGptLinear(const Lin& l, T x, bool qkv) {
  T out = Linear(g_, x, l.w, l.b, l.in, l.out);
  if (!l.lora_a.ok()) return out;
  // LoRALinear / LoRAQKVLinear.forward (litgpt/lora.py): lora_dropout(x), lora_A, lora_B (a
  // grouped conv1d for the fused query/key/value), zero_pad's index_copy_ into a zeroed
  // full-width tensor when only some of q/k/v are adapted, * scaling, + pretrained.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  const int parts = qkv ? (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0) : 1;
  const Wide q = static_cast<Wide>(a_.heads * a_.head_dim);
  const Wide kvw = static_cast<Wide>(a_.kv_heads * a_.head_dim);
  const Wide enabled_out =
      qkv ? (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0) : l.out;
  T xd = Dropout(g_, x, s_.LoraDropout());
  T ya = Linear(g_, xd, l.lora_a, T{}, l.in, r * static_cast<Wide>(parts));
  g_.Drop(xd);
  T yb = Linear(g_, ya, l.lora_b, T{}, r * static_cast<Wide>(parts), enabled_out);
  g_.Drop(ya);
  if (qkv && enabled_out != l.out) {
    T padded = g_.New(g_.Numel(yb) / std::max<Wide>(enabled_out, 1) * l.out, g_.Dtype(yb), true);
    g_.Record(Graph::Spec("IndexCopy", {yb}, {padded}));
    g_.Drop(yb);
    yb = padded;
  }
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, out, ys);
  g_.Drop(out);
  g_.Drop(ys);
  return sum;
}

T ModelRun::LitGptBlock(int layer, T x) {
  // litgpt/model.py Block.forward and CausalSelfAttention.forward.
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  auto norm = [&](const Norm& n, T t) {
    return a_.norm_upcasts ? LitGptRmsNorm(n, t) : LayerNorm(g_, t, n.w, n.b, n.width);
  };
  T xn = norm(bp.norms[0], x);
  T qkv = LitGptLinear(litgpt_qkv_[static_cast<size_t>(layer)], xn, true);
  T q = Slice(g_, qkv, tokens_ * heads * d);
  T k = Slice(g_, qkv, tokens_ * kv * d);
  T v = Slice(g_, qkv, tokens_ * kv * d);
  g_.Drop(qkv);
  // apply_rope over q[..., :rope_n_elem] (roped.to(dtype=x.dtype)), then
  // torch.cat((q_roped, q[..., rope_n_elem:])): a copy even when the whole head is roped.
  auto rope = [&](T t) {
    T r = ApplyRotary(t);
    T rc = Cast(g_, r, g_.Dtype(t));
    g_.Drop(r);
    T full = Copy(g_, rc);
    g_.Drop(rc);
    return full;
  };
  T qr = rope(q);
  g_.Drop(q);
  T kr = rope(k);
  g_.Drop(k);
  // k.repeat_interleave(q_per_kv, dim=1), v too.
  ExpandKvToQueryHeads(heads, kv, &kr, &v);
  const AttentionShape as = CausalShapeAtQueryWidth(heads, d);
  const SdpaBackend backend = CausalSdpaBackend(autocast_ ? adt_ : g_.Dtype(qr));
  T qc = AutocastIn(g_, qr), kc = AutocastIn(g_, kr), vc = AutocastIn(g_, v);
  g_.Drop(qr);
  g_.Drop(kr);
  g_.Drop(v);
  T y = Sdpa(g_, backend, qc, kc, vc, as, T{});
  g_.Drop(qc);
  g_.Drop(kc);
  g_.Drop(vc);
  T att = LitGptLinear(bp.at(TensorRole::kAttentionOut), y, false);
  g_.Drop(y);
  auto mlp = [&](T hin) {
    if (bp.has(TensorRole::kMlpGate)) {
      // LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x)).
      T f1 = LitGptLinear(bp.at(TensorRole::kMlpGate), hin, false);
      T f2 = LitGptLinear(bp.at(TensorRole::kMlpUp), hin, false);
      T a = Apply(g_, Unary::kSilu, f1);
      g_.Drop(f1);
      T m = Mul(g_, a, f2);
      g_.Drop(a);
      g_.Drop(f2);
      T o = LitGptLinear(bp.at(TensorRole::kMlpDown), m, false);
      g_.Drop(m);
      return o;
    }
    // GptNeoxMLP: proj(gelu(fc(x))).
    T f = LitGptLinear(bp.at(TensorRole::kMlpUp), hin, false);
    T a = Apply(g_, Unary::kGelu, f);
    g_.Drop(f);
    T o = LitGptLinear(bp.at(TensorRole::kMlpDown), a, false);
    g_.Drop(a);
    return o;
  };
  T out;
  if (fam_.layout == Family::Layout::kParallelTwoNorms) {
    // parallel_residual: mlp(norm_2(x)) + attention_output + x.
    g_.Drop(xn);
    T h2 = norm(bp.norms[1], x);
    T m = mlp(h2);
    g_.Drop(h2);
    T s1 = Add(g_, m, att);
    g_.Drop(m);
    g_.Drop(att);
    out = Add(g_, s1, x);
    g_.Drop(s1);
  } else {
    g_.Drop(xn);
    T x2 = Add(g_, att, x);
    g_.Drop(att);
    T h2 = norm(bp.norms[1], x2);
    T m = mlp(h2);
    g_.Drop(h2);
    out = Add(g_, m, x2);
    g_.Drop(m);
    g_.Drop(x2);
  }
  return out;
}

Result<T> ModelRun::LitGptForward() {
  if (!a_.causal || a_.encoder_decoder || a_.experts > 0 || a_.rotary_dims == 0) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs LitGPT's dense rotary GPTs (Llama, "
                                 "Mistral, Pythia-shaped) only");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  // cos and sin: slices of the model's fp32 buffers (no memory of their own).
  const Wide rd = static_cast<Wide>(a_.rotary_dims);
  cos_ = g_.External(seq_ * rd, DT::kF32);
  sin_ = g_.External(seq_ * rd, DT::kF32);
  for (int64_t i = 0; i < a_.layers; ++i) {
    g_.SetWhere("layer " + std::to_string(i));
    T next = RunBlock(static_cast<int>(i), x);
    g_.Drop(x);
    x = next;
  }
  g_.SetWhere("final norm");
  const Norm& ln_f = final_norms_.back();
  T hn = a_.norm_upcasts ? LitGptRmsNorm(ln_f, x) : LayerNorm(g_, x, ln_f.w, ln_f.b, ln_f.width);
  g_.Drop(x);
  g_.SetWhere("lm_head");
  T loss;
  std::vector<T> fp32;
  if (s_.loss == Loss::kChunked) {
    // GPT.forward(lm_head_chunk_size=128): the head per 128 positions; Fabric's precision plugin
    // converts each output to fp32 (convert_output); chunked_cross_entropy per chunk (the last
    // one sliced by one position, a copy).
    // loss_chunks counts chunks (TrainingSetup); LitGPT's own is 128 positions a chunk.
    const Wide chunk = s_.loss_chunks > 0
                           ? std::max<Wide>(1, (seq_ + static_cast<Wide>(s_.loss_chunks) - 1) /
                                                   static_cast<Wide>(s_.loss_chunks))
                           : 128;
    const Wide chunks = (seq_ + chunk - 1) / chunk;
    std::vector<T> bf;
    for (Wide c = 0; c < chunks; ++c) {
      const Wide rows = batch_ * std::min(chunk, seq_ - c * chunk);
      T part = Slice(g_, hn, rows * h);
      bf.push_back(Linear(g_, part, head_, head_bias_, h, vocab));
      g_.Drop(part);
    }
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    for (T b : bf) {
      fp32.push_back(Cast(g_, b, DT::kF32));
      g_.Drop(b);
    }
    for (size_t c = 0; c < fp32.size(); ++c) {
      T in = c + 1 == fp32.size() ? Copy(g_, fp32[c]) : g_.Alias(fp32[c]);
      T l = CrossEntropy(g_, in, g_.Numel(in) / vocab, vocab);
      g_.Drop(in);
      if (!loss.ok()) {
        loss = l;
      } else {
        T sum = Add(g_, loss, l);
        g_.Drop(loss);
        g_.Drop(l);
        loss = sum;
      }
    }
  } else {
    T lg = Linear(g_, hn, head_, head_bias_, h, vocab);
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    fp32.push_back(Cast(g_, lg, DT::kF32));
    g_.Drop(lg);
    // logits[..., :-1, :].reshape(-1, V): a copy, then cross_entropy.
    T in = Copy(g_, fp32[0], batch_ * (seq_ - 1) * vocab);
    loss = CrossEntropy(g_, in, batch_ * (seq_ - 1), vocab);
    g_.Drop(in);
  }
  for (T f : fp32) g_.Drop(f);
  g_.ClearAutocastCache();
  return loss;
}

}  // namespace memplan::estimator::step
