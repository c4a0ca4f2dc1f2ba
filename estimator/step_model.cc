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
  const bool titan = setup.framework == Framework::kTorchtitan;
  if (states.from_inventory || titan) {
    g.Alloc(StepCategory::kParameters, run.ParameterBytes());
    g.Alloc(StepCategory::kBuffers, run.BufferBytes());
    g.Alloc(StepCategory::kOptimizerStates, run.OptimizerStateBytes());
  } else {
    g.Alloc(StepCategory::kParameters, states.parameters);
    g.Alloc(StepCategory::kBuffers, states.buffers);
    g.Alloc(StepCategory::kOptimizerStates, states.optimizer_states);
  }
  g.Alloc(StepCategory::kOther, states.other);
  if (states.persistent_gradients > 0 && !titan) {
    g.Alloc(StepCategory::kGradients, states.persistent_gradients);
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
  m.saved_bytes = run.saved_bytes();
  m.block_saved_bytes = run.block_saved_bytes();
  m.notes = run.notes();
  return m;
}

}  // namespace memplan::estimator
