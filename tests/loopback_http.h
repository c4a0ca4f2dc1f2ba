// A tiny HTTP/1.1 server on 127.0.0.1 for tests of the Hugging Face Hub client (estimator/hub.h):
// it answers each request with what a handler returns, one connection at a time, and counts the
// connections it accepted, so a test can prove that a run opened none. Never reachable from
// outside the machine; the port is the kernel's choice. Header-only, test code only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace memplan::testing {

struct HttpTestRequest {
  std::string method;
  std::string path;                            // as sent: "/org/name/resolve/main/config.json"
  std::map<std::string, std::string> headers;  // names in lower case
};

struct HttpTestReply {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  int delay_ms = 0;  // wait this long before answering (a slow server)
};

// `content` as a server that honours "Range: bytes=a-b" answers `request`: 206 with the range,
// 416 for a range outside it, else 200 with all of it.
inline HttpTestReply ServeBytes(const HttpTestRequest& request, const std::string& content) {
  HttpTestReply reply;
  auto range = request.headers.find("range");
  if (range == request.headers.end()) {
    reply.body = content;
    return reply;
  }
  const std::string& r = range->second;  // bytes=a-b
  const size_t eq = r.find('='), dash = r.find('-');
  if (eq == std::string::npos || dash == std::string::npos) {
    reply.status = 416;
    return reply;
  }
  const uint64_t first = std::stoull(r.substr(eq + 1, dash - eq - 1));
  uint64_t last = dash + 1 < r.size() ? std::stoull(r.substr(dash + 1)) : content.size() - 1;
  if (first >= content.size() || last < first) {
    reply.status = 416;
    return reply;
  }
  last = std::min<uint64_t>(last, content.size() - 1);
  reply.status = 206;
  reply.body = content.substr(first, last - first + 1);
  reply.headers.emplace_back("Content-Range", "bytes " + std::to_string(first) + "-" +
                                                  std::to_string(last) + "/" +
                                                  std::to_string(content.size()));
  return reply;
}

class LoopbackHttpServer {
 public:
  using Handler = std::function<HttpTestReply(const HttpTestRequest&)>;

  explicit LoopbackHttpServer(Handler handler) : handler_(std::move(handler)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    REQUIRE(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(listen_fd_, 16) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~LoopbackHttpServer() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
  }
  LoopbackHttpServer(const LoopbackHttpServer&) = delete;
  LoopbackHttpServer& operator=(const LoopbackHttpServer&) = delete;

  // "http://127.0.0.1:<port>", no trailing '/'.
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_.load(); }
  std::vector<HttpTestRequest> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  void Serve() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      ++connections_;
      Answer(fd);
      ::close(fd);
    }
  }

  // Reads one request head (no body: the client only GETs), answers it, closes.
  void Answer(int fd) {
    std::string head;
    char buf[4096];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (head.find("\r\n\r\n") == std::string::npos && head.size() < 65536) {
      if (std::chrono::steady_clock::now() > deadline || stop_) return;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) return;
      head.append(buf, static_cast<size_t>(n));
    }
    HttpTestRequest request;
    size_t line_end = head.find("\r\n");
    const std::string first = head.substr(0, line_end);
    const size_t sp1 = first.find(' '), sp2 = first.find(' ', sp1 + 1);
    request.method = first.substr(0, sp1);
    request.path = first.substr(sp1 + 1, sp2 - sp1 - 1);
    for (size_t pos = line_end + 2; pos < head.size();) {
      const size_t end = head.find("\r\n", pos);
      if (end == std::string::npos || end == pos) break;
      const std::string line = head.substr(pos, end - pos);
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string name = line.substr(0, colon);
        for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        size_t v = colon + 1;
        while (v < line.size() && line[v] == ' ') ++v;
        request.headers[name] = line.substr(v);
      }
      pos = end + 2;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(request);
    }
    HttpTestReply reply = handler_(request);
    for (int waited = 0; waited < reply.delay_ms && !stop_; waited += 10) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::string out = "HTTP/1.1 " + std::to_string(reply.status) + " Test\r\n";
    for (const auto& [name, value] : reply.headers) out += name + ": " + value + "\r\n";
    out += "Content-Length: " + std::to_string(reply.body.size()) + "\r\nConnection: close\r\n\r\n";
    out += reply.body;
    for (size_t sent = 0; sent < out.size();) {
      const ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  Handler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  mutable std::mutex mu_;
  std::vector<HttpTestRequest> requests_;
  std::thread thread_;
};

// The Hugging Face Hub's resolve endpoints (GET <endpoint>/<repo>/resolve/<revision>/<file>) over
// files a test puts in `files` ("org/name" -> file -> bytes), answering as the Hub does:
// X-Repo-Commit and ETag on every answer for a repo it has; *.safetensors redirected (302) to a
// second, CDN-like server (another origin) with X-Linked-Etag; 401 + X-Error-Code GatedRepo for a
// gated repo; 401 RepoNotFound for an unknown one; 404 EntryNotFound for a missing file; files
// named in `slow` answered after `slow_ms`. Ranges are honoured (ServeBytes).
class FakeHub {
 public:
  static constexpr const char* kCommit = "0123456789abcdef0123456789abcdef01234567";

  std::map<std::string, std::map<std::string, std::string>> files;
  std::vector<std::string> gated;
  std::vector<std::string> slow;
  int slow_ms = 3000;

  FakeHub()
      : cdn_([this](const HttpTestRequest& r) { return Cdn(r); }),
        hub_([this](const HttpTestRequest& r) { return Hub(r); }) {}

  std::string endpoint() const { return hub_.url(); }
  // Connections to either server.
  int connections() const { return hub_.connections() + cdn_.connections(); }
  std::vector<HttpTestRequest> hub_requests() const { return hub_.requests(); }
  std::vector<HttpTestRequest> cdn_requests() const { return cdn_.requests(); }

  // The ETag the fake gives `content` (hex, as the Hub's sha256 blobs are named).
  static std::string Etag(const std::string& content) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(std::hash<std::string>()(content)));
    return std::string(hex) + std::to_string(content.size());
  }

 private:
  HttpTestReply Hub(const HttpTestRequest& r) {
    // /org/name/resolve/<revision>/<file>
    const size_t resolve = r.path.find("/resolve/");
    HttpTestReply reply;
    if (resolve == std::string::npos) {
      reply.status = 404;
      return reply;
    }
    const std::string repo = r.path.substr(1, resolve - 1);
    const std::string rest = r.path.substr(resolve + 9);
    const std::string file = rest.substr(rest.find('/') + 1);
    if (std::find(gated.begin(), gated.end(), repo) != gated.end()) {
      reply.status = 401;
      reply.headers = {{"X-Error-Code", "GatedRepo"}};
      return reply;
    }
    auto it = files.find(repo);
    if (it == files.end()) {
      reply.status = 401;
      reply.headers = {{"X-Error-Code", "RepoNotFound"}};
      return reply;
    }
    auto f = it->second.find(file);
    if (f == it->second.end()) {
      reply.status = 404;
      reply.headers = {{"X-Error-Code", "EntryNotFound"}, {"X-Repo-Commit", kCommit}};
      return reply;
    }
    const std::string etag = Etag(f->second);
    if (file.size() > 12 && file.substr(file.size() - 12) == ".safetensors") {
      reply.status = 302;
      reply.headers = {{"X-Repo-Commit", kCommit},
                       {"X-Linked-Etag", "\"" + etag + "\""},
                       {"Location", cdn_.url() + "/blobs/" + etag + "?signed=1"}};
      return reply;
    }
    reply = ServeBytes(r, f->second);
    reply.headers.emplace_back("X-Repo-Commit", kCommit);
    reply.headers.emplace_back("ETag", "W/\"" + etag + "\"");
    if (std::find(slow.begin(), slow.end(), file) != slow.end()) reply.delay_ms = slow_ms;
    return reply;
  }

  HttpTestReply Cdn(const HttpTestRequest& r) {
    for (const auto& [repo, repo_files] : files) {
      for (const auto& [file, content] : repo_files) {
        if (r.path == "/blobs/" + Etag(content) + "?signed=1") return ServeBytes(r, content);
      }
    }
    HttpTestReply reply;
    reply.status = 404;
    return reply;
  }

  LoopbackHttpServer cdn_;
  LoopbackHttpServer hub_;
};

}  // namespace memplan::testing
