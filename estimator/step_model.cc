#include "estimator/step_model.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "estimator/step_blocks.h"
#include "estimator/step_graph.h"
#include "estimator/step_ops.h"

namespace memplan::estimator {

std::string_view StepCategoryName(StepCategory c) {
  switch (c) {
    case StepCategory::kParameters: return "parameters";
    case StepCategory::kBuffers: return "buffers";
    case StepCategory::kGradients: return "gradients";
    case StepCategory::kActivations: return "activations";
    case StepCategory::kTemporaries: return "temporaries";
    case StepCategory::kOptimizerStates: return "optimizer_states";
    case StepCategory::kOptimizerTransients: return "optimizer_transients";
    case StepCategory::kOther: return "other";
    case StepCategory::kCommunication: return "communication";
  }
  return "?";
}

std::string_view StepPhaseName(StepPhase p) {
  switch (p) {
    case StepPhase::kForward: return "forward";
    case StepPhase::kLoss: return "loss";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kOptimizerStep: return "optimizer_step";
  }
  return "?";
}

uint64_t AllocatorRound(uint64_t bytes) {
  if (bytes == 0) return 0;
  return std::max<uint64_t>(512, (bytes + 511) / 512 * 512);
}

uint64_t CublasWorkspaceBytes(int gpu_sm) {
  return gpu_sm >= 90 ? uint64_t{32} << 20 : (uint64_t{4} << 20) * 2 + (uint64_t{16} << 10) * 8;
}

namespace {

using step::DT;
using step::Graph;
using step::T;
using step::Wide;

// The optimizer step's transient bytes (Note [The step model]): torch/optim/adamw.py.
//   foreach (_multi_tensor_adamw): torch._foreach_sqrt(exp_avg_sqs) makes one tensor per
//     parameter of the group being stepped, the other updates are in place: the largest group.
//   for-loop (_single_tensor_adamw): exp_avg_sq.sqrt() / bias_correction2_sqrt, two temporaries
//     of the largest parameter.
//   fused (_fused_adamw): none. SGD (foreach or not) updates in place; momentum too.
Wide OptimizerTransient(const TrainingSetup& s, const std::vector<Wide>& group_bytes,
                        Wide largest_tensor_bytes) {
  if (s.fused_optimizer) return 0;
  switch (s.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kLion: {
      // llm-foundry trains with Composer's DecoupledAdamW, which steps one tensor at a time
      // (composer/optim/decoupled_weight_decay.py, DecoupledAdamW.adamw): the for-loop's
      // temporaries whatever `foreach` says.
      const bool per_tensor =
          !s.foreach || (s.framework == Framework::kLlmFoundry && s.optimizer == Optimizer::kAdamW);
      if (per_tensor) return 2 * largest_tensor_bytes;
      Wide most = 0;
      for (Wide b : group_bytes) most = std::max(most, b);
      return most;
    }
    case Optimizer::kAdafactor: return 2 * largest_tensor_bytes;
    case Optimizer::kSgd:
    case Optimizer::kAdam8bit: return 0;
  }
  return 0;
}

}  // namespace

// The allocator-replay streams of the states, one each (Note [Reusing a step]).
constexpr int kFirstStateStream = -1;

// Note [Gradients that persist]
// Where gradients outlive the step (accumulation over micro-batches, PyTorch before 2.0 zeroing
// them in place, DDP's buckets, DeepSpeed's partitions and FSDP's shards), the memory model
// places that storage and the step model counts it from the start. A parameter's gradient,
// once complete, is then not a new tensor: AccumulateGrad adds it into the existing .grad in
// place (torch/csrc/autograd/functions/accumulate_grad.h, `variable_grad += new_grad`), and
// DeepSpeed's and FSDP's hooks copy it into their buckets (the memory model's bucket items) and
// drop it. Either way its buffer is freed as soon as it is complete; counting it as a second
// .grad would hold every gradient twice by the optimizer step.
Result<StepModel> SimulateStep(const ModelInventory& inventory, const TrainingSetup& setup,
                               const StepStates& states) {
  if (!inventory.arch.has_value()) {
    return Status::InvalidArgument(inventory.name + ": the step model needs the architecture");
  }
  Graph g;
  step::ModelRun run(g, inventory, setup);
  MEMPLAN_RETURN_IF_ERROR(run.Prepare());
  // What lives from one step to the next. torchtitan's states are FSDP2's shards, which the
  // step model lays out itself (step_torchtitan.cc); its gradients are set to None each step.
  // Each is one allocation on a stream of its own in the allocator's replay (Note [Reusing a
  // step]).
  const bool titan = setup.framework == Framework::kTorchtitan;
  int lump = 0;
  auto state = [&](StepCategory c, Wide bytes) {
    g.SetStream(kFirstStateStream - lump++);
    g.Alloc(c, bytes);
    g.SetStream(0);
  };
  if (states.from_inventory || titan) {
    state(StepCategory::kParameters, run.ParameterBytes());
    state(StepCategory::kBuffers, run.BufferBytes());
    state(StepCategory::kOptimizerStates, run.OptimizerStateBytes());
  } else {
    state(StepCategory::kParameters, states.parameters);
    state(StepCategory::kBuffers, states.buffers);
    state(StepCategory::kOptimizerStates, states.optimizer_states);
  }
  state(StepCategory::kOther, states.other);
  if (!titan) {
    state(StepCategory::kGradients, states.persistent_gradients);
    g.SetGradsInPlace(!states.plain_gradients);
  }
  g.SetPhase(StepPhase::kForward);
  MEMPLAN_ASSIGN_OR_RETURN(T loss, run.ForwardAndLoss());
  // fp16 autocast trains with torch.amp.GradScaler: scaler.scale(loss) is loss * scale (a
  // 0-dim tensor the scaler keeps), whose backward makes the loss's gradient; unscale_ makes
  // the reciprocal scale and the found-inf flag, alive through the optimizer step.
  const bool grad_scaler = setup.precision == Precision::kFp16Mixed && setup.autocast;
  if (grad_scaler && g.RequiresGrad(loss)) {
    T scale = g.External(1, DT::kF32);
    T scaled = step::Mul(g, loss, scale);
    g.Drop(loss);
    loss = scaled;
  }
  g.SetPhase(StepPhase::kBackward);
  g.SetWhere("backward");
  if (g.RequiresGrad(loss)) g.Backward(loss);
  g.Drop(loss);
  run.AfterBackward();

  // The optimizer step: every gradient exists; what the step adds on top of the states.
  g.SetPhase(StepPhase::kOptimizerStep);
  g.SetWhere("optimizer step");
  int unscale = -1;
  if (grad_scaler && states.torch_optimizer) {
    unscale = g.Alloc(StepCategory::kActivations, 2 * AllocatorRound(4));
  }
  if (states.torch_optimizer) {
    const Wide transient =
        OptimizerTransient(setup, run.OptimizerGroupBytes(), run.LargestTrainableBytes());
    const int t = g.Alloc(StepCategory::kOptimizerTransients, transient);
    g.Unref(t);
  } else {
    const int t = g.Alloc(StepCategory::kOptimizerTransients, 0);
    g.Unref(t);
  }
  if (unscale >= 0) g.Unref(unscale);
  if (g.overflow()) {
    return Status::OutOfRange(inventory.name +
                              ": the memory a step needs overflows 2^62 bytes; check "
                              "`micro_batch` and `seq_len`");
  }
  StepModel m;
  m.phases = g.peaks();
  for (int p = 0; p < kStepPhases; ++p) {
    if (m.phases[static_cast<size_t>(p)].bytes > m.peak_bytes) {
      m.peak_bytes = m.phases[static_cast<size_t>(p)].bytes;
      m.peak_phase = static_cast<StepPhase>(p);
    }
  }
  const step::AllocatorPeaks allocator = step::ReplayCachingAllocator(g.AllocatorLog());
  m.reserved_bytes = allocator.reserved;
  m.allocator_allocated_bytes = allocator.allocated;
  m.held_bytes = allocator.held;
  m.saved_bytes = run.saved_bytes();
  m.block_saved_bytes = run.block_saved_bytes();
  m.notes = run.notes();
  return m;
}

// Note [Reusing a step]
// The states the memory model hands the step model (StepStates) are allocated before the step
// and never freed, so they add the same bytes to every moment of it: each phase's peak is at
// the same moment over any states, only higher by their difference. The planner, which tries
// one setup under many ZeRO stages, offloads and bucket sizes, runs the step once per setup the
// step model can tell apart and moves it onto each configuration's states.
StepModel MoveToStates(StepModel run, const StepStates& from, const StepStates& to,
                       Framework framework) {
  // What SimulateStep allocated from the states it was given, each once, alone on its stream in
  // the allocator's replay: a plain loop and torchtitan lay out the parameters, buffers and
  // optimizer states themselves, and torchtitan keeps no gradients from one step to the next.
  const bool titan = framework == Framework::kTorchtitan;
  const bool own = from.from_inventory || titan;
  struct Field {
    StepCategory cat;
    uint64_t from, to;
  };
  std::vector<Field> fields = {{StepCategory::kOther, from.other, to.other}};
  if (!own) {
    fields.push_back({StepCategory::kParameters, from.parameters, to.parameters});
    fields.push_back({StepCategory::kBuffers, from.buffers, to.buffers});
    fields.push_back({StepCategory::kOptimizerStates, from.optimizer_states, to.optimizer_states});
  }
  if (!titan) {
    fields.push_back(
        {StepCategory::kGradients, from.persistent_gradients, to.persistent_gradients});
  }
  // A replay that passed its bound stays saturated (UINT64_MAX), not shifted into a wrap.
  const bool saturated = run.reserved_bytes == UINT64_MAX;
  for (Field& f : fields) {
    f.from = AllocatorRound(f.from);
    f.to = AllocatorRound(f.to);
    if (saturated) continue;
    const step::AllocatorPeaks was = step::ReplayCachingAllocator({{0, true, f.from, 0}});
    const step::AllocatorPeaks now = step::ReplayCachingAllocator({{0, true, f.to, 0}});
    run.reserved_bytes = run.reserved_bytes - was.reserved + now.reserved;
    run.held_bytes = run.held_bytes - was.held + now.held;
    run.allocator_allocated_bytes = run.allocator_allocated_bytes - was.allocated + now.allocated;
  }
  run.peak_bytes = 0;
  for (size_t p = 0; p < run.phases.size(); ++p) {
    StepPhasePeak& peak = run.phases[p];
    for (const Field& f : fields) {
      uint64_t& c = peak.categories[static_cast<size_t>(f.cat)];
      c = c - f.from + f.to;
      peak.bytes = peak.bytes - f.from + f.to;
    }
    if (peak.bytes > run.peak_bytes) {
      run.peak_bytes = peak.bytes;
      run.peak_phase = static_cast<StepPhase>(p);
    }
  }
  return run;
}

}  // namespace memplan::estimator
