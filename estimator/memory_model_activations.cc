// What a layer keeps for backward (Note [Architecture facts for activations]): the inventory's
// architecture mapped to a LayerShape, LayerActivationBytes per layer, and CountActivations for
// the whole model, the logits and the loss included.
#include <algorithm>
#include <string>
#include <vector>

#include "estimator/memory_model.h"
#include "estimator/memory_model_internal.h"

namespace memplan::estimator::mm {

// Note [Architecture facts for activations]
// The one place where the model's architecture (ArchitectureInfo, filled by the config.json
// builders) becomes the per-layer shape that LayerActivationBytes counts. A new architecture fact
// that changes activations (attention widths that differ from heads x head_dim, shared experts,
// sliding-window attention, ...) goes into ArchitectureInfo, then LayerShape, is mapped here, and
// is counted in LayerActivationBytes; nothing else reads ArchitectureInfo for activations.
// Families whose Transformers norm upcasts the hidden states to fp32 before normalising and
// multiplies the weight in after (LlamaRMSNorm and its copies: mistral, mixtral, qwen2, gemma;
// T5LayerNorm computes its variance in fp32 the same way).
// The family builders record it (ArchitectureInfo::norm_upcasts).
bool UpcastingNorm(const ArchitectureInfo& a) { return a.norm_upcasts; }

// Transformers' activations (transformers/activations.py ACT2FN), by config name: the f-wide
// tensors autograd keeps beyond the activation's input. The Python formulas keep their
// intermediates: NewGELUActivation ("gelu_new", also "gelu_accurate"), 0.5 * x * (1 + tanh(...)),
// keeps 0.5x, tanh(...) and 1 + tanh(...); FastGELUActivation ("gelu_fast") those and the
// products inside tanh's argument (six); QuickGELUActivation, x * sigmoid(1.702x), the sigmoid.
// F.gelu, F.silu and the tanh-approximate F.gelu ("gelu_pytorch_tanh") are fused kernels keeping
// their input only.
int ActivationExtraTensors(const std::string& hidden_act) {
  if (hidden_act == "gelu_new" || hidden_act == "gelu_accurate") return 3;
  if (hidden_act == "gelu_fast") return 6;
  if (hidden_act == "quick_gelu") return 1;
  return 0;
}

namespace {

LayerShape ShapeFor(const ModelInventory& inventory, const TrainingSetup& s, int64_t seq,
                    const ParamFacts& f) {
  const ArchitectureInfo& a = *inventory.arch;
  LayerShape l;
  l.seq = l.kv_seq = seq;
  l.batch = s.micro_batch;
  l.hidden = a.hidden;
  l.heads = a.heads;
  l.kv_heads = a.kv_heads;
  l.head_dim = a.head_dim;
  l.ffn = a.intermediate;
  l.gated = a.gated_mlp;
  l.experts = a.experts;
  l.top_k = a.experts_per_token;
  l.hidden_dropout = a.hidden_dropout > 0;
  l.attention_dropout = a.attention_dropout > 0;
  l.tp = s.tp;
  l.sequence_parallel = s.sequence_parallel && s.tp > 1;
  const bool sixteen_bit = s.precision != Precision::kFp32;
  l.norm_fp32 = sixteen_bit && UpcastingNorm(a);
  l.frozen_linears = s.lora_rank > 0;
  l.quantized_linears = s.lora_rank > 0 && s.qlora;
  l.norm_keeps_normalized = UpcastingNorm(a) && !l.frozen_linears;
  const Wide layers = U(std::max<int64_t>(a.layers + a.decoder_layers, 1));
  // MLA: keys are heads x (qk_nope + qk_rope) wide (head_dim), values heads x v_head_dim; each
  // token also keeps the query latent (q_a_proj output and its norm) and the key/value latent
  // (kv_a_proj output, and the norm of its kv_lora_rank part).
  if (a.kv_lora_rank > 0) {
    l.v_width = a.heads * a.v_head_dim;
    l.latent_width = 2 * a.q_lora_rank + (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank;
  }
  l.shared_ffn = a.shared_intermediate;
  const bool litgpt = s.framework == Framework::kLitGpt;
  l.adapter_input_width = static_cast<int64_t>(
      CeilDiv(litgpt ? f.litgpt_lora_input_width : f.lora_input_width, layers));
  l.adapter_padded_width =
      litgpt ? static_cast<int64_t>(CeilDiv(f.litgpt_lora_padded_width, layers)) : 0;
  l.fused_qkv_kept = litgpt;
  l.fused_qkv_matmul = s.framework == Framework::kTorchtitan;
  // Lit-GPT's MLPs call the fused torch.nn.functional.gelu / silu.
  l.mlp_activation_extra = litgpt ? 0 : ActivationExtraTensors(a.hidden_act);
  l.softmax_keeps_input = s.TorchBefore(1, 11);
  // Sliding windows and attention sinks leave the saved tensors as they are: eager and SDPA
  // attention compute the full s x s scores and mask them, and flash attention keeps one
  // log-sum-exp per query either way; a sink adds one column to s x s scores.
  return l;
}

}  // namespace

Activations CountActivations(const ModelInventory& inventory, const TrainingSetup& s,
                             const ParamFacts& f) {
  const ArchitectureInfo& a = *inventory.arch;
  const int e = s.precision == Precision::kFp32 ? 4 : 2;
  const int64_t seq = s.SeqLenFor(&a);
  Activations out;
  LayerShape self = ShapeFor(inventory, s, seq, f);
  LayerShape dec = self;
  dec.cross_attention = a.encoder_decoder;
  Wide enc_layer = LayerActivationBytes(self, e, s.flash_attention, s.checkpointing);
  // MoE models whose first (DeepSeek) or listed (Qwen mlp_only_layers) layers are dense: those
  // layers hold one dense_intermediate-wide MLP instead of the experts.
  const int64_t dense_layers =
      a.experts > 0 && a.moe_layers > 0 ? std::max<int64_t>(a.layers - a.moe_layers, 0) : 0;
  Wide dense_layer_bytes = 0;
  if (dense_layers > 0) {
    LayerShape dense = self;
    dense.experts = dense.top_k = 0;
    dense.shared_ffn = 0;
    dense.ffn = a.dense_intermediate > 0 ? a.dense_intermediate : a.intermediate;
    dense_layer_bytes = LayerActivationBytes(dense, e, s.flash_attention, s.checkpointing);
  }
  const Wide dec_layer = LayerActivationBytes(dec, e, s.flash_attention, s.checkpointing);
  const Wide sbh = U(seq) * U(s.micro_batch) * U(a.hidden);
  // Per stack, outside the layers: the embedding dropout mask and the final norm's input; a
  // quantised output head (Lit-GPT QLoRA) keeps the final norm's output too (MatMul4Bit's A).
  const bool litgpt = s.framework == Framework::kLitGpt;
  const Wide stack_extra = sbh * (self.norm_fp32 ? 4 : e) + (a.embedding_dropout > 0 ? sbh : 0) +
                           (litgpt && self.quantized_linears && f.head > 0 ? sbh * e : 0);
  if (a.encoder_decoder) {
    // Encoder stack, decoder stack, and the encoder output every cross-attention reads.
    out.saved =
        U(a.layers) * enc_layer + U(a.decoder_layers) * dec_layer + 2 * stack_extra + sbh * e;
    out.per_layer = dec_layer;
  } else {
    out.saved =
        U(a.layers - dense_layers) * enc_layer + U(dense_layers) * dense_layer_bytes + stack_extra;
    out.per_layer = enc_layer;
  }
  const LayerShape& top = a.encoder_decoder ? dec : self;
  const Wide full = LayerActivationBytes(top, e, s.flash_attention, Checkpointing::kNone);
  if (s.checkpointing == Checkpointing::kFull) {
    out.recompute = full;
    if (s.checkpoint_every > 1) {
      // Every K-th block checkpointed (Transformers' `layer_index % every_n_layers == 0`,
      // fms-fsdp's p = 1/K, torchtitan's selective K): ceil(L / K) blocks keep their input only,
      // the others everything an unchecked block of the stack's top type keeps.
      const int64_t total = a.encoder_decoder ? a.layers + a.decoder_layers : a.layers;
      const int64_t kept = total - (total + s.checkpoint_every - 1) / s.checkpoint_every;
      const Wide ckpt = LayerActivationBytes(top, e, s.flash_attention, Checkpointing::kFull);
      if (kept > 0 && full > ckpt) out.saved += U(kept) * (full - ckpt);
    }
  } else if (s.checkpointing == Checkpointing::kSelective ||
             s.checkpointing == Checkpointing::kOp) {
    const Wide kept = LayerActivationBytes(top, e, s.flash_attention, s.checkpointing);
    out.recompute = full > kept ? full - kept : 0;
  }
  const Wide t = U(s.tp);
  const Wide b = U(s.micro_batch);
  Wide attention_ws = s.flash_attention ? 0 : 2 * e * U(a.heads) * U(seq) * U(seq) * b / t;
  Wide mlp_ws = 2 * e * U(seq) * b * U(a.intermediate) * (a.gated_mlp ? 2 : 1) *
                std::max<Wide>(U(a.experts_per_token), 1) / t;
  out.workspace = std::max({attention_ws, mlp_ws, 2 * e * sbh});
  // Vocabulary-wide logits only for the language-model heads; a classification or QA head's
  // handful of outputs per token is negligible.
  const bool lm_head = inventory.model_class == "causal_lm" ||
                       inventory.model_class == "masked_lm" ||
                       inventory.model_class == "seq2seq_lm";
  if (lm_head && a.vocab > 0) {
    const Wide elems = CeilDiv(U(seq) * b * U(a.vocab), t);
    if (litgpt) {
      // Lit-GPT (finetune/*.py): the head runs in chunks of 128 positions (lm_head_chunk_size)
      // and Fabric's precision plugin returns them converted to fp32 (convert_output), which
      // chunked_cross_entropy's fp32 log-softmax keeps; backward then goes chunk by chunk.
      out.logits_forward = Scale(elems, kLogitsForwardFp32Bytes);
      const Wide chunk = CeilDiv(std::min<Wide>(U(seq), kLitGptLmHeadChunk) * b * U(a.vocab), t);
      out.logits_backward = Scale(chunk, kLogitsBackwardBytes);
    } else if (s.loss == Loss::kChunked && s.framework == Framework::kTorchtitan) {
      // torchtitan's ChunkedLossWrapper (components/loss.py): the hidden states are cut into N
      // sequence chunks; each chunk runs the head, cross_entropy(logits.float()) and its own
      // backward before the next, inside the forward. At a chunk's backward its 16-bit logits
      // (the loop's local), the log-softmax's fp32 output and the fp32 gradients of the loss and
      // of the log-softmax are alive at once (the fp32 copy went when the loss returned); the
      // hidden states' gradients gather in an fp32 accumulator. Backward then starts from that
      // gradient, cast to the hidden dtype and saved by _DecoderOutputGradientBackProp: no
      // logits and no logit gradients live in it.
      const Wide n = U(s.loss_chunks > 0 ? s.loss_chunks : 8);
      const Wide chunk = CeilDiv(elems, n);
      const Wide hidden = U(seq) * b * U(a.hidden);
      out.logits_forward = chunk * (e + 4 + 4 + 4) + hidden * 4;
      out.logits_kept = hidden * e;
      out.logits_backward = 0;
      out.logits_forward_per_logit = static_cast<double>(e + 12) / static_cast<double>(n);
    } else if (s.loss == Loss::kChunked) {
      // torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py):
      // the model returns the logits in N chunks (the head runs per chunk), all kept in the
      // compute dtype; the loss upcasts one chunk at a time (a transient) and cross_entropy's
      // log_softmax keeps each chunk's fp32 output for backward; backward then runs chunk by
      // chunk through the head, so the fp32 gradients are one chunk's.
      const Wide n = U(s.loss_chunks > 0 ? s.loss_chunks : 8);
      const Wide chunk = CeilDiv(elems, n);
      out.logits_forward = elems * (e == 2 ? 2 : 0) + elems * 4 + chunk * 4;
      out.logits_backward = Scale(chunk, kLogitsBackwardBytes);
      out.logits_forward_per_logit = (e == 2 ? 2 : 0) + 4;
    } else if (s.loss == Loss::kFused) {
      // Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py):
      // the logits are never whole; the forward computes them in chunks of
      // next_power_of_2(ceil(BT / ceil(V / H))) rows in the input dtype, writes the loss's
      // gradient in place and keeps grad_input [BT, H] (and grad_weight [V, H] when the head
      // trains) for backward, which only scales them.
      const Wide h = U(a.hidden);
      const Wide bt = U(seq) * b;
      const Wide inc = CeilDiv(U(a.vocab), std::max<Wide>(h, 1));
      Wide rows = 1;
      while (rows < CeilDiv(bt, std::max<Wide>(inc, 1))) rows *= 2;
      const bool head_trains = s.lora_rank == 0;
      out.logits_forward = CeilDiv(std::min(rows, bt) * U(a.vocab), t) * e + bt * h * e +
                           (head_trains ? U(a.vocab) * h * e / t : 0);
      out.logits_backward = 0;
      out.logits_forward_per_logit = 0;
    } else {
      out.logits_forward = elems * (e == 2 ? 2 : 0) + Scale(elems, kLogitsForwardFp32Bytes);
      out.logits_backward = Scale(elems, kLogitsBackwardBytes);
      out.logits_forward_per_logit = kLogitsForwardFp32Bytes + (e == 2 ? 2 : 0);
      // torchtitan (trainer.py _forward_backward_body, components/loss.py cross_entropy_loss):
      // cross_entropy(pred.flatten(0, 1).float(), ...), then `del pred` before backward: the
      // 16-bit logits and their fp32 copy are gone when backward starts; log_softmax's fp32
      // output stays for its backward.
      if (s.framework == Framework::kTorchtitan) out.logits_kept = elems * 4;
    }
    // PyTorch before 1.11: log_softmax keeps its input (the fp32 logits copy) as well.
    if (s.TorchBefore(1, 11)) out.logits_forward += elems * 4;
  }
  return out;
}

}  // namespace memplan::estimator::mm

namespace memplan::estimator {

using mm::kDropoutMaskBytes;
using mm::kFlashLseBytes;
using mm::kFlashRngStateBytes;
using mm::Saturate;
using mm::U;
using mm::Wide;

uint64_t LayerActivationBytes(const LayerShape& l, int elem_bytes, bool flash,
                              Checkpointing checkpointing) {
  const Wide e = static_cast<Wide>(elem_bytes);
  const Wide s = U(l.seq), b = U(l.batch), h = U(l.hidden), t = U(std::max<int64_t>(l.tp, 1));
  const Wide sbh = s * b * h;
  if (checkpointing == Checkpointing::kFull) return Saturate(e * sbh);  // the layer input
  const Wide mask = l.hidden_dropout ? 1 : 0;
  const Wide q_width = U(l.heads) * U(l.head_dim), kv_width = U(l.kv_heads) * U(l.head_dim);
  if (checkpointing == Checkpointing::kOp) {
    // torchtitan's per-op SelectiveAC (torchtitan/distributed/activation_checkpoint.py): the
    // block keeps its input, what the attention op returns (flash: the output, an fp32
    // log-sum-exp per head and token and the RNG seed and offset; the math kernel: the output
    // and the probabilities) and the outputs of the 1st, 3rd, 5th, ... matmul in the block's call
    // order (the policy recomputes every second one); everything else is recomputed.
    // tests/trace/test_trace.py holds the traced block to this.
    const Wide v_w = l.v_width > 0 ? U(l.v_width) : kv_width;
    std::vector<Wide> widths;
    if (l.fused_qkv_matmul) {
      widths.push_back(q_width + kv_width + v_w);
    } else {
      widths.insert(widths.end(), {q_width, kv_width, v_w});
    }
    widths.push_back(h);  // output projection
    const Wide f = U(l.ffn) * U(std::max<int64_t>(l.top_k, 1));
    if (l.gated) widths.push_back(f);  // gate (w1), then up (w3)
    widths.insert(widths.end(), {f, h});
    Wide mm = 0;
    for (size_t i = 0; i < widths.size(); i += 2) mm += widths[i];
    const Wide o_w = l.v_width > 0 ? v_w : q_width;
    const Wide attention = flash ? e * s * b * o_w +
                                       static_cast<Wide>(kFlashLseBytes) * U(l.heads) * s * b +
                                       kFlashRngStateBytes
                                 : e * s * b * o_w + e * U(l.heads) * s * U(l.kv_seq) * b;
    return Saturate(e * sbh + (e * s * b * mm + attention) / t);
  }
  // Attention core: softmax output, plus dropout mask and dropout output when dropout is on;
  // flash attention keeps only the per-head log-sum-exp.
  auto core = [&](Wide kv_seq) -> Wide {
    if (flash) return static_cast<Wide>(kFlashLseBytes) * U(l.heads) * s * b / t;
    Wide per = e + (l.attention_dropout ? static_cast<Wide>(kDropoutMaskBytes) + e : 0) +
               (l.softmax_keeps_input ? e : 0);
    return per * U(l.heads) * s * kv_seq * b / t;
  };
  // Megatron's selective recompute drops the core attention (flash or not) and recomputes it.
  const bool keep_core = checkpointing == Checkpointing::kNone;
  // A Linear keeps its input only for its weight's gradient: not when the weight is frozen
  // (LoRA), unless bitsandbytes' 4-bit matmul keeps it anyway (QLoRA).
  const bool linear_inputs = !l.frozen_linears || l.quantized_linears;
  const Wide lin = linear_inputs ? e : 0;
  // Each norm keeps its input (in fp32 when it upcasts), the normalised tensor when its weight
  // trains and upcasts, and the following Linear's input.
  const Wide norm = (l.norm_fp32 ? 4 : e) + (l.norm_keeps_normalized ? e : 0) + lin;
  // Replicated across tensor-parallel ranks (split with sequence parallelism): the norm and
  // first-Linear inputs of each block and the dropout masks after each block.
  // Self-attention: norm, QKV input, Q, K, V, output-projection input (flash attention keeps it
  // as its output in any case), dropout mask.
  const Wide out_proj = flash || linear_inputs ? e : 0;
  const Wide v_width = l.v_width > 0 ? U(l.v_width) : kv_width;
  // The output projection reads the values' width (heads x v_head_dim under MLA).
  const Wide o_width = l.v_width > 0 ? v_width : q_width;
  Wide replicated = norm * sbh + mask * sbh + e * s * b * U(l.latent_width);
  // Query, key and value as the attention keeps them. Lit-GPT (fused_qkv_kept): the fused
  // output, kept whole by the value view, plus the roped query and key copies; with grouped
  // keys and values the key and value are expanded to query width and copied, and the fused
  // output is freed.
  Wide qkv_width = q_width + kv_width + v_width;
  if (l.fused_qkv_kept) {
    qkv_width = l.kv_heads == l.heads ? qkv_width + q_width + kv_width : 3 * q_width;
  }
  Wide sharded = e * s * b * qkv_width + out_proj * s * b * o_width;
  Wide core_bytes = core(U(l.kv_seq));
  if (l.cross_attention) {
    // Encoder-decoder attention: norm, Q input, Q, K and V over the encoder sequence,
    // output-projection input, dropout mask; its scores are s x kv_seq.
    const Wide kv_s = U(l.kv_seq);
    replicated += norm * sbh + mask * sbh;
    sharded += e * b * (s * q_width + 2 * kv_s * kv_width) + out_proj * b * s * q_width;
    core_bytes += core(kv_s);
  }
  // MLP: norm, first-Linear input, then per token the activation's input and output (gated:
  // gate, up, act(gate) and the product, which is the second Linear's input), dropout mask. MoE:
  // each token's MLP runs in top-k experts, with the token copied in and out of each, and the
  // router's fp32 logits and probabilities.
  replicated += norm * sbh + mask * sbh;
  Wide mlp = s * b * U(l.ffn) * ((l.gated ? 3 : 1) * e + lin + U(l.mlp_activation_extra) * e);
  if (l.experts > 0) {
    const Wide k = U(std::max<int64_t>(l.top_k, 1));
    mlp *= k;
    replicated += 2 * e * k * sbh + 2 * 4 * s * b * U(l.experts);
    // The shared expert(s): one more dense MLP every token passes, with its own input.
    if (l.shared_ffn > 0)
      mlp += s * b * U(l.shared_ffn) * ((l.gated ? 3 : 1) * e + lin) + lin * sbh;
  }
  sharded += mlp;
  // LoRA adapters (PEFT / Lit-GPT LoRALinear): lora_dropout's mask and output, lora_A's input.
  replicated += (static_cast<Wide>(kDropoutMaskBytes) + e) * s * b * U(l.adapter_input_width);
  sharded += e * s * b * U(l.adapter_padded_width);
  Wide total = (l.sequence_parallel ? replicated / t : replicated) + sharded / t +
               (keep_core ? core_bytes : 0);
  return Saturate(total);
}

}  // namespace memplan::estimator
