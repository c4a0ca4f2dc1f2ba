// JsonFieldReader (Note [JSON field reader]): the exact errors a user sees for a field of the wrong
// type, out of range, missing, and for a misspelt key.
#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "common/json.h"
#include "tests/status_testing.h"

namespace memplan {
namespace {

using nlohmann::json;

std::string Message(const Status& status) { return status.message(); }

TEST_CASE("JsonFieldReader: a wrong type names the field and what it got") {
  const json j = {{"lr", "fast"}, {"resume", 1}, {"name", 3}, {"count", 1.5}, {"list", {1, 2}}};
  JsonFieldReader r(j, "step options");
  double lr = 0.5;
  CHECK(Message(r.Number("lr", &lr)) == "step options: 'lr' must be a number, got \"fast\"");
  CHECK(lr == 0.5);
  bool resume = false;
  CHECK(Message(r.Bool("resume", &resume)) ==
        "step options: 'resume' must be true or false, got 1");
  std::string name;
  CHECK(Message(r.String("name", &name)) == "step options: 'name' must be a string, got 3");
  int count = 0;
  CHECK(Message(r.Integer("count", &count, 1, 8)) ==
        "step options: 'count' must be an integer from 1 to 8, got 1.5");
  CHECK(Message(r.Integer("list", &count, 1, 8)) ==
        "step options: 'list' must be an integer from 1 to 8, got an array");
}

TEST_CASE("JsonFieldReader: integers outside the range, T's own range included") {
  const json j = json::parse(R"({"zero": 0, "big": 18446744073709551615, "neg": -1, "ok": 4})");
  JsonFieldReader r(j, "schedule", "nvme.");
  uint32_t depth = 7;
  CHECK(Message(r.Integer<uint32_t>("zero", &depth, 1, 4096)) ==
        "schedule: 'nvme.zero' must be an integer from 1 to 4096, got 0");
  CHECK(Message(r.Integer("big", &depth)) ==
        "schedule: 'nvme.big' must be an integer from 0 to 4294967295, got 18446744073709551615");
  CHECK(Message(r.Integer("neg", &depth)) ==
        "schedule: 'nvme.neg' must be an integer from 0 to 4294967295, got -1");
  CHECK(depth == 7);
  CHECK_OK(r.Integer("ok", &depth));
  CHECK(depth == 4);
  uint64_t big = 0;
  CHECK_OK(r.Integer("big", &big));
  CHECK(big == UINT64_MAX);
  int64_t neg = 0;
  CHECK_OK(r.Integer("neg", &neg));
  CHECK(neg == -1);
  CHECK(Message(r.Integer("big", &neg)) ==
        "schedule: 'nvme.big' must be an integer from -9223372036854775808 to "
        "9223372036854775807, got 18446744073709551615");
}

TEST_CASE("JsonFieldReader: absent keys keep the default; Require names a missing one") {
  const json j = {{"a", nullptr}};
  JsonFieldReader r(j, "bench report");
  int64_t seconds = 9;
  CHECK_OK(r.Integer("seconds", &seconds));
  CHECK(seconds == 9);
  CHECK(Message(r.Require("seconds")) == "bench report: 'seconds' is missing");
  CHECK_OK(r.Require("a"));
  CHECK(Message(r.Integer("a", &seconds)) ==
        "bench report: 'a' must be an integer from -9223372036854775808 to 9223372036854775807, "
        "got null");
}

TEST_CASE(
    "JsonFieldReader: GetAll and RequireAll read fields in order, stopping at the first error") {
  using F = JsonFieldReader;
  const json j = {{"steps", 4}, {"name", "x"}, {"rate", "fast"}, {"later", 1}};
  const JsonFieldReader r(j, "bench report", "run.");
  int64_t steps = 0, later = 0, absent = 7;
  std::string name;
  double rate = 2.5;
  CHECK_OK(
      r.GetAll(F::Field("steps", &steps), F::Field("absent", &absent), F::Field("name", &name)));
  CHECK(steps == 4);
  CHECK(absent == 7);
  CHECK(name == "x");
  // The first error wins, and the fields after it are not read.
  CHECK(Message(r.GetAll(F::Field("rate", &rate), F::Field("later", &later))) ==
        "bench report: 'run.rate' must be a number, got \"fast\"");
  CHECK(rate == 2.5);
  CHECK(later == 0);
  CHECK(Message(r.RequireAll(F::Field("steps", &steps), F::Field("absent", &absent),
                             F::Field("later", &later))) ==
        "bench report: 'run.absent' is missing");
  CHECK(later == 0);
  CHECK_OK(r.RequireAll(F::Field("later", &later)));
  CHECK(later == 1);
}

TEST_CASE("JsonFieldReader: unknown keys, with the closest known ones") {
  const json j = {{"params", {{"buffer_count", 2}, {"bufer_bytes", 4096}}}};
  JsonFieldReader root(j, "schedule");
  CHECK_OK(root.CheckKeys({"version", "params"}));
  JsonFieldReader params = root.Child("params");
  CHECK(Message(params.CheckKeys({"buffer_bytes", "buffer_count"})) ==
        "schedule: unknown key 'params.bufer_bytes' (did you mean buffer_bytes?)");
  CHECK(Message(params.CheckKeys({"buffer_count", "tier"})) ==
        "schedule: unknown key 'params.bufer_bytes'");
  const json not_object = json::array();
  CHECK(Message(JsonFieldReader(not_object, "setup JSON").CheckKeys({"a"})) ==
        "setup JSON: expected an object, got an array");
  const json nested = {{"nvme", 1}};
  CHECK(Message(root.CheckKeys({"nvme"})) == "schedule: unknown key 'params'");
  CHECK(Message(JsonFieldReader(nested, "schedule").Child("nvme").CheckKeys({"path"})) ==
        "schedule: 'nvme' expected an object, got 1");
}

TEST_CASE("JsonFieldReader: Get picks the getter by the field's type") {
  const json j = {{"targets", {"q_proj", 3}}, {"names", {"q_proj", "v_proj"}}, {"rate", 2}};
  JsonFieldReader r(j, "setup JSON");
  std::vector<std::string> targets;
  CHECK(Message(r.Get("targets", &targets)) ==
        "setup JSON: 'targets' must be a list of strings, got an array");
  CHECK_OK(r.Get("names", &targets));
  CHECK(targets == std::vector<std::string>{"q_proj", "v_proj"});
  double rate = 0;
  CHECK_OK(r.Get("rate", &rate));
  CHECK(rate == 2.0);
  bool flag = false;
  CHECK(Message(r.Get("rate", &flag)) == "setup JSON: 'rate' must be true or false, got 2");
}

TEST_CASE("JsonFieldReader: byte sizes as numbers or size strings") {
  const json j = {{"a", 4096}, {"b", "2KiB"}, {"c", 1e3}, {"d", -1}, {"e", "lots"}};
  JsonFieldReader r(j, "cluster.json");
  uint64_t bytes = 0;
  CHECK_OK(r.ByteSize("a", &bytes));
  CHECK(bytes == 4096);
  CHECK_OK(r.ByteSize("b", &bytes));
  CHECK(bytes == 2048);
  CHECK_OK(r.ByteSize("c", &bytes));
  CHECK(bytes == 1000);
  CHECK(Message(r.ByteSize("d", &bytes)) ==
        "cluster.json: 'd' must be a byte count or a size such as \"80GiB\", got -1");
  CHECK(Message(r.ByteSize("e", &bytes)).find("cluster.json: 'e'") == 0);
  CHECK(bytes == 1000);
}

TEST_CASE("JsonFieldReader: an enum's parse error is prefixed with the field") {
  const json j = {{"tier", "disk"}};
  JsonFieldReader r(j, "schedule", "params.");
  auto parse = [](std::string_view text) -> Result<int> {
    if (text == "gpu") return 0;
    return Status::InvalidArgument("unknown tier \"" + std::string(text) + "\"");
  };
  int tier = -1;
  CHECK(Message(r.Enum("tier", parse, &tier)) == "schedule: 'params.tier': unknown tier \"disk\"");
  CHECK(tier == -1);
}

}  // namespace
}  // namespace memplan
