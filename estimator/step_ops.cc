#include "estimator/step_ops.h"

#include <algorithm>

namespace memplan::estimator::step {
namespace {

Wide RoundUp(Wide x, Wide m) { return (x + m - 1) / m * m; }

}  // namespace

DT Promote(DT a, DT b) {
  if (a == b) return a;
  if (a == DT::kF32 || b == DT::kF32) return DT::kF32;
  if (Half(a) && Half(b)) return DT::kF32;  // bf16 with fp16 promotes to fp32
  return Half(a) ? a : b;
}

T Cast(Graph& g, T x, DT dt) {
  if (g.Dtype(x) == dt) return g.Alias(x);
  T out = g.New(g.Numel(x), dt, g.RequiresGrad(x));
  g.Record(Graph::Spec("ToCopy", {x}, {out}));
  return out;
}

T AutocastIn(Graph& g, T x) {
  if (!g.autocast() || !(g.Dtype(x) == DT::kF32 || Half(g.Dtype(x)))) return g.Alias(x);
  if (g.Dtype(x) == g.autocast_dtype()) return g.Alias(x);
  const T leaf = g.Leaf(x);
  return leaf.ok() ? g.CastWeight(leaf, g.autocast_dtype()) : Cast(g, x, g.autocast_dtype());
}

T Fp32In(Graph& g, T x) {
  if (!g.autocast() || !Half(g.Dtype(x))) return g.Alias(x);
  return Cast(g, x, DT::kF32);
}

T AutocastBmm(Graph& g, const char* op, T a, T b, Wide out_numel) {
  T ac = AutocastIn(g, a), bc = AutocastIn(g, b);
  g.Drop(a);
  g.Drop(b);
  T out = g.New(out_numel, g.Dtype(ac), true);
  g.Record(Graph::Spec(op, {ac, bc}, {out}, {ac, bc}));
  g.Drop(ac);
  g.Drop(bc);
  return out;
}

T View(Graph& g, T x, Wide numel) {
  T v = g.Alias(x, numel, /*view=*/true);
  g.Record(Graph::Spec("View", {x}, {v}, {}, {true}));
  return v;
}

T Copy(Graph& g, T x, Wide numel) {
  const Wide n = numel == 0 ? g.Numel(x) : numel;
  T out = g.New(n, g.Dtype(x), g.RequiresGrad(x));
  g.Record(Graph::Spec("Copy", {x}, {out}, {}, {n == g.Numel(x)}));
  return out;
}

T Slice(Graph& g, T x, Wide numel) {
  T v = g.Alias(x, numel, /*view=*/true);
  g.Record(Graph::Spec("Slice", {x}, {v}));
  return v;
}

std::vector<T> Split(Graph& g, T x, Wide parts) {
  std::vector<T> views;
  for (Wide i = 0; i < parts; ++i) views.push_back(g.Alias(x, g.Numel(x) / parts, /*view=*/true));
  g.Record(Graph::Spec("Split", {x}, views));
  return views;
}

T Cat(Graph& g, const std::vector<T>& parts) {
  Wide n = 0;
  bool rg = false;
  DT dt = g.Dtype(parts[0]);
  for (const T& p : parts) {
    n += g.Numel(p);
    rg = rg || g.RequiresGrad(p);
    dt = Promote(dt, g.Dtype(p));
  }
  T out = g.New(n, dt, rg);
  Graph::NodeSpec spec = Graph::Spec("Cat", parts, {out});
  // Each part's gradient is a narrow view of the output's (no allocation).
  spec.passthrough.assign(parts.size(), true);
  g.Record(std::move(spec));
  return out;
}

T Linear(Graph& g, T x, T w, T bias, Wide in, Wide out) {
  const Wide tokens = g.Numel(x) / std::max<Wide>(in, 1);
  T xin = AutocastIn(g, x);
  T wc = g.autocast() ? g.CastWeight(w, g.autocast_dtype()) : w;
  T bc = bias.ok() && g.autocast() ? g.CastWeight(bias, g.autocast_dtype()) : bias;
  const bool rg = g.RequiresGrad(xin) || g.RequiresGrad(wc) || g.RequiresGrad(bc);
  T y = g.New(tokens * out, g.Dtype(xin), rg);
  Graph::NodeSpec spec = Graph::Spec("Linear", {xin, wc, bc}, {y});
  if (g.RequiresGrad(wc)) spec.saved.push_back(xin);
  if (g.RequiresGrad(xin)) spec.saved.push_back(wc);
  g.Record(std::move(spec));
  g.Drop(xin);
  // Autocast's casts are this call's references; otherwise wc and bc are the caller's tensors
  // (a weight the caller cast itself, as DeepSeek-V3's router does, stays the caller's to drop).
  if (g.autocast()) {
    g.Drop(wc);
    g.Drop(bc);
  }
  return y;
}

T MatmulThenBias(Graph& g, T x, T w, T bias, Wide in, Wide out) {
  const Wide tokens = g.Numel(x) / std::max<Wide>(in, 1);
  T xin = AutocastIn(g, x);
  T wc = g.autocast() ? g.CastWeight(w, g.autocast_dtype(), /*view=*/true) : w;
  T y = g.New(tokens * out, g.Dtype(xin), g.RequiresGrad(xin) || g.RequiresGrad(wc));
  Graph::NodeSpec spec = Graph::Spec("Matmul", {xin, wc}, {y});
  if (g.RequiresGrad(wc)) spec.saved.push_back(xin);
  if (g.RequiresGrad(xin)) spec.saved.push_back(wc);
  g.Record(std::move(spec));
  g.Drop(xin);
  if (g.autocast()) g.Drop(wc);  // as Linear: only autocast's cast is this call's
  if (!bias.ok()) return y;
  // AddBackward0 passes the gradient on; the engine casts the product's to 16 bits and reduces
  // the bias's (sum_to_size) to its own size, with nothing full-size besides.
  const DT dt = Promote(g.Dtype(y), g.Dtype(bias));
  T sum = g.New(g.Numel(y), dt, g.RequiresGrad(y) || g.RequiresGrad(bias));
  Graph::NodeSpec add = Graph::Spec("Add(bias)", {y, bias}, {sum});
  add.passthrough = {g.Dtype(y) == dt, false};
  g.Record(std::move(add));
  g.Drop(y);
  return sum;
}

T Embedding(Graph& g, T w, Wide tokens, Wide width, DT out_dt) {
  T y = g.New(tokens * width, out_dt, g.RequiresGrad(w));
  g.Record(Graph::Spec("Embedding", {w}, {y}));
  return y;
}

namespace {

// The gradient of a broadcast input is reduced from a full-size product (grad * other).sum().
std::vector<std::pair<Wide, DT>> BroadcastExtras(Graph& g, T a, T b, Wide n, DT dt) {
  std::vector<std::pair<Wide, DT>> extra;
  for (T x : {a, b}) {
    if (g.RequiresGrad(x) && g.Numel(x) < n) extra.emplace_back(n, dt);
  }
  return extra;
}

}  // namespace

T Mul(Graph& g, T a, T b) {
  const Wide n = std::max(g.Numel(a), g.Numel(b));
  const DT dt = Promote(g.Dtype(a), g.Dtype(b));
  T y = g.New(n, dt, g.RequiresGrad(a) || g.RequiresGrad(b));
  Graph::NodeSpec spec = Graph::Spec("Mul", {a, b}, {y});
  if (g.RequiresGrad(a)) spec.saved.push_back(b);
  if (g.RequiresGrad(b)) spec.saved.push_back(a);
  spec.extra = BroadcastExtras(g, a, b, n, dt);
  g.Record(std::move(spec));
  return y;
}

T Add(Graph& g, T a, T b) {
  const Wide n = std::max(g.Numel(a), g.Numel(b));
  const DT dt = Promote(g.Dtype(a), g.Dtype(b));
  T y = g.New(n, dt, g.RequiresGrad(a) || g.RequiresGrad(b));
  Graph::NodeSpec spec = Graph::Spec("Add", {a, b}, {y});
  // The output's gradient goes to an input as it is, unless the input was broadcast (reduced)
  // or of another dtype (the engine casts it).
  spec.passthrough = {g.Numel(a) == n && g.Dtype(a) == dt, g.Numel(b) == n && g.Dtype(b) == dt};
  spec.extra = BroadcastExtras(g, a, b, n, dt);
  g.Record(std::move(spec));
  return y;
}

T Div(Graph& g, T a, T b) {
  const Wide n = std::max(g.Numel(a), g.Numel(b));
  const DT dt = Promote(g.Dtype(a), g.Dtype(b));
  T y = g.New(n, dt, g.RequiresGrad(a) || g.RequiresGrad(b));
  Graph::NodeSpec spec = Graph::Spec("Div", {a, b}, {y});
  if (g.RequiresGrad(a) || g.RequiresGrad(b)) spec.saved.push_back(b);
  if (g.RequiresGrad(b)) spec.saved.push_back(a);
  spec.extra = BroadcastExtras(g, a, b, n, dt);
  g.Record(std::move(spec));
  return y;
}

T Scale(Graph& g, T x) {
  T y = g.New(g.Numel(x), g.Dtype(x), g.RequiresGrad(x));
  g.Record(Graph::Spec("Scale", {x}, {y}));
  return y;
}

T Apply(Graph& g, Unary op, T x) {
  // pow, rsqrt, exp and sqrt are fp32 ops under autocast: their input is cast first.
  const bool fp32_policy =
      op == Unary::kPow || op == Unary::kRsqrt || op == Unary::kExp || op == Unary::kSqrt;
  T in = fp32_policy ? Fp32In(g, x) : g.Alias(x);
  T y = g.New(g.Numel(in), g.Dtype(in), g.RequiresGrad(in));
  Graph::NodeSpec spec = Graph::Spec("Unary", {in}, {y});
  switch (op) {
    case Unary::kSilu:
    case Unary::kGelu:
    case Unary::kGeluTanh: spec.saved = {in}; break;
    case Unary::kPow:
      spec.saved = {in};
      // grad * exponent * self.pow(exponent - 1): two full-size temporaries.
      spec.extra = {{g.Numel(in), g.Dtype(in)}, {g.Numel(in), g.Dtype(in)}};
      break;
    case Unary::kRelu:
    case Unary::kTanh:
    case Unary::kSigmoid:
    case Unary::kRsqrt:
    case Unary::kExp:
    case Unary::kSqrt: spec.saved = {y}; break;
    case Unary::kNeg: break;
  }
  if (!g.RequiresGrad(in)) spec.saved.clear();
  g.Record(std::move(spec));
  g.Drop(in);
  return y;
}

T MeanRows(Graph& g, T x, Wide width) {
  T y = g.New(g.Numel(x) / std::max<Wide>(width, 1), g.Dtype(x), g.RequiresGrad(x));
  g.Record(Graph::Spec("Mean", {x}, {y}));
  return y;
}

T Dropout(Graph& g, T x, double p) {
  // at::dropout: `if (p == 0 || !train || input.numel() == 0) return input;`
  if (p <= 0) return View(g, x);
  T y = g.New(g.Numel(x), g.Dtype(x), g.RequiresGrad(x));
  // The mask is kept for backward only when the input needs a gradient (a frozen embedding's
  // dropout under LoRA without checkpointing keeps none).
  T mask = g.New(g.Numel(x), DT::kBool, false);
  g.Record(Graph::Spec("NativeDropout", {x}, {y},
                       g.RequiresGrad(x) ? std::vector<T>{mask} : std::vector<T>{}));
  g.Drop(mask);
  return y;
}

T Softmax(Graph& g, T x, DT out_dt) {
  T in = g.autocast() ? Fp32In(g, x) : g.Alias(x);
  T y = g.New(g.Numel(in), out_dt, g.RequiresGrad(in));
  Graph::NodeSpec spec = Graph::Spec("Softmax", {in}, {y});
  if (g.RequiresGrad(in)) spec.saved = {y};
  g.Record(std::move(spec));
  g.Drop(in);
  return y;
}

T LayerNorm(Graph& g, T x, T w, T b, Wide width) {
  // layer_norm is an fp32 op under autocast.
  T in = Fp32In(g, x);
  const Wide rows = g.Numel(in) / std::max<Wide>(width, 1);
  const bool rg = g.RequiresGrad(in) || g.RequiresGrad(w) || g.RequiresGrad(b);
  T y = g.New(g.Numel(in), g.Dtype(in), rg);
  // native_layer_norm's mean and rstd are fp32 whatever the input (the CUDA kernel's acc type).
  T mean = g.New(rows, DT::kF32, false);
  T rstd = g.New(rows, DT::kF32, false);
  Graph::NodeSpec spec = Graph::Spec("LayerNorm", {in, w, b}, {y});
  // The weight and bias are saved too: no memory of their own when they are the parameters,
  // a copy kept until the backward when the caller cast them (llm-foundry's LPLayerNorm).
  if (rg) spec.saved = {in, mean, rstd, w, b};
  g.Record(std::move(spec));
  g.Drop(mean);
  g.Drop(rstd);
  g.Drop(in);
  return y;
}

T FusedRmsNorm(Graph& g, T x, T w, Wide width) {
  const Wide rows = g.Numel(x) / std::max<Wide>(width, 1);
  const bool rg = g.RequiresGrad(x) || g.RequiresGrad(w);
  T y = g.New(g.Numel(x), g.Dtype(x), rg);
  T rstd = g.New(rows, DT::kF32, false);
  Graph::NodeSpec spec = Graph::Spec("FusedRmsNorm", {x, w}, {y});
  if (rg) spec.saved = {x, rstd};
  g.Record(std::move(spec));
  g.Drop(rstd);
  return y;
}

T Sdpa(Graph& g, SdpaBackend backend, T q, T k, T v, const AttentionShape& a, T mask,
       std::vector<T>* stats_out) {
  const bool rg = g.RequiresGrad(q) || g.RequiresGrad(k) || g.RequiresGrad(v);
  const DT dt = g.Dtype(q);
  const Wide rows = a.batch * a.heads * a.seq;
  if (backend == SdpaBackend::kMath) {
    // The math composite (attention.cpp _scaled_dot_product_attention_math), with autocast off
    // below SDPA's autocast kernel. 16-bit inputs are computed in fp32 (torch.backends.cuda's
    // allow_fp16_bf16_reduction_math_sdp is off by default): q, k and v upcast; q scaled by
    // sqrt(scale); a causal call without a mask makes one (ones and tril in bool, `where` to the
    // accumulation dtype) that lives until the call returns; grouped keys and values repeated
    // (clones); k^T scaled; q @ k^T; the mask added in place; softmax; dropout; the
    // probabilities cast back (the tuple's second output, freed when the caller takes the
    // first); @ v; the output cast back.
    const DT acc = Half(dt) ? DT::kF32 : dt;
    T qa = Cast(g, q, acc);
    T ka = Cast(g, k, acc);
    T va = Cast(g, v, acc);
    T qs = Scale(g, qa);
    g.Drop(qa);
    T causal;
    if (a.causal && !mask.ok()) {
      T ones = g.New(a.seq * a.kv_seq, DT::kBool, false);
      T tril = g.New(a.seq * a.kv_seq, DT::kBool, false);
      g.Drop(ones);
      causal = g.New(a.seq * a.kv_seq, acc, false);
      g.Drop(tril);
    }
    if (a.kv_heads != a.heads) {
      const Wide groups = a.heads / std::max<Wide>(a.kv_heads, 1);
      T kr = Copy(g, ka, g.Numel(ka) * groups);
      g.Drop(ka);
      ka = kr;
      T vr = Copy(g, va, g.Numel(va) * groups);
      g.Drop(va);
      va = vr;
    }
    T ks = Scale(g, ka);
    g.Drop(ka);
    T scores = g.New(rows * a.kv_seq, acc, rg);
    g.Record(Graph::Spec("Bmm(qk)", {qs, ks}, {scores}, {qs, ks}));
    g.Drop(qs);
    g.Drop(ks);
    T probs = Softmax(g, scores, acc);
    g.Drop(scores);
    T dropped = Dropout(g, probs, a.dropout);
    g.Drop(probs);
    T second = Cast(g, dropped, dt);
    T out32 = g.New(rows * a.v_head_dim, acc, rg);
    g.Record(Graph::Spec("Bmm(pv)", {dropped, va}, {out32}, {dropped, va}));
    g.Drop(dropped);
    g.Drop(va);
    T out = Cast(g, out32, dt);
    g.Drop(out32);
    g.Drop(second);
    g.Drop(causal);
    return out;
  }
  T out = g.New(rows * a.v_head_dim, dt, rg);
  Graph::NodeSpec spec = Graph::Spec("Sdpa", {q, k, v}, {out});
  std::vector<T> stats;
  switch (backend) {
    case SdpaBackend::kFlash: {
      stats.push_back(g.New(rows, DT::kF32, false));  // logsumexp, B x H x L
      stats.push_back(g.New(2, DT::kU64, false));     // philox seed and offset
      stats.push_back(g.New(1, DT::kU64, false));     // "unused" debug mask
      // flash_api.cpp mha_bwd: the fp32 dQ accumulator and the softmax row sums; with grouped
      // keys and values, dK and dV per query head before they are summed.
      const Wide lr = RoundUp(a.seq, 128);
      const Wide dr = a.head_dim <= 128 ? RoundUp(a.head_dim, 32) : RoundUp(a.head_dim, 64);
      spec.extra = {{a.batch * lr * a.heads * dr, DT::kF32}, {a.batch * a.heads * lr, DT::kF32}};
      if (a.kv_heads != a.heads) {
        spec.extra.emplace_back(a.batch * a.kv_seq * a.heads * a.head_dim, dt);
        spec.extra.emplace_back(a.batch * a.kv_seq * a.heads * a.v_head_dim, dt);
      }
      break;
    }
    case SdpaBackend::kEfficient:
      stats.push_back(g.New(a.batch * a.heads * RoundUp(a.seq, 32), DT::kF32, false));
      stats.push_back(g.New(1, DT::kI64, false));  // philox seed
      stats.push_back(g.New(1, DT::kI64, false));  // philox offset
      break;
    case SdpaBackend::kCudnn: {
      stats.push_back(g.New(rows, DT::kF32, false));  // B x H x L x 1
      stats.push_back(g.New(1, DT::kI64, false));
      stats.push_back(g.New(1, DT::kI64, false));
      const Wide lr = RoundUp(a.seq, 128);
      const Wide dr = a.head_dim <= 128 ? RoundUp(a.head_dim, 32) : RoundUp(a.head_dim, 64);
      spec.extra = {{a.batch * lr * a.heads * dr, DT::kF32}, {a.batch * a.heads * lr, DT::kF32}};
      break;
    }
    case SdpaBackend::kMath: break;
  }
  if (rg) {
    spec.saved = {q, k, v, out};
    spec.saved.insert(spec.saved.end(), stats.begin(), stats.end());
    if (mask.ok() && backend != SdpaBackend::kFlash) spec.saved.push_back(mask);
  }
  g.Record(std::move(spec));
  for (T s : stats) {
    if (stats_out != nullptr) stats_out->push_back(g.Alias(s));
    g.Drop(s);
  }
  return out;
}

T CrossEntropy(Graph& g, T x, Wide rows, Wide vocab) {
  const bool rg = g.RequiresGrad(x);
  T logp = g.New(rows * vocab, g.Dtype(x), rg);
  g.Record(Graph::Spec("LogSoftmax", {x}, {logp}, {logp}));
  T total_weight = g.New(1, g.Dtype(x), false);
  T loss = g.New(1, g.Dtype(x), rg);
  g.Record(Graph::Spec("NllLoss", {logp}, {loss}, {logp, total_weight}));
  g.Drop(total_weight);
  g.Drop(logp);
  return loss;
}

T CrossEntropyLoss(Graph& g, T x, Wide rows, Wide vocab) {
  if (!g.autocast() || !Half(g.Dtype(x))) return CrossEntropy(g, x, rows, vocab);
  const bool rg = g.RequiresGrad(x);
  T logp = g.New(rows * vocab, g.Dtype(x), rg);
  g.Record(Graph::Spec("LogSoftmax", {x}, {logp}, {logp}));
  T logp32 = Cast(g, logp, DT::kF32);
  g.Drop(logp);
  T total_weight = g.New(1, DT::kF32, false);
  T loss = g.New(1, DT::kF32, rg);
  g.Record(Graph::Spec("NllLoss", {logp32}, {loss}, {logp32, total_weight}));
  g.Drop(total_weight);
  g.Drop(logp32);
  return loss;
}

}  // namespace memplan::estimator::step
