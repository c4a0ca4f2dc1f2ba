// The Hub client (hub.h) and LoadModel's use of it, over libcurl against a fake Hub on loopback
// (tests/loopback_http.h): no test here reaches the network.
#include "estimator/hub.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "estimator/inventory.h"
#include "estimator/model_source.h"
#include "tests/estimator_testing.h"
#include "tests/loopback_http.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

namespace fs = std::filesystem;
using testing::FakeHub;
using testing::LoopbackHttpServer;
using testing::TempDir;

// Sets environment variables for one test case and puts the old values back.
class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* name :
         {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME",
          "TRANSFORMERS_CACHE", "HF_ENDPOINT", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
          "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DOWNLOAD_TIMEOUT"}) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name,
                          value == nullptr ? std::nullopt : std::optional<std::string>(value));
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  void Set(const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::string LittleEndian64(uint64_t v) {
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A whole safetensors file of F16 tensors (zeros).
std::string Safetensors(const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors) {
  nlohmann::ordered_json header = {{"__metadata__", {{"format", "pt"}}}};
  uint64_t offset = 0;
  for (const auto& [name, shape] : tensors) {
    uint64_t bytes = 2;
    for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    header[name] = {{"dtype", "F16"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return LittleEndian64(text.size()) + text + std::string(offset, '\0');
}

std::string Fixture(const std::string& name) { return testing::ReadFixture(name); }

HubOptions Options(const FakeHub& hub) {
  HubOptions o;
  o.allow_network = true;
  o.endpoint = hub.endpoint();
  o.timeout_s = 5;
  return o;
}

LoadOptions Load(const HubOptions& hub) {
  LoadOptions o;
  o.hub = hub;
  return o;
}

TEST_CASE("hub: config.json lands in the Hugging Face cache layout, then is found offline") {
  ScopedEnv env;
  TempDir cache("memplan_hub_");
  env.Set("HF_HUB_CACHE", cache.path().string());
  FakeHub hub;
  hub.files["org/tiny"]["config.json"] = Fixture("gpt2");
  HubOptions options = Options(hub);
  options.token = "hf_secret";

  auto model = LoadModel("org/tiny", Load(options));
  REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  CHECK(model->source == "config");
  CHECK(testing::Total(*model) == 124439808);
  // Transformers must find it too: blobs/<etag>, a relative link in snapshots/<commit>, refs/main.
  const fs::path repo = cache.path() / "models--org--tiny";
  const std::string etag = FakeHub::Etag(Fixture("gpt2"));
  CHECK(testing::ReadWholeFile(repo / "blobs" / etag) == Fixture("gpt2"));
  const fs::path link = repo / "snapshots" / FakeHub::kCommit / "config.json";
  CHECK(fs::is_symlink(link));
  CHECK(fs::read_symlink(link) == fs::path("../../blobs/" + etag));
  CHECK(testing::ReadWholeFile(repo / "refs" / "main") == FakeHub::kCommit);
  REQUIRE(hub.hub_requests().size() == 1);
  CHECK(hub.hub_requests()[0].path == "/org/tiny/resolve/main/config.json");
  CHECK(hub.hub_requests()[0].headers["authorization"] == "Bearer hf_secret");

  // Now cached: found with the network off, and with it on without a request.
  const int before = hub.connections();
  HubOptions offline = options;
  offline.allow_network = false;
  offline.offline_reason = "--offline";
  auto again = LoadModel("org/tiny", Load(offline));
  REQUIRE_OK(again);
  CHECK(testing::Total(*again) == 124439808);
  CHECK_OK(LoadModel("ORG/Tiny", Load(options)));  // the cache matched ignoring case
  // The cache folder itself, as a path, resolves to the snapshot refs/main names.
  auto folder = LoadModel(repo.string() + "/", Load(offline));
  REQUIRE_MESSAGE(folder.ok(), folder.status().ToString());
  CHECK(testing::Total(*folder) == 124439808);
  CHECK(hub.connections() == before);
}

TEST_CASE("hub: --model-config gives a shape list the architecture, a built config keeps its own") {
  TempDir dir("memplan_hub_");
  dir.Write("shapes.json", R"({"wte.weight": [50257, 768], "h.0.mlp.c_fc.weight": [768, 3072],
                               "h.0.mlp.c_proj.weight": [3072, 768]})");
  dir.Write("config.json", Fixture("gpt2"));
  LoadOptions options;
  auto plain = LoadModel(dir.PathOf("shapes.json"), options);
  REQUIRE_OK(plain);
  CHECK_FALSE(plain->arch.has_value());
  options.model_config = dir.PathOf("config.json");
  auto shaped = LoadModel(dir.PathOf("shapes.json"), options);
  REQUIRE_MESSAGE(shaped.ok(), shaped.status().ToString());
  REQUIRE(shaped->arch.has_value());
  CHECK(shaped->arch->hidden == 768);
  CHECK(shaped->arch->layers == 12);
  CHECK(shaped->model_type == "gpt2");
  CHECK(testing::Total(*shaped) == testing::Total(*plain));
  auto built = LoadModel("gpt2", options);
  REQUIRE_OK(built);
  REQUIRE(built->notes.size() == 1);
  CHECK(built->notes[0].find("not used") != std::string::npos);
  dir.Write("bad.json", R"({"model_type": "novel"})");
  options.model_config = dir.PathOf("bad.json");
  auto bad = LoadModel(dir.PathOf("shapes.json"), options);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("hidden_size") != std::string::npos);
}

TEST_CASE("hub: an unsupported model_type falls back to shard headers fetched by range") {
  ScopedEnv env;
  TempDir cache("memplan_hub_");
  env.Set("HF_HUB_CACHE", cache.path().string());
  FakeHub hub;
  auto& repo = hub.files["org/novel"];
  repo["config.json"] = R"({"model_type": "novel", "hidden_size": 16, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "vocab_size": 32,
                            "intermediate_size": 64})";
  const std::string shard1 = Safetensors({{"model.embed.weight", {32, 16}},
                                          {"model.layers.0.mlp.up.weight", {64, 16}},
                                          {"model.layers.0.mlp.down.weight", {16, 64}}});
  const std::string shard2 = Safetensors(
      {{"model.layers.1.mlp.up.weight", {64, 16}}, {"model.layers.1.mlp.down.weight", {16, 64}}});
  repo["model-00001-of-00002.safetensors"] = shard1;
  repo["model-00002-of-00002.safetensors"] = shard2;
  repo["model.safetensors.index.json"] = R"({"metadata": {}, "weight_map": {
      "model.embed.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.mlp.up.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.mlp.down.weight": "model-00001-of-00002.safetensors",
      "model.layers.1.mlp.up.weight": "model-00002-of-00002.safetensors",
      "model.layers.1.mlp.down.weight": "model-00002-of-00002.safetensors"}})";
  HubOptions options = Options(hub);
  options.token = "hf_secret";
  std::vector<std::string> progress;
  options.progress = [&](const HubProgress& p) { progress.push_back(p.file); };

  auto model = LoadModel("org/novel", Load(options));
  REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  CHECK(model->source == "safetensors");
  CHECK(testing::Total(*model) == 32 * 16 + 4 * 64 * 16);
  REQUIRE(model->arch.has_value());  // the config's generic fields
  CHECK(model->arch->hidden == 16);
  CHECK(model->arch->layers == 2);
  REQUIRE(model->notes.size() == 1);
  CHECK(model->notes[0].find("safetensors headers") != std::string::npos);
  CHECK(progress == std::vector<std::string>{"config.json", "model.safetensors.index.json",
                                             "model-00001-of-00002.safetensors (header)",
                                             "model-00002-of-00002.safetensors (header)"});
  // Only headers crossed the wire, by range, and the token never went to the CDN.
  for (const auto& r : hub.cdn_requests()) {
    CHECK(r.headers.count("authorization") == 0);
    REQUIRE(r.headers.count("range") == 1);
  }
  CHECK(hub.cdn_requests().size() == 4);  // 8 bytes, then the header, per shard
  const fs::path snapshot = cache.path() / "models--org--novel" / "snapshots" / FakeHub::kCommit;
  CHECK(fs::file_size(snapshot / "model-00001-of-00002.safetensors.header") < shard1.size());
  CHECK_FALSE(fs::exists(snapshot / "model-00001-of-00002.safetensors"));

  // A second run reads the headers from the cache.
  const int before = hub.connections();
  HubOptions offline = options;
  offline.allow_network = false;
  auto again = LoadModel("org/novel", Load(offline));
  REQUIRE_MESSAGE(again.ok(), again.status().ToString());
  CHECK(testing::Total(*again) == testing::Total(*model));
  CHECK(hub.connections() == before);
}

TEST_CASE("hub: one model.safetensors when there is no index") {
  ScopedEnv env;
  TempDir cache("memplan_hub_");
  env.Set("HF_HUB_CACHE", cache.path().string());
  FakeHub hub;
  hub.files["org/one"]["config.json"] = R"({"model_type": "novel", "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10})";
  hub.files["org/one"]["model.safetensors"] = Safetensors({{"embed.weight", {10, 8}}});
  auto model = LoadModel("org/one", Load(Options(hub)));
  REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  CHECK(testing::Total(*model) == 80);
}

TEST_CASE("hub: gated, unknown, missing, slow, offline and no cache") {
  ScopedEnv env;
  TempDir cache("memplan_hub_");
  env.Set("HF_HUB_CACHE", cache.path().string());
  FakeHub hub;
  hub.files["org/tiny"]["config.json"] = Fixture("gpt2");
  hub.gated = {"meta-llama/Llama-3.1-8B"};
  hub.files["org/slow"]["config.json"] = Fixture("gpt2");
  hub.slow = {"config.json"};
  hub.slow_ms = 3000;
  const HubOptions options = Options(hub);

  auto gated = FetchHubFile("meta-llama/Llama-3.1-8B", "config.json", options);
  REQUIRE_FALSE(gated.ok());
  CHECK(gated.status().code() == StatusCode::kFailedPrecondition);
  CHECK(gated.status().message().find("gated repository: accept its licence at " + hub.endpoint() +
                                      "/meta-llama/Llama-3.1-8B") != std::string::npos);
  CHECK(gated.status().message().find("log in") != std::string::npos);

  auto unknown = FetchHubFile("org/absent", "config.json", options);
  CHECK(unknown.status().code() == StatusCode::kNotFound);
  CHECK(unknown.status().message().find("repository 'org/absent' not found") != std::string::npos);

  auto missing = FetchHubFile("org/tiny", "model.safetensors.index.json", options);
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find("has no file model.safetensors.index.json") !=
        std::string::npos);
  // Nothing was written for what failed.
  CHECK_FALSE(fs::exists(cache.path() / "models--org--absent"));
  CHECK_FALSE(fs::exists(cache.path() / "models--meta-llama--Llama-3.1-8B"));

  HubOptions quick = options;
  quick.timeout_s = 0.5;
  const auto start = std::chrono::steady_clock::now();
  auto slow = FetchHubFile("org/slow", "config.json", quick);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(slow.status().code() == StatusCode::kUnavailable);
  CHECK(slow.status().message().find("no complete answer within 0.5") != std::string::npos);
  CHECK(seconds < 2.5);

  // Off: no connection at all, and the error says why.
  const int before = hub.connections();
  HubOptions off = options;
  off.allow_network = false;
  off.offline_reason = "HF_HUB_OFFLINE=1";
  auto offline = LoadModel("org/tiny2", Load(off));
  REQUIRE_FALSE(offline.ok());
  CHECK(offline.status().message().find("fetching from the Hub is off (HF_HUB_OFFLINE=1)") !=
        std::string::npos);
  CHECK(FetchHubFile("org/tiny", "config.json", off).status().code() ==
        StatusCode::kFailedPrecondition);
  CHECK(hub.connections() == before);

  // Bad ids never reach the server.
  CHECK(FetchHubFile("../etc", "config.json", options).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(hub.connections() == before);
}

TEST_CASE("hub: HubOptionsFromEnvironment reads huggingface_hub's variables") {
  ScopedEnv env;
  TempDir home("memplan_hub_");
  env.Set("HF_HOME", home.path().string());
  HubOptions o = HubOptionsFromEnvironment();
  CHECK(o.allow_network);
  CHECK(o.endpoint == "https://huggingface.co");
  CHECK(o.token.empty());
  home.Write("token", "hf_fromfile\n");
  CHECK(HubOptionsFromEnvironment().token == "hf_fromfile");
  env.Set("HF_TOKEN", " hf_env ");
  CHECK(HubOptionsFromEnvironment().token == "hf_env");
  env.Set("HF_ENDPOINT", "http://127.0.0.1:1/");
  CHECK(HubOptionsFromEnvironment().endpoint == "http://127.0.0.1:1");
  env.Set("HF_HUB_DOWNLOAD_TIMEOUT", "2.5");
  CHECK(HubOptionsFromEnvironment().timeout_s == 2.5);
  for (const char* on : {"1", "ON", "yes", "True"}) {
    env.Set("HF_HUB_OFFLINE", on);
    HubOptions offline = HubOptionsFromEnvironment();
    CHECK_FALSE(offline.allow_network);
    CHECK(offline.offline_reason == std::string("HF_HUB_OFFLINE=") + on);
  }
  env.Set("HF_HUB_OFFLINE", "0");
  CHECK(HubOptionsFromEnvironment().allow_network);
  env.Set("TRANSFORMERS_OFFLINE", "1");
  CHECK_FALSE(HubOptionsFromEnvironment().allow_network);
}

// --- Issue 30 H2: a hostile Hub cannot make memplan write outside the cache --------------------

// A Hub that answers every file of every repo itself: config.json with a model_type memplan does
// not build (so the safetensors headers are fetched), an index whose one shard is `shard`, and a
// valid 4x4 F32 safetensors file for anything else (ranges honoured); `commit` and `etag` are its
// X-Repo-Commit and ETag, and `location`, when set, answers config.json with a 302 there.
struct HostileHub {
  std::string shard = "model-00001-of-00001.safetensors";
  std::string commit = "abc123";
  std::string etag = "e7a9";
  std::string location;
  LoopbackHttpServer server{[this](const testing::HttpTestRequest& r) { return Answer(r); }};

  static std::string Shard() {
    const std::string header = R"({"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}})";
    return LittleEndian64(header.size()) + header + std::string(64, '\0');
  }
  testing::HttpTestReply Answer(const testing::HttpTestRequest& r) {
    testing::HttpTestReply reply;
    const std::string path = r.path;
    if (!location.empty() && path.size() >= 12 && path.substr(path.size() - 12) == "/config.json") {
      reply.status = 302;
      reply.headers = {{"Location", location}, {"X-Repo-Commit", commit}};
      return reply;
    }
    std::string body = Shard();
    if (path.size() >= 12 && path.substr(path.size() - 12) == "/config.json") {
      body = R"({"model_type": "zzz_unknown"})";
    } else if (path.find("model.safetensors.index.json") != std::string::npos) {
      body = nlohmann::json({{"weight_map", {{"w", shard}}}}).dump();
    }
    reply = testing::ServeBytes(r, body);
    reply.headers.emplace_back("X-Repo-Commit", commit);
    reply.headers.emplace_back("ETag", "\"" + etag + "\"");
    return reply;
  }
};

// Every path under `root` (links not followed), relative, sorted.
std::vector<std::string> Tree(const fs::path& root) {
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator();
       ++it) {
    out.push_back(it->path().lexically_relative(root).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_CASE("hub: a hostile Hub or a planted link never makes memplan write outside the cache") {
  struct Scenario {
    std::string name;
    std::function<void(HostileHub&, const fs::path& tmp, HubOptions&)> set;
    bool loads = false;  // a legal name: it loads, its files in the cache
  };
  const std::vector<Scenario> scenarios = {
      {"shard ../", [](HostileHub& h, const fs::path&,
                       HubOptions&) { h.shard = "../../../../ESCAPED.safetensors"; }},
      {"shard absolute",
       [](HostileHub& h, const fs::path& tmp, HubOptions&) {
         h.shard = (tmp / "absdir" / "sub" / "ABS.safetensors").string();
       }},
      {"shard a/../..", [](HostileHub& h, const fs::path&,
                           HubOptions&) { h.shard = "a/../../../../x.safetensors"; }},
      {"shard NUL",
       [](HostileHub& h, const fs::path&, HubOptions&) {
         h.shard = std::string("x.safetensors\0/../../../../y", 28);
       }},
      {"shard backslash", [](HostileHub& h, const fs::path&,
                             HubOptions&) { h.shard = "..\\..\\..\\..\\x.safetensors"; }},
      {"shard newline",
       [](HostileHub& h, const fs::path&, HubOptions&) { h.shard = "x\n.safetensors"; }},
      {"shard %2e%2e",
       [](HostileHub& h, const fs::path&, HubOptions&) {
         h.shard = "%2e%2e/%2e%2e/%2e%2e/%2e%2e/x.safetensors";  // a name, not '..' for us
       },
       true},
      {"commit ../",
       [](HostileHub& h, const fs::path&, HubOptions&) { h.commit = "../../../../evil"; }},
      {"commit ..", [](HostileHub& h, const fs::path&, HubOptions&) { h.commit = ".."; }},
      {"commit absolute", [](HostileHub& h, const fs::path& tmp,
                             HubOptions&) { h.commit = (tmp / "absdir").string(); }},
      {"etag ../",
       [](HostileHub& h, const fs::path&, HubOptions&) { h.etag = "../../../../blob"; }},
      {"etag absolute", [](HostileHub& h, const fs::path& tmp,
                           HubOptions&) { h.etag = (tmp / "absdir" / "blob").string(); }},
      {"revision ../", [](HostileHub&, const fs::path&,
                          HubOptions& o) { o.revision = "../../../../../outside/ref"; }},
      {"revision absolute", [](HostileHub&, const fs::path& tmp,
                               HubOptions& o) { o.revision = (tmp / "outside" / "ref").string(); }},
      {"redirect to a path with ..",
       [](HostileHub& h, const fs::path&, HubOptions&) {
         h.location = "/../../../../x/config.json";
       }},
      {"redirect to file://",
       [](HostileHub& h, const fs::path&, HubOptions&) { h.location = "file:///etc/passwd"; }},
      {"blobs linked outside",
       [](HostileHub&, const fs::path& tmp, HubOptions&) {
         fs::create_directories(tmp / "cache" / "models--evil--m");
         fs::create_directory_symlink(tmp / "outside", tmp / "cache" / "models--evil--m" / "blobs");
       }},
      {"snapshots linked outside",
       [](HostileHub&, const fs::path& tmp, HubOptions&) {
         fs::create_directories(tmp / "cache" / "models--evil--m");
         fs::create_directory_symlink(tmp / "outside",
                                      tmp / "cache" / "models--evil--m" / "snapshots");
       }},
      {"snapshot dir linked outside",
       [](HostileHub& h, const fs::path& tmp, HubOptions&) {
         fs::create_directories(tmp / "cache" / "models--evil--m" / "snapshots");
         fs::create_directory_symlink(tmp / "outside",
                                      tmp / "cache" / "models--evil--m" / "snapshots" / h.commit);
       }},
      {"refs linked outside",
       [](HostileHub&, const fs::path& tmp, HubOptions&) {
         fs::create_directories(tmp / "cache" / "models--evil--m");
         fs::create_directory_symlink(tmp / "outside", tmp / "cache" / "models--evil--m" / "refs");
       }},
      {"repo folder linked outside",
       [](HostileHub&, const fs::path& tmp, HubOptions&) {
         fs::create_directory_symlink(tmp / "outside", tmp / "cache" / "models--evil--m");
       }},
      {"refs/main a dangling link",
       [](HostileHub&, const fs::path& tmp, HubOptions&) {
         fs::create_directories(tmp / "cache" / "models--evil--m" / "refs");
         fs::create_symlink(tmp / "outside" / "created",
                            tmp / "cache" / "models--evil--m" / "refs" / "main");
       }},
  };
  for (const Scenario& scenario : scenarios) {
    CAPTURE(scenario.name);
    ScopedEnv env;
    TempDir tmp("memplan_hostile_hub_");
    // tmp/a/b/c/cache: "../../../../x" from a snapshot lands in tmp, visible to the walk.
    const fs::path root = tmp.path() / "a" / "b" / "c";
    fs::create_directories(root / "cache");
    fs::create_directories(root / "outside");
    env.Set("HF_HUB_CACHE", (root / "cache").string());
    HostileHub hub;
    HubOptions options;
    options.allow_network = true;
    options.endpoint = hub.server.url();
    options.timeout_s = 5;
    scenario.set(hub, root, options);
    const std::vector<std::string> before = Tree(tmp.path());

    auto model = LoadModel("evil/m", Load(options));
    CAPTURE(model.status().ToString());
    CHECK(model.ok() == scenario.loads);
    CHECK(model.status().message().find('\n') == std::string::npos);
    // The whole temporary tree: nothing new but under cache/, and outside/ as it was (empty).
    for (const std::string& path : Tree(tmp.path())) {
      if (std::find(before.begin(), before.end(), path) != before.end()) continue;
      CAPTURE(path);
      CHECK(path.rfind("a/b/c/cache/", 0) == 0);
    }
    CHECK(fs::is_empty(root / "outside"));
    // No request for a shard whose name the index refused.
    for (const auto& r : hub.server.requests()) {
      CAPTURE(r.path);
      CHECK(r.path.find("ESCAPED") == std::string::npos);
      CHECK(r.path.find("ABS.safetensors") == std::string::npos);
    }
  }
}

TEST_CASE("hub: the hostile Hub's harmless twin loads, and names from data are URL-escaped") {
  ScopedEnv env;
  TempDir tmp("memplan_hostile_hub_");
  env.Set("HF_HUB_CACHE", tmp.PathOf("cache"));
  HostileHub hub;
  hub.shard = "sub dir/model #1?.safetensors";  // legal: a folder, a space, '#' and '?'
  HubOptions options;
  options.allow_network = true;
  options.endpoint = hub.server.url();
  options.timeout_s = 5;
  options.revision = "refs/pr/1";
  auto model = LoadModel("evil/m", Load(options));
  REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  CHECK(testing::Total(*model) == 16);
  const fs::path repo = tmp.path() / "cache" / "models--evil--m";
  CHECK(fs::is_regular_file(repo / "snapshots" / "abc123" / "sub dir" /
                            "model #1?.safetensors.header"));
  CHECK(testing::ReadWholeFile(repo / "refs" / "refs" / "pr" / "1") == "abc123");
  bool escaped = false;
  for (const auto& r : hub.server.requests()) {
    escaped |= r.path == "/evil/m/resolve/refs%2Fpr%2F1/sub/dir%20dir/model%20%231%3F.safetensors";
    escaped |= r.path == "/evil/m/resolve/refs%2Fpr%2F1/sub%20dir/model%20%231%3F.safetensors";
    CHECK(r.path.find('#') == std::string::npos);
    CHECK(r.path.find('?') == std::string::npos);
  }
  CHECK(escaped);
  for (const std::string& path : Tree(tmp.path())) {
    CAPTURE(path);
    CHECK(path.rfind("cache", 0) == 0);
  }
}

}  // namespace
}  // namespace memplan::estimator
