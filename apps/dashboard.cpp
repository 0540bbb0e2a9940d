#include "apps/dashboard.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
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

// Where a poll left off in one JSONL file: its `line`th complete line starts at byte `offset`.
// Polls ask for the lines after the ones they have, so each reads only what was appended since,
// not the whole file (a long run's metrics.jsonl reaches tens of MB; read whole once a second, it
// cost a core and grew the process by the allocator's leftovers). A file replaced since (a resume
// rewrites metrics.jsonl: a new inode) or cut shorter is read again from its start.
struct Cursor {
  int64_t line = 0;
  std::streamoff offset = 0;
  ino_t inode = 0;
};

// The complete lines of `file` from line `from` on (a line still being written, without its
// newline, waits for the next poll), reading from `cursor` when it is at or before `from`.
std::vector<std::string> lines_from(const fs::path& file, int64_t from, Cursor& cursor) {
  std::vector<std::string> lines;
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    cursor = {};
    return lines;
  }
  if (st.st_ino != cursor.inode || st.st_size < cursor.offset || from < cursor.line) cursor = {.inode = st.st_ino};
  std::ifstream in(file, std::ios::binary);
  in.seekg(cursor.offset);
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline yet: not complete
    if (cursor.line >= from) lines.push_back(line);
    ++cursor.line;
    cursor.offset += static_cast<std::streamoff>(line.size()) + 1;
  }
  return lines;
}

// The last complete line of `file`, read from its end; empty when it has none.
std::string last_line(const fs::path& file) {
  std::ifstream in(file, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const std::streamoff size = in.tellg();
  for (std::streamoff window = 64 << 10;; window *= 2) {
    const std::streamoff start = std::max<std::streamoff>(0, size - window);
    std::string tail(static_cast<size_t>(size - start), '\0');
    in.seekg(start);
    in.read(tail.data(), static_cast<std::streamsize>(tail.size()));
    const size_t end = tail.rfind('\n');
    if (end == std::string::npos) {
      if (start == 0) return "";
      continue;
    }
    const size_t before = end == 0 ? std::string::npos : tail.rfind('\n', end - 1);
    if (before == std::string::npos && start > 0) continue;  // the line starts before the window
    const size_t begin = before == std::string::npos ? 0 : before + 1;
    return tail.substr(begin, end - begin);
  }
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
json run_view(const fs::path& run, int64_t from, Cursor& cursor) {
  json view{{"name", run_name(run)}, {"metrics", json::array()}, {"samples", nullptr}};
  try {
    view["status"] = read_run_status(run);
  } catch (const Error& e) {
    view["status"] = {{"state", "unknown"}, {"error", e.what()}, {"actors", json::array()}};
  }
  from = std::max<int64_t>(from, 0);
  const auto lines = lines_from(run / "metrics.jsonl", from, cursor);
  int64_t next = std::min(from, cursor.line);
  for (const auto& line : lines) {
    try {
      view["metrics"].push_back(json::parse(line));
    } catch (const json::exception& e) {
      view["error"] = (run / "metrics.jsonl").string() + ":" + std::to_string(next + 1) + ": not JSON (" + e.what() + ")";
      break;
    }
    ++next;
  }
  view["next"] = next;
  if (const auto sample = last_line(run / "samples.jsonl"); !sample.empty())
    view["samples"] = json::parse(sample, nullptr, /*allow_exceptions=*/false);
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
  std::mutex cursors_mutex;  // polls are served by several threads
  std::map<std::string, Cursor> cursors;  // metrics.jsonl path -> where the last poll left off
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
      if (run_name(run) == name) {
        // One cursor per run and one poll at a time on it: a page polling on, or one just opened.
        std::lock_guard lock(impl_->cursors_mutex);
        return send_json(res, run_view(run, from, impl_->cursors[(run / "metrics.jsonl").string()]));
      }
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
