// The memory items (Note [Memory items]): one function per allocation behaviour of a framework,
// and kItemRules, their report order.
#include <algorithm>
#include <string>

#include "estimator/memory_model.h"
#include "estimator/memory_model_internal.h"

namespace memplan::estimator::mm {

Wide OptimizerStateBytes(const TrainingSetup& s, Wide trainable, Wide factored) {
  const bool pure = s.precision == Precision::kBf16Pure;
  switch (s.optimizer) {
    case Optimizer::kAdamW: return trainable * (pure ? 4 : 8);
    case Optimizer::kAdam8bit:
      return trainable * 2 + CeilDiv(trainable, static_cast<Wide>(kAdam8bitBlock)) * 2 * 4;
    case Optimizer::kSgd: return s.sgd_momentum > 0 ? trainable * (pure ? 2 : 4) : 0;
    case Optimizer::kLion: return trainable * (pure ? 2 : 4);
    case Optimizer::kAdafactor: return trainable * (pure ? 2 : 4) + factored * 4;
  }
  return 0;
}

namespace {

// Note [Memory items]
// Each memory item is one allocation behaviour of a framework, modelled by one small function
// below that says what it is, where the framework allocates it (file and function), and in which
// phases (Note [Phases]) it is live. kItemRules lists them in report order; EstimateMemory runs
// them over one ItemContext (the facts every item reads, computed once) and takes the peak as the
// largest phase total. To check one item against DeepSpeed's or PyTorch's source, read its
// function alone.
// (ItemContext: memory_model_internal.h.)

// Note [NVMe partitions]
// ZeRO-3 with offload_param nvme swaps a parameter's 16-bit partition out only when
// AsyncPartitionedParameterSwapper.swappable_tensor holds: at least max(MIN_AIO_BYTES = 1 MiB,
// aio.block_size) bytes (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py; the caller is
// partition_parameters.py Init._partition_param). A smaller partition stays in host memory, pinned
// with pin_memory. Each swapped partition has a file of its own, its length rounded up to
// AIO_ALIGNED_BYTES (1024, swap_tensor/utils.py). Transformers builds a tied output head as a
// Linear of its own inside zero.Init and ties it to the embedding afterwards, so that Linear's
// partition is swapped out once and its file stays on the drive beside the embedding's.
// The optimizer swapper applies the same size rule to each parameter's fp32 gradient partition
// (swap_tensor/optimizer_utils.py _swap_out_gradients): a smaller one is kept in host memory
// (unswapped_gradients). Measured with DeepSpeed 0.19 (tests/accuracy/deepspeed_nvme.json).
constexpr Wide kMinAioBytes = Wide{1} << 20;
constexpr Wide kAioAlignedBytes = 1024;

struct NvmeSplit {
  Wide nvme = 0;    // bytes written to swap files, per GPU
  Wide memory = 0;  // bytes kept in host memory, per GPU
};

// The inventory's partitions of `elem_bytes` per element, split by the swapper's size rule.
// `params`: the 16-bit working partitions (persistent tensors excluded: they stay whole on the
// GPU; tied aliases count as the file their construction left); otherwise the fp32 gradients.
NvmeSplit NvmePartitions(const ItemContext& c, Wide elem_bytes, bool params) {
  NvmeSplit out;
  const Wide min_aio = std::max<Wide>(kMinAioBytes, U(c.s.aio_block_size));
  const Wide threshold = U(c.s.stage3_param_persistence_threshold);
  for (const TensorInfo& t : c.inventory.tensors) {
    const bool alias = !t.tied_to.empty();
    if (params ? U(t.numel) <= threshold : alias) continue;
    const Wide bytes = CeilDiv(c.TpShare(U(t.numel)), c.d) * elem_bytes;
    if (bytes >= min_aio) {
      out.nvme += params ? CeilDiv(bytes, kAioAlignedBytes) * kAioAlignedBytes : bytes;
    } else if (!alias) {
      out.memory += bytes;
    }
  }
  return out;
}

// params_working, params_quantized, autocast_weight_copies. The working copy of every parameter
// (16-bit in mixed and pure precision, fp32 in fp32 and under autocast), adapters included,
// QLoRA's quantised Linears excluded. ZeRO-3 partitions each over the data-parallel group and
// keeps tensors of at most stage3_param_persistence_threshold elements whole on every GPU
// (deepspeed/runtime/zero/partition_parameters.py, Init._partition_param; stage3.py
// persistent_parameters); offload_param moves the partitions to host memory or NVMe
// (partitioned_param_swapper.py). All phases.
Status ParamsWorking(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  const Wide plain = c.f.total - c.frozen_quantized + c.f.lora;
  Wide gpu = 0, cpu = 0, nvme = 0, pinned = 0;
  std::string how;
  if (c.Fsdp()) {
    // FSDP flattens each wrapped unit's parameters and keeps this rank's shard in the parameter
    // dtype (fp32 under MixedPrecision, which casts only the gathered copy): FlatParamHandle's
    // local shard (torch/distributed/fsdp/_flat_param.py); CPUOffload(offload_params=True)
    // keeps it in pinned host memory.
    const Wide shard = c.FsdpShard(plain) * c.fsdp_param_bytes;
    how = ", " + c.FsdpName() +
          (c.fsdp == FsdpSharding::kNoShard
               ? std::string(" (not sharded)")
               : " (sharded over " + std::to_string(static_cast<uint64_t>(c.d)) + " GPUs)");
    if (c.fsdp_offload) {
      cpu = pinned = shard * c.g;
    } else {
      gpu = shard;
    }
    out->Add("params_working",
             "parameters, " + std::string(c.fsdp_param_bytes == 4 ? "fp32" : "bf16") + how, gpu,
             cpu, 0, pinned, kAllPhases);
  } else if (s.zero_stage == 3) {
    const Wide persistent = c.f.persistent + c.f.lora_persistent;
    const Wide persistent_bytes = c.TpShare(persistent) * c.w;
    const Wide shard = CeilDiv(c.TpShare(plain - persistent), c.d) * c.w;
    gpu = persistent_bytes;
    how = ", ZeRO-3 partitioned over " + std::to_string(static_cast<uint64_t>(c.d)) +
          " GPUs (tensors <= " + std::to_string(s.stage3_param_persistence_threshold) +
          " elements kept whole)";
    if (s.offload_param == OffloadDevice::kCpu) {
      cpu = shard * c.g;
      if (s.pin_memory) pinned = cpu;
      how += ", partitions offloaded to CPU";
    } else if (s.offload_param == OffloadDevice::kNvme) {
      nvme = shard * c.g;
      how += ", partitions offloaded to NVMe";
      if (c.frozen_quantized == 0) {  // Note [NVMe partitions]
        const NvmeSplit split = NvmePartitions(c, c.w, /*params=*/true);
        const Wide adapters = CeilDiv(c.TpShare(c.f.lora - c.f.lora_persistent), c.d) * c.w;
        nvme = (split.nvme + adapters) * c.g;
        // The small partitions of trainable tensors move into nvme_param_flat_buffer with the
        // rest when it holds the whole partition; frozen ones (LoRA's base) stay where they are.
        const bool flat_holds_all = U(s.param_max_in_cpu) >= c.Part(c.trainable, 1);
        cpu = (c.lora || !flat_holds_all ? split.memory : 0) * c.g;
        if (s.pin_memory) pinned = cpu;
        how += " (those under max(1 MiB, aio.block_size) kept in host memory)";
      }
    } else {
      gpu += shard;
    }
  } else {
    gpu = c.TpShare(plain) * c.param_bytes;
  }
  if (!c.Fsdp()) {
    out->Add("params_working",
             "parameters, " + std::string(s.autocast ? "fp32" : c.half) + " working copy" + how,
             gpu, cpu, nvme, pinned, kAllPhases);
  }
  if (s.autocast) {
    // torch.autocast casts each weight to 16-bit when an op uses it (aten/src/ATen/
    // autocast_mode.cpp cached_cast); the matmul saves the copy for the input gradient, so it
    // lives to its layer's backward. The cast cache keeps the copies of weights that require
    // grad (leaves only) until the forward ends; a frozen weight's copy (LoRA's base) is not
    // cached. With every block checkpointed nothing in a block is saved: the forward holds the
    // cached copies of the trainable weights, and each block's backward the copies its recompute
    // casts again (the largest block's).
    const bool every_block =
        s.checkpointing == Checkpointing::kFull && std::max<int64_t>(s.checkpoint_every, 1) == 1;
    if (!every_block) {
      out->Add("autocast_weight_copies",
               "16-bit copies of the weights made by torch.autocast, saved for backward",
               c.TpShare(c.f.total) * 2, 0, 0, 0, kPhaseForward | kPhaseBackward,
               Alloc::kTransient);
    } else {
      const Wide cached = c.lora ? c.f.lora : c.trainable;
      out->Add("autocast_weight_copies",
               "16-bit copies of the trainable weights in torch.autocast's cache (forward; every "
               "block checkpointed saves none)",
               c.TpShare(cached) * 2, 0, 0, 0, kPhaseForward, Alloc::kTransient);
      out->Add("autocast_recompute_copies",
               "16-bit copies of the largest block's weights, cast again by its recompute and "
               "saved for its backward",
               c.TpShare(static_cast<Wide>(c.counts.largest_block_params)) * 2, 0, 0, 0,
               kPhaseBackward, Alloc::kTransient);
    }
  }
  if (c.frozen_quantized > 0) {
    // bitsandbytes Params4bit: 4-bit codes plus the quantisation state (absmax per 64 weights).
    const Wide q = Scale(c.Part(c.frozen_quantized, 3), c.nf4_bits / 8);
    out->Add("params_quantized",
             "frozen base Linears in NF4 (" + std::string(s.double_quant ? "4.127" : "4.5") +
                 " bits per parameter)",
             q, 0, 0, 0, kAllPhases);
    // bitsandbytes MatMul4Bit.forward/backward dequantise each weight to a 16-bit copy for the
    // matmul (F.dequantize_4bit(B, quant_state).to(A.dtype)); one Linear at a time. The copy is
    // in the dtype the weight was quantised from: Transformers quantises the loaded bf16 weights
    // (one copy), Lightning's plugin (fabric/plugins/precision/bitsandbytes.py, _Linear4bit)
    // quantises an fp16 copy, so dequantize_4bit returns fp16 and .to(bf16) makes a second.
    const Wide copies = s.framework == Framework::kLitGpt && c.w == 2 ? 2 : 1;
    out->Add("qlora_dequant_workspace",
             copies == 2 ? "fp16 and bf16 copies of the Linear being dequantised (bitsandbytes "
                           "MatMul4Bit on weights Lightning quantised from fp16)"
                         : "16-bit copy of the Linear being dequantised (bitsandbytes MatMul4Bit)",
             copies * c.TpShare(c.largest_quantized) * c.w, 0, 0, 0, kPhaseForward | kPhaseBackward,
             Alloc::kTransient);
  }
  return Status::Ok();
}

// params_master. Mixed precision keeps fp32 master weights of the trainable parameters in the
// optimizer's partition (DeepSpeed stage_1_and_2.py single_partition_of_fp32_groups, stage3.py
// fp32_partitioned_groups_flat), on the optimizer's device. Not under autocast, whose weights are
// fp32 already. All phases.
Status ParamsMaster(const ItemContext& c, Builder* out) {
  if (!c.master) return Status::Ok();
  Wide gpu = 0, cpu = 0, nvme = 0;
  c.PlaceOptimizer(c.Part(c.trainable, 1) * 4, &gpu, &cpu, &nvme);
  out->Add("params_master",
           "fp32 master weights of the trainable parameters" +
               std::string(c.s.zero_stage >= 1 ? ", ZeRO-partitioned" : "") +
               (c.Offloaded() ? ", on " + c.opt_where : ""),
           gpu, cpu, nvme, 0, kAllPhases);
  return Status::Ok();
}

// grads, grads_fp32. Note [Gradient storage]. Without optimizer offload: the gradient (its
// partition from ZeRO-2 on) in the working dtype, plus in mixed precision the fp32 copy the
// optimizer steps on: the whole partition for ZeRO-0/1/2 (stage_1_and_2.py
// single_partition_of_fp32_groups[i].grad), one sub-group at a time for ZeRO-3, which flattens a
// sub-group's 16-bit gradients, converts them to fp32, steps and frees them
// (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group).
// With optimizer offload, ZeRO-3 keeps the 16-bit gradient partition in host memory
// (stage3.py grad_partitions_flat_buffer on the offload device, pinned with pin_memory) and
// converts each reduced partition to fp32 on the way: into an fp32 buffer per sub-group in host
// memory for offload_optimizer cpu, swapped out to NVMe for nvme
// (stage3.py partition_grads -> optimizer_swapper.swap_out_gradients). ZeRO-1/2 copy the reduced
// partition into an fp32 gradient buffer in host memory (stage_1_and_2.py
// async_accumulate_grad_in_cpu_via_gpu).
Status Grads(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (c.Fsdp()) {
    // FSDP reduce-scatters each unit's gradient and keeps this rank's shard as the flat
    // parameter's .grad, in the parameter dtype (_post_backward_hook, _cast_grad_to_param_dtype);
    // with CPUOffload the shard is copied to pinned host memory (_offload_grad).
    const Wide bytes = c.FsdpShard(c.trainable) * c.fsdp_param_bytes;
    out->Add("grads",
             "gradients of the trainable parameters, " + c.FsdpName() +
                 (c.fsdp == FsdpSharding::kNoShard ? "" : ", sharded"),
             c.fsdp_offload ? 0 : bytes, c.fsdp_offload ? bytes * c.g : 0, 0,
             c.fsdp_offload ? bytes * c.g : 0, kAllPhases);
    return Status::Ok();
  }
  if (!c.Offloaded()) {
    // A plain loop (zero_grad(set_to_none=True), one micro-batch per step, one GPU, no
    // DeepSpeed or FSDP) has no gradients until backward makes them (Note [Gradient storage]):
    // the first layer's backward holds the head's and that block's, backward's end all of them.
    // Before PyTorch 2.0 zero_grad() zeroed the gradients in place (set_to_none=False): they
    // stayed allocated from one step to the next.
    const bool plain = c.PlainGradients();
    const std::string what = std::string(s.autocast ? "fp32" : c.half) +
                             " gradients of the trainable parameters" +
                             std::string(s.zero_stage >= 2 ? ", ZeRO-partitioned" : "");
    out->Add("grads", what, c.Part(c.trainable, 2) * c.grad_bytes, 0, 0, 0,
             plain ? kPhaseBackwardEnd | kPhaseOptimizerStep : kAllPhases);
    if (plain) {
      const Wide layers = std::max<Wide>(U(c.arch.layers), 1);
      const Wide early =
          c.lora ? c.f.lora / layers
                 : std::min(c.trainable, c.f.head_grad + U(c.counts.largest_block_params));
      out->Add("grads_first_layer",
               "gradients the first layer of backward has made: the head's and its block's",
               early * c.grad_bytes, 0, 0, 0, kPhaseBackward);
    }
    if (!c.master) return Status::Ok();
    if (s.zero_stage == 3) {
      const Wide sub_group = std::min(U(s.sub_group_size), c.Part(c.trainable, 1));
      out->Add("grads_fp32",
               "one sub-group's gradients flattened (" + c.half +
                   ") and converted to fp32 for the step: min(sub_group_size, partition) x " +
                   std::to_string(static_cast<uint64_t>(4 + c.w)) + " bytes",
               sub_group * (4 + c.w), 0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
    } else {
      out->Add("grads_fp32",
               "fp32 copy of the gradient partition the optimizer steps on (step transient)",
               c.Part(c.trainable, 1) * 4, 0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
    }
    return Status::Ok();
  }
  const Wide partition = c.Part(c.trainable, 1);
  if (s.zero_stage == 3) {
    const Wide half = partition * c.w * c.g;
    out->Add("grads",
             c.half + " gradient partitions in host memory (ZeRO-3 with offloaded optimizer)", 0,
             half, 0, s.pin_memory ? half : 0, kAllPhases);
  }
  const Wide fp32 = partition * 4 * c.g;
  if (s.zero_stage == 3 && s.offload_optimizer == OffloadDevice::kNvme) {
    Wide swapped = fp32, kept = 0;
    if (!c.lora && c.frozen_quantized == 0) {  // Note [NVMe partitions]
      const NvmeSplit split = NvmePartitions(c, 4, /*params=*/false);
      swapped = split.nvme * c.g;
      kept = split.memory * c.g;
    }
    out->Add("grads_fp32",
             "fp32 gradient partitions swapped out to NVMe with the optimizer state (those under "
             "max(1 MiB, aio.block_size) kept in host memory)",
             0, kept, swapped, 0, kAllPhases);
  } else {
    out->Add("grads_fp32", "fp32 gradient partitions in host memory (offloaded optimizer)", 0, fp32,
             0, s.pin_memory ? fp32 : 0, kAllPhases);
  }
  return Status::Ok();
}

// ddp_grad_buckets. torch DistributedDataParallel's reducer allocates flat buckets covering every
// gradient when it is built; unless gradient_as_bucket_view, the parameters' .grad tensors are
// separate and the buckets are a second copy (torch/nn/parallel/distributed.py,
// gradient_as_bucket_view: "the saved memory size will be equal to the total gradients size").
// ZeRO-0 on more than one data-parallel rank. All phases.
Status DdpBuckets(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage != 0 || c.Fsdp() || s.DataParallel() <= 1 || s.gradient_as_bucket_view) {
    return Status::Ok();
  }
  out->Add("ddp_grad_buckets",
           "DDP gradient buckets, a second copy of the gradients (gradient_as_bucket_view off)",
           c.TpShare(c.trainable) * c.grad_bytes, 0, 0, 0, kAllPhases);
  return Status::Ok();
}

// optimizer_states. The optimizer's state tensors for the trainable partition (torch.optim's
// state dict; DeepSpeed's partitioned optimizer), on the optimizer's device. SGD keeps a momentum
// buffer only with momentum > 0 (torch/optim/sgd.py). All phases.
Status OptimizerStates(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (c.Fsdp()) {
    // A torch.optim optimizer over the sharded flat parameters: its states are shard-sized, on
    // the CPU with CPUOffload (the parameters it steps live there).
    const Wide factored = c.FsdpShard(c.f.factored);
    const Wide bytes = OptimizerStateBytes(s, c.FsdpShard(c.trainable), factored);
    out->Add("optimizer_states",
             std::string(OptimizerName(s.optimizer)) + " states, " + c.FsdpName() +
                 (c.fsdp_offload ? ", on cpu" : ""),
             c.fsdp_offload ? 0 : bytes, c.fsdp_offload ? bytes * c.g : 0, 0, 0, kAllPhases);
    return Status::Ok();
  }
  Wide gpu = 0, cpu = 0, nvme = 0;
  const Wide factored =
      s.zero_stage >= 1 ? CeilDiv(c.TpShare(c.f.factored), c.d) : c.TpShare(c.f.factored);
  c.PlaceOptimizer(OptimizerStateBytes(s, c.Part(c.trainable, 1), factored), &gpu, &cpu, &nvme);
  out->Add("optimizer_states",
           std::string(OptimizerName(s.optimizer)) + " states" +
               (s.zero_stage >= 1 ? ", ZeRO-partitioned" : "") +
               (c.Offloaded() ? ", on " + c.opt_where : ""),
           gpu, cpu, nvme, 0, kAllPhases);
  return Status::Ok();
}

// optimizer_step_transient. A PyTorch optimizer on the GPU (ZeRO-0): torch/optim/adam.py
// _multi_tensor_adam (foreach, PyTorch's default on CUDA) builds exp_avg_sq_sqrt for every
// parameter at once, one state-sized tensor set; _single_tensor_adam (foreach=False) builds it one
// tensor at a time (sqrt, then the division: two temporaries of the largest tensor); the fused
// kernel (fused=True) updates in place. SGD updates in place (torch/optim/sgd.py, no weight
// decay). DeepSpeed's optimizers (ZeRO >= 1: FusedAdam, CPU Adam) update in place.
Status OptimizerStepTransient(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if ((s.zero_stage != 0 && !c.Fsdp()) || c.fsdp_offload || s.fused_optimizer) {
    return Status::Ok();
  }
  const Wide state_elem = s.precision == Precision::kBf16Pure ? 2 : 4;
  // Under FSDP the optimizer sees one flat parameter per wrapped unit (its shard).
  const Wide largest =
      c.Fsdp() && !c.lora ? c.FsdpShard(c.largest_unit) : c.f.largest_trainable_tensor;
  const Wide all = c.Fsdp() ? c.FsdpShard(c.trainable) : c.TpShare(c.trainable);
  Wide transient = 0;
  std::string how;
  // torch.optim takes its foreach path only for plain Tensors and Parameters
  // (torch/optim/optimizer.py _default_to_fused_or_foreach checks the exact type): FSDP's
  // FlatParameter gets the per-tensor loop.
  const bool foreach = s.foreach && !c.Fsdp();
  switch (s.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kLion:
      if (foreach) {
        transient = all * state_elem;
        how = "torch foreach: one state-sized tensor set";
      } else {
        transient = 2 * largest * state_elem;
        how = "per-tensor loop: two temporaries of the largest tensor";
      }
      break;
    case Optimizer::kAdafactor:
      transient = 2 * 4 * largest;
      how = "factored update of the largest tensor";
      break;
    case Optimizer::kSgd:
    case Optimizer::kAdam8bit: break;
  }
  out->Add("optimizer_step_transient", "temporaries of the optimizer step (" + how + ")", transient,
           0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
  return Status::Ok();
}

// nvme_optimizer_swap_buffers. ZeRO-Infinity's optimizer swapper stages sub-groups through
// buffer_count pinned fp32 buffers of the largest sub-group (min(sub_group_size, partition))
// (deepspeed/runtime/swap_tensor/optimizer_utils.py, SwapBufferManager). All phases.
Status NvmeOptimizerSwapBuffers(const ItemContext& c, Builder* out) {
  if (c.s.offload_optimizer != OffloadDevice::kNvme) return Status::Ok();
  const Wide sub_group = std::min(U(c.s.sub_group_size), c.Part(c.trainable, 1));
  const Wide buffers = U(c.s.optimizer_buffer_count) * sub_group * 4 * c.g;
  out->Add("nvme_optimizer_swap_buffers",
           "pinned swap buffers for optimizer state: buffer_count x min(sub_group_size, "
           "partition) x fp32",
           0, buffers, 0, buffers, kAllPhases);
  return Status::Ok();
}

// nvme_param_flat_buffer. With offload_param nvme, ZeRO-3 still gives the trainable parameters
// 16-bit partitions a flat host buffer, pinned, of up to offload_param.max_in_cpu elements
// (default 1e9) per rank, and moves the partitions into it: they live in host memory as well as
// in their swap files (deepspeed/runtime/zero/stage3.py _create_param_groups_fp16_flat_cpu_memory,
// _configure_tensor_swapping). Sub-groups beyond max_in_cpu stay on NVMe and are swapped out
// after the step through one pinned buffer of the largest sub-group's parameters
// (partitioned_param_swapper.py reserve_partitioned_swap_space). All phases.
Status NvmeParamFlatBuffer(const ItemContext& c, Builder* out) {
  if (c.s.zero_stage != 3 || c.s.offload_param != OffloadDevice::kNvme) return Status::Ok();
  const Wide partition = c.Part(c.trainable, 1);
  const Wide flat = std::min(U(c.s.param_max_in_cpu), partition);
  Wide bytes = flat * c.w;
  std::string how = "min(max_in_cpu, partition)";
  if (flat < partition) {
    bytes += std::min(U(c.s.sub_group_size), partition) * c.d * c.w;
    how += " + a reuse buffer of the largest sub-group";
  }
  bytes *= c.g;
  out->Add("nvme_param_flat_buffer",
           "pinned flat " + c.half +
               " buffer of the trainable parameters' partitions in host "
               "memory beside their swap files: " +
               how,
           0, bytes, 0, bytes, kAllPhases);
  return Status::Ok();
}

// nvme_param_swap_buffers. offload_param: nvme reads partitions through buffer_count pinned
// buffers of buffer_size elements (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py,
// AsyncPartitionedParameterSwapper). All phases.
Status NvmeParamSwapBuffers(const ItemContext& c, Builder* out) {
  if (c.s.offload_param != OffloadDevice::kNvme) return Status::Ok();
  const Wide buffers = U(c.s.param_buffer_count) * U(c.s.param_buffer_size) * c.w * c.g;
  out->Add("nvme_param_swap_buffers",
           "pinned swap buffers for parameters: buffer_count x buffer_size x " + c.half, 0, buffers,
           0, buffers, kAllPhases);
  return Status::Ok();
}

// activations, activation_recompute, backward_workspace, logits_and_loss, logits_grad: what
// autograd saves for the backward pass (CountActivations, Korthikanti et al.), live from the
// forward pass to the first layer of backward; the recomputed layer and the layer's gradient
// temporaries in backward; the logits and the loss's log-softmax, and their gradients.
Status ActivationItems(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  const Activations& act = c.act;
  const Alloc tr = Alloc::kTransient;
  out->Add("activations",
           "saved activations, " + std::to_string(c.arch.layers + c.arch.decoder_layers) +
               " layers (" + std::string(CheckpointingName(s.checkpointing)) + " checkpointing" +
               (s.flash_attention ? ", flash attention" : "") + ")",
           act.saved, 0, 0, 0, kPhaseForward | kPhaseBackward, tr);
  out->Add("activation_recompute", "one layer's recomputed activations during its backward pass",
           act.recompute, 0, 0, 0, kPhaseBackward, tr);
  out->Add("backward_workspace", "gradient temporaries of the layer in backward", act.workspace, 0,
           0, 0, kPhaseBackward | kPhaseBackwardEnd, tr);
  const Loss loss = c.s.loss;
  const bool split =
      act.logits_kept != static_cast<Wide>(-1) && act.logits_kept < act.logits_forward;
  out->Add("logits_and_loss",
           loss == Loss::kFused
               ? "fused linear cross-entropy: one chunk of logits and the gradients it keeps"
           : loss == Loss::kChunked && split
               ? "one sequence chunk's logits, log-softmax and gradients, and the hidden "
                 "states' fp32 gradient (torchtitan's ChunkedLossWrapper, backward per chunk)"
           : loss == Loss::kChunked
               ? "logits b*s*V (" + c.half + ", in chunks) and each chunk's fp32 log-softmax"
           : split ? "logits b*s*V (" + c.half +
                         " and fp32) and the loss's fp32 log-softmax, "
                         "until the loss is computed"
                   : "logits b*s*V (" + c.half + " and fp32) and the log-softmax kept by the loss",
           act.logits_forward, 0, 0, 0, split ? kPhaseForward : kPhaseForward | kPhaseBackward, tr);
  if (split) {
    out->Add("loss_log_softmax",
             loss == Loss::kChunked
                 ? "the hidden states' gradient the chunked loss hands to backward"
                 : "the loss's fp32 log-softmax b*s*V, kept for its backward",
             act.logits_kept, 0, 0, 0, kPhaseBackward, tr);
  }
  out->Add("logits_grad", "fp32 gradients of the log-probabilities and logits", act.logits_backward,
           0, 0, 0, kPhaseBackward, tr);
  return Status::Ok();
}

// comm_reduce_bucket, comm_allgather_bucket. ZeRO-3 allocates one flat gradient bucket of
// reduce_bucket_size elements per gradient dtype at start-up when contiguous_gradients is on, its
// default (stage3.py _setup_for_real_optimizer, the IPG bucket buffer). ZeRO-1/2: the gradient
// reduce buckets during backward and the parameter all-gather buckets after the step, x4.5 with
// overlap_comm (the Hugging Face DeepSpeed guide's rule for ZeRO-2).
Status CommBuckets(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage < 1 || c.Fsdp()) return Status::Ok();
  const Wide reduce_elems = std::min(U(s.reduce_bucket_size), c.TpShare(c.trainable));
  if (s.zero_stage == 3) {
    out->Add("comm_reduce_bucket",
             "flat gradient bucket of reduce_bucket_size elements (contiguous_gradients)",
             reduce_elems * c.w, 0, 0, 0, kAllPhases);
    return Status::Ok();
  }
  const double factor = s.OverlapComm() ? kOverlapCommFactor : 1.0;
  out->Add("comm_reduce_bucket",
           "gradient reduce buckets (reduce_bucket_size" +
               std::string(s.OverlapComm() ? " x 4.5 with overlap_comm" : "") + ")",
           Scale(reduce_elems * c.w, factor), 0, 0, 0, kPhaseBackward | kPhaseBackwardEnd,
           Alloc::kTransient);
  const Wide gather =
      Scale(std::min(U(s.allgather_bucket_size), c.TpShare(c.f.total + c.f.lora)) * c.w, factor);
  out->Add("comm_allgather_bucket", "parameter all-gather buckets after the step", gather, 0, 0, 0,
           kPhaseOptimizerStep, Alloc::kTransient);
  return Status::Ok();
}

// zero3_live_params, zero3_block_grads. ZeRO-3 gathers the current block's parameters and
// prefetches up to stage3_prefetch_bucket_size more, capped by stage3_max_live_parameters
// (deepspeed/runtime/zero/partitioned_param_coordinator.py, fetch_sub_module); in backward the
// block's full gradients exist until reduce-scattered.
Status Zero3Buffers(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage != 3 || c.Fsdp()) return Status::Ok();
  const Wide block = c.TpShare(c.counts.largest_block_params);
  const Wide live = std::min(U(s.stage3_max_live_parameters),
                             block + std::min(U(s.stage3_prefetch_bucket_size), block));
  out->Add("zero3_live_params",
           "gathered parameters of the current block plus the prefetch bucket "
           "(stage3_prefetch_bucket_size), capped by stage3_max_live_parameters",
           live * c.w, 0, 0, 0, kFwdBwd, Alloc::kTransient);
  const Wide block_trainable =
      c.lora ? CeilDiv(c.TpShare(c.f.lora),
                       U(std::max<int64_t>(c.arch.layers + c.arch.decoder_layers, 1)))
             : block;
  out->Add("zero3_block_grads", "full gradients of the current block before reduce-scatter",
           block_trainable * c.w, 0, 0, 0, kPhaseBackward | kPhaseBackwardEnd, Alloc::kTransient);
  return Status::Ok();
}

// fsdp_unsharded_params, fsdp_unit_grads. FSDP all-gathers a wrapped unit's flat parameter
// in the compute dtype before the unit runs (FlatParamHandle.unshard from _pre_forward and
// _pre_backward_hook, torch/distributed/fsdp/_runtime_utils.py). FULL_SHARD frees it after the
// unit's forward and after its backward (reshard) and prefetches the next unit in backward
// (BackwardPrefetch.BACKWARD_PRE); SHARD_GRAD_OP keeps every unit unsharded from its forward
// until its backward; NO_SHARD with CPU offload copies each unit to the GPU and frees nothing
// before backward. In backward the unit's unsharded gradient lives until it is reduce-scattered
// (or copied to the CPU).
Status FsdpUnits(const ItemContext& c, Builder* out) {
  if (!c.Fsdp()) return Status::Ok();
  const Wide all = c.TpShare(c.f.total - c.frozen_quantized + c.f.lora);
  const Wide unit = std::min(all, c.largest_unit);
  const unsigned live_phases = kPhaseForward | kPhaseBackward;
  Wide live = 0;
  std::string how;
  switch (c.fsdp) {
    case FsdpSharding::kFullShard:
      live = std::min(all, 2 * unit);
      how = "the current unit and the one prefetched";
      break;
    case FsdpSharding::kShardGradOp:
      live = all;
      how = "every unit, kept from its forward until its backward (SHARD_GRAD_OP)";
      break;
    case FsdpSharding::kNoShard:
      live = c.fsdp_offload ? all : 0;
      how = "every unit copied from the CPU, kept until after backward (NO_SHARD)";
      break;
    case FsdpSharding::kNone: break;
  }
  out->Add("fsdp_unsharded_params", "unsharded parameters on the GPU: " + how, live * c.w, 0, 0, 0,
           live_phases, Alloc::kTransient);
  if (c.fsdp != FsdpSharding::kNoShard || c.fsdp_offload) {
    const Wide grads = c.lora
                           ? CeilDiv(c.TpShare(c.f.lora),
                                     U(std::max<int64_t>(c.arch.layers + c.arch.decoder_layers, 1)))
                           : unit;
    out->Add("fsdp_unit_grads",
             "the unit's unsharded gradient before reduce-scatter (or the copy to the CPU)",
             (grads + (c.fsdp == FsdpSharding::kNoShard ? 0 : CeilDiv(grads, c.d))) * c.w, 0, 0, 0,
             kPhaseBackward | kPhaseBackwardEnd, Alloc::kTransient);
  }
  return Status::Ok();
}

struct ItemRule {
  const char* items;  // the breakdown items it adds, for readers
  Status (*add)(const ItemContext&, Builder*);
};

// Every item of the model, in report order (cuda_context and allocator_margin are added with the
// phase totals).
constexpr ItemRule kItemRules[] = {
    {"params_working, autocast_weight_copies, autocast_recompute_copies, params_quantized, "
     "qlora_dequant_workspace",
     ParamsWorking},
    {"params_master", ParamsMaster},
    {"grads, grads_fp32", Grads},
    {"ddp_grad_buckets", DdpBuckets},
    {"optimizer_states", OptimizerStates},
    {"optimizer_step_transient", OptimizerStepTransient},
    {"nvme_optimizer_swap_buffers", NvmeOptimizerSwapBuffers},
    {"nvme_param_swap_buffers", NvmeParamSwapBuffers},
    {"nvme_param_flat_buffer", NvmeParamFlatBuffer},
    {"activations, activation_recompute, backward_workspace, logits_and_loss, logits_grad",
     ActivationItems},
    {"comm_reduce_bucket, comm_allgather_bucket", CommBuckets},
    {"zero3_live_params, zero3_block_grads", Zero3Buffers},
    {"fsdp_unsharded_params, fsdp_unit_grads", FsdpUnits},
};

}  // namespace

Status AddItems(const ItemContext& c, Builder* out) {
  for (const ItemRule& rule : kItemRules) MEMPLAN_RETURN_IF_ERROR(rule.add(c, out));
  return Status::Ok();
}

}  // namespace memplan::estimator::mm
