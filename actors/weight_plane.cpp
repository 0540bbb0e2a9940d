#include "actors/weight_plane.hpp"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <fstream>
#include <thread>
#include <unistd.h>

#include <httplib.h>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"

namespace troupe {
namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "troupe-weights-";

// A name of its own under `root`, by process and a counter (several runs in one process).
fs::path fresh_path(const fs::path& root, const std::string& what) {
  static std::atomic<int64_t> counter{0};
  return root / (kPrefix + std::to_string(::getpid()) + "-" + what + std::to_string(counter++));
}

fs::path fresh_dir(const fs::path& root) {
  auto dir = fresh_path(root, "");
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Folders and files left by runs that were killed (SIGKILL, a crash) hold a whole model each: one
// whose process is gone is removed.
void sweep_stale(const fs::path& root) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, fs::directory_options::skip_permission_denied, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind(kPrefix, 0) != 0) continue;
    const auto pid = std::atoll(name.c_str() + std::char_traits<char>::length(kPrefix));
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
  }
}

bool roomy_shm(int64_t bytes) {
  std::error_code ec;
  auto shm = fs::space("/dev/shm", ec);
  return !ec && fs::is_directory("/dev/shm") && shm.available > static_cast<uintmax_t>(3 * bytes);
}

std::string url_host(const std::string& host) {
  if (host != "0.0.0.0" && host != "::" && !host.empty()) return host;
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? name : "localhost";
}

// GET url into `file`; throws Error naming the version and URL.
void fetch(const WeightsReady& notice, const fs::path& file) {
  const std::string& url = notice.url;
  const auto scheme = url.find("://");
  const auto slash = url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  const std::string what = "weights v" + std::to_string(notice.version) + ": GET " + url;
  if (scheme == std::string::npos || slash == std::string::npos) throw Error(what + ": not an http://host:port/file URL");
  httplib::Client client(url.substr(0, slash));
  client.set_connection_timeout(10);
  client.set_read_timeout(120);
  std::ofstream out(file, std::ios::binary);
  if (!out) throw Error(what + ": cannot write " + file.string());
  auto res = client.Get(url.substr(slash), [&](const char* data, size_t n) { return static_cast<bool>(out.write(data, n)); });
  if (!res) throw Error(what + ": " + httplib::to_string(res.error()));
  if (res->status != 200) throw Error(what + ": HTTP " + std::to_string(res->status) + " (the version may have been freed)");
  out.close();
  if (!out) throw Error(what + ": cannot write " + file.string());
}

}  // namespace

// The store's folder over HTTP: GET /vN.safetensors, for generators on other hosts.
class WeightServer {
 public:
  WeightServer(const fs::path& dir, const std::string& host) {
    server_.set_mount_point("/", dir.string());
    port_ = server_.bind_to_any_port(host);
    if (port_ <= 0) throw Error("cannot serve weights over HTTP on " + host + " (cluster.listen)");
    base_ = "http://" + url_host(host) + ":" + std::to_string(port_) + "/";
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~WeightServer() {
    server_.stop();
    thread_.join();
  }
  const std::string& base() const { return base_; }

 private:
  httplib::Server server_;
  int port_ = -1;
  std::string base_;
  std::thread thread_;
};

WeightStore::WeightStore(fs::path fallback, int64_t bytes_hint, const std::string& serve_on) {
  sweep_stale("/dev/shm");
  // Two versions may be on disk at once (the newest and one a slow generator still loads).
  dir_ = fresh_dir(roomy_shm(bytes_hint) ? fs::path("/dev/shm") : fallback.empty() ? fs::temp_directory_path() : fallback);
  if (!serve_on.empty()) server_ = std::make_unique<WeightServer>(dir_, serve_on);
}

WeightStore::~WeightStore() {
  server_.reset();
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

WeightsReady WeightStore::write(const std::map<std::string, torch::Tensor>& weights, int64_t version) {
  auto start = std::chrono::steady_clock::now();
  const std::string name = "v" + std::to_string(version) + ".safetensors";
  int64_t bytes = write_safetensors(dir_ / name, weights);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return WeightsReady{version, (dir_ / name).string(), bytes, s, server_ ? server_->base() + name : "", this_host()};
}

const std::string& this_host() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string boot;
    std::getline(in, boot);
    return boot.empty() ? url_host("") : boot;
  }();
  return id;
}

std::map<std::string, torch::Tensor> read_weights(const WeightsReady& notice, bool over_http) {
  if (!over_http && notice.host == this_host() && fs::exists(notice.path)) return read_safetensors_file(notice.path);
  if (notice.url.empty())
    throw Error("weights v" + std::to_string(notice.version) + ": " + notice.path +
                " is on the trainer's host and the trainer serves no URL (set cluster.listen for workers on other hosts)");
  const auto file = fresh_path(roomy_shm(notice.bytes) ? fs::path("/dev/shm") : fs::temp_directory_path(), "fetch-");
  std::error_code ec;
  try {
    fetch(notice, file);
    auto weights = read_safetensors_file(file);
    fs::remove(file, ec);
    return weights;
  } catch (...) {
    fs::remove(file, ec);
    throw;
  }
}

void free_weights(const WeightsReady& notice) {
  std::error_code ec;
  fs::remove(notice.path, ec);
}

}  // namespace troupe
