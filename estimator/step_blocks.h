// The frameworks' training code as the step model runs it (Note [The step model] in
// step_model.h): the model's parameters from the inventory (with LoRA adapters and QLoRA's
// storage), each block's forward as the framework writes it, the output head and the loss, the
// checkpointing wrapper per policy. Internal to the estimator.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "estimator/inventory.h"
#include "estimator/step_graph.h"
#include "estimator/step_ops.h"
#include "estimator/training_setup.h"

namespace memplan::estimator::step {

// One Linear of a block: its weight and bias, widths, and LoRA adapters when adapted.
struct Lin {
  T w, b;
  Wide in = 0, out = 0;
  T lora_a, lora_b;     // LoRA A [r, in], B [out, r]
  bool matmul = false;  // FalconLinear: MatmulThenBias (step_ops.h), not F.linear
  bool ok() const { return w.ok(); }
};

// A norm: weight and bias (invalid when absent), width.
struct Norm {
  T w, b;
  Wide width = 0;
};

// A block's parameters by role (Note [Tensor roles]).
struct BlockParams {
  std::map<TensorRole, Lin> lin;            // the block's Linears (experts and routers excluded)
  std::vector<Norm> norms;                  // hidden-width norms in registration order
  std::vector<Norm> qk_norms;               // narrower norms (query/key norms), in order
  std::vector<T> experts;                   // fused expert tensors (3-D) and their biases
  std::map<TensorRole, T> expert;           // the fused experts by role (weights)
  std::map<TensorRole, Wide> expert_width;  // their output widths (2F for gate_up, h for down)
  std::map<TensorRole, T> expert_bias;      // their biases by role (gpt-oss)
  T sinks;                                  // the attention's learned sink logits (gpt-oss)
  Lin router;
  Wide expert_params = 0;  // routed expert parameters of the block (all experts)
  bool has(TensorRole r) const { return lin.count(r) > 0; }
  const Lin& at(TensorRole r) const { return lin.at(r); }
};

// One training step's model code over a Graph: parameters, forward, loss.
class ModelRun {
 public:
  ModelRun(Graph& g, const ModelInventory& inventory, const TrainingSetup& setup);

  // The parameters (as Graph params), the blocks' parameters, LoRA adapters; fails on an
  // architecture the step model cannot run.
  Status Prepare();
  // The forward pass and the loss, as the framework runs them, phases set; returns the loss.
  Result<T> ForwardAndLoss();
  // What runs when backward returns: torchtitan's FSDP2 root callback (the last reductions).
  void AfterBackward();

  // Bytes of each optimizer parameter group (rounded per tensor, in the states' dtype), and of
  // the largest trainable tensor.
  const std::vector<Wide>& OptimizerGroupBytes() const { return group_bytes_; }
  Wide LargestTrainableBytes() const { return largest_trainable_; }
  // The model states as this framework allocates them, each tensor rounded as the caching
  // allocator rounds it: parameters (NF4 storage for QLoRA's base, adapters included),
  // buffers, optimizer states (Adam's two per trainable tensor, in its dtype).
  Wide ParameterBytes() const { return parameter_bytes_; }
  Wide BufferBytes() const { return buffer_bytes_; }
  Wide OptimizerStateBytes() const { return state_bytes_; }
  uint64_t saved_bytes() const { return saved_bytes_; }
  uint64_t block_saved_bytes() const { return block_saved_bytes_; }
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  // How a Transformers decoder family writes its block (Prepare fills it from the model_type;
  // each field names the modelling code that decides it).
  struct Family {
    // kLayerNoParams: OlmoLayerNorm, F.layer_norm of an fp32 copy without weight or bias, cast
    // back to the input's dtype.
    // kCohere: CohereLayerNorm, LayerNorm written in Python ops over an fp32 copy, weight only.
    // kLayer1P: NemotronLayerNorm1P, F.layer_norm with weight + 1, its arguments cast to the
    // autocast dtype and autocast off.
    enum class NormKind { kRms, kRmsGemma, kRmsOlmo, kLayer, kLayerNoParams, kCohere, kLayer1P };
    enum class Layout { kSequential, kSandwich, kPostNorm, kParallel, kParallelTwoNorms };
    // kRelu2: ReLUSquaredActivation, relu then torch.square (a pow: fp32 under autocast).
    enum class Act { kSilu, kGelu, kGeluTanh, kGeluNew, kRelu, kRelu2 };
    // kPerHeadLayer: StableLmLayerNormPerHead, one LayerNorm module per head over its split.
    // kCohere: CohereLayerNorm over each head (a [heads, head_dim] weight).
    enum class QkNorm { kNone, kHeadRms, kFullRms, kHeadLayer, kPerHeadLayer, kCohere };
    NormKind norm = NormKind::kRms;
    Layout layout = Layout::kSequential;
    Act act = Act::kSilu;
    QkNorm qk_norm = QkNorm::kNone;
    bool qk_norm_after_rotary = false;  // HunYuan: the rotation first, then query/key_layernorm
    // OLMo 1-3, Cohere: the rotated q and k are cast back to their dtype; OLMo's cos and sin
    // tables stay fp32, Cohere's rotation runs on fp32 copies (q.float()).
    bool rotary_cast_back = false;
    bool rotary_fp32_tables = false;
    bool rotary_upcast_first = false;
    bool logit_scale = false;  // Cohere: logits * logit_scale
    // ERNIE 4.5: per call, the fp32 tables' halves repeat_interleave'd anew; q.float() * cos
    // plus rotate_half(q) (in q's dtype), .float(), * sin; cast back.
    bool ernie_rotary = false;
    // Helium: the same interleaved per-call tables (in the hidden states' dtype), then Llama's
    // products in q's dtype.
    bool interleaved_tables = false;
    bool gated = true;
    bool rotary = true;
    Wide rotary_dims = 0;  // per head; 0: the whole head
    bool learned_positions = false;
    bool query_scaled = false;    // OPT: q_proj(h) * scaling
    bool probs_to_value = false;  // GPT-2's eager: softmax(x).type(value.dtype)
    // GPT-J's _attn: query and key cast to fp32 (locals until it returns) before q @ k^T, the
    // probabilities then cast to the value's dtype.
    bool qk_fp32 = false;
    double resid_dropout = 0;       // after attention and after the MLP
    bool mlp_dropout_only = false;  // StableLM: its hidden dropout follows the MLP alone
    // StableLM's parallel block: residual + attn + mlp (the residual's dtype first), where
    // Phi's and GPT-J's add attn + mlp before the residual.
    bool residual_first = false;
    double embedding_dropout = 0;
    bool embedding_scale = false;  // Gemma: embeddings * sqrt(hidden)
    // Granite's multipliers, each a multiplication by a Python float (1.0 included): the
    // embeddings by embedding_multiplier, each branch by residual_multiplier before its residual
    // add, the logits divided by logits_scaling.
    bool granite_multipliers = false;
    bool embedding_norm = false;  // Bloom: word_embeddings_layernorm
    // ALiBi attention: Bloom's baddbmm eager attention, or Falcon's ALiBi folded into a float
    // mask for SDPA.
    bool bloom_attention = false;
    bool falcon_alibi = false;
    bool mla = false;     // DeepSeek-V2: multi-head latent attention and its router (step_mla.cc)
    bool mla_v3 = false;  // DeepSeek-V3's: its rotation and its sigmoid router (step_mla.cc)
    bool v3_router = false;  // DeepSeek-V3's sigmoid router (DeepSeek-V3, GLM-4.5's MoE)
    bool gpt_oss = false;    // gpt-oss: sinks, alternating masks, biased experts (step_oss.cc)
  };

  // Prepare's stages, in the order it runs them (step_prepare.cc): refusals, dtypes, the
  // inventory's parameters (tied ones aliased), LoRA adapters, the blocks' parameters by role,
  // LitGPT's fused qkv, the Transformers family, then the optimizer groups and model states.
  using AdapterMap = std::map<const TensorInfo*, std::pair<T, T>>;  // LoRA A and B per target
  // `l` takes the Linear weight `t` (parameter `p`): its widths and its LoRA adapters, if any.
  static void AssignLinearWeight(Lin* l, const TensorInfo& t, T p, const AdapterMap& adapters);
  Status CheckRunnable() const;
  void ChooseDtypes();
  Status LayOutParameters();
  Status MakeAdapters(AdapterMap* adapters, std::vector<Wide>* adapter_bytes);
  void AssignBlockParameters(const AdapterMap& adapters);
  void FuseLitGptQkv(std::vector<Wide>* adapter_bytes);  // recounts adapter_bytes
  void ChooseFamily();
  void CountOptimizerGroups(const std::vector<Wide>& adapter_bytes);
  void CountModelStates(const std::vector<Wide>& adapter_bytes);

  // Transformers' encoder masked LMs (step_encoders.cc): BertForMaskedLM,
  // RobertaForMaskedLM, XLMRobertaForMaskedLM, DistilBertForMaskedLM. What the blocks' roles
  // leave open, filled by PrepareEncoder from the top-level tensors' roles.
  struct Encoder {
    bool on = false;                 // the model is one of them (Prepare: EncoderMaskedLm)
    bool distil = false;             // DistilBERT's TransformerBlock: no attention-output dropout
    bool roberta_positions = false;  // position ids made from the input ids (RoBERTa, XLM-R)
    bool head_gelu = false;          // RobertaLMHead: gelu whatever hidden_act says
    T token_type;                    // the segment table (BERT, RoBERTa), none for DistilBERT
    Lin transform;                   // the MLM head's dense transform
    Norm embedding_norm, head_norm;
    // The head: the masked LM's, or a classifier over the first token (sequence) or every token.
    enum class Task { kMaskedLm, kSequence, kToken };
    Task task = Task::kMaskedLm;
    Lin pooler;                    // BertPooler's dense (BERT's sequence classifier)
    std::vector<Lin> classifiers;  // in order: RoBERTa's dense and out_proj, DistilBERT's
                                   // pre_classifier and classifier, else the one classifier
  };
  bool EncoderMaskedLm() const;
  Status PrepareEncoder(const AdapterMap& adapters);
  Result<T> EncoderForward();
  T EncoderEmbeddings();
  T EncoderLookup(T table, Wide rows, T ids);
  T EncoderBlock(int layer, T x);
  T EncoderAttention(const BlockParams& bp, T h);
  T EncoderEagerAttention(T q, T k, T v);
  T MaskedLmLoss(T hidden);
  T ClassifierLoss(T hidden);
  T embedding_output_;  // the encoder model's local embedding_output (EncoderForward)

  // Transformers' T5ForConditionalGeneration (step_t5.cc): the encoder and decoder stacks'
  // parameters, which the blocks' roles share one layer index between, laid out by PrepareT5
  // from the inventory's order (Note [T5's parameters] there).
  struct T5Attention {
    Lin q, k, v, o;
    Norm norm;  // the sublayer's T5LayerNorm
  };
  struct T5Block {
    T5Attention self, cross;  // cross: the decoder's only
    Lin wi, wi_1, wo;         // wi: wi_0 when gated
    Norm ff_norm;
  };
  struct T5Stack {
    std::vector<T5Block> blocks;
    T relative_bias;  // block 0's relative_attention_bias table
    Norm final_norm;
    bool decoder = false;
    // This forward's tensors: the position bias (1 x heads x seq x seq, shared by the blocks),
    // the cross-attention's zero bias, the eager causal mask.
    T bias, cross_bias, mask;
  };
  struct T5 {
    bool on = false;
    T5Stack encoder, decoder;
    T encoder_out;  // the encoder's last hidden state, the decoder's key_value_states
    // The cross-attention's zero bias when it requires grad (checkpointing): a leaf, whose
    // .grad lives as long as it does.
    T cross_leaf;
  };
  bool T5ConditionalGeneration() const;
  Status PrepareT5(const AdapterMap& adapters);
  Result<T> T5Forward();
  T T5RunStack(T5Stack& st, T x);
  T T5RunBlock(T5Stack& st, int layer, T x);
  T T5BlockForward(T5Stack& st, int layer, T x);
  T T5LayerNorm(const Norm& n, T x);
  T T5PositionBias(const T5Stack& st);
  T T5AttentionForward(T5Stack& st, const T5Attention& at, T h, bool cross);
  T T5EagerAttention(T q, T k, T v, T bias, T mask, bool folded_kv);
  T T5FeedForward(const T5Block& b, T h);

  // Transformers' decoder-only LMs (LlamaDecoderLayer and its relatives).
  T TransformersDecoderBlock(int layer, T x);
  T BodyAdd(T a, T b);  // Add as the block's own op, outside its submodules
  // With checkpointing, the input embedding's output made to require grad, and held until the
  // end of backward when that makes it a leaf (Note [The frozen embedding's leaf]).
  void HoldEmbeddingLeaf(T t);
  // residual + branch, the branch scaled first where the family says (Granite).
  T ResidualAdd(T residual, T branch);
  T TransformersAttention(int layer, const BlockParams& bp, T h);
  bool SlidingMasked(int layer) const;  // the layer's SDPA gets a sliding-window mask
  bool AnySlidingMasked() const;
  struct QkvViews {
    T q, k, v;
  };
  QkvViews TransformersQkv(int layer, const BlockParams& bp, T h);
  T TransformersSdpa(AttentionShape as, DT cdt, QkvViews* t);
  // The attention output as transpose(1, 2) leaves it, made batch x seq x heads x d (a copy
  // where its layout is heads-major).
  T SeqMajor(T out, SdpaBackend backend, bool heads_major_query);
  // Tensor.clamp_ of `x` (dropped) where it needs a gradient: ClampBackward1 keeps a clone of x
  // from before the clamp. OLMo's clip_qkv.
  T ClampInPlace(T x);
  // repeat_kv's result from `x` (dropped): x itself where the reshape is a view, else a copy.
  T RepeatKv(T x);
  T TransformersEagerAttention(const QkvViews& t);
  T TransformersMlp(const BlockParams& bp, T h);
  T BloomAttention(const BlockParams& bp, T h);
  T TransformersMoe(const BlockParams& bp, T h);
  // What a router returns: its logits, the top-k routing weights and their experts' indices,
  // each a local of the MoE block's forward until it returns (`_, weights, indices = gate(x)`:
  // `_` is a variable like any other).
  struct Routing {
    T logits, weights, indices;
  };
  Routing TransformersRouter(const BlockParams& bp, T h);
  // softmax(logits) in fp32, then topk: the top-k routing weights (fp32) and their indices.
  Routing TopKRouting(T logits);
  // topk_weights /= topk_weights.sum(-1, keepdim=True) (+ 1e-20 with `epsilon`), in place.
  T NormalizeTopK(T weights, bool epsilon);
  // DynamicCache.update in training: *key copied, *value copied (or cast) to the key's dtype, the
  // cache holding both until the output is dropped; the layer goes on with the copies.
  void CacheUpdate(T* key, T* value);
  // DeepSeek-V2 (step_mla.cc, Note [DeepSeek-V2 in the step model]).
  void MlaRotaryTable(DT dt);  // dt: the hidden states' (V3's tables are cast to it)
  T MlaRotary(T x);
  std::vector<T> MlaSplit(T x, const std::vector<Wide>& parts);
  T MlaAttention(const BlockParams& bp, T h);
  T MlaEagerAttention(const QkvViews& t, const AttentionShape& as);
  Routing DeepseekV2Router(const BlockParams& bp, T h);
  T MlaV3Rotary(T x);
  Routing DeepseekV3Router(const BlockParams& bp, T h);
  // gpt-oss (step_oss.cc, Note [gpt-oss in the step model]).
  Status CheckGptOss() const;
  void GptOssTables(DT dt);
  T GptOssRotary(T x);
  T GptOssAttention(int layer, const BlockParams& bp, T h);
  T GptOssMlp(const BlockParams& bp, T h);
  T GptOssGroupedLinear(T x, T w, T bias, T offs, Wide out);
  T LayerMask(int layer) const;  // the mask block `layer` is called with
  Result<T> TransformersForward();
  // torchtune (torchtune/modules/transformer.py, attention.py, peft/lora.py).
  Result<T> TorchtuneForward();
  T TorchtuneBlock(int layer, T x);
  T TorchtuneRmsNorm(const Norm& n, T x);
  T TorchtuneRope(T x);
  T TorchtuneLinear(const Lin& l, T x);
  T BlockFor(int layer, T x);
  // LitGPT (litgpt/model.py, lora.py, utils.py chunked_cross_entropy) under Lightning Fabric.
  Result<T> LitGptForward();
  T LitGptBlock(int layer, T x);
  T LitGptRmsNorm(const Norm& n, T x);
  T LitGptLinear(const Lin& l, T x, bool qkv);
  // llm-foundry's MPT (llmfoundry/models/mpt/modeling_mpt.py, layers/blocks.py, attention.py,
  // ffn.py, norm.py) with attn_impl 'torch', as ComposerMPTCausalLM trains it.
  Result<T> FoundryForward();
  T FoundryBlock(int layer, T x);
  T FoundryAttention(const BlockParams& bp, T a);
  T FoundryNorm(const Norm& n, T x);
  // torchtitan's Llama 3 under FSDP2 (step_torchtitan.cc, Note [FSDP2 in the step model]).
  struct FsdpUnit {
    std::string name;
    std::vector<T> params;            // as the step's ops use them (the compute dtype)
    std::vector<Wide> numel, padded;  // elements; padded: dim 0 to a multiple of the ranks
    bool reshard_after_forward = true;
    std::vector<int> unsharded;  // the unsharded parameters' buffers while unsharded
    int gathered = -1;           // an all-gather's output waiting for its copy-out
  };
  void PrepareTorchtitan();
  Result<T> TorchtitanForward();
  T TorchtitanBlock(int layer, T x);
  T TorchtitanRunBlock(int layer, T x);  // checkpointed per the policy
  StepCategory FsdpTransient() const;
  void FsdpUnshard(FsdpUnit& u);
  void FsdpWait(FsdpUnit& u, bool forward);
  void FsdpReshard(FsdpUnit& u);
  void FsdpReduce(const std::vector<int>& grads, Wide elems, bool accumulate, bool tied);
  void FsdpPostBackward(FsdpUnit& u);
  // Unshards `unit` and prefetches unit `prefetch` (-1: none).
  void FsdpPreBackward(size_t unit, int prefetch);
  // Shared by the torchtune and LitGPT blocks, which repeat grouped k/v and call SDPA causal.
  void ExpandKvToQueryHeads(Wide heads, Wide kv, T* k, T* v);
  // Self-attention over the batch's sequences: `heads` query heads over `kv` key/value heads,
  // each d wide (kv = heads once repeated to query width); no dropout, no explicit mask.
  AttentionShape SelfAttentionShape(Wide heads, Wide kv, Wide d) const;
  SdpaBackend CausalSdpaBackend(DT compute) const;
  // x in fp32 times rsqrt(mean(x^2) + eps), the part every RMSNorm shares; x^2 as pow(2)
  // (Transformers: saves x) or as x * x (LitGPT: a Mul, which saves its inputs).
  enum class Square { kPow, kSelfMul };
  // With `variance`, the mean of squares is returned there (a local the caller keeps) instead of
  // dropped.
  T RmsNormalizedF32(const Norm& n, T x, Square square = Square::kPow, T* variance = nullptr);
  T HfRmsNorm(const Norm& n, T x);
  T GemmaRmsNorm(const Norm& n, T x);
  T OlmoRmsNorm(const Norm& n, T x);
  // CohereLayerNorm over rows of `width`: x.to(fp32), (x - mean) twice, pow(2).mean, rsqrt,
  // weight.to(fp32) * ..., .to(x's dtype).
  T CohereLayerNorm(const Norm& n, T x, Wide width);
  T NormAny(const Norm& n, T x);
  T ApplyRotary(T x);
  T RotateHalf(T x);                // Llama's rotation of all of x (ApplyRotary's core)
  T RotateHalf(T x, T cos, T sin);  // the same with tables of the caller's
  T Activation(T x);
  T LoraLinear(const Lin& l, T x);
  // The loss as Transformers' ForCausalLMLoss computes it from the last hidden states.
  T CausalLmLoss(T hidden);
  T DecoderClassifierLoss(T hidden);
  // Runs block `layer`, checkpointed or not per the setup.
  T RunBlock(int layer, T x);
  // Every block in order from x (dropped), each named "layer i": the output of the last.
  T RunLayers(T x);
  // The running sum of per-chunk losses: `l` when there is none yet, else loss + l (both dropped).
  T AddLoss(T loss, T l);
  bool Checkpointed(int layer) const;
  Status CheckFamily() const;

  Family fam_;
  Encoder enc_;
  T5 t5_;
  Graph& g_;
  const ModelInventory& inv_;
  const TrainingSetup& s_;
  const ArchitectureInfo& a_;
  DT pdt_ = DT::kF32;   // parameter dtype
  DT adt_ = DT::kBF16;  // autocast dtype
  bool autocast_ = false;
  Wide batch_ = 1, seq_ = 1, tokens_ = 1;
  bool quantized_base_ = false;  // QLoRA: the frozen block Linears in NF4
  // LitGPT's fused attention.qkv per block (its checkpoints' q/k/v in one Linear), and which of
  // query, key, value its LoRA adapts (LoRAQKVLinear's enable_lora).
  std::vector<Lin> litgpt_qkv_;
  bool lora_q_ = false, lora_k_ = false, lora_v_ = false;
  std::vector<T> params_;  // per inventory tensor (tied aliases: the target's)
  std::vector<BlockParams> blocks_;
  T embedding_, position_embedding_, head_, head_bias_;
  Lin classifier_;  // a decoder's sequence or token classifier (score, classifier), with LoRA
  std::vector<Norm> final_norms_;
  T cos_, sin_;           // rotary tables of this forward
  T mask_;                // an explicit attention mask of this forward
  T alibi_;               // Falcon: build_alibi_tensor's, passed to every layer
  T sliding_mask_;        // gpt-oss: the sliding-window layers' mask of this forward
  T positions_;           // gpt-oss: position_ids of this forward
  T attn_bias_;           // llm-foundry's ALiBi bias (MPTModel.attn_bias), kept across steps
  std::vector<T> cache_;  // DynamicCache copies held until the output is dropped
  bool use_cache_ = false;
  bool explicit_mask_ = false;
  // The attention runs through SDPA: flash_attention, and for Transformers a family with an
  // SDPA path (TransformersRunsSdpa); else eager.
  bool sdpa_ = true;
  std::vector<Wide> group_bytes_;
  Wide parameter_bytes_ = 0, buffer_bytes_ = 0, state_bytes_ = 0;
  Wide largest_trainable_ = 0;
  uint64_t saved_bytes_ = 0;
  uint64_t block_saved_bytes_ = 0;
  std::vector<std::string> notes_;
  // FSDP2 (torchtitan): the units in forward order, the ranks a parameter is sharded over, the
  // forward's all_gather_state, the reduce-scatter inputs in flight, and
  // whether backward prefetches (off once a chunked loss's backwards cleared the order).
  std::vector<FsdpUnit> units_;
  size_t final_unit_ = 0;  // the unit of the final norm (and the head)
  Wide head_padded_ = 0;   // the head's elements, padded
  std::set<int> reduced_;  // parameters (tensor ids) whose sharded gradient exists
  T held_grad_;            // what the chunked loss's autograd function holds until backward ends
  std::map<int, std::vector<T>> sac_cache_;  // per block: what the per-op policy saved
  bool sac_recompute_ = false;               // TorchtitanBlock runs as the recompute
  Wide ranks_ = 1;
  int ag_state_ = -1;
  std::vector<int> rs_states_;
  bool prefetch_ = true;
};

}  // namespace memplan::estimator::step
