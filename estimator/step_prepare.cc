// ModelRun::Prepare (Note [The step model] in step_model.h): the model's parameters laid out from
// the inventory as the framework builds them (tied aliases, LoRA adapters, LitGPT's fused qkv,
// QLoRA's storage), the Transformers family's block description, and the model states' bytes.
// Each stage below is one step of Prepare, in the order it runs them: the order of the graph's
// parameters is part of the result.
#include <algorithm>
#include <initializer_list>
#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "estimator/step_blocks.h"
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

// The stages in order; each names what it fills.
Status ModelRun::Prepare() {
  MEMPLAN_RETURN_IF_ERROR(CheckRunnable());
  ChooseDtypes();
  MEMPLAN_RETURN_IF_ERROR(LayOutParameters());
  const bool lora = s_.lora_rank > 0;
  // LoRA adapters: PEFT builds lora_A / lora_B in fp32 (autocast_adapter_dtype) beside the base.
  AdapterMap adapters;
  std::vector<Wide> adapter_bytes;
  if (lora) MEMPLAN_RETURN_IF_ERROR(MakeAdapters(&adapters, &adapter_bytes));
  AssignBlockParameters(adapters);
  // torchtitan's Llama 3 holds query, key and value as one Linear (wqkv) too.
  if (s_.framework == Framework::kLitGpt || s_.framework == Framework::kTorchtitan) {
    FuseLitGptQkv(&adapter_bytes);
  }
  ChooseFamily();
  if (s_.torch_compile) {
    // Note [torch.compile as an upper bound]
    // Inductor's partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_
    // partition) chooses what the compiled forward saves for backward by a minimum cut over
    // what eager autograd would save, recomputing the cheap pointwise ops instead, and fuses the
    // temporaries between them away; what it saves is at most about what eager saves. The step
    // model runs the eager code, so for a compiled model its figures are an upper bound:
    // torchtune's published Llama-3.1-8B LoRA run on one RTX 4090 (2 x 2048, checkpointing on)
    // peaks at 16.2 GiB compiled, where its eager trace allocates 19.4.
    notes_.push_back(
        "torch.compile: run as the eager code, an upper bound (Inductor saves at most about what "
        "eager autograd saves and fuses temporaries away; torchtune's 8B LoRA run on an RTX "
        "4090: 16.2 GiB compiled, 19.4 GiB eager)");
  }
  if (EncoderMaskedLm()) MEMPLAN_RETURN_IF_ERROR(PrepareEncoder(adapters));
  if (T5ConditionalGeneration()) MEMPLAN_RETURN_IF_ERROR(PrepareT5(adapters));
  if (!embedding_.ok()) {
    return Status::Unimplemented(inv_.name + ": the step model found no token embedding");
  }
  if (!head_.ok() && (inv_.model_class == "causal_lm")) {
    return Status::Unimplemented(inv_.name + ": the step model found no output head");
  }
  CountOptimizerGroups(adapter_bytes);
  CountModelStates(adapter_bytes);
  if (s_.framework == Framework::kTorchtitan) PrepareTorchtitan();
  return Status::Ok();
}

Status ModelRun::CheckRunnable() const {
  // What the step model does not run yet is refused, never run as something else.
  if (s_.checkpointing == Checkpointing::kSelective ||
      (s_.checkpointing == Checkpointing::kOp && s_.framework != Framework::kTorchtitan)) {
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
  // QLoRA's base is torchao's NF4 under torchtune only; bitsandbytes' Linear4bit (PEFT, LitGPT's
  // bnb.nf4) dequantizes into copies of its own (MatMul4Bit) that a frozen Linear would miss.
  if (s_.qlora && s_.lora_rank > 0 && s_.framework != Framework::kTorchtune) {
    return Status::Unimplemented(
        "the step model runs QLoRA as torchtune's torchao NF4 only; it does not run "
        "bitsandbytes' 4-bit Linear (PEFT, LitGPT's bnb.nf4) yet");
  }
  // What TransformersForward refuses from the architecture alone, refused before the parameters
  // of a large model (DeepSeek-V3's 47,000 tensors) are laid out for nothing.
  // Transformers' MptForCausalLM (always ALiBi, whatever attn_config says) is not modelled: an
  // MPT without ALiBi must not run as a generic decoder.
  if (s_.framework == Framework::kTransformers && !EncoderMaskedLm() &&
      !T5ConditionalGeneration() &&
      (!a_.causal || a_.encoder_decoder ||
       (a_.kv_lora_rank > 0 &&
        ((inv_.model_type != "deepseek_v2" && inv_.model_type != "deepseek_v3") ||
         !a_.block_options.empty())) ||
       inv_.model_type == "mpt")) {
    return Status::Unimplemented(
        "the step model runs Transformers' decoder LMs (DeepSeek-V2's and V3's latent attention "
        "and gpt-oss included), encoder masked LMs and sequence and token classifiers (BERT, "
        "RoBERTa, XLM-RoBERTa, DistilBERT) and T5ForConditionalGeneration so far");
  }
  // Options of a block that add ops without adding tensors (OLMoE's clip_qkv), which the family
  // reader records (ArchitectureInfo::block_options) and no Transformers block here runs.
  if (s_.framework == Framework::kTransformers && !a_.block_options.empty()) {
    std::string names;
    for (const std::string& o : a_.block_options) names += (names.empty() ? "" : ", ") + o;
    return Status::Unimplemented(inv_.name + ": the step model does not run " + inv_.model_type +
                                 "'s " + names + " yet");
  }
  // A decoder's task head other than the LM's (Note [Decoder classifiers in the step model]):
  // sequence and token classifiers run; the rest is refused, not run as an LM head.
  if (s_.framework == Framework::kTransformers && !EncoderMaskedLm() &&
      !T5ConditionalGeneration() && a_.causal) {
    const std::string& c = inv_.model_class;
    if (c != "causal_lm" && c != "base" && c != "sequence_classification" &&
        c != "token_classification") {
      return Status::Unimplemented(inv_.name + ": the step model does not run a decoder's " + c +
                                   " head yet (its LM, sequence and token classifier heads run)");
    }
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
  return Status::Ok();
}

void ModelRun::ChooseDtypes() {
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
}

Status ModelRun::LayOutParameters() {
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
  return Status::Ok();
}

Status ModelRun::MakeAdapters(AdapterMap* adapters, std::vector<Wide>* adapter_bytes) {
  MEMPLAN_ASSIGN_OR_RETURN(auto targets, LoraTargetTensors(inv_, s_));
  const Wide r = static_cast<Wide>(s_.lora_rank);
  // PEFT keeps adapters in fp32 (autocast_adapter_dtype); torchtune and LitGPT build them in
  // the model's dtype.
  const DT adapter_dt = s_.framework == Framework::kTransformers ? DT::kF32 : pdt_;
  for (const TensorInfo* t : targets) {
    T a = g_.Param(r * static_cast<Wide>(t->InFeatures()), adapter_dt, true);
    T b = g_.Param(static_cast<Wide>(t->OutFeatures()) * r, adapter_dt, true);
    (*adapters)[t] = {a, b};
    adapter_bytes->push_back(Rounded(r * static_cast<Wide>(t->InFeatures()), adapter_dt));
    adapter_bytes->push_back(Rounded(static_cast<Wide>(t->OutFeatures()) * r, adapter_dt));
  }
  return Status::Ok();
}

void ModelRun::AssignLinearWeight(Lin* l, const TensorInfo& t, T p, const AdapterMap& adapters) {
  l->w = p;
  l->in = static_cast<Wide>(t.InFeatures());
  l->out = static_cast<Wide>(t.OutFeatures());
  auto it = adapters.find(&t);
  if (it != adapters.end()) {
    l->lora_a = it->second.first;
    l->lora_b = it->second.second;
  }
}

void ModelRun::AssignBlockParameters(const AdapterMap& adapters) {
  const int64_t layers = a_.layers;
  blocks_.assign(static_cast<size_t>(std::max<int64_t>(layers, 0)), BlockParams{});
  // Linear weights first, then their biases (a bias may precede no weight in the list).
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    const T p = params_[i];
    if (t.layer >= 0 && t.layer < layers && !t.block.empty()) {
      BlockParams& bp = blocks_[static_cast<size_t>(t.layer)];
      if (LinearRole(t.role) && t.IsLinearWeight()) {
        AssignLinearWeight(&bp.lin[t.role], t, p, adapters);
      } else if (t.role == TensorRole::kRouter && !t.bias) {
        bp.router.w = p;
        bp.router.in = static_cast<Wide>(t.shape.size() == 2 ? t.shape[1] : 0);
        bp.router.out = static_cast<Wide>(t.shape.empty() ? 0 : t.shape[0]);
      } else if (t.role == TensorRole::kRouter) {
        bp.router.b = p;  // gpt-oss's GptOssTopKRouter.bias
      } else if (t.role == TensorRole::kAttentionSinks) {
        bp.sinks = p;
      } else if (t.role == TensorRole::kExpertUp || t.role == TensorRole::kExpertGate ||
                 t.role == TensorRole::kExpertGateUp || t.role == TensorRole::kExpertDown) {
        bp.experts.push_back(p);
        bp.expert_params += t.numel;
        if (t.bias) bp.expert_bias[t.role] = p;
        if (!t.bias && t.shape.size() == 3) {
          bp.expert[t.role] = p;
          // Transformers >= 5: gate_up_proj [E, 2F, h] and down_proj [E, h, F] (gpt-oss stores
          // them [E, in, out]).
          bp.expert_width[t.role] =
              static_cast<Wide>(inv_.model_type == "gpt_oss" ? t.shape[2] : t.shape[1]);
        }
      } else if (t.role == TensorRole::kNorm && !t.bias) {
        // A norm inside the attention module normalises the query or key (q_norm, k_norm,
        // query_layernorm, MLA's q_a_layernorm and kv_a_layernorm, MPT's q_ln): by its module,
        // not its width, which is the hidden width for OLMo 2's and OLMoE's full-width norms.
        Norm n{p, T{}, static_cast<Wide>(t.numel)};
        const bool in_attention = t.name.find(".self_attn.") != std::string::npos ||
                                  t.name.find(".attn.") != std::string::npos;
        (in_attention ? bp.qk_norms : bp.norms).push_back(n);
      }
    } else if (t.block.empty()) {
      if (t.role == TensorRole::kEmbedding && !embedding_.ok()) embedding_ = p;
      if (t.role == TensorRole::kPositionEmbedding) position_embedding_ = p;
      if (t.role == TensorRole::kNorm && !t.bias) {
        final_norms_.push_back(Norm{p, T{}, static_cast<Wide>(t.numel)});
      }
      if (t.role == TensorRole::kHead && t.IsLinearWeight()) head_ = p;
      if (t.role == TensorRole::kHead && t.bias && t.kind == ModuleKind::kLinear) head_bias_ = p;
      if (t.role == TensorRole::kClassifier && t.IsLinearWeight()) {
        AssignLinearWeight(&classifier_, t, p, adapters);
      }
      if (t.role == TensorRole::kClassifier && t.bias) classifier_.b = p;
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
}

void ModelRun::FuseLitGptQkv(std::vector<Wide>* adapter_bytes) {
  const bool lora = s_.lora_rank > 0;
  // LitGPT holds query, key and value as one Linear (attn.qkv) in every model; its LoRA on it
  // is one LoRAQKVLinear whose lora_A is [r x enabled parts, in] and lora_B [enabled out, r].
  // Which of query, key and value it adapts is what LoraTargetTensors resolved (its adapters on
  // the separate projections, by role, whatever the targets were called: LitGPT's query/value or
  // Hugging Face's q_proj/v_proj), one place deciding.
  // A checkpoint whose query, key and value are one tensor already (GPT-NeoX's
  // query_key_value) has one adapter there whatever the parts: which parts LitGPT's LoRAQKVLinear
  // enables is then the targets' (LitGPT's default: query and value).
  auto named = [&](std::initializer_list<const char*> names) {
    for (const std::string& t : s_.lora_targets) {
      for (const char* n : names) {
        if (t == n) return true;
      }
    }
    return false;
  };
  const bool defaults = s_.lora_targets.empty();
  const bool all = named({"all-linear", "query_key_value", "qkv"});
  lora_q_ = lora_k_ = lora_v_ = false;
  for (const BlockParams& bp : blocks_) {
    auto adapted = [&](TensorRole role) { return bp.has(role) && bp.at(role).lora_a.ok(); };
    const bool fused = adapted(TensorRole::kAttentionQkv);
    lora_q_ = lora_q_ || adapted(TensorRole::kAttentionQ) ||
              (fused && (defaults || all || named({"query", "q_proj"})));
    lora_k_ =
        lora_k_ || adapted(TensorRole::kAttentionK) || (fused && (all || named({"key", "k_proj"})));
    lora_v_ = lora_v_ || adapted(TensorRole::kAttentionV) ||
              (fused && (defaults || all || named({"value", "v_proj"})));
  }
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
      const bool biased = bp.has(TensorRole::kAttentionQ) && bp.at(TensorRole::kAttentionQ).b.ok();
      if (biased) l.b = g_.Param(l.out, pdt_, !lora);
    }
    const int parts = (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0);
    if (parts > 0) {
      const Wide out = (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0);
      l.lora_a = g_.Param(r * static_cast<Wide>(parts) * h, pdt_, true);
      l.lora_b = g_.Param(out * r, pdt_, true);
      adapter_bytes->push_back(Rounded(r * static_cast<Wide>(parts) * h, pdt_));
      adapter_bytes->push_back(Rounded(out * r, pdt_));
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
  adapter_bytes->clear();
  const Wide rr = r;
  for (const BlockParams& bp : blocks_) {
    for (const auto& [role, l] : bp.lin) {
      if (!l.lora_a.ok()) continue;
      adapter_bytes->push_back(Rounded(rr * l.in, pdt_));
      adapter_bytes->push_back(Rounded(l.out * rr, pdt_));
    }
  }
  for (const Lin& l : litgpt_qkv_) {
    if (!l.lora_a.ok()) continue;
    const int parts = (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0);
    const Wide out = (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0);
    adapter_bytes->push_back(Rounded(rr * static_cast<Wide>(parts) * h, pdt_));
    adapter_bytes->push_back(Rounded(out * rr, pdt_));
  }
}

void ModelRun::ChooseFamily() {
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
             : act == "relu"  ? Family::Act::kRelu
             : act == "relu2" ? Family::Act::kRelu2
                              : Family::Act::kGelu;
  if (!act.empty() && act != "gelu" && fam_.act == Family::Act::kGelu) {
    notes_.push_back("hidden_act '" + act +
                     "' is run as GELU (one saved input per activation); its own ops may keep "
                     "more");
  }
  fam_.norm = a_.norm_upcasts ? Family::NormKind::kRms : Family::NormKind::kLayer;
  if (type == "gemma" || type == "gemma2" || type == "gemma3_text") {
    fam_.norm = Family::NormKind::kRmsGemma;
    fam_.embedding_scale = true;
  }
  // Glm4DecoderLayer: post_self_attn_layernorm after the attention and post_mlp_layernorm after
  // the MLP, each before its residual add, as Gemma 2's (all four norms are the hidden width, so
  // which of them the step model reads where does not change a byte).
  if (type == "gemma2" || type == "gemma3_text" || type == "glm4") {
    fam_.layout = Family::Layout::kSandwich;
  }
  fam_.granite_multipliers = type == "granite" || type == "granitemoe";
  sdpa_ = s_.flash_attention &&
          (s_.framework != Framework::kTransformers || TransformersRunsSdpa(type));
  if (s_.flash_attention && !sdpa_ && type != "gpt_oss" && type != "bloom") {
    notes_.push_back(type +
                     " has no SDPA path in Transformers: its attention runs eager, every layer's "
                     "score matrices kept (attn_implementation=\"flash_attention_2\" would not; "
                     "not modelled)");
  }
  fam_.rotary_cast_back = type == "olmo" || type == "olmo2" || type == "olmo3";
  fam_.rotary_fp32_tables = fam_.rotary_cast_back;
  if (type == "ernie4_5") {
    fam_.ernie_rotary = true;
    fam_.rotary_fp32_tables = true;
  }
  // HeliumRMSNorm multiplies in fp32 and casts back (Olmo2RMSNorm's); its rotation interleaves
  // per call as ERNIE's does, in the tables' dtype.
  if (type == "helium") {
    fam_.interleaved_tables = true;
    fam_.norm = Family::NormKind::kRmsOlmo;
  }
  // NemotronDecoderLayer: Llama's order with NemotronLayerNorm1P (and relu2, from hidden_act).
  if (type == "nemotron") fam_.norm = Family::NormKind::kLayer1P;
  // Exaone4DecoderLayer: OLMo 2's order (each branch's norm after it) with LlamaRMSNorm, and
  // Qwen3's per-head q_norm and k_norm before the rotation (none on its NoPE layers).
  if (type == "exaone4") {
    fam_.layout = Family::Layout::kPostNorm;
    fam_.qk_norm = Family::QkNorm::kHeadRms;
  }
  // CohereDecoderLayer: one CohereLayerNorm read by the attention and the MLP, residual + attn
  // + mlp; CohereAttention's optional q_norm and k_norm before the rotation, which runs on fp32
  // copies (its rotate_half interleaves: a stack where Llama cats, the same bytes) and is cast
  // back; the logits scaled.
  if (type == "cohere" || type == "cohere2") {
    fam_.norm = Family::NormKind::kCohere;
    fam_.qk_norm = Family::QkNorm::kCohere;
    fam_.layout = Family::Layout::kParallel;
    fam_.residual_first = true;
    fam_.rotary_cast_back = true;
    fam_.rotary_upcast_first = true;
    fam_.logit_scale = true;
  }
  if (type == "olmo2" || type == "olmo3") {
    fam_.norm = Family::NormKind::kRmsOlmo;
    fam_.layout = Family::Layout::kPostNorm;
    fam_.qk_norm = Family::QkNorm::kFullRms;
  }
  // OlmoeAttention: q_norm(q_proj(x)) and k_norm(k_proj(x)) over the whole projection, as OLMo
  // 2's, in Llama's pre-norm block with LlamaRMSNorm's cast.
  if (type == "olmoe") fam_.qk_norm = Family::QkNorm::kFullRms;
  if (type == "qwen3" || type == "qwen3_moe" || type == "gemma3_text") {
    fam_.qk_norm = Family::QkNorm::kHeadRms;
  }
  // HunYuanDenseV1Attention: apply_rotary_pos_emb, then query_layernorm and key_layernorm (the
  // order its code has; neither order changes a byte at the grid's points, as SmolLM3's NoPE).
  if (type == "hunyuan_v1_dense") {
    fam_.qk_norm = Family::QkNorm::kHeadRms;
    fam_.qk_norm_after_rotary = true;
  }
  if (type == "phi") {
    fam_.layout = Family::Layout::kParallel;
    fam_.qk_norm = Family::QkNorm::kHeadLayer;
  }
  if (type == "gptj") fam_.layout = Family::Layout::kParallel;
  // OlmoDecoderLayer: Llama's block with OlmoLayerNorm, which has no parameters: the blocks'
  // two norms and the final one are norms of the hidden width with neither weight nor bias.
  if (type == "olmo") {
    fam_.norm = Family::NormKind::kLayerNoParams;
    const Norm none{T{}, T{}, static_cast<Wide>(a_.hidden)};
    for (BlockParams& bp : blocks_) bp.norms = {none, none};
    final_norms_ = {none};
  }
  // StableLmDecoderLayer: input_layernorm feeds both branches with use_parallel_residual;
  // qk_layernorm is one LayerNorm per head; hidden_dropout follows the MLP only.
  if (type == "stablelm") {
    if (a_.parallel_attention) {
      fam_.layout = Family::Layout::kParallel;
      fam_.residual_first = true;
    }
    fam_.qk_norm = Family::QkNorm::kPerHeadLayer;
    fam_.mlp_dropout_only = true;
    fam_.resid_dropout = a_.hidden_dropout;
  }
  if (type == "falcon") {
    // FalconDecoderLayer: parallel attention reads one norm (two with the new decoder
    // architecture); ALiBi goes into the mask (FalconModel.forward).
    if (a_.parallel_attention) {
      fam_.layout =
          a_.cached_kv_heads > 0 ? Family::Layout::kParallelTwoNorms : Family::Layout::kParallel;
    }
    fam_.falcon_alibi = a_.alibi;
    // The blocks' four projections are FalconLinear; the head (and a classifier's score) are
    // nn.Linear.
    for (BlockParams& bp : blocks_) {
      for (auto& [role, l] : bp.lin) l.matmul = true;
    }
  }
  if (type == "bloom") {
    fam_.bloom_attention = true;
    fam_.embedding_norm = true;
  }
  if (type == "gpt_neox") fam_.layout = Family::Layout::kParallelTwoNorms;
  // DeepseekV2Attention (multi-head latent attention) and DeepseekV2TopkRouter: step_mla.cc.
  fam_.mla = (type == "deepseek_v2" || type == "deepseek_v3") && a_.kv_lora_rank > 0;
  fam_.mla_v3 = fam_.mla && type == "deepseek_v3";
  // Glm4MoeTopkRouter is DeepseekV3TopkRouter's code; the rest of the block is Llama's.
  fam_.v3_router = fam_.mla_v3 || type == "glm4_moe";
  // GptOssAttention, GptOssMLP and GptOssRMSNorm (weight * x in fp32, then cast): step_oss.cc.
  if (type == "gpt_oss") {
    fam_.gpt_oss = true;
    fam_.norm = Family::NormKind::kRmsOlmo;
  }
  fam_.query_scaled = type == "opt";
  // GPTNeoSelfAttention._attn is GPT-J's without the scaling (torch.where takes its place).
  fam_.probs_to_value = type == "gpt2" || type == "gptj" || type == "gpt_neo";
  fam_.qk_fp32 = type == "gptj" || type == "gpt_neo";
  fam_.learned_positions = a_.learned_positions;
  if (type == "gpt2" || type == "opt" || type == "starcoder2" || type == "phi" || type == "gptj" ||
      type == "seed_oss" || type == "gpt_bigcode" || type == "gpt_neo") {
    fam_.resid_dropout = a_.hidden_dropout;
  }
  if (type != "opt") fam_.embedding_dropout = a_.embedding_dropout;
}

void ModelRun::CountOptimizerGroups(const std::vector<Wide>& adapter_bytes) {
  const bool lora = s_.lora_rank > 0;
  // Optimizer groups (Transformers' Trainer: weight decay for all but biases and norm weights,
  // get_decay_parameter_names), each tensor rounded, states in the dtype of what the optimizer
  // steps: the parameter, or its fp32 master copy in mixed precision without autocast.
  const DT odt = (s_.precision == Precision::kBf16Mixed || s_.precision == Precision::kFp16Mixed)
                     ? DT::kF32
                     : pdt_;
  Wide decay = 0, no_decay = 0;
  if (lora) {
    for (Wide b : adapter_bytes) {
      decay += b;
      largest_trainable_ = std::max(largest_trainable_, b);
    }
  } else {
    for (const TensorInfo& t : inv_.tensors) {
      if (!t.tied_to.empty()) continue;
      const Wide b = Rounded(t.numel, odt);
      largest_trainable_ = std::max(largest_trainable_, b);
      // get_decay_parameter_names also forbids names containing "bias": T5's
      // relative_attention_bias tables.
      if (t.bias || t.role == TensorRole::kNorm || t.role == TensorRole::kRelativeAttentionBias) {
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
}

void ModelRun::CountModelStates(const std::vector<Wide>& adapter_bytes) {
  const bool lora = s_.lora_rank > 0;
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
    // builder shares one rope among the layers; lora_qwen2_self_attention makes one per layer,
    // and so do lora_llama2_self_attention and lora_llama3_self_attention (the builders memplan
    // .trace picks without llama3 rope scaling), while lora_llama3_1 and lora_llama3_2 build one
    // Llama3ScaledRoPE for all layers.
    const bool qwen2 = inv_.model_type == "qwen2";
    const bool per_layer = qwen2 || a_.rope_type != "llama3";
    const Wide width = static_cast<Wide>(a_.head_dim) * (qwen2 ? 2 : 1);
    const Wide ropes = per_layer && lora ? static_cast<Wide>(std::max<int64_t>(a_.layers, 1)) : 1;
    buffer_bytes_ =
        ropes *
        (Rounded(static_cast<Wide>(std::max<int64_t>(a_.max_positions, 1)) * width, DT::kF32) +
         Rounded(static_cast<Wide>(a_.head_dim) / 2, DT::kF32));
  } else if (s_.framework == Framework::kLitGpt) {
    // LitGPT's GPT.rope_cache (litgpt/model.py): cos and sin buffers of max_seq_length x
    // rope_n_elem in fp32, max_seq_length set to the training sequence length by the recipes.
    buffer_bytes_ = 2 * Rounded(seq_ * static_cast<Wide>(a_.rotary_dims), DT::kF32);
    // LoRAQKVLinear.lora_ind (litgpt/lora.py): when only some of query, key and value are
    // adapted, the first forward registers _lora_ind, the int64 positions of the adapted
    // outputs, as a buffer of each fused qkv.
    for (const Lin& l : litgpt_qkv_) {
      if (!l.lora_a.ok() || (lora_q_ && lora_k_ && lora_v_)) continue;
      const Wide q = static_cast<Wide>(a_.heads * a_.head_dim);
      const Wide kvw = static_cast<Wide>(a_.kv_heads * a_.head_dim);
      buffer_bytes_ +=
          Rounded((lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0), DT::kI64);
    }
  } else {
    for (const TensorInfo& b : inv_.buffers) {
      const bool floating =
          b.dtype == DType::kF32 || b.dtype == DType::kF16 || b.dtype == DType::kBF16;
      // model.to(dtype) casts floating buffers only: position ids stay int64, GPT-BigCode's
      // causal table bool.
      const DT dt = floating                  ? pdt_
                    : b.dtype == DType::kI64  ? DT::kI64
                    : b.dtype == DType::kBool ? DT::kBool
                                              : DT::kF32;
      buffer_bytes_ += Rounded(b.numel, dt);
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
}

}  // namespace memplan::estimator::step
