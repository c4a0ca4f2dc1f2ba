"""What a CUDA run allocates, reproduced on fake CPU tensors (part of memplan.trace).

memplan.trace runs the real training code on torch's FakeTensorMode with *CPU* fake tensors:
fake CUDA tensors trace a forward pass, but torch's autograd engine asks the CUDA driver for the
device's primary context before it runs a backward on them, which fails on a machine without a
GPU. On CPU, a handful of things differ from what the same code does on a GPU. Each difference is
corrected here, and each correction names the PyTorch source it follows (torch 2.15):

1. The caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp, ``round_size``): every
   allocation of n > 0 bytes takes ``max(512, ceil(n / 512) * 512)`` allocated bytes
   (kMinBlockSize = 512); a zero-byte tensor takes none. ``allocated_bytes`` counts a block's
   size, and a block carved from a cached segment is split whenever the remainder is at least
   512 bytes (small pool) or more than 1 MiB (large pool, kSmallSize): only an unsplit large-pool
   remainder (at most 1 MiB, never with ``expandable_segments``) escapes this rounding; it
   depends on the cache's history and is not modelled.
2. Scaled dot-product attention (aten/src/ATen/native/transformers/attention.cpp,
   ``scaled_dot_product_attention``; cuda/sdp_utils.cpp, ``select_sdp_backend``): on a GPU the
   backend is chosen from the device's compute capability; without one the CPU path is taken.
   ``ScaledDotProductAttention`` below picks the backend the chosen GPU would (cuDNN first on
   sm90/sm100 with cuDNN > 9.15, then flash, memory-efficient, math; each with its dtype, head
   dimension, mask and GQA conditions) and calls the same fused op the CUDA branch calls, so the
   autograd node saves what CUDA saves (query, key, value, output, the fp32 logsumexp of
   B x H x L, the RNG state). The math backend is the composite itself, run unchanged.
3. Kernel workspaces the fused attention backward allocates through the caching allocator,
   invisible to a meta kernel: flash attention's fp32 dQ accumulator (B x roundup(L, 128) x H x
   roundup(D, 32)) and softmax row sums (B x H x roundup(L, 128)), and with GQA the expanded dK
   and dV (B x S x H x D) before they are summed per KV head (flash_attn/flash_api.cpp,
   ``mha_bwd``); cuDNN's FA-style backward is given the same fp32 dQ accumulator and row sums
   (its workspace size is cuDNN's own and is not published; stated in the output).
4. Dropout (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``): CUDA runs
   ``native_dropout`` and saves a bool mask; CPU multiplies by a noise tensor of the input's
   dtype and saves that.
5. RMSNorm (aten/src/ATen/native/layer_norm.cpp, ``rms_norm_symint``): CUDA runs the fused
   ``_fused_rms_norm`` (saves the input and an fp32 rstd per row); CPU runs a composite that
   upcasts.
6. LayerNorm statistics (torch/_refs ``native_layer_norm``): on CPU, mean and rstd come back in
   the input's dtype; CUDA keeps them in fp32 (the accumulate type).
7. Autocast (aten/src/ATen/autocast_mode.cpp): the CUDA policy (which ops run in the lower
   precision, which in fp32, which set an fp32 output dtype, which promote) differs from the CPU
   one (CPU keeps layer_norm, softmax and pow in bf16 but casts cross_entropy_loss's input to
   fp32). ``CudaAutocast`` enables CPU autocast with the CUDA policy: the ops that have a CUDA
   autocast kernel in this torch, each with its CUDA cast policy and the weight-cast cache
   (fp32 leaf parameters cast once per autocast region and kept until it ends); ops with only a
   CPU policy fall through. ``verify_autocast_policy`` checks the table against the real CUDA
   autocast kernels (which run on fake CUDA tensors in a forward pass).
8. The cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, ``getChosenWorkspaceSize``):
   allocated from the caching allocator at the first matmul on a stream and kept; 32 MiB on
   sm90/sm100, 4096 KiB x 2 + 16 KiB x 8 elsewhere.
9. The optimizer's implementation (torch/optim/optimizer.py, ``_default_to_fused_or_foreach``):
   on CUDA, torch's Adam/AdamW/SGD default to ``foreach`` (one batch of temporaries per parameter
   group); fake parameters are not of type Tensor or Parameter, so on fake tensors the default is
   the for-loop. The harness passes ``foreach=True`` wherever the framework keeps torch's
   default.
"""

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ---- 1. the caching allocator ---------------------------------------------------------------------

MIN_BLOCK_BYTES = 512  # kMinBlockSize


def round_allocation(nbytes):
    """Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes``."""
    nbytes = int(nbytes)
    if nbytes <= 0:
        return 0
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


# ---- GPUs --------------------------------------------------------------------------------------

# Compute capability of the GPUs a user names; what decides the attention backend and the cuBLAS
# workspace size.
GPU_ARCH = {
    "v100": (7, 0), "t4": (7, 5), "a100": (8, 0), "a800": (8, 0), "a10": (8, 6), "a10g": (8, 6),
    "rtx3090": (8, 6), "a6000": (8, 6), "rtx4090": (8, 9), "l4": (8, 9), "l40s": (8, 9),
    "h100": (9, 0), "h800": (9, 0), "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0),
}
# The cuDNN the torch 2.15 CUDA 13 wheel ships (nvidia-cudnn-cu13 9.26): newer than 9.15.0, so
# cuDNN attention is preferred on sm90/sm100 (sdp_utils.cpp, check_prefer_cudnn_attention).
CUDNN_VERSION = 92600


def parse_gpu(name):
    """(name, (major, minor)) for a GPU name ("a100", "h100-80", "sm90"); ValueError if unknown."""
    key = str(name).lower().strip()
    if key.startswith("sm") and key[2:].isdigit():
        digits = key[2:]
        return key, (int(digits[:-1]), int(digits[-1]))
    base = key.split("-")[0].replace("_", "")
    if base in GPU_ARCH:
        return key, GPU_ARCH[base]
    raise ValueError("unknown GPU %r (one of %s, or smXY)" % (name, ", ".join(sorted(GPU_ARCH))))


def cublas_workspace_bytes(arch):
    """The cuBLAS workspace one stream holds (CublasHandlePool.cpp, default size)."""
    if arch in ((9, 0), (10, 0)):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


# ---- 2/3. scaled dot-product attention -----------------------------------------------------------

MATH, FLASH, EFFICIENT, CUDNN = "math", "flash", "efficient", "cudnn"


def _low_precision(dtype):
    return dtype in (torch.float16, torch.bfloat16)


def select_sdpa_backend(arch, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa,
                        enabled=None):
    """The backend select_sdp_backend picks on a GPU of compute capability ``arch`` for these
    inputs (cuda/sdp_utils.cpp): cuDNN (preferred on sm90/sm100), flash, memory-efficient, math,
    each behind its constraints. ``enabled`` is torch.backends.cuda's flags (sdpa_kernel)."""
    if enabled is None:
        enabled = {
            CUDNN: torch.backends.cuda.cudnn_sdp_enabled(),
            FLASH: torch.backends.cuda.flash_sdp_enabled(),
            EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
            MATH: torch.backends.cuda.math_sdp_enabled(),
        }
    major, minor = arch
    dims_ok = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    if not dims_ok:
        return MATH
    b, hq, lq, dq = q.shape
    hk, lk, dk = k.shape[1], k.shape[2], k.shape[3]
    dv = v.shape[3]
    requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or
                                                 v.requires_grad)
    heads_ok = hq == hk == v.shape[1] or (enable_gqa and hk == v.shape[1] and hq % hk == 0)
    nonzero = lq > 0 and lk > 0
    last_dim_contiguous = all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    dtype = q.dtype

    def can_cudnn():
        if not (major >= 8 and (major, minor) <= (12, 1)):
            return False
        if not _low_precision(dtype) or not heads_ok or not nonzero or not last_dim_contiguous:
            return False
        if dropout_p * 16.0 != math.floor(dropout_p * 16.0):
            return False
        if b > 65535 or hq > 65535 or lk == 1:
            return False
        sm90_or_10x = (major == 9 and minor == 0) or major == 10
        limit = 256 if sm90_or_10x else 128
        if dq > limit or dv > limit or dq % 8 or dv % 8:
            return False
        if requires_grad and sm90_or_10x:
            if not ((dq <= 128 and dv <= 128) or (dq == 192 and dv == 128) or
                    (dq == 256 and dv == 256)):
                return False
        return True

    def can_flash():
        if attn_mask is not None or not (dq == dk == dv and dq <= 256):
            return False
        if not ((8, 0) <= (major, minor) <= (12, 1)):
            return False
        if requires_grad and ((8, 6) <= (major, minor) <= (8, 9) or major == 12):
            if not (dq <= 192 or (dropout_p == 0.0 and dq > 224)):
                return False
        if is_causal and lq != lk:
            return False
        if not _low_precision(dtype) or not heads_ok or not nonzero or not last_dim_contiguous:
            return False
        return True

    def can_efficient():
        if not ((5, 0) <= (major, minor) <= (12, 1)):
            return False
        half = _low_precision(dtype)
        align = 1
        if major >= 8:
            align = 4
        if major >= 8 or (major >= 7 and half):
            align = max(align, 128 // (16 if half else 32))
        if dq != dk or dq % align or dv % align or dq <= 0:
            return False
        allowed = (torch.float16, torch.float32, torch.bfloat16) if major >= 8 else \
            (torch.float16, torch.float32)
        if dtype not in allowed or not heads_ok or not nonzero:
            return False
        return all(t.stride(-1) == 1 for t in (q, k, v))

    order = [FLASH, EFFICIENT, MATH]
    if sm_prefers_cudnn(arch):
        order = [CUDNN, FLASH, EFFICIENT, MATH]
    else:
        order.append(CUDNN)
    for backend in order:
        if not enabled.get(backend, False):
            continue
        if backend == CUDNN and can_cudnn():
            return CUDNN
        if backend == FLASH and can_flash():
            return FLASH
        if backend == EFFICIENT and can_efficient():
            return EFFICIENT
        if backend == MATH:
            return MATH
    return MATH


def sm_prefers_cudnn(arch):
    """check_prefer_cudnn_attention: cuDNN > 9.15 on sm9x/sm10x (CUDA >= 13 wheel)."""
    return CUDNN_VERSION > 91500 and arch[0] in (9, 10)


def _pad_last_dim(t, alignment):
    size = t.shape[-1]
    if size % alignment == 0:
        return t
    return F.pad(t, (0, alignment - size % alignment))


def _convert_bool_mask(mask, dtype):
    if mask is None or mask.dtype != torch.bool:
        return mask
    new = torch.zeros_like(mask, dtype=dtype)
    return new.masked_fill_(mask.logical_not(), float("-inf"))


def _preprocess_mask_efficient(mask, q, k):
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % 16:
        padded = F.pad(mask, (0, 16 - last % 16))
        return padded[..., :last]
    if mask.stride(0) % 16 or mask.stride(1) % 16 or mask.stride(2) % 16:
        return mask.contiguous()
    return mask


class ScaledDotProductAttention(TorchFunctionMode):
    """F.scaled_dot_product_attention as the CUDA composite runs it on ``arch``: the backend
    select_sdp_backend would pick, then the same fused op the CUDA branch of attention.cpp calls
    (flash inputs padded to a head dimension multiple of 8, a bool mask made additive, the
    memory-efficient mask expanded and aligned to 16). Counts the backends used."""

    def __init__(self, arch):
        super().__init__()
        self.arch = arch
        self.backends = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
        autocast = CudaAutocastPolicy.active
        if autocast is not None and torch.is_autocast_enabled("cpu"):
            # scaled_dot_product_attention has a lower-precision CUDA autocast kernel: the
            # backend is chosen, and the op run, on the cast inputs, with autocast excluded
            # below it (what the math composite calls is not cast again).
            query, key, value = (autocast.cast(t, autocast.dtype) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = autocast.cast(attn_mask, autocast.dtype)
            exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return self._run(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa)
        return self._run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _run(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        backend = select_sdpa_backend(self.arch, query, key, value, attn_mask, dropout_p,
                                      is_causal, enable_gqa)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        requires_grad = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad)
        if backend == CUDNN:
            mask = attn_mask
            if mask is not None and mask.dtype == torch.bool:
                mask = _convert_bool_mask(mask, query.dtype)
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, mask, requires_grad, dropout_p, is_causal, False,
                scale=scale)[0]
        if backend == FLASH:
            og = query.shape[-1]
            og_scale = scale if scale is not None else 1.0 / math.sqrt(og)
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                _pad_last_dim(query, 8), _pad_last_dim(key, 8), _pad_last_dim(value, 8),
                dropout_p, is_causal, False, scale=og_scale)[0]
            return out[..., :og] if out.shape[-1] != og else out
        if backend == EFFICIENT:
            mask = _convert_bool_mask(attn_mask, query.dtype)
            if mask is not None:
                mask = _preprocess_mask_efficient(mask, query, key)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, requires_grad, dropout_p, is_causal, scale=scale)[0]
        # The math backend is the composite _scaled_dot_product_attention_math (a bool mask made
        # additive first), not this call on CPU tensors, which would run the CPU's fused flash
        # kernel: the math composite keeps the whole score matrix, in fp32 for 16-bit inputs
        # unless allow_fp16_bf16_reduction_math_sdp is set.
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, _convert_bool_mask(attn_mask, query.dtype), dropout_p, is_causal,
            None, scale=scale, enable_gqa=enable_gqa)[0]


# ---- 4/5. dropout and RMSNorm take their CUDA kernels --------------------------------------------

class CudaFunctions(TorchFunctionMode):
    """F.dropout and F.rms_norm as CUDA runs them: native_dropout (a bool mask saved) and
    _fused_rms_norm (the input and an fp32 rstd saved)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout, torch.nn.functional.dropout):
            return self._dropout(func, *args, **kwargs)
        if func in (F.rms_norm, torch.rms_norm):
            return self._rms_norm(func, *args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(func, input, p=0.5, training=True, inplace=False, train=None):
        if train is not None:
            training = train
        if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return func(input, p, training, inplace) if func is F.dropout else func(input, p,
                                                                                   training)

    @staticmethod
    def _rms_norm(func, input, normalized_shape, weight=None, eps=None):
        policy = CudaAutocastPolicy.active
        if torch.is_autocast_enabled("cpu") and policy is not None:
            # rms_norm has an fp32 CUDA autocast kernel (autocast_mode.cpp).
            input = policy.cast(input, torch.float32)
            weight = policy.cast(weight, torch.float32) if weight is not None else None
        with torch._C._ExcludeDispatchKeyGuard(
                torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return FusedRmsNorm.apply(input, tuple(normalized_shape), weight)


class FusedRmsNorm(torch.autograd.Function):
    """aten::_fused_rms_norm as CUDA runs it: the output in the input's dtype and an fp32 rstd
    per row, saving the input, rstd and weight (derivatives.yaml, _fused_rms_norm). On CPU the op
    has no kernel of its own and decomposes into the upcasting composite, so its CUDA allocations
    are made here explicitly; the backward returns the input's and the weight's gradients. The
    CUDA backward kernel's partial sums for the weight gradient are not modelled."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight):
        rows = input.shape[:input.dim() - len(normalized_shape)]
        rstd = torch.empty(tuple(rows) + (1,) * len(normalized_shape), dtype=torch.float32,
                           device=input.device)
        dtype = input.dtype if weight is None else torch.promote_types(input.dtype,
                                                                       weight.dtype)
        out = torch.empty(input.shape, dtype=dtype, device=input.device)
        ctx.save_for_backward(input, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        input, rstd, weight = ctx.saved_tensors
        grad_input = torch.empty_like(input) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if weight is not None and \
            ctx.needs_input_grad[2] else None
        return grad_input, None, grad_weight


# ---- 3/6. below autograd: LayerNorm statistics, attention-backward workspaces ------------------

def _roundup(x, m):
    return (x + m - 1) // m * m


class CudaKernels(TorchDispatchMode):
    """Below autograd: native_layer_norm keeps fp32 statistics, and the fused attention backward
    ops allocate the workspaces their CUDA kernels take from the caching allocator."""

    def __init__(self):
        super().__init__()
        self.workspaces = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.native_layer_norm.default:
            out, mean, rstd = func(*args, **kwargs)
            if mean.dtype != torch.float32 and mean.dtype != torch.float64:
                mean = mean.to(torch.float32)
                rstd = rstd.to(torch.float32)
            return out, mean, rstd
        if func in (torch.ops.aten._scaled_dot_product_flash_attention.default,
                    torch.ops.aten._scaled_dot_product_efficient_attention.default,
                    torch.ops.aten._scaled_dot_product_cudnn_attention.default):
            # The meta kernels make the RNG state tensors on the meta device (CUDA makes them on
            # the GPU): made on the trace's device, so they are counted and checkpointing sees
            # the same saved tensors when it recomputes.
            out = func(*args, **kwargs)
            device = args[0].device
            return type(out)(
                torch.empty(t.shape, dtype=t.dtype, device=device)
                if isinstance(t, torch.Tensor) and t.device.type == "meta" else t for t in out)
        if func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            return self._with_workspace("flash", func, args, kwargs)
        if func is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
            return self._with_workspace("cudnn", func, args, kwargs)
        return func(*args, **kwargs)

    def _with_workspace(self, kind, func, args, kwargs):
        grad_out, query, key = args[0], args[1], args[2]
        b, h, lq, d = query.shape
        hk, lk = key.shape[1], key.shape[2]
        lq_r = _roundup(lq, 128)
        d_r = _roundup(d, 32) if d <= 128 else _roundup(d, 64)
        held = [torch.empty((b, lq_r, h, d_r), dtype=torch.float32, device=query.device),
                torch.empty((b, h, lq_r), dtype=torch.float32, device=query.device)]
        if kind == "flash" and hk != h:
            held.append(torch.empty((b, lk, h, d), dtype=query.dtype, device=query.device))
            held.append(torch.empty((b, lk, h, d), dtype=query.dtype, device=query.device))
        nbytes = sum(round_allocation(t.numel() * t.element_size()) for t in held)
        self.workspaces[kind] = max(self.workspaces.get(kind, 0), nbytes)
        result = func(*args, **kwargs)
        del held
        return result


# ---- 7. autocast with the CUDA policy ------------------------------------------------------------

LOWER = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
PROMOTE = "promote"
FP32_APPEND_DTYPE = "fp32_append_dtype"

# The CUDA autocast policy of every op that has an AutocastCUDA kernel in torch 2.15
# (autocast_mode.h's AT_FORALL_* lists); verify_autocast_policy checks it against the kernels.
CUDA_AUTOCAST_POLICY = {}
for _name in ("_convolution", "_convolution.deprecated", "_cudnn_rnn",
              "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell",
              "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
              "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
              "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
              "cudnn_convolution", "cudnn_convolution_transpose", "einsum", "gru_cell",
              "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv",
              "prelu", "rnn_relu_cell", "rnn_tanh_cell", "scaled_dot_product_attention"):
    CUDA_AUTOCAST_POLICY[_name] = LOWER
for _name in ("_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "acos", "asin",
              "binary_cross_entropy", "binary_cross_entropy_with_logits", "cdist", "cosh",
              "cosine_embedding_loss", "cosine_similarity", "dist", "erfinv", "exp", "expm1",
              "frobenius_norm.dim", "group_norm", "hinge_embedding_loss", "huber_loss", "kl_div",
              "l1_loss", "layer_norm", "linalg_matrix_sqrth", "log", "log10", "log1p", "log2",
              "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
              "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d",
              "nuclear_norm", "nuclear_norm.dim", "pdist", "poisson_nll_loss", "pow.Scalar",
              "pow.Tensor_Scalar", "pow.Tensor_Tensor", "reciprocal", "renorm", "rms_norm",
              "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softplus", "tan",
              "triplet_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d",
              "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d",
              "upsample_nearest3d", "upsample_trilinear3d"):
    CUDA_AUTOCAST_POLICY[_name] = FP32
for _name in ("cumprod", "cumsum", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
              "linalg_vector_norm", "log_softmax.int", "prod", "prod.dim_int", "softmax.int",
              "sum", "sum.dim_IntList"):
    CUDA_AUTOCAST_POLICY[_name] = FP32_SET_OPT_DTYPE
for _name in ("norm.Scalar", "norm.ScalarOpt_dim"):
    CUDA_AUTOCAST_POLICY[_name] = FP32_APPEND_DTYPE
for _name in ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
              "scatter_add", "tensordot", "vdot"):
    CUDA_AUTOCAST_POLICY[_name] = PROMOTE


def _op(name):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


def autocast_cuda_ops():
    """Names (without "aten::") of the ops with an AutocastCUDA kernel in this torch."""
    return sorted(n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and
                  torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA"))


def autocast_cpu_ops():
    return sorted(n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and
                  torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU"))


class CudaAutocastPolicy:
    """The CUDA autocast policy on CPU autocast: while installed, Python kernels registered at
    AutocastCPU replace the CPU policy: each op with a CUDA autocast kernel casts as CUDA does
    (with the weight-cast cache of autocast_mode.cpp's cached_cast), every other op with a
    CPU-only kernel falls through. It stays installed for a whole traced step, so checkpointing's
    recomputation (which re-enters CPU autocast with the state it recorded) casts the same way.
    One instance at a time; not thread-safe."""

    active = None

    def __init__(self):
        self._cache = {}
        self._lib = None

    @property
    def dtype(self):
        return torch.get_autocast_dtype("cpu")

    def clear_cache(self):
        self._cache.clear()

    def cast(self, t, to_type):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or \
                t.dtype == torch.float64 or t.dtype == to_type:
            return t
        can_cache = (torch.is_autocast_cache_enabled() or _REGION_CACHE[0]) and \
            to_type == self.dtype and t.dtype == torch.float32 and t.requires_grad and \
            t.is_leaf and not t._is_view()
        if can_cache:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            out = t.to(to_type)
            self._cache[id(t)] = (weakref.ref(t), out)
            return out
        return t.to(to_type)

    def _cast_args(self, value, to_type):
        if isinstance(value, torch.Tensor):
            return self.cast(value, to_type)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._cast_args(v, to_type) for v in value)
        return value

    def _promote_type(self, values):
        current = self.dtype
        for v in values:
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and \
                        t.dtype != torch.float64:
                    if current == torch.float32 or t.dtype == torch.float32:
                        current = torch.float32
        return current

    def _kernel(self, op, policy):
        exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        schema_args = [a.name for a in op._schema.arguments]

        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if policy == LOWER:
                    args = [self._cast_args(a, self.dtype) for a in args]
                    kwargs = {k: self._cast_args(v, self.dtype) for k, v in kwargs.items()}
                elif policy == FP32:
                    args = [self._cast_args(a, torch.float32) for a in args]
                    kwargs = {k: self._cast_args(v, torch.float32) for k, v in kwargs.items()}
                elif policy == FP32_SET_OPT_DTYPE:
                    first = args[0] if args else None
                    eligible = isinstance(first, torch.Tensor) and first.is_floating_point() \
                        and first.dtype != torch.float64
                    if eligible and "dtype" in schema_args:
                        index = schema_args.index("dtype")
                        if index < len(args):
                            if args[index] is None:
                                args = list(args)
                                args[index] = torch.float32
                        elif kwargs.get("dtype") is None:
                            kwargs["dtype"] = torch.float32
                elif policy == PROMOTE:
                    to_type = self._promote_type(list(args) + list(kwargs.values()))
                    args = [self._cast_args(a, to_type) for a in args]
                    kwargs = {k: self._cast_args(v, to_type) for k, v in kwargs.items()}
                return op(*args, **kwargs)

        return kernel

    def __enter__(self):
        if CudaAutocastPolicy.active is not None:
            raise RuntimeError("CudaAutocastPolicy is not reentrant")
        import warnings
        self._lib = torch.library.Library("aten", "IMPL")
        cuda_ops = set(autocast_cuda_ops())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in sorted(cuda_ops):
                policy = CUDA_AUTOCAST_POLICY.get(name)
                if policy is None or policy == FP32_APPEND_DTYPE:
                    continue
                try:
                    op = _op(name)
                except AttributeError:
                    continue
                self._lib.impl(name, self._kernel(op, policy), "AutocastCPU")
            for name in autocast_cpu_ops():
                if name not in cuda_ops:
                    self._lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        # torch.is_autocast_enabled() without a device asks about CUDA (autocast_mode.py); code
        # that casts by hand when autocast is on (llm-foundry's LPLayerNorm and LPRMSNorm:
        # _cast_if_autocast_enabled) must see the emulated CUDA autocast, which is CPU autocast.
        self._is_enabled = torch.is_autocast_enabled

        def is_autocast_enabled(*args, **kwargs):
            if not args and not kwargs:
                return self._is_enabled("cpu")
            return self._is_enabled(*args, **kwargs)
        torch.is_autocast_enabled = is_autocast_enabled
        CudaAutocastPolicy.active = self
        return self

    def __exit__(self, *exc):
        CudaAutocastPolicy.active = None
        torch.is_autocast_enabled = self._is_enabled
        self._cache.clear()
        self._lib._destroy()
        self._lib = None
        return False


# Whether the current autocast region caches weight casts (torch's own cache flag is turned off
# in the regions memplan opens, so the C++ cache never holds a second copy).
_REGION_CACHE = [False]


class CudaAutocast:
    """``torch.autocast("cuda", dtype)`` for the traced forward: CPU autocast, cast by the
    installed CudaAutocastPolicy; the weight-cast cache lives until the region ends."""

    def __init__(self, dtype=torch.bfloat16, cache_enabled=True):
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self._autocast = None
        self._own_policy = None

    def __enter__(self):
        if CudaAutocastPolicy.active is None:
            self._own_policy = CudaAutocastPolicy().__enter__()
        self._autocast = torch.autocast("cpu", dtype=self.dtype, cache_enabled=False)
        self._autocast.__enter__()
        _REGION_CACHE[0] = self.cache_enabled
        return self

    def __exit__(self, *exc):
        _REGION_CACHE[0] = False
        CudaAutocastPolicy.active.clear_cache()
        self._autocast.__exit__(*exc)
        if self._own_policy is not None:
            self._own_policy.__exit__(*exc)
        return False


class CudaSemantics:
    """Everything above, for one traced step: the autocast policy, the function-level
    corrections (SDPA, dropout, RMSNorm) and the kernel-level ones. Torch-function modes are not
    active while autograd runs the backward, so activation checkpointing's recomputation is
    wrapped to re-enter them (torch.utils.checkpoint: the non-reentrant recompute context and the
    reentrant CheckpointFunction.backward) and to drop the weight-cast cache of the recompute's
    autocast region when it ends, as torch does."""

    def __init__(self, arch):
        self.arch = arch
        self.sdpa = ScaledDotProductAttention(arch)
        self.kernels = CudaKernels()
        self._stack = None

    @contextlib.contextmanager
    def recompute_modes(self):
        sdpa = ScaledDotProductAttention(self.arch)
        sdpa.backends = self.sdpa.backends
        cached = _REGION_CACHE[0]
        _REGION_CACHE[0] = torch.is_autocast_enabled("cpu")
        try:
            with sdpa, CudaFunctions():
                yield
        finally:
            _REGION_CACHE[0] = cached
            if CudaAutocastPolicy.active is not None:
                CudaAutocastPolicy.active.clear_cache()

    def __enter__(self):
        import torch.utils.checkpoint as cp
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(CudaAutocastPolicy())
        self._stack.enter_context(self.sdpa)
        self._stack.enter_context(CudaFunctions())
        self._stack.enter_context(self.kernels)
        semantics = self
        original_impl = cp._checkpoint_without_reentrant_generator_impl
        original_backward = cp.CheckpointFunction.backward

        def impl(fn, args, kwargs, *rest, context_fn=cp.noop_context_fn, **options):
            def wrapped_context_fn():
                forward_context, recompute_context = context_fn()
                return forward_context, _chain(recompute_context, semantics.recompute_modes())
            return original_impl(fn, args, kwargs, *rest, context_fn=wrapped_context_fn,
                                 **options)

        def backward(ctx, *args):
            with semantics.recompute_modes():
                return original_backward(ctx, *args)

        cp._checkpoint_without_reentrant_generator_impl = impl
        cp.CheckpointFunction.backward = staticmethod(backward)

        def restore():
            cp._checkpoint_without_reentrant_generator_impl = original_impl
            cp.CheckpointFunction.backward = staticmethod(original_backward)
        self._stack.callback(restore)
        self._stack.enter_context(_unpacked_position_ids())
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


@contextlib.contextmanager
def _unpacked_position_ids():
    """Transformers' masks look for packed sequences in the position ids when there is no
    attention mask and no cache (gradient checkpointing, or use_cache false):
    masking_utils.find_packed_sequence_indices. On real tensors the traced batches' positions (an
    arange per sequence) give None, and SDPA runs causal with no mask. On fake tensors the values
    cannot be read, and its is_tracing() check (which counts a FakeTensor as tracing) answers
    "packed": a materialized mask, the memory-efficient kernel and repeated keys and values that
    the GPU run does not have. The traced batches are never packed, so the answer is None."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _chain(first, second):
    with first, second:
        yield


def verify_autocast_policy():
    """Differences between CUDA_AUTOCAST_POLICY and this torch: (ops with a CUDA autocast kernel
    missing from the table, table entries torch has no CUDA kernel for, ops whose output dtype
    under the real CUDA autocast kernels (run on fake CUDA tensors) differs from the emulation's
    on fake CPU tensors). All three empty means the emulation matches."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cuda_ops = set(autocast_cuda_ops())
    missing = sorted(cuda_ops - set(CUDA_AUTOCAST_POLICY))
    extra = sorted(set(CUDA_AUTOCAST_POLICY) - cuda_ops)
    probes = {
        "linear": lambda d, x32, xb, w: F.linear(x32, w),
        "mm": lambda d, x32, xb, w: torch.mm(x32, w.t()),
        "matmul": lambda d, x32, xb, w: torch.matmul(x32, w.t()),
        "bmm": lambda d, x32, xb, w: torch.bmm(x32[None], w.t()[None]),
        "baddbmm": lambda d, x32, xb, w: torch.baddbmm(x32[None, :, :8], x32[None], w.t()[None]),
        "softmax.int": lambda d, x32, xb, w: torch.softmax(xb, -1),
        "log_softmax.int": lambda d, x32, xb, w: torch.log_softmax(xb, -1),
        "layer_norm": lambda d, x32, xb, w: F.layer_norm(xb, (32,)),
        "rms_norm": lambda d, x32, xb, w: F.rms_norm(xb, (32,)),
        "pow.Tensor_Scalar": lambda d, x32, xb, w: xb.pow(2),
        "rsqrt": lambda d, x32, xb, w: xb.rsqrt(),
        "exp": lambda d, x32, xb, w: xb.exp(),
        "sum": lambda d, x32, xb, w: xb.sum(),
        "cumsum": lambda d, x32, xb, w: xb.cumsum(-1),
        "nll_loss": lambda d, x32, xb, w: F.nll_loss(xb, torch.zeros(16, dtype=torch.long,
                                                                        device=d)),
        "cross_entropy": lambda d, x32, xb, w: F.cross_entropy(
            xb, torch.zeros(16, dtype=torch.long, device=d)),
        "addcmul": lambda d, x32, xb, w: torch.addcmul(xb, x32, x32),
        "silu": lambda d, x32, xb, w: F.silu(xb),
        "gelu": lambda d, x32, xb, w: F.gelu(xb),
        "mean": lambda d, x32, xb, w: xb.mean(-1),
        "embedding": lambda d, x32, xb, w: F.embedding(torch.zeros(4, dtype=torch.long,
                                                                   device=d), w),
    }
    differ = []
    with FakeTensorMode():
        for name, probe in probes.items():
            results = {}
            for device in ("cuda", "cpu"):
                x32 = torch.empty(16, 32, device=device, requires_grad=True)
                xb = torch.empty(16, 32, device=device, dtype=torch.bfloat16)
                w = torch.empty(8, 32, device=device, requires_grad=True)
                if device == "cuda":
                    torch.set_autocast_enabled("cuda", True)
                    torch.set_autocast_dtype("cuda", torch.bfloat16)
                    torch.autocast_increment_nesting()
                    try:
                        results[device] = probe(device, x32, xb, w).dtype
                    finally:
                        torch.autocast_decrement_nesting()
                        torch.set_autocast_enabled("cuda", False)
                        torch.clear_autocast_cache()
                else:
                    with CudaAutocastPolicy(), CudaAutocast(torch.bfloat16), CudaFunctions():
                        results[device] = probe(device, x32, xb, w).dtype
            if results["cuda"] != results["cpu"]:
                differ.append((name, str(results["cuda"]), str(results["cpu"])))
    return missing, extra, differ


@contextlib.contextmanager
def no_op():
    yield
