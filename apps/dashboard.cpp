#include "apps/dashboard.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "actors/run_status.hpp"
#include "policy/error.hpp"

namespace troupe {

extern const char* const kDashboardPage;  // apps/dashboard.html, compiled in (apps/CMakeLists.txt)

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

bool is_run(const fs::path& dir) { return fs::exists(dir / "metrics.jsonl") || fs::exists(dir / "status.json"); }

fs::file_time_type last_written(const fs::path& dir) {
  std::error_code ec;
  auto t = fs::last_write_time(dir / "metrics.jsonl", ec);
  if (ec) t = fs::last_write_time(dir / "status.json", ec);
  return ec ? fs::file_time_type::min() : t;
}

// The runs `root` holds: itself when it is a run folder (or `one_run` says it is one), else its
// sub-folders that are, the one written last at the end (the page opens that one).
std::vector<fs::path> runs_under(const fs::path& root, bool one_run) {
  if (one_run || is_run(root)) return {root};
  std::vector<fs::path> runs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec))
    if (entry.is_directory() && is_run(entry.path())) runs.push_back(entry.path());
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return last_written(a) < last_written(b); });
  return runs;
}

std::string run_name(const fs::path& run) { return fs::weakly_canonical(run).filename().string(); }

// The complete lines of a JSONL file (a line still being written, without its newline, waits
// for the next poll).
std::vector<std::string> complete_lines(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> lines;
  std::string all = text.str();
  for (size_t start = 0, end; (end = all.find('\n', start)) != std::string::npos; start = end + 1)
    lines.push_back(all.substr(start, end - start));
  return lines;
}

std::string read_whole(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(file.string() + ": cannot read it (is libjs-dygraphs installed? scripts/setup.sh installs it)");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One poll of the page: the run's status, its metrics from line `from` on, its latest samples.
// A line that is not JSON stops the metrics there, with an error naming the file and line.
json run_view(const fs::path& run, int64_t from) {
  json view{{"name", run_name(run)}, {"metrics", json::array()}, {"samples", nullptr}};
  try {
    view["status"] = read_run_status(run);
  } catch (const Error& e) {
    view["status"] = {{"state", "unknown"}, {"error", e.what()}, {"actors", json::array()}};
  }
  const auto lines = complete_lines(run / "metrics.jsonl");
  int64_t next = std::min<int64_t>(std::max<int64_t>(from, 0), static_cast<int64_t>(lines.size()));
  for (; next < static_cast<int64_t>(lines.size()); ++next) {
    try {
      view["metrics"].push_back(json::parse(lines[next]));
    } catch (const json::exception& e) {
      view["error"] = (run / "metrics.jsonl").string() + ":" + std::to_string(next + 1) + ": not JSON (" + e.what() + ")";
      break;
    }
  }
  view["next"] = next;
  const auto samples = complete_lines(run / "samples.jsonl");
  if (!samples.empty()) view["samples"] = json::parse(samples.back(), nullptr, /*allow_exceptions=*/false);
  if (view["samples"].is_discarded()) view["samples"] = nullptr;
  return view;
}

void send_json(httplib::Response& res, const json& j, int status = 200) {
  res.status = status;
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// Why host:port cannot be bound, as the system says it (httplib only says that it failed).
std::string bind_failure(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) != 1)
    return "not an IPv4 address of this machine";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return std::strerror(errno);
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  const int err = errno;
  close(fd);
  return rc == 0 ? "it could not be bound" : std::strerror(err);
}

}  // namespace

struct Dashboard::Impl {
  fs::path root;
  bool one_run = false;
  std::string host;
  int port = 0;
  httplib::Server http;
  std::thread thread;
};

Dashboard::Dashboard(fs::path root, const std::string& host, int port, const std::string& key, bool one_run)
    : impl_(std::make_unique<Impl>()) {
  if (!fs::is_directory(root)) throw Error(root.string() + ": not a folder (expected a run folder, or a folder of runs)");
  impl_->root = std::move(root);
  impl_->one_run = one_run;
  impl_->host = host;
  const fs::path dygraphs = TROUPE_DYGRAPHS_DIR;
  auto& http = impl_->http;
  http.Get("/", [](const httplib::Request&, httplib::Response& res) { res.set_content(kDashboardPage, "text/html; charset=utf-8"); });
  // dygraphs from its Debian package, read when asked (a missing file is a clear 500).
  for (const auto& [name, type] : {std::pair{"dygraph.min.js", "text/javascript"}, std::pair{"dygraph.min.css", "text/css"}}) {
    http.Get(std::string("/") + name, [file = dygraphs / name, type = std::string(type)](const httplib::Request&, httplib::Response& res) {
      try {
        res.set_content(read_whole(file), type);
      } catch (const Error& e) {
        res.status = 500;
        res.set_content(e.what(), "text/plain");
      }
    });
  }
  http.Get("/api/runs", [this](const httplib::Request&, httplib::Response& res) {
    json list = json::array();
    for (const auto& run : runs_under(impl_->root, impl_->one_run)) {
      json status;
      try {
        status = read_run_status(run);
      } catch (const Error& e) {
        status = {{"state", "unknown"}};
      }
      list.push_back({{"name", run_name(run)}, {"state", status.value("state", "unknown")}, {"step", status.value("step", 0)},
                      {"steps", status.value("steps", 0)}});
    }
    send_json(res, list);
  });
  http.Get("/api/run", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.get_param_value("name");
    int64_t from = 0;
    try {
      if (req.has_param("from")) from = std::stoll(req.get_param_value("from"));
    } catch (const std::exception&) {
      return send_json(res, {{"error", "from: expected a line number, got '" + req.get_param_value("from") + "'"}}, 400);
    }
    for (const auto& run : runs_under(impl_->root, impl_->one_run))
      if (run_name(run) == name) return send_json(res, run_view(run, from));
    send_json(res, {{"error", "no run named '" + name + "' in " + impl_->root.string()}}, 404);
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr p) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      what = e.what();
    }
    send_json(res, {{"error", what}}, 500);
  });
  // SO_REUSEADDR alone: httplib's default adds SO_REUSEPORT, with which a second dashboard would
  // bind the same port silently and share its connections.
  http.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  impl_->port = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (impl_->port < 0)
    throw Error(key + ": cannot serve the dashboard on " + host + ":" + std::to_string(port) + ": " + bind_failure(host, port) +
                " (choose another port, or port 0 for any free one)");
  if (host != "127.0.0.1" && host != "localhost" && host != "::1")
    std::cerr << "troupe: the dashboard on " << host << " shows " << impl_->root.string()
              << " to every machine that reaches it, without a password" << std::endl;
}

Dashboard::~Dashboard() {
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string Dashboard::url() const { return "http://" + impl_->host + ":" + std::to_string(impl_->port) + "/"; }

void Dashboard::serve_in_background() {
  impl_->thread = std::thread([this] { impl_->http.listen_after_bind(); });
}

void Dashboard::serve_here() { impl_->http.listen_after_bind(); }

}  // namespace troupe
