// The thread-group Collective: N ranks on N threads all-gather, reduce-scatter and all-reduce host
// buffers with exact, rank-ordered fp32 sums (16-bit results rounded once), in place as NCCL
// allows; ranks that disagree on a call get InvalidArgument; a rank that never comes breaks the
// group after the timeout.
#include "offload/thread_collective.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "offload/half.h"

namespace memplan::offload {
namespace {

using Collectives = std::vector<std::unique_ptr<Collective>>;

Collectives MakeGroup(int world, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  auto group = CreateThreadGroupCollectives(world, nullptr, timeout);
  REQUIRE_MESSAGE(group.ok(), group.status().ToString());
  return std::move(*group);
}

// Runs body(rank, collective) on one thread per rank; returns each rank's status.
std::vector<Status> OnRanks(Collectives& group,
                            const std::function<Status(int, Collective&)>& body) {
  std::vector<Status> status(group.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] { status[r] = body(static_cast<int>(r), *group[r]); });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

void RequireAllOk(const std::vector<Status>& status) {
  for (size_t r = 0; r < status.size(); ++r) {
    CAPTURE(r);
    REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
  }
}

float Value(int rank, uint64_t i) { return static_cast<float>(rank * 1000 + static_cast<int>(i)); }

TEST_CASE("thread collective: ranks, names, bad arguments") {
  Collectives group = MakeGroup(3);
  REQUIRE(group.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(group[static_cast<size_t>(r)]->rank() == r);
    CHECK(group[static_cast<size_t>(r)]->world_size() == 3);
    CHECK(group[static_cast<size_t>(r)]->Name() == "thread-group");
  }
  CHECK(CreateThreadGroupCollectives(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(CreateThreadGroupCollectives(2, nullptr, std::chrono::milliseconds(0)).status().code() ==
        StatusCode::kInvalidArgument);
  float x = 0;
  CHECK(group[0]->AllGather(nullptr, &x, 1, ElementType::kFloat32).code() ==
        StatusCode::kInvalidArgument);
  CHECK(group[0]->AllReduce(&x, uint64_t{1} << 62, ElementType::kFloat32).code() ==
        StatusCode::kOutOfRange);
  // Zero elements: every rank must still call, and nothing is touched.
  RequireAllOk(OnRanks(group, [](int, Collective& c) {
    return c.AllGather(nullptr, nullptr, 0, ElementType::kFloat32);
  }));
}

TEST_CASE(
    "thread collective: all-gather puts each rank's buffer in rank "
    "order, in place too") {
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    Collectives group = MakeGroup(world);
    constexpr uint64_t kCount = 1000;
    std::vector<std::vector<float>> recv(static_cast<size_t>(world));
    std::vector<std::vector<float>> in_place(static_cast<size_t>(world));
    RequireAllOk(OnRanks(group, [&](int r, Collective& c) {
      std::vector<float> send(kCount);
      for (uint64_t i = 0; i < kCount; ++i) send[i] = Value(r, i);
      std::vector<float>& out = recv[static_cast<size_t>(r)];
      out.assign(kCount * static_cast<uint64_t>(world), -1.0f);
      MEMPLAN_RETURN_IF_ERROR(c.AllGather(send.data(), out.data(), kCount, ElementType::kFloat32));
      // In place: this rank's slot of the result buffer is its send buffer.
      std::vector<float>& buf = in_place[static_cast<size_t>(r)];
      buf.assign(kCount * static_cast<uint64_t>(world), -1.0f);
      std::copy(send.begin(), send.end(), buf.begin() + static_cast<int64_t>(r * kCount));
      return c.AllGather(buf.data() + r * kCount, buf.data(), kCount, ElementType::kFloat32);
    }));
    for (int r = 0; r < world; ++r) {
      size_t wrong = 0;
      for (int q = 0; q < world; ++q) {
        for (uint64_t i = 0; i < kCount; ++i) {
          const uint64_t at = static_cast<uint64_t>(q) * kCount + i;
          wrong += recv[static_cast<size_t>(r)][at] != Value(q, i);
          wrong += in_place[static_cast<size_t>(r)][at] != Value(q, i);
        }
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("thread collective: reduce-scatter and all-reduce sum exactly in fp32") {
  constexpr int kWorld = 4;
  constexpr uint64_t kCount = 300;
  Collectives group = MakeGroup(kWorld);
  std::vector<std::vector<float>> scattered(kWorld), scattered_in_place(kWorld), reduced(kWorld);
  RequireAllOk(OnRanks(group, [&](int r, Collective& c) {
    std::vector<float> send(kCount * kWorld);
    for (uint64_t i = 0; i < send.size(); ++i) send[i] = Value(r, i) * 0.5f;
    std::vector<float>& out = scattered[static_cast<size_t>(r)];
    out.assign(kCount, 0.0f);
    MEMPLAN_RETURN_IF_ERROR(
        c.ReduceScatter(send.data(), out.data(), kCount, ElementType::kFloat32));
    // In place: the result lands in this rank's slot of the send buffer.
    std::vector<float> buf = send;
    MEMPLAN_RETURN_IF_ERROR(
        c.ReduceScatter(buf.data(), buf.data() + r * kCount, kCount, ElementType::kFloat32));
    scattered_in_place[static_cast<size_t>(r)].assign(buf.begin() + r * kCount,
                                                      buf.begin() + (r + 1) * kCount);
    std::vector<float>& all = reduced[static_cast<size_t>(r)];
    all = send;
    return c.AllReduce(all.data(), all.size(), ElementType::kFloat32);
  }));
  for (int r = 0; r < kWorld; ++r) {
    size_t wrong = 0;
    for (uint64_t i = 0; i < kCount * kWorld; ++i) {
      float want = 0;
      for (int q = 0; q < kWorld; ++q) want += Value(q, i) * 0.5f;
      wrong += reduced[static_cast<size_t>(r)][i] != want;
      if (i / kCount == static_cast<uint64_t>(r)) {
        wrong += scattered[static_cast<size_t>(r)][i % kCount] != want;
        wrong += scattered_in_place[static_cast<size_t>(r)][i % kCount] != want;
      }
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("thread collective: 16-bit sums are accumulated in fp32 and rounded once") {
  // In bf16, 256 + 1 rounds back to 256 at every hop; in fp32, 256 + 1 + 1 = 258 is exact and
  // representable in bf16.
  constexpr int kWorld = 3;
  Collectives group = MakeGroup(kWorld);
  std::vector<uint16_t> bf16(kWorld), fp16(kWorld);
  RequireAllOk(OnRanks(group, [&](int r, Collective& c) {
    const float mine = r == 0 ? 256.0f : 1.0f;
    uint16_t b = FloatToBf16(mine);
    MEMPLAN_RETURN_IF_ERROR(c.AllReduce(&b, 1, ElementType::kBFloat16));
    bf16[static_cast<size_t>(r)] = b;
    // fp16 has a 2-unit step above 2048: 2048 + 1 + 1 = 2050 only when accumulated in fp32.
    std::vector<uint16_t> send(kWorld, FloatToFp16(r == 0 ? 2048.0f : 1.0f));
    uint16_t out = 0;
    MEMPLAN_RETURN_IF_ERROR(c.ReduceScatter(send.data(), &out, 1, ElementType::kFloat16));
    fp16[static_cast<size_t>(r)] = out;
    return Status::Ok();
  }));
  for (int r = 0; r < kWorld; ++r) {
    CHECK(Bf16ToFloat(bf16[static_cast<size_t>(r)]) == 258.0f);
    CHECK(Fp16ToFloat(fp16[static_cast<size_t>(r)]) == 2050.0f);
  }
}

TEST_CASE(
    "thread collective: ranks that disagree fail together; a missing "
    "rank breaks the group") {
  {
    Collectives group = MakeGroup(2);
    std::vector<Status> status = OnRanks(group, [&](int r, Collective& c) {
      std::vector<float> send(8, 1.0f), recv(16);
      return c.AllGather(send.data(), recv.data(), r == 0 ? 8 : 4, ElementType::kFloat32);
    });
    for (const Status& s : status) {
      CHECK(s.code() == StatusCode::kInvalidArgument);
      CHECK(s.message().find("same calls") != std::string::npos);
    }
    // The group still works after a mismatch.
    RequireAllOk(OnRanks(group, [&](int, Collective& c) {
      std::vector<float> x(4, 2.0f);
      MEMPLAN_RETURN_IF_ERROR(c.AllReduce(x.data(), x.size(), ElementType::kFloat32));
      return x[3] == 4.0f ? Status::Ok() : Status::Internal("wrong sum");
    }));
  }
  Collectives group = MakeGroup(2, std::chrono::milliseconds(100));
  float x = 1.0f;
  Status alone = group[0]->AllReduce(&x, 1, ElementType::kFloat32);
  CHECK(alone.code() == StatusCode::kFailedPrecondition);
  CHECK(alone.message().find("broken") != std::string::npos);
  CHECK(group[1]->AllReduce(&x, 1, ElementType::kFloat32).code() ==
        StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace memplan::offload
