#include "estimator/hub.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "common/file.h"
#include "common/strings.h"
#include "estimator/hf_cache.h"
#include "estimator/safetensors.h"

namespace memplan::estimator {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxRedirects = 5;
// A config.json or an index is a few KiB to a few MiB; a safetensors header at most 100 MiB
// (safetensors.cc refuses more).
constexpr uint64_t kMaxFileBytes = uint64_t{32} << 20;

std::string Trim(std::string s) {
  auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!s.empty() && space(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && space(static_cast<unsigned char>(s[start]))) ++start;
  return s.substr(start);
}

// huggingface_hub's ENV_VARS_TRUE_VALUES.
bool IsTrue(const std::string& value) {
  std::string upper;
  for (char c : value)
    upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  return upper == "1" || upper == "ON" || upper == "YES" || upper == "TRUE";
}

// scheme://host[:port] of a URL ("" when it has none), and the rest.
struct Url {
  std::string origin;
  std::string path;
};

Url SplitUrl(std::string_view url) {
  size_t scheme = url.find("://");
  if (scheme == std::string_view::npos) return {"", std::string(url)};
  size_t slash = url.find('/', scheme + 3);
  if (slash == std::string_view::npos) return {std::string(url), "/"};
  return {std::string(url.substr(0, slash)), std::string(url.substr(slash))};
}

// The target of a redirect from `from`: absolute, scheme-relative or path-relative.
std::string Resolve(std::string_view from, std::string_view location) {
  if (location.find("://") != std::string_view::npos) return std::string(location);
  const Url base = SplitUrl(from);
  if (location.rfind("//", 0) == 0) {
    return base.origin.substr(0, base.origin.find("://") + 1) + std::string(location);
  }
  if (!location.empty() && location.front() == '/') return base.origin + std::string(location);
  std::string dir = base.path.substr(0, base.path.rfind('/') + 1);
  return base.origin + dir + std::string(location);
}

std::string Header(const HttpResponse& r, const std::string& name) {
  auto it = r.headers.find(name);
  return it == r.headers.end() ? std::string() : Trim(it->second);
}

// An ETag as huggingface_hub names its blobs: without W/ and quotes.
std::string NormalizeEtag(std::string etag) {
  if (etag.rfind("W/", 0) == 0) etag = etag.substr(2);
  etag.erase(std::remove(etag.begin(), etag.end(), '"'), etag.end());
  return etag;
}

// Server-supplied names become paths in the cache: only [A-Za-z0-9] (a commit or a hash).
bool SafeName(std::string_view s) {
  return !s.empty() && s.size() <= 128 && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0;
  });
}

// Percent-encodes all but RFC 3986's unreserved characters (and '/' when `keep_slash`).
std::string UrlEscape(std::string_view text, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) != 0 || c == '-' || c == '.' || c == '_' || c == '~' ||
        (keep_slash && c == '/')) {
      out += c;
    } else {
      out += '%';
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
  return out;
}

std::string RepoFolder(std::string_view repo_id) {
  std::string folder = "models--";
  for (char c : repo_id) folder += c == '/' ? std::string("--") : std::string(1, c);
  return folder;
}

HttpClient* ClientFor(const HubOptions& options) {
  if (options.client != nullptr) return options.client;
  static std::unique_ptr<HttpClient> curl = MakeCurlHttpClient();
  return curl.get();
}

struct Fetched {
  std::string commit;
  std::string etag;
  HttpResponse response;
};

// One file of the repo at the revision, following redirects itself: the token goes to the
// endpoint's origin only, and the commit and ETag come from the Hub's own response (a CDN's
// response carries neither).
Result<Fetched> Get(std::string_view repo_id, std::string_view file, const HubOptions& options,
                    int64_t range_first, int64_t range_last) {
  MEMPLAN_RETURN_IF_ERROR(ValidateRepoId(repo_id));
  const std::string what = "'" + std::string(repo_id) + "' file " + std::string(file);
  if (!options.allow_network) {
    return Status::FailedPrecondition(
        what + " is not in the local Hugging Face cache, and fetching it is off (" +
        (options.offline_reason.empty() ? std::string("offline") : options.offline_reason) +
        "); download it first or pass a path");
  }
  HttpClient* client = ClientFor(options);
  if (client == nullptr) {
    return Status::FailedPrecondition(
        "fetching " + what +
        " from the Hugging Face Hub needs libcurl, and this memplan was built without it "
        "(install libcurl4-openssl-dev and rebuild with -DMEMPLAN_WITH_CURL=ON), or download the "
        "model and pass its directory");
  }
  // Names from data become URL path segments only escaped (as huggingface_hub's hf_hub_url
  // quotes them): a '?', '#' or "%2e%2e" in a shard name stays part of the name.
  MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(file, what + ": the file name"));
  MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(options.revision, what + ": the revision"));
  HttpRequest request;
  request.url = options.endpoint + "/" + std::string(repo_id) + "/resolve/" +
                UrlEscape(options.revision, /*keep_slash=*/false) + "/" +
                UrlEscape(file, /*keep_slash=*/true);
  request.timeout_s = options.timeout_s;
  request.range_first = range_first;
  request.range_last = range_last;
  request.max_body_bytes = range_first >= 0 ? kMaxSafetensorsHeaderBytes : kMaxFileBytes;
  const std::string hub_origin = SplitUrl(options.endpoint).origin;
  if (options.progress && range_first <= 0) {
    options.progress(HubProgress{std::string(repo_id),
                                 std::string(file) + (range_first == 0 ? " (header)" : ""),
                                 request.url});
  }
  Fetched out;
  for (int hop = 0;; ++hop) {
    request.bearer_token = SplitUrl(request.url).origin == hub_origin ? options.token : "";
    auto got = client->Get(request);
    if (!got.ok()) return got.status().WithPrefix("fetching " + what + " from " + request.url);
    out.response = std::move(got).value();
    const HttpResponse& r = out.response;
    if (out.commit.empty()) out.commit = Header(r, "x-repo-commit");
    if (out.etag.empty()) {
      std::string etag = Header(r, "x-linked-etag");
      out.etag = NormalizeEtag(etag.empty() ? Header(r, "etag") : etag);
    }
    if (r.status < 300 || r.status >= 400) break;
    std::string location = Header(r, "location");
    if (location.empty() || hop == kMaxRedirects) {
      return Status::Unavailable(
          "fetching " + what + ": " + request.url + " answered " + std::to_string(r.status) +
          (location.empty() ? " without a Location" : " (too many redirects)"));
    }
    request.url = Resolve(request.url, location);
  }
  const HttpResponse& r = out.response;
  const std::string code = Header(r, "x-error-code");
  if (r.status == 200 || r.status == 206) return out;
  if (code == "GatedRepo") {
    return Status::FailedPrecondition(
        "'" + std::string(repo_id) + "' is a gated repository: accept its licence at " +
        options.endpoint + "/" + std::string(repo_id) +
        ", then log in (huggingface-cli login, or set HF_TOKEN)" +
        (options.token.empty() ? "" : "; the token given has no access yet"));
  }
  if (code == "EntryNotFound" || (r.status == 404 && code != "RepoNotFound")) {
    return Status::NotFound("'" + std::string(repo_id) + "' has no file " + std::string(file) +
                            " at revision " + options.revision + " on " + options.endpoint);
  }
  if (code == "RepoNotFound" || r.status == 401 || r.status == 403) {
    return Status::NotFound(
        "repository '" + std::string(repo_id) + "' not found on " + options.endpoint +
        (options.token.empty()
             ? "; if it is private or gated, log in (huggingface-cli login, or set HF_TOKEN)"
             : " with the token given (check the id, and that the token has access)"));
  }
  return Status::Unavailable("fetching " + what + ": " + request.url + " answered HTTP " +
                             std::to_string(r.status));
}

// Where fetched files go: the first cache root, and in it the repo's folder (relative), which is
// created under the root (Note [Paths from data]: no directory below the root may be a link).
struct CacheDir {
  std::string root;
  std::string repo;  // "models--org--name"

  // `relative` (to the repo folder) as a path under the root; errors name `what`.
  Result<std::string> Path(std::string_view relative, const std::string& what) const {
    return PathUnder(root, repo + "/" + std::string(relative), what);
  }
  // The directory `relative` (to the repo folder), created.
  Status MakeDirs(std::string_view relative) const {
    return MakeDirectoriesUnder(root, repo + "/" + std::string(relative));
  }
};

Result<CacheDir> RepoDir(std::string_view repo_id) {
  MEMPLAN_RETURN_IF_ERROR(ValidateRepoId(repo_id));
  std::vector<std::string> roots = HfCacheRoots();
  if (roots.empty()) {
    return Status::FailedPrecondition(
        "no Hugging Face cache to fetch into: set HF_HUB_CACHE or HF_HOME (HOME is unset)");
  }
  // The root is the user's (it may be a link to another disk): created as it is named.
  std::error_code ec;
  fs::create_directories(roots.front(), ec);
  if (ec) return Status::IoError(roots.front() + ": cannot create: " + ec.message());
  return CacheDir{roots.front(), RepoFolder(repo_id)};
}

Status CheckNames(const Fetched& f, std::string_view repo_id, std::string_view file) {
  if (!SafeName(f.commit)) {
    return Status::Unavailable("fetching '" + std::string(repo_id) + "' file " + std::string(file) +
                               ": the Hub's answer has no usable X-Repo-Commit header");
  }
  return Status::Ok();
}

// refs/<revision> -> commit, as huggingface_hub writes it (no newline), unless the revision is
// the commit itself. A revision with '/' ("refs/pr/1") is a file in a folder, as there.
Status WriteRef(const CacheDir& cache, const HubOptions& options, const std::string& commit) {
  if (options.revision == commit) return Status::Ok();
  const std::string ref = "refs/" + options.revision;
  MEMPLAN_ASSIGN_OR_RETURN(std::string path, cache.Path(ref, "the revision"));
  MEMPLAN_RETURN_IF_ERROR(cache.MakeDirs(ref.substr(0, ref.rfind('/'))));
  return WriteFileAtomically(path, commit);
}

}  // namespace

HubOptions HubOptionsFromEnvironment() {
  HubOptions o;
  std::string endpoint = EnvOrEmpty("HF_ENDPOINT");
  if (!endpoint.empty()) o.endpoint = endpoint;
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  o.token = Trim(EnvOrEmpty("HF_TOKEN"));
  if (o.token.empty()) o.token = Trim(EnvOrEmpty("HUGGING_FACE_HUB_TOKEN"));
  if (o.token.empty()) {
    std::string path = EnvOrEmpty("HF_TOKEN_PATH");
    if (path.empty()) {
      std::string home = EnvOrEmpty("HF_HOME");
      if (home.empty()) {
        std::string cache = EnvOrEmpty("XDG_CACHE_HOME");
        if (cache.empty() && !EnvOrEmpty("HOME").empty()) cache = EnvOrEmpty("HOME") + "/.cache";
        if (!cache.empty()) home = cache + "/huggingface";
      }
      if (!home.empty()) path = home + "/token";
    }
    if (!path.empty()) {
      auto token = ReadFileToString(path, 4096);
      if (token.ok()) o.token = Trim(*token);
    }
  }
  o.allow_network = true;
  for (const char* name : {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}) {
    if (IsTrue(EnvOrEmpty(name))) {
      o.allow_network = false;
      o.offline_reason = std::string(name) + "=" + EnvOrEmpty(name);
      break;
    }
  }
  std::string timeout = EnvOrEmpty("HF_HUB_DOWNLOAD_TIMEOUT");
  if (!timeout.empty()) {
    char* end = nullptr;
    double seconds = std::strtod(timeout.c_str(), &end);
    if (end != timeout.c_str() && seconds > 0 && seconds < 3600) o.timeout_s = seconds;
  }
  return o;
}

Result<std::string> FetchHubFile(std::string_view repo_id, std::string_view file,
                                 const HubOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(Fetched f, Get(repo_id, file, options, -1, -1));
  MEMPLAN_RETURN_IF_ERROR(CheckNames(f, repo_id, file));
  MEMPLAN_ASSIGN_OR_RETURN(CacheDir cache, RepoDir(repo_id));
  if (!SafeName(f.etag)) {
    return Status::Unavailable("fetching '" + std::string(repo_id) + "' file " + std::string(file) +
                               ": the Hub's answer has no usable ETag");
  }
  // Every path from the file's name and the server's headers, checked before anything is
  // created (Note [Paths from data]).
  const std::string snapshot_rel = "snapshots/" + f.commit;
  const std::string link_rel = snapshot_rel + "/" + std::string(file);
  MEMPLAN_ASSIGN_OR_RETURN(std::string blob, cache.Path("blobs/" + f.etag, "the ETag"));
  MEMPLAN_ASSIGN_OR_RETURN(std::string snapshot, cache.Path(snapshot_rel, "the commit"));
  MEMPLAN_ASSIGN_OR_RETURN(std::string link, cache.Path(link_rel, "the file name"));
  MEMPLAN_RETURN_IF_ERROR(cache.MakeDirs("blobs"));
  MEMPLAN_RETURN_IF_ERROR(cache.MakeDirs(link_rel.substr(0, link_rel.rfind('/'))));
  MEMPLAN_RETURN_IF_ERROR(WriteFileAtomically(blob, f.response.body));
  // A relative link, as huggingface_hub makes them, so the cache survives being moved.
  std::string target = "../../blobs/" + f.etag;
  for (char c : file) {
    if (c == '/') target = "../" + target;
  }
  // Only a link (or nothing) is replaced: a directory or a file of that name stays, and the
  // fetch fails naming it.
  struct stat st;
  if (::lstat(link.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) ::unlink(link.c_str());
  if (::symlink(target.c_str(), link.c_str()) != 0) {
    return Status::IoError(link + ": cannot link to " + blob + ": " + std::strerror(errno));
  }
  MEMPLAN_RETURN_IF_ERROR(WriteRef(cache, options, f.commit));
  return snapshot;
}

Result<std::string> FetchHubSafetensorsHeader(std::string_view repo_id, std::string_view file,
                                              const HubOptions& options) {
  const std::string what = "'" + std::string(repo_id) + "' file " + std::string(file);
  MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(file, what + ": the file name"));
  MEMPLAN_ASSIGN_OR_RETURN(Fetched prefix, Get(repo_id, file, options, 0, 7));
  MEMPLAN_RETURN_IF_ERROR(CheckNames(prefix, repo_id, file));
  const std::string& bytes = prefix.response.body;
  if (bytes.size() != 8) {
    return Status::Unavailable(
        "fetching " + what + ": asked for its first 8 bytes, got " + std::to_string(bytes.size()) +
        (prefix.response.status == 200 ? " (the server ignored the range)" : ""));
  }
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  }
  if (length == 0 || length > kMaxSafetensorsHeaderBytes) {
    return Status::InvalidArgument(what + ": header length " + std::to_string(length) +
                                   " is not a safetensors header's");
  }
  MEMPLAN_ASSIGN_OR_RETURN(Fetched header,
                           Get(repo_id, file, options, 8, static_cast<int64_t>(8 + length - 1)));
  if (header.response.body.size() != length) {
    return Status::Unavailable("fetching " + what + ": asked for its " + std::to_string(length) +
                               "-byte header, got " + std::to_string(header.response.body.size()) +
                               " bytes");
  }
  MEMPLAN_ASSIGN_OR_RETURN(CacheDir cache, RepoDir(repo_id));
  const std::string snapshot_rel = "snapshots/" + prefix.commit;
  const std::string path_rel = snapshot_rel + "/" + std::string(file) + ".header";
  MEMPLAN_ASSIGN_OR_RETURN(std::string snapshot, cache.Path(snapshot_rel, "the commit"));
  MEMPLAN_ASSIGN_OR_RETURN(std::string path, cache.Path(path_rel, "the file name"));
  MEMPLAN_RETURN_IF_ERROR(cache.MakeDirs(path_rel.substr(0, path_rel.rfind('/'))));
  MEMPLAN_RETURN_IF_ERROR(WriteFileAtomically(path, bytes + header.response.body));
  MEMPLAN_RETURN_IF_ERROR(WriteRef(cache, options, prefix.commit));
  return snapshot;
}

}  // namespace memplan::estimator
