// OptimizerSwapper: see optimizer_swapper.h for the contract.
//
// Note [Two slots per sub-group]
// A step rewrites every sub-group's states. Writing them in place would leave, after a crash
// mid-step, a mix of new and old sub-groups and no way back to either whole step. So each
// sub-group has two state values in the store, "state.<i>.0" and "state.<i>.1"; epoch E lives in
// slot E % 2 and carries a header with E. Step E + 1 reads slot E % 2 and writes slot (E + 1) % 2,
// never touching the only copy of epoch E. The commit point is SwapStore::Sync() at the end of the
// step: data fdatasynced, then the index (with the new values' checksums) replaced atomically.
// After a crash the index on disk is the one of the last commit, so:
//   - a slot rewritten since then fails its checksum (DataLoss) or, if never synced, is absent;
//   - slots holding the committed epoch were not written since, and read back whole.
// Open() takes, for every sub-group, the epochs of its readable slots and resumes from the
// largest epoch that every sub-group holds. A slot that is unreadable or ahead of it is the torn
// step; the next step overwrites it. The cost is twice the NVMe space for states, not twice the
// I/O: each step still reads and writes every state once.
//
// Note [One slot per sub-group]
// For a drive too small for two copies of the states (OptimizerSwapperOptions::state_slots 1),
// each sub-group has one state value, "state.<i>.0", and every step rewrites it in place: same
// key, same size, so SwapStore::Put rewrites the same extent, and the store needs half the space
// for states. Reads and writes per step are unchanged, and so is every result, bit for bit: a
// sub-group's states are read (ahead or not) before that sub-group is stepped and written, and
// each sub-group is read and written once a step. What is given up is the torn-step safety of
// Note [Two slots per sub-group]; the crash semantics are instead:
//   - The begun marker (kBegunKey) of step E + 1 is committed (put and synced) before the step's
//     first write, whatever sync_every_step says, and the commit marker (kCommittedKey) at the end
//     says E + 1 once every sub-group is written (synced with the step when sync_every_step, else
//     by the next step's begun marker or Sync() or Close()).
//   - A process killed between them leaves each sub-group holding step E, step E + 1, or torn
//     bytes, and no way back to either whole step. Open() refuses such a store with DataLoss: the
//     begun marker ahead of the commit (the first thing it reads), a sub-group whose header holds
//     another step than the commit, an unreadable marker or header (checksum failures) each fail
//     it, naming the store, saying it keeps one slot, which step was interrupted, and that
//     training must restart from a checkpoint. It never resumes from a mix. A crash after the
//     begun marker and before the first write is refused too: the marker cannot say whether a
//     write began (the conservative side).
//   - In the process, a step that ends uncommitted after its writer began rewriting a sub-group
//     (an I/O error, the update callback's error, AbortStep(), FinishStep(false), a failed Load())
//     marks the swapper torn (Impl::torn_step): every later Step(), BeginStep(), Load() and read
//     fails with DataLoss saying the same, so that a retry can never step from a mix, and the
//     begun marker stays ahead of the commit, so Open() refuses the store too. One that ends
//     before any write (its sub-groups only read, or never handed over) puts the begun marker back
//     and leaves the store as it was.
//   - A store whose last step committed (FinishStep()) and closed cleanly resumes exactly as
//     with two slots.
//   - Going back a step is impossible: OptimizerSwapperOptions::max_epoch below the committed
//     step is DataLoss (the ranks of a job killed between two ranks' commits cannot agree: Note
//     [Resuming ranks] in engine_optimizer.cc), and the engine does not run beside backward a step
//     that the norm may make it redo or skip (it waits for the norm: Note [Clipping by the global
//     norm]); a prepared step abandoned for another reason after its first write (an I/O error,
//     other options at Step(), AbandonStep()) leaves the store torn as above.
// The store's metadata says "state_slots": 1 (format version 2, which memplans reading version 1
// only refuse), and Open() needs the same value in its options.
//
// Note [Commits without a flush]
// The commits above order the store's writes: every value of step E has finished writing before
// the index naming it replaces the last one, and step E + 1 writes nothing until that rename has
// returned. A rename is visible to every process at once and a killed process cannot take back
// writes that finished, so that order alone makes each commit survive a process killed anywhere
// (OOM, preemption, a signal, a crash): that is OptimizerSwapperOptions::durability
// kProcessCrash, the default. What the flush (fdatasync of the data, fsync of the index and its
// directory) adds is the same after a power loss or a kernel crash, at the price of emptying the
// drive's write cache each step: measured on the development VM at 0.27-0.48 s a step for about
// 300 MB written, a fifth of the step, for a guarantee DeepSpeed does not give at all (it never
// flushes its swap files) and that a local NVMe drive of a cloud instance does not keep anyway
// (its contents end with the instance). Without the flush a power loss can leave any mix of the
// last steps' writes and index renames on the drive; every block carries its checksum in the
// index, and Open() resumes from the newest step that every sub-group holds readable (two slots)
// or refuses a store whose sub-groups disagree with the commit marker (one slot), so what it can
// leave is an older step or DataLoss, never a silent mix. kPowerLoss keeps the flush on every
// commit; OptimizerSwapper::Sync() and Close() with keep_files flush whatever the option says.
#include "offload/optimizer_swapper.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <random>

#include <sys/stat.h>
#include <unistd.h>

#include "common/json.h"
#include "offload/optimizer_swapper_internal.h"

namespace memplan::offload {
namespace {

Result<std::unique_ptr<nvme::SwapStore>> OpenStore(const OptimizerSwapperOptions& options,
                                                   const nvme::SwapStoreOptions& store_options) {
  if (!options.make_backend) return nvme::SwapStore::Open(store_options);
  MEMPLAN_ASSIGN_OR_RETURN(std::unique_ptr<nvme::Backend> backend, options.make_backend());
  return nvme::SwapStore::Open(store_options, std::move(backend));
}

}  // namespace

Status ValidateSwapStepOptions(SwapOptimizer optimizer, const SwapStepOptions& options) {
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      const auto* adam = std::get_if<AdamOptions>(&options);
      if (adam == nullptr) {
        return Status::InvalidArgument("the swapper runs Adam; the step was given other options");
      }
      if (adam->amsgrad != (optimizer == SwapOptimizer::kAdamAmsgrad)) {
        return Status::InvalidArgument("AdamOptions::amsgrad must match the swapper's optimizer (" +
                                       std::string(SwapOptimizerName(optimizer)) + ")");
      }
      return adam->Validate();
    }
    case SwapOptimizer::kSgd: {
      const auto* sgd = std::get_if<SgdOptions>(&options);
      if (sgd == nullptr) {
        return Status::InvalidArgument("the swapper runs SGD; the step was given other options");
      }
      if (sgd->momentum == 0) {
        return Status::InvalidArgument(
            "the swapper's SGD keeps a momentum buffer; momentum must be > 0");
      }
      return sgd->Validate();
    }
    case SwapOptimizer::kLion: {
      const auto* lion = std::get_if<LionOptions>(&options);
      if (lion == nullptr) {
        return Status::InvalidArgument("the swapper runs Lion; the step was given other options");
      }
      return lion->Validate();
    }
  }
  return Status::Internal("unknown optimizer");
}

namespace {

// RunSwapOptimizerStep on elements [a, a + len) of the arrays, in place: each state array's part
// is a span of its own (the kernels take one span per array).
Status StepPart(CpuOptimizer& cpu, SwapOptimizer optimizer, const SwapStepOptions& options,
                int64_t step, std::span<float> params, std::span<const float> grads,
                std::span<float> states, uint64_t a, uint64_t len, std::span<uint16_t> half,
                HalfDtype half_dtype) {
  const uint64_t n = params.size();
  auto state = [&](int k) {
    return states.subspan(static_cast<size_t>(k) * n + a, static_cast<size_t>(len));
  };
  std::span<float> p = params.subspan(a, len);
  std::span<const float> g = grads.subspan(a, len);
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      AdamTensors t;
      t.params = p;
      t.grads = g;
      t.exp_avg = state(0);
      t.exp_avg_sq = state(1);
      if (optimizer == SwapOptimizer::kAdamAmsgrad) t.max_exp_avg_sq = state(2);
      t.half_params = half;
      t.half_dtype = half_dtype;
      return cpu.AdamStep(std::get<AdamOptions>(options), step, t);
    }
    case SwapOptimizer::kSgd:
      return cpu.SgdStep(std::get<SgdOptions>(options), step, p, g, state(0), half, half_dtype);
    case SwapOptimizer::kLion:
      return cpu.LionStep(std::get<LionOptions>(options), step, p, g, state(0), half, half_dtype);
  }
  return Status::Internal("unknown optimizer");
}

}  // namespace

Status RunSegmentedSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                                     std::span<const SwapStepOptions> group_options,
                                     std::span<const StepSegment> segments, std::span<float> params,
                                     std::span<const float> grads, std::span<float> states,
                                     std::span<uint16_t> half, HalfDtype half_dtype) {
  const uint64_t n = params.size();
  const auto count = static_cast<uint64_t>(SwapOptimizerStates(optimizer));
  if (states.size() != n * count || grads.size() != n ||
      (half_dtype != HalfDtype::kNone && half.size() != n)) {
    return Status::InvalidArgument("segmented optimizer step: array sizes do not match");
  }
  uint64_t at = 0;
  for (const StepSegment& seg : segments) {
    if (seg.offset != at || seg.count == 0 || seg.count > n - at || seg.step < 0) {
      return Status::InvalidArgument(
          "segmented optimizer step: segments must cover the "
          "sub-group in order");
    }
    if (seg.group >= group_options.size()) {
      return Status::InvalidArgument("segmented optimizer step: group " +
                                     std::to_string(seg.group) + " of " +
                                     std::to_string(group_options.size()));
    }
    at += seg.count;
  }
  if (at != n) {
    return Status::InvalidArgument("segmented optimizer step: segments cover " +
                                   std::to_string(at) + " of " + std::to_string(n) + " elements");
  }
  for (const StepSegment& seg : segments) {
    const size_t a = seg.offset, len = seg.count;
    std::span<uint16_t> seg_half =
        half_dtype == HalfDtype::kNone ? std::span<uint16_t>() : half.subspan(a, len);
    if (seg.step == 0) {  // skipped: only the 16-bit copy of the unchanged weights
      if (half_dtype != HalfDtype::kNone) {
        MEMPLAN_RETURN_IF_ERROR(cpu.ConvertToHalf(params.subspan(a, len), seg_half, half_dtype));
      }
      continue;
    }
    MEMPLAN_RETURN_IF_ERROR(StepPart(cpu, optimizer, group_options[seg.group], seg.step, params,
                                     grads, states, a, len, seg_half, half_dtype));
  }
  return Status::Ok();
}

Status RunSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                            const SwapStepOptions& options, int64_t step, std::span<float> params,
                            std::span<const float> grads, std::span<float> states,
                            std::span<uint16_t> half, HalfDtype half_dtype,
                            std::span<const uint16_t> half_grads, HalfDtype grad_dtype) {
  const size_t n = params.size();
  if (grad_dtype != HalfDtype::kNone && optimizer != SwapOptimizer::kAdam &&
      optimizer != SwapOptimizer::kAdamAmsgrad) {
    return Status::InvalidArgument("16-bit gradients are stepped by Adam only, not " +
                                   std::string(SwapOptimizerName(optimizer)));
  }
  const int count = SwapOptimizerStates(optimizer);
  if (states.size() != n * static_cast<size_t>(count)) {
    return Status::InvalidArgument("optimizer step: " + std::to_string(states.size()) +
                                   " state elements for " + std::to_string(n) + " params and " +
                                   std::to_string(count) + " states");
  }
  auto state = [&](int k) { return states.subspan(static_cast<size_t>(k) * n, n); };
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      AdamTensors t;
      t.params = params;
      t.grads = grads;
      t.exp_avg = state(0);
      t.exp_avg_sq = state(1);
      if (optimizer == SwapOptimizer::kAdamAmsgrad) t.max_exp_avg_sq = state(2);
      t.half_params = half;
      t.half_dtype = half_dtype;
      t.half_grads = half_grads;
      t.grad_dtype = grad_dtype;
      return cpu.AdamStep(std::get<AdamOptions>(options), step, t);
    }
    case SwapOptimizer::kSgd:
      return cpu.SgdStep(std::get<SgdOptions>(options), step, params, grads, state(0), half,
                         half_dtype);
    case SwapOptimizer::kLion:
      return cpu.LionStep(std::get<LionOptions>(options), step, params, grads, state(0), half,
                          half_dtype);
  }
  return Status::Internal("unknown optimizer");
}

Status OptimizerSwapperOptions::Validate() const {
  if (sub_group_elements == 0 || sub_group_elements % kElementAlign != 0) {
    return Status::InvalidArgument("sub_group_elements must be a positive multiple of 1024, not " +
                                   std::to_string(sub_group_elements));
  }
  if (sub_group_elements > (uint64_t{1} << 34)) {
    return Status::InvalidArgument("sub_group_elements " + std::to_string(sub_group_elements) +
                                   " is too large (at most 2^34)");
  }
  if (buffer_count < 2) {
    return Status::InvalidArgument("buffer_count must be at least 2, not " +
                                   std::to_string(buffer_count));
  }
  if (state_slots != 1 && state_slots != 2) {
    return Status::InvalidArgument("state_slots must be 1 or 2, not " +
                                   std::to_string(state_slots));
  }
  if (store.directory.empty()) return Status::InvalidArgument("the store directory is empty");
  if (identity.size() > kMaxIdentityBytes) {
    return Status::InvalidArgument("the store's identity is " + std::to_string(identity.size()) +
                                   " bytes; at most 64 MiB");
  }
  if (grad_dtype != HalfDtype::kNone && optimizer != SwapOptimizer::kAdam &&
      optimizer != SwapOptimizer::kAdamAmsgrad) {
    return Status::InvalidArgument("grad_dtype " + std::string(HalfDtypeName(grad_dtype)) +
                                   " needs Adam; " + std::string(SwapOptimizerName(optimizer)) +
                                   " steps fp32 gradients");
  }
  return cpu.Validate();
}
uint64_t OptimizerSwapper::RequiredSlotBytes(const OptimizerSwapperOptions& options) {
  return BufferLayout::Bytes(SwapOptimizerStates(options.optimizer), options.sub_group_elements,
                             options.half_dtype != HalfDtype::kNone, options.grad_dtype);
}

uint64_t OptimizerSwapper::RequiredStoreBytes(const OptimizerSwapperOptions& options,
                                              uint64_t num_elements) {
  // Extents are rounded to the store's alignment, which is at most 64 KiB on any device we know;
  // round every value to 64 KiB and add 1 MiB for the metadata value.
  constexpr uint64_t kExtentAlign = uint64_t{64} << 10;
  const int states = SwapOptimizerStates(options.optimizer);
  const uint64_t sg = options.sub_group_elements;
  const uint64_t full = num_elements / sg;
  const uint64_t tail = num_elements % sg;
  auto per_group = [&](uint64_t n) {
    return options.state_slots * RoundUp(kHeaderBytes + (1 + states) * 4 * n, kExtentAlign) +
           RoundUp(BufferLayout::GradBytes(options.grad_dtype) * n, kExtentAlign);
  };
  return full * per_group(sg) + (tail ? per_group(tail) : 0) + (uint64_t{1} << 20);
}
OptimizerSwapper::OptimizerSwapper(std::unique_ptr<Impl> impl, uint64_t num_elements,
                                   uint64_t sub_group_elements, uint64_t epoch)
    : impl_(std::move(impl)),
      num_elements_(num_elements),
      sub_group_elements_(sub_group_elements),
      sub_group_count_((num_elements + sub_group_elements - 1) / sub_group_elements),
      epoch_(epoch) {
  impl_->grads_written.assign(sub_group_count_, false);
  impl_->stats.epoch = epoch;
}

OptimizerSwapper::~OptimizerSwapper() { (void)Close(); }

uint64_t OptimizerSwapper::SubGroupSize(uint64_t i) const {
  const uint64_t begin = SubGroupBegin(i);
  return std::min(sub_group_elements_, num_elements_ - begin);
}

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::Create(
    const OptimizerSwapperOptions& options, uint64_t num_elements, const ParamFiller& fill) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  if (num_elements == 0) return Status::InvalidArgument("num_elements must be > 0");
  if (!fill) return Status::InvalidArgument("no parameter filler given");

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->states = SwapOptimizerStates(options.optimizer);
  impl->slots = options.state_slots;
  impl->store_id = std::random_device{}() * uint64_t{0x100000000} + std::random_device{}();

  nvme::SwapStoreOptions so = options.store;
  so.open_existing = false;
  so.keep_files = true;
  if (so.capacity_bytes == 0) so.capacity_bytes = RequiredStoreBytes(options, num_elements);
  struct stat st {};
  const bool dir_existed = ::stat(so.directory.c_str(), &st) == 0;
  MEMPLAN_ASSIGN_OR_RETURN(impl->store, OpenStore(options, so));

  const uint64_t sg = options.sub_group_elements;
  auto initialise = [&]() -> Status {
    MEMPLAN_RETURN_IF_ERROR(impl->SetUpBuffers());
    const uint64_t groups = (num_elements + sg - 1) / sg;
    for (uint64_t i = 0; i < groups; ++i) {
      const uint64_t first = i * sg;
      const uint64_t n = std::min(sg, num_elements - first);
      std::span<std::byte> value = impl->Value(0, n);
      std::memset(value.data(), 0, value.size());
      SlotHeader h = impl->MakeHeader(0, i, first, n);
      std::memcpy(value.data(), &h, sizeof(h));
      MEMPLAN_RETURN_IF_ERROR(
          fill(first, impl->Array(0, 0, n))
              .WithPrefix("filling parameters of sub-group " + std::to_string(i)));
      MEMPLAN_RETURN_IF_ERROR(impl->store->Put(StateKey(i, 0), value));
    }
    if (!options.identity.empty()) {
      MEMPLAN_RETURN_IF_ERROR(impl->store->Put(
          kIdentityKey,
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(options.identity.data()),
                                     options.identity.size())));
    }
    const std::string meta = impl->MetaJson(num_elements);
    MEMPLAN_RETURN_IF_ERROR(impl->store->Put(
        kMetaKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(meta.data()), meta.size())));
    if (impl->slots == 1) {
      // A one-slot store says which step it holds (Note [One slot per sub-group]).
      const uint64_t zero = 0;
      MEMPLAN_RETURN_IF_ERROR(impl->store->Put(
          kCommittedKey,
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(&zero), sizeof(zero))));
    }
    return impl->store->Sync();
  };
  if (Status status = initialise(); !status.ok()) {
    // Nothing was committed: leave nothing behind (the store keeps its files on Close, so remove
    // them here, and the directory when this call created it).
    (void)impl->store->Close();
    for (const char* name : {nvme::SwapStore::kDataFileName, nvme::SwapStore::kIndexFileName,
                             nvme::SwapStore::kLockFileName}) {
      ::unlink((so.directory + "/" + name).c_str());
    }
    if (!dir_existed) ::rmdir(so.directory.c_str());
    return status;
  }
  return std::unique_ptr<OptimizerSwapper>(
      new OptimizerSwapper(std::move(impl), num_elements, sg, 0));
}

// Open()'s first step: the store's metadata (its geometry, which must match `options`, and its
// optimizer) and its identity record. `where` names the store in errors.
Status OptimizerSwapper::Impl::ReadMeta(const std::string& where, uint64_t& num_elements,
                                        uint64_t& sub_group_elements) {
  // The metadata: geometry and optimizer.
  auto meta_size_or = store->Size(kMetaKey);
  if (!meta_size_or.ok()) {
    return Status::DataLoss(where +
                            ": no metadata; the store was not made by Create(), or its "
                            "creation never completed");
  }
  const uint64_t meta_size = *meta_size_or;
  if (meta_size > (1 << 16)) return Status::DataLoss(where + ": metadata is implausibly large");
  std::string meta_text(meta_size, '\0');
  MEMPLAN_RETURN_IF_ERROR(store->Get(
      kMetaKey, std::span<std::byte>(reinterpret_cast<std::byte*>(meta_text.data()), meta_size)));
  auto meta = ParseJson(meta_text, where + " metadata");
  if (!meta.ok()) return Status::DataLoss(meta.status().message());
  try {
    const nlohmann::json& m = *meta;
    if (m.at("format") != kMetaFormat ||
        (m.at("version") != kMetaVersion && m.at("version") != kMetaVersionSlots)) {
      return Status::DataLoss(where + ": metadata of an unknown format or version");
    }
    slots = m.at("version") == kMetaVersion ? 2 : m.at("state_slots").get<uint32_t>();
    if (slots != 1 && slots != 2) {
      return Status::DataLoss(where + ": metadata with " + std::to_string(slots) +
                              " state slots per sub-group");
    }
    store_id = m.at("store_id").get<uint64_t>();
    num_elements = m.at("num_elements").get<uint64_t>();
    sub_group_elements = m.at("sub_group_elements").get<uint64_t>();
    const std::string optimizer = m.at("optimizer").get<std::string>();
    if (optimizer != SwapOptimizerName(options.optimizer)) {
      return Status::InvalidArgument(where + " was created for optimizer " + optimizer + ", not " +
                                     std::string(SwapOptimizerName(options.optimizer)));
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::DataLoss(where + ": bad metadata: " + e.what());
  }
  if (slots != options.state_slots) {
    return Status::InvalidArgument(where + " keeps " + std::to_string(slots) + " state slot" +
                                   (slots == 1 ? "" : "s") + " per sub-group (state_slots " +
                                   std::to_string(slots) + "), not " +
                                   std::to_string(options.state_slots) +
                                   ": open it with state_slots " + std::to_string(slots));
  }
  if (sub_group_elements != options.sub_group_elements) {
    return Status::InvalidArgument(where + " has sub-groups of " +
                                   std::to_string(sub_group_elements) + " elements, not " +
                                   std::to_string(options.sub_group_elements));
  }
  if (num_elements == 0 || sub_group_elements == 0 || sub_group_elements % kElementAlign != 0) {
    return Status::DataLoss(where + ": metadata with an impossible geometry");
  }
  // What the store holds, as its owner described it (none in a store made without one).
  options.identity.clear();
  if (auto size = store->Size(kIdentityKey); size.ok()) {
    if (*size > kMaxIdentityBytes) {
      return Status::DataLoss(where + ": its identity record is implausibly large");
    }
    options.identity.assign(*size, '\0');
    MEMPLAN_RETURN_IF_ERROR(store->Get(
        kIdentityKey,
        std::span<std::byte>(reinterpret_cast<std::byte*>(options.identity.data()), *size)));
  }
  return Status::Ok();
}

// Open()'s second step: the newest step every sub-group holds whole (Note [Two slots per
// sub-group]), not past the commit marker nor options.max_epoch, and the traces of a step begun
// after it.
Result<RecoveryReport> OptimizerSwapper::Impl::Recover(const std::string& where,
                                                       uint64_t num_elements,
                                                       uint64_t sub_group_elements) {
  if (slots == 1) return RecoverOneSlot(where, num_elements, sub_group_elements);
  // Recovery: the epochs each sub-group holds whole (Note [Two slots per sub-group]).
  const uint64_t groups = (num_elements + sub_group_elements - 1) / sub_group_elements;
  std::vector<std::array<std::optional<uint64_t>, 2>> held(groups);
  RecoveryReport found;
  for (uint64_t i = 0; i < groups; ++i) {
    const uint64_t first = i * sub_group_elements;
    const uint64_t n = std::min(sub_group_elements, num_elements - first);
    for (uint64_t slot = 0; slot < 2; ++slot) {
      const std::string key = StateKey(i, slot);
      auto size = store->Size(key);
      if (!size.ok()) continue;  // never written, or written after the last commit
      if (*size != kHeaderBytes + (1 + states) * 4 * n) {
        found.notes.push_back(key + ": wrong size " + std::to_string(*size));
        continue;
      }
      SlotHeader h{};
      Status read = store->GetRange(
          key, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(&h), sizeof(h)));
      if (!read.ok()) {
        found.notes.push_back(key + ": unreadable (" + read.message() + ")");
        continue;
      }
      auto epoch = CheckHeader(h, i, slot, first, n);
      if (!epoch.ok()) {
        found.notes.push_back(epoch.status().message());
        continue;
      }
      held[i][slot] = *epoch;
    }
  }
  // The newest epoch every sub-group holds, and not past the commit marker (stores written before
  // the marker existed have none). Sub-group 0's epochs are the only candidates.
  uint64_t marker = UINT64_MAX;
  if (store->Size(kCommittedKey).ok()) {
    Status read = store->Get(
        kCommittedKey, std::span<std::byte>(reinterpret_cast<std::byte*>(&marker), sizeof(marker)));
    if (!read.ok()) {
      found.notes.push_back(std::string(kCommittedKey) + ": " + read.message());
      marker = UINT64_MAX;
    }
  }
  std::optional<uint64_t> committed;
  for (const auto& candidate : held[0]) {
    if (!candidate || *candidate > options.max_epoch || *candidate > marker) continue;
    bool everywhere = std::all_of(held.begin(), held.end(), [&](const auto& held_slots) {
      return held_slots[0] == candidate || held_slots[1] == candidate;
    });
    if (everywhere && (!committed || *candidate > *committed)) committed = candidate;
  }
  if (!committed) {
    std::string detail = found.notes.empty() ? "" : " (first problem: " + found.notes[0] + ")";
    if (options.max_epoch != UINT64_MAX) {
      return Status::DataLoss(where + ": no step up to " + std::to_string(options.max_epoch) +
                              " is held whole by every sub-group (a store keeps its last two "
                              "steps)" +
                              detail);
    }
    return Status::DataLoss(where + ": no step is held whole by every sub-group" + detail);
  }
  found.epoch = *committed;
  // The other slot of each sub-group should hold epoch - 1 (or nothing at epoch 0); anything else
  // there, or a damaged slot, is the trace of a step that did not commit.
  for (uint64_t i = 0; i < groups; ++i) {
    const uint64_t other = (found.epoch + 1) % 2;
    const std::string key = StateKey(i, other);
    const bool exists = store->Size(key).ok();
    const bool expected_previous =
        held[i][other] && found.epoch > 0 && *held[i][other] == found.epoch - 1;
    const bool empty_at_start = !exists && found.epoch == 0;
    if (!expected_previous && !empty_at_start) {
      ++found.torn_sub_groups;
      if (held[i][other] && *held[i][other] > found.epoch) {
        found.notes.push_back(key + ": holds uncommitted epoch " + std::to_string(*held[i][other]));
      }
    }
  }
  // A store whose previous-epoch slots were merely never written (epoch 0 only) is not torn; one
  // where every sub-group has its previous epoch intact is not torn either.
  uint64_t begun = 0;
  if (store->Size(kBegunKey).ok()) {
    Status read = store->Get(
        kBegunKey, std::span<std::byte>(reinterpret_cast<std::byte*>(&begun), sizeof(begun)));
    if (!read.ok()) found.notes.push_back(std::string(kBegunKey) + ": " + read.message());
  }
  if (begun > found.epoch) {
    found.notes.push_back("step " + std::to_string(begun) + " was begun and not committed");
  }
  found.torn = found.torn_sub_groups > 0 || begun > found.epoch;
  if (found.torn) found.torn_epoch = found.epoch + 1;
  return found;
}

// Open()'s second step for a one-slot store (Note [One slot per sub-group]): the committed step,
// which every sub-group must hold, or DataLoss.
Result<RecoveryReport> OptimizerSwapper::Impl::RecoverOneSlot(const std::string& where,
                                                              uint64_t num_elements,
                                                              uint64_t sub_group_elements) {
  const std::string restart = "; restart training from a checkpoint";
  auto read_marker = [&](const char* key, uint64_t* value) -> Status {
    MEMPLAN_ASSIGN_OR_RETURN(const uint64_t size, store->Size(key));
    if (size != sizeof(uint64_t)) {
      return Status::DataLoss(std::string(key) + " holds " + std::to_string(size) + " bytes");
    }
    return store->Get(key, std::span<std::byte>(reinterpret_cast<std::byte*>(value), size));
  };
  uint64_t committed = 0, begun = 0;
  if (Status read = read_marker(kCommittedKey, &committed); !read.ok()) {
    return Status::DataLoss(where +
                            ": keeps one state slot per sub-group (state_slots 1) and its commit "
                            "marker is unreadable (" +
                            read.message() + "), so which step it holds is unknown" + restart);
  }
  if (Status read = read_marker(kBegunKey, &begun);
      !read.ok() && read.code() != StatusCode::kNotFound) {
    return Status::DataLoss(where +
                            ": keeps one state slot per sub-group (state_slots 1) and its begun "
                            "marker is unreadable (" +
                            read.message() + "), so whether a step was interrupted is unknown" +
                            restart);
  }
  if (begun > committed) {
    return Status::DataLoss(
        where + ": step " + std::to_string(begun) +
        " was begun and never committed, and the store keeps one state slot per sub-group "
        "(state_slots 1): that step rewrote the sub-groups' states in place, so the store holds "
        "a mix of steps " +
        std::to_string(committed) + " and " + std::to_string(begun) + " that cannot be resumed" +
        restart);
  }
  if (committed > options.max_epoch) {
    return Status::DataLoss(where + ": step " + std::to_string(options.max_epoch) +
                            " asked for, but the store keeps one state slot per sub-group "
                            "(state_slots 1) and holds its last step, " +
                            std::to_string(committed) + ", only" + restart);
  }
  const uint64_t groups = (num_elements + sub_group_elements - 1) / sub_group_elements;
  for (uint64_t i = 0; i < groups; ++i) {
    const uint64_t first = i * sub_group_elements;
    const uint64_t n = std::min(sub_group_elements, num_elements - first);
    const std::string key = StateKey(i, 0);
    const std::string mix =
        " (a one-slot store, state_slots 1, holding a mix of steps cannot be "
        "resumed" +
        restart + ")";
    auto size = store->Size(key);
    if (!size.ok() || *size != kHeaderBytes + (1 + states) * 4 * n) {
      return Status::DataLoss(where + ": " + key +
                              (size.ok() ? " has the wrong size " + std::to_string(*size)
                                         : std::string(" is missing")) +
                              mix);
    }
    SlotHeader h{};
    Status read =
        store->GetRange(key, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(&h), sizeof(h)));
    if (read.code() == StatusCode::kDataLoss) {
      return Status::DataLoss(where + ": " + read.message() + mix);
    }
    MEMPLAN_RETURN_IF_ERROR(read.WithPrefix(where));
    Result<uint64_t> epoch = CheckHeader(h, i, 0, first, n);
    if (!epoch.ok()) return Status::DataLoss(where + ": " + epoch.status().message() + mix);
    if (*epoch != committed) {
      return Status::DataLoss(where + ": sub-group " + std::to_string(i) + " holds step " +
                              std::to_string(*epoch) + " but the last commit is step " +
                              std::to_string(committed) + mix);
    }
  }
  RecoveryReport found;
  found.epoch = committed;
  return found;
}

void OptimizerSwapper::Impl::EndUncommitted(uint64_t to, bool wrote) {
  if (slots != 1) return;
  if (!wrote) {
    // Nothing rewritten: the committed step is whole; say so on disk too.
    const uint64_t back = to - 1;
    Status restored = store->Put(
        kBegunKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(&back), sizeof(back)));
    if (restored.ok()) restored = store->Sync(options.durability);
    if (restored.ok()) return;
    // The marker on disk still says `to` was begun: Open() will refuse the store, and so does
    // this swapper, rather than the two disagree.
  }
  torn_step = to;
}

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::Open(
    const OptimizerSwapperOptions& options, RecoveryReport* report) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->states = SwapOptimizerStates(options.optimizer);

  nvme::SwapStoreOptions so = options.store;
  so.open_existing = true;
  so.keep_files = true;
  MEMPLAN_ASSIGN_OR_RETURN(impl->store, OpenStore(options, so));
  const std::string where = "optimizer swapper store " + so.directory;

  uint64_t num_elements = 0, sub_group_elements = 0;
  MEMPLAN_RETURN_IF_ERROR(impl->ReadMeta(where, num_elements, sub_group_elements));
  MEMPLAN_ASSIGN_OR_RETURN(const RecoveryReport found,
                           impl->Recover(where, num_elements, sub_group_elements));
  if (report != nullptr) *report = found;

  MEMPLAN_RETURN_IF_ERROR(impl->SetUpBuffers());
  auto swapper = std::unique_ptr<OptimizerSwapper>(
      new OptimizerSwapper(std::move(impl), num_elements, sub_group_elements, found.epoch));
  return swapper;
}

Status OptimizerSwapper::WriteGradients(uint64_t sub_group, std::span<const float> grads) {
  if (impl_->options.grad_dtype != HalfDtype::kNone) {
    return Status::FailedPrecondition("the optimizer swapper takes " +
                                      std::string(HalfDtypeName(impl_->options.grad_dtype)) +
                                      " gradients (WriteHalfGradients), not fp32");
  }
  return PutGradients(sub_group, std::as_bytes(grads), grads.size());
}

Status OptimizerSwapper::WriteHalfGradients(uint64_t sub_group, std::span<const uint16_t> grads) {
  if (impl_->options.grad_dtype == HalfDtype::kNone) {
    return Status::FailedPrecondition(
        "the optimizer swapper takes fp32 gradients (WriteGradients), not 16-bit ones");
  }
  return PutGradients(sub_group, std::as_bytes(grads), grads.size());
}

Status OptimizerSwapper::PutGradients(uint64_t sub_group, std::span<const std::byte> bytes,
                                      size_t count) {
  if (impl_->closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  if (count != SubGroupSize(sub_group)) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(SubGroupSize(sub_group)) + " elements; " +
                                   std::to_string(count) + " gradients given");
  }
  MEMPLAN_RETURN_IF_ERROR(impl_->store->Put(GradKey(sub_group), bytes));
  impl_->grads_written[sub_group] = true;
  return Status::Ok();
}
Status OptimizerSwapper::ReadState(uint64_t sub_group, int state, std::span<float> out) {
  if (state < 0 || state >= impl_->states) {
    return Status::InvalidArgument("state " + std::to_string(state) + " out of range (" +
                                   std::to_string(impl_->states) + " states)");
  }
  return ReadArray(sub_group, state + 1, out);
}

Status OptimizerSwapper::ReadParams(uint64_t sub_group, std::span<float> out) {
  return ReadArray(sub_group, 0, out);
}

Status OptimizerSwapper::ReadArray(uint64_t sub_group, int array, std::span<float> out) {
  if (sub_group < sub_group_count_ && out.size() != SubGroupSize(sub_group)) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(SubGroupSize(sub_group)) +
                                   " elements; the output holds " + std::to_string(out.size()));
  }
  return ReadRange(sub_group, array, 0, out);
}

Status OptimizerSwapper::ReadRange(uint64_t sub_group, int array, uint64_t offset,
                                   std::span<float> out) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  const uint64_t n = SubGroupSize(sub_group);
  if (array < 0 || array > s.states) {
    return Status::InvalidArgument("array " + std::to_string(array) + " out of range");
  }
  if (offset > n || out.size() > n - offset) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(n) + " elements; elements [" +
                                   std::to_string(offset) + ", " +
                                   std::to_string(offset + out.size()) + ") asked for");
  }
  if (s.torn_step != 0) {
    return s.TornError("reading sub-group " + std::to_string(sub_group) + " of the optimizer");
  }
  const uint64_t slot = s.SlotOf(epoch_);
  const std::string key = StateKey(sub_group, slot);
  SlotHeader h{};
  MEMPLAN_RETURN_IF_ERROR(
      s.store->GetRange(key, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(&h), sizeof(h))));
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t epoch,
                           s.CheckHeader(h, sub_group, slot, SubGroupBegin(sub_group), n));
  if (epoch != epoch_) {
    return Status::DataLoss("state slot " + key + " holds epoch " + std::to_string(epoch) +
                            ", expected " + std::to_string(epoch_));
  }
  const uint64_t at = kHeaderBytes + static_cast<uint64_t>(array) * 4 * n + offset * 4;
  return s.store->GetRange(
      key, at, std::span<std::byte>(reinterpret_cast<std::byte*>(out.data()), out.size_bytes()));
}

const std::string& OptimizerSwapper::identity() const { return impl_->options.identity; }

void OptimizerSwapper::DiscardGradients() {
  std::fill(impl_->grads_written.begin(), impl_->grads_written.end(), false);
}

Status OptimizerSwapper::Load(const ArrayFiller& fill, std::span<const bool> arrays) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("a step is begun; finish or abort it first");
  if (s.torn_step != 0) return s.TornError("load");
  if (arrays.size() != static_cast<size_t>(1 + s.states)) {
    return Status::InvalidArgument("load: " + std::to_string(arrays.size()) + " array flags for " +
                                   std::to_string(1 + s.states) + " arrays");
  }
  if (!fill) return Status::InvalidArgument("load: no filler given");
  // As a step (Note [Two slots per sub-group]): the begun marker, every sub-group's new value in
  // its other slot, then the commit; the slot of epoch() is never touched. With one slot the
  // values are rewritten in place (Note [One slot per sub-group]).
  const uint64_t from = epoch_, to = epoch_ + 1;
  bool wrote = false;
  Status status = [&]() -> Status {
    MEMPLAN_RETURN_IF_ERROR(s.store->Put(
        kBegunKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(&to), sizeof(to))));
    MEMPLAN_RETURN_IF_ERROR(
        s.store->Sync(s.options.durability).WithPrefix("beginning load " + std::to_string(to)));
    const size_t b = 0;
    for (uint64_t i = 0; i < sub_group_count_; ++i) {
      const uint64_t n = SubGroupSize(i);
      std::span<std::byte> value = s.Value(b, n);
      const std::string where = "load " + std::to_string(to) + ", sub-group " + std::to_string(i);
      MEMPLAN_RETURN_IF_ERROR(s.store->Get(StateKey(i, s.SlotOf(from)), value).WithPrefix(where));
      SlotHeader h;
      std::memcpy(&h, value.data(), sizeof(h));
      MEMPLAN_ASSIGN_OR_RETURN(const uint64_t held,
                               s.CheckHeader(h, i, s.SlotOf(from), SubGroupBegin(i), n));
      if (held != from) {
        return Status::DataLoss(where + ": slot holds epoch " + std::to_string(held) +
                                ", expected " + std::to_string(from));
      }
      for (int a = 0; a <= s.states; ++a) {
        if (arrays[static_cast<size_t>(a)]) {
          MEMPLAN_RETURN_IF_ERROR(fill(i, a, s.Array(b, a, n)).WithPrefix(where));
        }
      }
      h = s.MakeHeader(to, i, SubGroupBegin(i), n);
      std::memcpy(value.data(), &h, sizeof(h));
      wrote = true;
      MEMPLAN_RETURN_IF_ERROR(s.store->Put(StateKey(i, s.SlotOf(to)), value).WithPrefix(where));
    }
    MEMPLAN_RETURN_IF_ERROR(s.store->Put(
        kCommittedKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(&to), sizeof(to))));
    return s.store->Sync(s.options.durability).WithPrefix("committing load " + std::to_string(to));
  }();
  if (!status.ok()) {
    s.EndUncommitted(to, wrote);
    return status;
  }
  epoch_ = to;
  s.stats.epoch = to;
  return Status::Ok();
}

uint32_t OptimizerSwapper::state_slots() const { return impl_->slots; }

uint64_t OptimizerSwapper::torn_step() const { return impl_->torn_step; }

Status OptimizerSwapper::Sync() {
  if (impl_->closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  return impl_->store->Sync();
}

OptimizerSwapperStats OptimizerSwapper::stats() const {
  OptimizerSwapperStats out = impl_->stats;
  if (impl_->pool != nullptr) out.pool = impl_->pool->stats();
  if (impl_->store) out.store = impl_->store->stats();
  return out;
}

Status OptimizerSwapper::Close() {
  if (impl_->closed) return Status::Ok();
  AbortStep();  // a begun step is not committed
  Impl& s = *impl_;
  s.closed = true;
  Status status;
  if (s.store) status = s.store->Close();  // keep_files: writes the index, fsyncs the data
  s.buffers.clear();                       // back to the pool before the pool goes
  s.own_pool.reset();
  return status;
}

}  // namespace memplan::offload
