// FaultBackend on its own, through the raw Submit/Reap contract: which requests each trigger hits,
// what a completion then says, that nothing outside the plan changes, and the memory backend it
// usually wraps.
#include "nvme/fault_backend.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "nvme/backend.h"
#include "tests/status_testing.h"

namespace memplan::nvme {
namespace {

std::unique_ptr<Backend> MemoryBackend(uint32_t queue_depth = 8) {
  BackendOptions options;
  options.queue_depth = queue_depth;
  Result<std::unique_ptr<Backend>> backend = CreateMemoryBackend(options);
  REQUIRE_OK(backend);
  return std::move(backend).value();
}

std::unique_ptr<FaultBackend> Wrap(const FaultPlan& plan = {}, uint32_t queue_depth = 8) {
  Result<std::unique_ptr<FaultBackend>> fault =
      FaultBackend::Create(MemoryBackend(queue_depth), plan);
  REQUIRE_MESSAGE(fault.ok(), fault.status().ToString());
  return std::move(fault).value();
}

// Submits one request, reaps its completion and returns the result.
int64_t Do(Backend& backend, Request& request) {
  Request* one[] = {&request};
  Result<size_t> taken = backend.Submit(one);
  REQUIRE_OK(taken);
  REQUIRE(*taken == 1);
  Completion c;
  Result<size_t> reaped = backend.Reap({&c, 1}, 1);
  REQUIRE_OK(reaped);
  REQUIRE(*reaped == 1);
  REQUIRE(c.request == &request);
  return c.result;
}

int64_t Write(Backend& backend, int file, uint64_t offset, std::vector<unsigned char>& data) {
  Request r{OpType::kWrite, file, offset, data.data(), static_cast<uint32_t>(data.size()), -1, 0};
  return Do(backend, r);
}

int64_t Read(Backend& backend, int file, uint64_t offset, std::vector<unsigned char>& data) {
  Request r{OpType::kRead, file, offset, data.data(), static_cast<uint32_t>(data.size()), -1, 0};
  return Do(backend, r);
}

// Which of `count` one-byte reads fail under `plan`, as a string of '.' and 'x'.
std::string FailurePattern(const FaultPlan& plan, int count) {
  std::unique_ptr<FaultBackend> fault = Wrap();
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> byte(1, 7);
  REQUIRE(Write(*fault, *file, 0, byte) == 1);
  REQUIRE_OK(fault->SetPlan(plan));
  std::string pattern;
  for (int i = 0; i < count; ++i) pattern += Read(*fault, *file, 0, byte) < 0 ? 'x' : '.';
  return pattern;
}

// ---- The memory backend -------------------------------------------------------------------------

TEST_CASE("fault: the memory backend stores per file, reads short past the end, honours depth") {
  std::unique_ptr<Backend> memory = MemoryBackend(2);
  CHECK(memory->capabilities().name == "memory");
  CHECK(memory->capabilities().queue_depth == 2);
  Result<int> a = memory->RegisterFile(0);
  Result<int> b = memory->RegisterFile(0);
  REQUIRE_OK(a);
  REQUIRE_OK(b);
  CHECK(*a != *b);

  std::vector<unsigned char> data = {1, 2, 3, 4, 5};
  CHECK(Write(*memory, *a, 10, data) == 5);
  std::vector<unsigned char> in(8, 0xEE);
  CHECK(Read(*memory, *a, 12, in) == 3);  // short: the file ends at 15
  CHECK(in[0] == 3);
  CHECK(in[2] == 5);
  CHECK(in[3] == 0xEE);  // nothing written past what was transferred
  CHECK(Read(*memory, *a, 15, in) == 0);
  CHECK(Read(*memory, *b, 0, in) == 0);  // the other file is empty
  CHECK(Read(*memory, *a, 0, in) == 8);  // the hole before offset 10 reads as zeros
  CHECK(in[0] == 0);

  // Busy: a third request does not fit in a queue of two until something is reaped.
  Request r1{OpType::kRead, *a, 0, in.data(), 1, -1, 1};
  Request r2 = r1, r3 = r1;
  Request* three[] = {&r1, &r2, &r3};
  Result<size_t> taken = memory->Submit(three);
  REQUIRE_OK(taken);
  CHECK(*taken == 2);
  CHECK(memory->in_flight() == 2);
  CHECK(*memory->Submit({&three[2], 1}) == 0);
  Completion out[4];
  CHECK(*memory->Reap(out, 4) == 2);  // min_complete is clamped to what is in flight
  CHECK(*memory->Submit({&three[2], 1}) == 1);
  CHECK(*memory->Reap(out, 1) == 1);
  CHECK(out[0].request == &r3);
  CHECK(*memory->Reap(out, 1) == 0);  // nothing in flight: never waits

  Request bad{OpType::kRead, 99, 0, in.data(), 1, -1, 0};
  CHECK(Do(*memory, bad) == -EBADF);
  CHECK_OK(memory->UnregisterFile(*a));
  CHECK(memory->UnregisterFile(*a).code() == StatusCode::kInvalidArgument);
  Request gone{OpType::kRead, *a, 0, in.data(), 1, -1, 0};
  CHECK(Do(*memory, gone) == -EBADF);
}

// ---- FaultBackend -------------------------------------------------------------------------------

TEST_CASE("fault: the wrapper forwards everything and names itself after the inner backend") {
  std::unique_ptr<FaultBackend> fault = Wrap({}, 16);
  CHECK(fault->capabilities().name == "fault(memory)");
  CHECK(fault->capabilities().queue_depth == 16);
  CHECK(fault->inner()->capabilities().name == "memory");
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  CHECK_OK(fault->RegisterBuffers({}));
  std::vector<unsigned char> data = {9, 8, 7};
  CHECK(Write(*fault, *file, 0, data) == 3);
  std::vector<unsigned char> in(3);
  CHECK(Read(*fault, *file, 0, in) == 3);
  CHECK(in == data);
  CHECK(fault->counters().requests == 2);
  CHECK(fault->counters().total() == 0);
  CHECK_OK(fault->UnregisterFile(*file));

  CHECK(FaultBackend::Create(nullptr).status().code() == StatusCode::kInvalidArgument);
  FaultPlan bad;
  bad.flip.probability = 1.5;
  CHECK(FaultBackend::Create(MemoryBackend(), bad).status().code() == StatusCode::kInvalidArgument);
  bad = FaultPlan{};
  bad.error = 0;
  CHECK(fault->SetPlan(bad).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("fault: the nth request fails at completion with the planned errno") {
  FaultPlan plan;
  plan.fail.nth = 3;
  CHECK(FailurePattern(plan, 6) == "..x...");
  plan.fail.times = 2;
  CHECK(FailurePattern(plan, 6) == "..xx..");
  plan.fail.times = 0;
  CHECK(FailurePattern(plan, 6) == "..xxxx");

  for (int err : {EIO, ENOSPC, EINTR, EAGAIN}) {
    CAPTURE(err);
    FaultPlan one;
    one.fail.nth = 1;
    one.error = err;
    std::unique_ptr<FaultBackend> fault = Wrap(one);
    Result<int> file = fault->RegisterFile(0);
    REQUIRE_OK(file);
    std::vector<unsigned char> data = {1, 2, 3};
    CHECK(Write(*fault, *file, 0, data) == -err);
    CHECK(fault->counters().errors == 1);
    CHECK(fault->in_flight() == 0);
  }
}

TEST_CASE("fault: triggers count per op type or over all ops") {
  FaultPlan plan;
  plan.fail.op = OpType::kWrite;
  plan.fail.nth = 2;
  std::unique_ptr<FaultBackend> fault = Wrap(plan);
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> data(16, 1);
  CHECK(Write(*fault, *file, 0, data) == 16);  // write 1
  CHECK(Read(*fault, *file, 0, data) == 16);   // reads are not counted
  CHECK(Read(*fault, *file, 0, data) == 16);
  CHECK(Write(*fault, *file, 0, data) == -EIO);  // write 2
  CHECK(Write(*fault, *file, 0, data) == 16);

  plan.fail.op.reset();  // every op counts
  REQUIRE_OK(fault->SetPlan(plan));
  CHECK(Read(*fault, *file, 0, data) == 16);
  CHECK(Write(*fault, *file, 0, data) == -EIO);
  Request sync{OpType::kFsync, *file, 0, nullptr, 0, -1, 0};
  CHECK(Do(*fault, sync) == 0);
}

TEST_CASE("fault: random faults follow the seed") {
  FaultPlan plan;
  plan.fail.probability = 0.3;
  plan.seed = 1234;
  const std::string first = FailurePattern(plan, 400);
  CHECK(FailurePattern(plan, 400) == first);  // same seed, same faults
  const auto hits = std::count(first.begin(), first.end(), 'x');
  CHECK(hits > 80);
  CHECK(hits < 160);
  plan.seed = 4321;
  CHECK(FailurePattern(plan, 400) != first);
  plan.fail.probability = 1.0;
  CHECK(FailurePattern(plan, 5) == "xxxxx");
  plan.fail.probability = 0.0;
  CHECK(FailurePattern(plan, 5) == ".....");
}

TEST_CASE("fault: a short transfer moves only the bytes it reports") {
  std::unique_ptr<FaultBackend> fault = Wrap();
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> data(100, 0x11);
  REQUIRE(Write(*fault, *file, 0, data) == 100);

  FaultPlan plan;
  plan.shorten.nth = 1;
  plan.short_keep_bytes = 40;
  REQUIRE_OK(fault->SetPlan(plan));
  std::vector<unsigned char> update(100, 0x22);
  Request w{OpType::kWrite, *file, 0, update.data(), 100, -1, 77};
  CHECK(Do(*fault, w) == 40);
  // The caller's request is untouched: the length was cut on a private copy.
  CHECK(w.length == 100);
  CHECK(w.user_data == 77);
  CHECK(fault->counters().short_transfers == 1);

  REQUIRE_OK(fault->SetPlan(plan));  // restart the count: the next read is shortened too
  std::vector<unsigned char> in(100, 0xEE);
  CHECK(Read(*fault, *file, 0, in) == 40);
  CHECK(in[39] == 0x22);
  CHECK(in[40] == 0xEE);  // not read, not touched

  REQUIRE_OK(fault->SetPlan({}));
  CHECK(Read(*fault, *file, 0, in) == 100);
  CHECK(in[39] == 0x22);
  CHECK(in[40] == 0x11);  // the short write really stopped at 40 bytes

  plan.short_keep_bytes = 200;  // longer than the request: left alone
  REQUIRE_OK(fault->SetPlan(plan));
  CHECK(Read(*fault, *file, 0, in) == 100);
  CHECK(fault->counters().short_transfers == 2);
}

TEST_CASE("fault: bit flips in data read and in data written") {
  std::unique_ptr<FaultBackend> fault = Wrap();
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> zeros(64, 0);
  REQUIRE(Write(*fault, *file, 0, zeros) == 64);

  FaultPlan plan;
  plan.flip.op = OpType::kRead;
  plan.flip.nth = 1;
  plan.flip_bit = 64 * 8 + 9;  // wraps to bit 9 of a 64-byte transfer: byte 1, mask 0x02
  REQUIRE_OK(fault->SetPlan(plan));
  std::vector<unsigned char> in(64, 0);
  CHECK(Read(*fault, *file, 0, in) == 64);
  CHECK(in[1] == 0x02);
  in[1] = 0;
  CHECK(in == zeros);
  CHECK(fault->counters().read_flips == 1);

  plan.flip.op = OpType::kWrite;
  REQUIRE_OK(fault->SetPlan(plan));
  std::vector<unsigned char> out(64, 0);
  CHECK(Write(*fault, *file, 0, out) == 64);
  CHECK(out == zeros);  // restored before the completion came back
  CHECK(fault->counters().write_flips == 1);
  REQUIRE_OK(fault->SetPlan({}));
  CHECK(Read(*fault, *file, 0, in) == 64);
  CHECK(in[1] == 0x02);  // but the device got the flipped bit
}

TEST_CASE("fault: a failed submit takes nothing; an error beats a short transfer") {
  FaultPlan plan;
  plan.submit_fail.nth = 2;
  std::unique_ptr<FaultBackend> fault = Wrap(plan);
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> data(10, 3);
  CHECK(Write(*fault, *file, 0, data) == 10);
  Request r{OpType::kRead, *file, 0, data.data(), 10, -1, 0};
  Request* one[] = {&r};
  Result<size_t> failed = fault->Submit(one);
  CHECK(failed.status().code() == StatusCode::kIoError);
  CHECK(fault->in_flight() == 0);
  CHECK(fault->counters().submit_failures == 1);
  CHECK(Do(*fault, r) == 10);

  FaultPlan both;
  both.fail.nth = 1;
  both.shorten.nth = 1;
  both.short_keep_bytes = 2;
  REQUIRE_OK(fault->SetPlan(both));
  CHECK(Do(*fault, r) == -EIO);
  CHECK(fault->counters().errors == 1);
  CHECK(fault->counters().short_transfers == 0);
}

TEST_CASE("fault: a request the inner backend refuses is not counted and keeps its buffer") {
  // The inner queue holds 2; a third request is refused, and must not have been counted as the
  // trigger's 3rd request or left with a flipped bit.
  FaultPlan plan;
  plan.flip.op = OpType::kWrite;
  plan.flip.nth = 3;
  std::unique_ptr<FaultBackend> fault = Wrap(plan, 2);
  Result<int> file = fault->RegisterFile(0);
  REQUIRE_OK(file);
  std::vector<unsigned char> a(8, 0), b(8, 0), c(8, 0);
  Request ra{OpType::kWrite, *file, 0, a.data(), 8, -1, 0};
  Request rb{OpType::kWrite, *file, 8, b.data(), 8, -1, 0};
  Request rc{OpType::kWrite, *file, 16, c.data(), 8, -1, 0};
  Request* all[] = {&ra, &rb, &rc};
  Result<size_t> taken = fault->Submit(all);
  REQUIRE_OK(taken);
  CHECK(*taken == 2);
  CHECK(c == std::vector<unsigned char>(8, 0));
  Completion out[2];
  CHECK(*fault->Reap(out, 2) == 2);
  CHECK(fault->counters().write_flips == 0);
  CHECK(Do(*fault, rc) == 8);  // now it is the 3rd write counted
  CHECK(fault->counters().write_flips == 1);
  CHECK(c == std::vector<unsigned char>(8, 0));
}

}  // namespace
}  // namespace memplan::nvme
