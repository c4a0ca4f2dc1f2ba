// Fetching a model's description from the Hugging Face Hub into the standard cache, behind a
// small HTTP seam (HttpClient), so that everything but the transport is tested without sockets.
//
// What is fetched, and only when HubOptions::allow_network: config.json; and, when memplan cannot
// build that config (an unsupported model_type), model.safetensors.index.json and each shard's
// header, or model.safetensors' header, by HTTP range requests (the first 8 bytes give the
// header's length). Never weights.
//
// Cache layout (huggingface_hub's, so that Transformers finds the files too):
// <root>/models--org--name/blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag>,
// refs/<revision> holding <commit>. A safetensors header is written as
// snapshots/<commit>/<file>.header, never under the file's own name: a truncated file there would
// break a later from_pretrained.
//
// Token: $HF_TOKEN (or $HUGGING_FACE_HUB_TOKEN), else the file at $HF_TOKEN_PATH or
// $HF_HOME/token (~/.cache/huggingface/token). It is sent to the endpoint's host only, never
// across a redirect to another host (the Hub redirects large files to a CDN).
//
// Nothing here prints: progress goes through HubOptions::progress, which the CLI prints.
// Thread safety: a HubOptions and its client are used from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memplan::estimator {

struct HttpRequest {
  std::string url;
  std::string bearer_token;  // "" = no Authorization header
  int64_t range_first = -1;  // bytes range_first..range_last (inclusive); -1 = the whole body
  int64_t range_last = -1;
  double timeout_s = 10;  // for the whole exchange, connecting included
  uint64_t max_body_bytes = uint64_t{64} << 20;
};

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // of this response; names in lower case
  std::string body;
};

// One HTTP GET, without following redirects (the caller decides where a token may go).
class HttpClient {
 public:
  virtual ~HttpClient() = default;
  // Any status is a response; errors are for exchanges that did not complete: Unavailable
  // (cannot resolve or connect, TLS, timed out), ResourceExhausted (a body over
  // max_body_bytes), InvalidArgument (a URL the client cannot use).
  virtual Result<HttpResponse> Get(const HttpRequest& request) = 0;
};

// The libcurl client; nullptr when memplan was built without libcurl (MEMPLAN_WITH_CURL).
std::unique_ptr<HttpClient> MakeCurlHttpClient();

// Progress of a fetch, for the CLI to print.
struct HubProgress {
  std::string repo_id;
  std::string file;  // "config.json", "model-00001-of-00004.safetensors (header)"
  std::string url;
};

struct HubOptions {
  bool allow_network = false;
  std::string offline_reason;  // why not, for messages: "--offline", "HF_HUB_OFFLINE=1"
  std::string endpoint = "https://huggingface.co";  // no trailing '/'
  std::string token;
  std::string revision = "main";
  double timeout_s = 10;
  HttpClient* client = nullptr;  // not owned; nullptr: libcurl
  std::function<void(const HubProgress&)> progress;
};

// HubOptions as huggingface_hub reads its environment: $HF_ENDPOINT, the token (above),
// $HF_HUB_OFFLINE or $TRANSFORMERS_OFFLINE ("1", "ON", "YES", "TRUE"), $HF_HUB_DOWNLOAD_TIMEOUT
// (seconds). allow_network is true unless offline.
HubOptions HubOptionsFromEnvironment();

// Fetches `file` of `repo_id` at options.revision into the first cache root (hf_cache.h) and
// returns the snapshot directory holding it. Errors name the repo and file: NotFound (no such
// file, or no such repo), FailedPrecondition (a gated repo: accept its licence on the Hub and
// log in; a private repo without a token; offline; built without libcurl), Unavailable (network,
// timeout, server errors).
Result<std::string> FetchHubFile(std::string_view repo_id, std::string_view file,
                                 const HubOptions& options);

// Fetches the header of the safetensors `file` (its first 8 + N bytes) by two range requests and
// writes it as snapshots/<commit>/<file>.header; returns the snapshot directory.
Result<std::string> FetchHubSafetensorsHeader(std::string_view repo_id, std::string_view file,
                                              const HubOptions& options);

}  // namespace memplan::estimator
