// PyTorch's ops as the step model runs them (Note [The step model] in step_model.h): what each
// allocates in forward, what autograd saves for its backward (tools/autograd/derivatives.yaml),
// what its backward allocates, and how the CUDA autocast policy casts its inputs
// (aten/src/ATen/autocast_mode.h: matmuls and attention in the lower precision, pow, softmax,
// log_softmax, layer_norm, the losses in fp32, everything else as its inputs promote).
//
// Shapes are element counts: a tensor of `tokens` rows of `width` is tokens * width elements;
// what an op needs of the shape beyond that is an argument.
//
// Internal to the estimator; used by step_model.cc and ModelRun (step_blocks.h).
#pragma once

#include "estimator/step_graph.h"

namespace memplan::estimator::step {

// Type promotion of two floating tensors (fp32 wins).
DT Promote(DT a, DT b);

// x.to(dt): the same tensor (another reference) when it has that dtype already.
T Cast(Graph& g, T x, DT dt);
// An autocast-cast input: x cast to the autocast dtype under autocast, else x (a reference).
T AutocastIn(Graph& g, T x);
// An fp32-policy input under autocast (pow, softmax, layer_norm, losses): x cast to fp32.
T Fp32In(Graph& g, T x);
// bmm (or baddbmm) of `a` and `b` as eager attention runs it under autocast: both cast to the
// autocast dtype (references without autocast), the product of `out_numel` elements saving the
// two operands it multiplied. Takes `a` and `b`: they are dropped.
T AutocastBmm(Graph& g, const char* op, T a, T b, Wide out_numel);

// A view or reshape (no memory; its gradient is the output's).
T View(Graph& g, T x, Wide numel = 0);
// A copy with the same elements (contiguous(), clone(), repeat_kv's expand + reshape of
// `factor` times the elements): a new tensor, no saved tensors.
T Copy(Graph& g, T x, Wide numel = 0);
// One slice of `x` (narrow/chunk/split/indexing) as a view; its backward allocates the whole
// of `x` (slice_backward zeros + copy).
T Slice(Graph& g, T x, Wide numel);
// x.chunk(parts) (torch.split): `parts` views of x, one autograd node (SplitBackward) that waits
// for every part's gradient and then allocates the whole of x's.
std::vector<T> Split(Graph& g, T x, Wide parts);
// torch.cat of `parts` (a new tensor).
T Cat(Graph& g, const std::vector<T>& parts);

// F.linear(x, w, bias) with x of `tokens` x `in`: under autocast x and w (through the weight
// cache) cast to the autocast dtype. mm saves its input when the weight trains and the weight
// when the input needs a gradient.
T Linear(Graph& g, T x, T w, T bias, Wide in, Wide out);
// FalconLinear.forward: `x @ w.T`, then `+ bias` as an op of its own. The transpose is a view,
// which autocast casts anew at every call (it caches leaves only), so only what the product
// saves keeps the cast. The 16-bit product plus an fp32 bias is promoted to fp32: the sum is
// the bias's dtype, and the product is freed once added.
T MatmulThenBias(Graph& g, T x, T w, T bias, Wide in, Wide out);
// F.embedding(ids, w): saves the indices (the batch).
T Embedding(Graph& g, T w, Wide tokens, Wide width, DT out_dt);

// Elementwise ops. `a` and `b` broadcast to the larger; the result promotes their dtypes.
T Mul(Graph& g, T a, T b);
T Add(Graph& g, T a, T b);
T Div(Graph& g, T a, T b);
// By a Python scalar: x * c, x + c, x / c (no saved tensors).
T Scale(Graph& g, T x);
// Unary ops, with what each saves: silu, gelu and pow save the input; tanh, sigmoid, rsqrt,
// exp, relu and sqrt the result; neg saves nothing.
enum class Unary {
  kSilu,
  kGelu,
  kGeluTanh,
  kRelu,
  kTanh,
  kSigmoid,
  kRsqrt,
  kExp,
  kPow,
  kNeg,
  kSqrt
};
T Apply(Graph& g, Unary op, T x);
// x.mean(-1, keepdim=True) over rows of `width` (also sum): no saved tensors.
T MeanRows(Graph& g, T x, Wide width);
// F.dropout(x, p): identity when p == 0; native_dropout keeps a bool mask.
T Dropout(Graph& g, T x, double p);
// torch.nn.functional.softmax(x, dim=-1[, dtype]): saves its result.
T Softmax(Graph& g, T x, DT out_dt);

// nn.LayerNorm / F.layer_norm over rows of `width` (native_layer_norm): saves the input, the
// fp32 mean and rstd per row, and the weight and bias; the output in the input's dtype (fp32
// under autocast).
T LayerNorm(Graph& g, T x, T w, T b, Wide width);
// F.rms_norm on CUDA (_fused_rms_norm): saves the input and an fp32 rstd per row.
T FusedRmsNorm(Graph& g, T x, T w, Wide width);

// Scaled dot-product attention, fused: the backend select_sdp_backend picks (flash,
// memory-efficient, cuDNN) keeps q, k, v, the output and fp32 log-sum-exp statistics; the math
// backend runs the ops of EagerAttention. q: batch x heads x seq x head_dim elements, k and v
// kv_heads wide (the same as heads unless grouped).
enum class SdpaBackend { kFlash, kEfficient, kCudnn, kMath };
struct AttentionShape {
  Wide batch = 1, heads = 1, kv_heads = 1, seq = 1, kv_seq = 1, head_dim = 1, v_head_dim = 1;
  double dropout = 0;
  bool mask = false;   // an explicit additive mask (batch x 1 x seq x kv_seq) is passed
  bool causal = true;  // is_causal when no mask is passed (an encoder's attention is not)
};
// `stats`: when given, the kernel's other outputs (log-sum-exp, RNG state) are returned there,
// each with a reference of the caller's (a selective checkpoint keeps them).
T Sdpa(Graph& g, SdpaBackend backend, T q, T k, T v, const AttentionShape& a, T mask,
       std::vector<T>* stats_out = nullptr);

// log_softmax over rows of `vocab` then nll_loss: saves the fp32 log-probabilities (and the
// target, part of the batch); returns the scalar loss. `x` must be fp32 already (the caller
// casts as the framework does).
T CrossEntropy(Graph& g, T x, Wide rows, Wide vocab);
// F.cross_entropy called on `x` as it is (at::cross_entropy_loss, which autocast does not cast):
// nll_loss_nd(log_softmax(x, dim, x.dtype)), so under autocast a 16-bit x gets 16-bit
// log-probabilities (saved) and nll_loss, an fp32 op, an fp32 copy of them (saved too);
// otherwise CrossEntropy.
T CrossEntropyLoss(Graph& g, T x, Wide rows, Wide vocab);

}  // namespace memplan::estimator::step
