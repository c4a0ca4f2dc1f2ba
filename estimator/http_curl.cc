// The HttpClient of hub.h over libcurl (Debian's libcurl4-openssl-dev), when memplan is built
// with it (MEMPLAN_WITH_CURL, AUTO by default); otherwise MakeCurlHttpClient returns nullptr and
// the hub layer says how to get it.
//
// Note [libcurl loaded on first use]
// libcurl is opened with dlopen when the first request is made, not linked: linked, its ~30
// libraries (TLS, Kerberos, LDAP, ...) are loaded and relocated at every start of every program
// that links the estimator, about 4 ms of CPU, which is most of what `memplan estimate` costs for
// a dense model; only a Hub fetch needs them. The build still needs curl/curl.h (the types and
// option numbers are libcurl's stable ABI); a machine without the library gets an error saying
// which package to install when it first fetches.
#include "estimator/hub.h"

#if MEMPLAN_HAVE_CURL
#include <curl/curl.h>
#include <dlfcn.h>

#include <cctype>
#include <mutex>
#include <type_traits>
#endif

namespace memplan::estimator {

#if MEMPLAN_HAVE_CURL
namespace {

// The libcurl functions memplan calls, resolved once (Note [libcurl loaded on first use]).
struct CurlApi {
  CURLcode (*global_init)(long flags) = nullptr;
  CURL* (*easy_init)() = nullptr;
  CURLcode (*easy_setopt)(CURL* curl, CURLoption option, ...) = nullptr;
  CURLcode (*easy_perform)(CURL* curl) = nullptr;
  CURLcode (*easy_getinfo)(CURL* curl, CURLINFO info, ...) = nullptr;
  void (*easy_cleanup)(CURL* curl) = nullptr;
  const char* (*easy_strerror)(CURLcode code) = nullptr;
  curl_slist* (*slist_append)(curl_slist* list, const char* text) = nullptr;
  void (*slist_free_all)(curl_slist* list) = nullptr;
};

// Loads libcurl and initialises it, once per process; the error says what is missing.
Result<const CurlApi*> LoadCurl() {
  static CurlApi api;
  static Status status = Status::Ok();
  static std::once_flag once;
  std::call_once(once, [] {
    void* library = nullptr;
    std::string tried;
    // Debian's libcurl4 (OpenSSL), then libcurl3-gnutls: the same ABI.
    for (const char* name : {"libcurl.so.4", "libcurl-gnutls.so.4"}) {
      library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why != nullptr ? why : name);
    }
    if (library == nullptr) {
      status = Status::Unavailable(
          "fetching from the Hub needs libcurl, which cannot be loaded (" + tried +
          "); install it (Debian: apt-get install libcurl4), or pass a local config.json");
      return;
    }
    auto bind = [&](auto* target, const char* symbol) {
      void* address = dlsym(library, symbol);
      if (address == nullptr && status.ok()) {
        status = Status::Unavailable(std::string("libcurl lacks ") + symbol +
                                     "; it is too old for memplan");
      }
      *target = reinterpret_cast<std::remove_pointer_t<decltype(target)>>(address);
    };
    bind(&api.global_init, "curl_global_init");
    bind(&api.easy_init, "curl_easy_init");
    bind(&api.easy_setopt, "curl_easy_setopt");
    bind(&api.easy_perform, "curl_easy_perform");
    bind(&api.easy_getinfo, "curl_easy_getinfo");
    bind(&api.easy_cleanup, "curl_easy_cleanup");
    bind(&api.easy_strerror, "curl_easy_strerror");
    bind(&api.slist_append, "curl_slist_append");
    bind(&api.slist_free_all, "curl_slist_free_all");
    if (status.ok() && api.global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
      status = Status::Unavailable("libcurl failed to initialise");
    }
  });
  if (!status.ok()) return status;
  return &api;
}

struct Exchange {
  HttpResponse response;
  uint64_t max_body_bytes = 0;
  bool too_large = false;
};

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* x = static_cast<Exchange*>(user);
  const size_t n = size * count;
  if (x->response.body.size() + n > x->max_body_bytes) {
    x->too_large = true;
    return 0;  // makes libcurl stop with CURLE_WRITE_ERROR
  }
  x->response.body.append(data, n);
  return n;
}

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* x = static_cast<Exchange*>(user);
  const size_t n = size * count;
  std::string_view line(data, n);
  if (line.rfind("HTTP/", 0) == 0) {
    x->response.headers.clear();  // a new response (after 100 Continue): only its headers count
    return n;
  }
  size_t colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  std::string name;
  for (char c : line.substr(0, colon)) {
    name.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' ')) {
    value.remove_suffix(1);
  }
  x->response.headers[name] = std::string(value);
  return n;
}

class CurlHttpClient : public HttpClient {
 public:
  Result<HttpResponse> Get(const HttpRequest& request) override {
    MEMPLAN_ASSIGN_OR_RETURN(const CurlApi* api, LoadCurl());
    const auto curl_easy_setopt = api->easy_setopt;
    CURL* curl = api->easy_init();
    if (curl == nullptr) return Status::ResourceExhausted("libcurl: cannot start a transfer");
    struct curl_slist* headers = nullptr;
    Exchange x;
    x.max_body_bytes = request.max_body_bytes;
    char error[CURL_ERROR_SIZE] = {0};
    const long timeout_ms = static_cast<long>(request.timeout_s * 1000);
    std::string auth;
    if (!request.bearer_token.empty()) {
      auth = "Authorization: Bearer " + request.bearer_token;
      headers = api->slist_append(headers, auth.c_str());
    }
    std::string range;
    if (request.range_first >= 0) {
      range = std::to_string(request.range_first) + "-" + std::to_string(request.range_last);
    }
    curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);  // hub.cc follows, deciding on tokens
#if LIBCURL_VERSION_NUM >= 0x075500
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
#endif
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
    curl_easy_setopt(curl, CURLOPT_USERAGENT, "memplan/" MEMPLAN_VERSION);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    if (!range.empty()) curl_easy_setopt(curl, CURLOPT_RANGE, range.c_str());
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &OnBody);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &x);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &OnHeader);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &x);
    const CURLcode code = api->easy_perform(curl);
    long status = 0;
    api->easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
    api->slist_free_all(headers);
    api->easy_cleanup(curl);
    if (x.too_large) {
      return Status::ResourceExhausted(request.url + ": the answer exceeds " +
                                       std::to_string(request.max_body_bytes) + " bytes");
    }
    if (code == CURLE_OPERATION_TIMEDOUT) {
      return Status::Unavailable(request.url + ": no complete answer within " +
                                 std::to_string(timeout_ms / 1000.0).substr(0, 5) +
                                 " s (HF_HUB_DOWNLOAD_TIMEOUT sets the limit)");
    }
    if (code != CURLE_OK) {
      return Status::Unavailable(
          request.url + ": " +
          (error[0] != '\0' ? std::string(error) : std::string(api->easy_strerror(code))));
    }
    x.response.status = static_cast<int>(status);
    return std::move(x.response);
  }
};

}  // namespace

std::unique_ptr<HttpClient> MakeCurlHttpClient() { return std::make_unique<CurlHttpClient>(); }

#else

std::unique_ptr<HttpClient> MakeCurlHttpClient() { return nullptr; }

#endif

}  // namespace memplan::estimator
