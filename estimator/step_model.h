// What one training step allocates on a GPU, op by op: the training code's forward, loss,
// backward and optimizer step run symbolically over the tensors they make, and the caching
// allocator's live bytes are followed through them, per category and per phase.
//
// Note [The step model]
// A step of a PyTorch training loop allocates what its ops allocate and frees a tensor when the
// last reference to it goes: the Python variable that held it, or the autograd node that saved
// it for backward (torch/csrc/autograd: SavedVariable; a node's saved tensors are released once
// it has run). The memory at any moment is therefore the parameters, buffers and optimizer
// states, plus what autograd has saved so far, plus the few tensors in flight. The step model
// runs the framework's own forward of each block, op by op as the framework's Python calls them
// (step_blocks.cc, step_frameworks.cc: each block reads like its forward, naming the file and
// function), with PyTorch's rules for what each op saves (tools/autograd/derivatives.yaml), for
// what autocast casts (the CUDA autocast policy, with its weight-cast cache), and for what each
// backward kernel allocates; then the loss as the framework computes it, the backward in reverse
// order, releasing each node's saved tensors and incoming gradient after it runs (before its
// results are added into the next nodes' input buffers), accumulating gradients as
// AccumulateGrad does (a tied weight's first gradient waits in the engine's input buffer until
// the second arrives), and the optimizer step as torch.optim implements it (foreach AdamW's
// sqrt(v) per parameter group; the for-loop's two temporaries of a tensor; fused: none). The
// backward's seed (ones_like(loss), made before the engine runs) lives until backward returns;
// fp16 autocast scales the loss and unscales the gradients as torch.amp.GradScaler does.
// Activation checkpointing keeps each wrapped block's input only and re-runs its forward when
// the block's backward begins (torch.utils.checkpoint, non-reentrant), up to the last tensor the
// forward saved (its early stop); torchtitan's op-level policy keeps the outputs of the ops it
// lists.
//
// Every allocation is rounded as the CUDA caching allocator rounds a request (512 bytes,
// c10/cuda/CUDACachingAllocator.cpp round_size). The categories are PyTorch's memory tracker's
// (torch.distributed._tools.mem_tracker): parameters, buffers, gradients, activations (made in
// forward or recomputation, the loss included), temporaries (made in backward), optimizer
// states, optimizer transients, other (the cuBLAS workspace and the batch), communication
// (FSDP2's collective buffers between modules). The model is held to
// traces of the real code on fake tensors (memplan.trace; tests/accuracy/trace_grid.json).
//
// Thread safety: pure functions over plain values.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/training_setup.h"

namespace memplan::estimator {

// The memory tracker's categories.
enum class StepCategory {
  kParameters,
  kBuffers,
  kGradients,
  kActivations,
  kTemporaries,
  kOptimizerStates,
  kOptimizerTransients,
  kOther,
  // FSDP2's all-gather outputs and reduce-scatter inputs while they wait between modules
  // (FSDPMemTracker's all-gather and reduce-scatter buffers); zero without FSDP2.
  kCommunication,
};
constexpr int kStepCategories = 9;
std::string_view StepCategoryName(StepCategory c);  // "parameters", ...

// The phases of a step, as the memory tracker splits them.
enum class StepPhase { kForward, kLoss, kBackward, kOptimizerStep };
constexpr int kStepPhases = 4;
std::string_view StepPhaseName(StepPhase p);  // "forward", "loss", "backward", "optimizer_step"

using StepBytes = std::array<uint64_t, kStepCategories>;

// The highest live bytes a phase reached, and what they were at that moment.
struct StepPhasePeak {
  uint64_t bytes = 0;
  StepBytes categories{};
  std::string where;  // the op or module at the peak ("lm_head backward", "layer 3 recompute")
};

// What the model states are: how many bytes, in which tensors, per GPU. The memory model fills
// it for the setup (plain PyTorch, DeepSpeed ZeRO, FSDP); the step model adds what the step
// allocates around them.
struct StepStates {
  uint64_t parameters = 0;        // every parameter's working copy on the GPU, rounded per tensor
  uint64_t buffers = 0;           // registered buffers on the GPU
  uint64_t optimizer_states = 0;  // on the GPU
  // Gradients that persist across steps (DeepSpeed's partitions, DDP buckets, accumulation):
  // counted from the start of the step. Zero for a loop that sets them to None after each step.
  uint64_t persistent_gradients = 0;
  // The step makes .grad tensors of the trainable parameters and keeps them. false: a
  // parameter's gradient, once complete, goes into storage that outlives the step (the
  // persistent gradients, DeepSpeed's buckets, FSDP's reduce-scatter, an offloaded optimizer's
  // host copy) and its buffer is freed (Note [Gradients that persist]).
  bool plain_gradients = true;
  // The optimizer step runs on the GPU with torch.optim (foreach / for-loop / fused per the
  // setup); false: DeepSpeed's or an offloaded optimizer, modelled by the memory model.
  bool torch_optimizer = true;
  uint64_t other = 0;  // the cuBLAS workspace and the batch
  // Plain PyTorch training (no DeepSpeed, no FSDP): the step model counts parameters, buffers
  // and optimizer states itself, tensor by tensor as the framework allocates them, instead of
  // the fields above.
  bool from_inventory = false;
};

struct StepModel {
  std::array<StepPhasePeak, kStepPhases> phases{};
  StepPhase peak_phase = StepPhase::kForward;
  uint64_t peak_bytes = 0;
  // The caching allocator's replay of the step's allocations (Note [The caching allocator's
  // reserve] in step_allocator.cc): the most it reserves (max_memory_reserved) and the most its
  // blocks hold at once; their difference is what its caching adds.
  uint64_t reserved_bytes = 0;
  uint64_t allocator_allocated_bytes = 0;
  // The most its segments that hold a live block reach at once: what it cannot give back when a
  // cudaMalloc fails, the reserve a step needs on a full GPU.
  uint64_t held_bytes = 0;
  // Saved activations at the end of the forward pass, all blocks, and one block's.
  uint64_t saved_bytes = 0;
  uint64_t block_saved_bytes = 0;
  std::vector<std::string> notes;  // what the model assumed, one sentence each
};

// Runs one steady-state training step (the second: optimizer states exist, gradients do not
// yet) of `setup` on `inventory` over `states`. Errors: an architecture the step model does not
// know how to run (the message says which), overflow.
Result<StepModel> SimulateStep(const ModelInventory& inventory, const TrainingSetup& setup,
                               const StepStates& states);

// `run`, made over `from` for a setup of `framework`, as it would be over `to` (Note [Reusing a
// step]): the same StepStates but for the bytes of parameters, buffers, optimizer_states,
// persistent_gradients and other, each as SimulateStep allocates them (a plain loop and
// torchtitan lay out the first three themselves; torchtitan keeps no gradients).
StepModel MoveToStates(StepModel run, const StepStates& from, const StepStates& to,
                       Framework framework);

// The cuBLAS workspace PyTorch keeps from the first matmul: 4 MiB x 2 + 16 KiB x 8 (the default
// CUBLAS_WORKSPACE_CONFIG) before Hopper, 32 MiB from sm90 on
// (aten/src/ATen/cuda/CublasHandlePool.cpp getChosenWorkspaceSize).
uint64_t CublasWorkspaceBytes(int gpu_sm);

// A request rounded as the CUDA caching allocator rounds it: 512-byte multiples, 512 at least;
// 0 stays 0.
uint64_t AllocatorRound(uint64_t bytes);

}  // namespace memplan::estimator
