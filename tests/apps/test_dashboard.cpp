// The dashboard in a real browser: Debian's headless chromium loads the page of a running tiny
// run (`troupe run ... run.dashboard=`) and of a run killed mid-way (`troupe dashboard`), and the
// test reads back what the page drew: every point dygraphs holds against metrics.jsonl, each
// actor's state, the run's state. A screenshot of each page is kept in the fixtures folder
// (dashboard_running.png, dashboard_killed.png).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tests/actors/run_util.hpp"

extern char** environ;

namespace fs = std::filesystem;
using namespace troupe::test;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

std::string read(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A troupe process in the background, its stdout and stderr in `log`; killed when the test ends.
struct Process {
  pid_t pid = -1;
  fs::path log;

  Process(const std::string& command, fs::path log_file) : log(std::move(log_file)) {
    // An earlier run's log would be read before the shell truncates it: its old port, its old lines.
    fs::remove(log);
    const std::string line = command + " > " + shell_quote(log.string()) + " 2>&1";
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  // Waits (at most two minutes) until the log matches `pattern`; its first group.
  std::string wait_for(const std::string& pattern) {
    const std::regex re(pattern);
    std::smatch m;
    for (auto until = Clock::now() + std::chrono::minutes(2); Clock::now() < until;) {
      const std::string text = read(log);
      if (std::regex_search(text, m, re)) return m.size() > 1 ? m[1].str() : m[0].str();
      if (waitpid(pid, nullptr, WNOHANG) == pid) {
        pid = -1;
        FAIL("the process ended before printing /" << pattern << "/:\n" << read(log));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL("no /" << pattern << "/ within two minutes:\n" << read(log));
    return "";
  }
  int wait_exit() {
    int status = 0;
    for (auto until = Clock::now() + std::chrono::minutes(1); Clock::now() < until;) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    FAIL("the process did not end within a minute:\n" << read(log));
    return -2;
  }
  ~Process() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

// `command` ended after two minutes if it has not ended by then (a dashboard that did bind serves on).
std::string bounded(const std::string& command) { return "timeout 120 sh -c " + shell_quote(command); }

std::string task_args() {
  auto task = fixtures() / "arithmetic";
  return "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" +
         shell_quote((task / "train.jsonl").string()) + " trainer.sft_warmup.path=" +
         shell_quote((task / "format.jsonl").string()) + " trainer.steps=100000 run.checkpoint_every=0";
}

// The lines of DIR/metrics.jsonl written whole so far (a live run may be mid-line), parsed.
std::vector<json> metrics_so_far(const fs::path& dir) {
  std::vector<json> out;
  std::string text = read(dir / "metrics.jsonl");
  for (size_t start = 0, end; (end = text.find('\n', start)) != std::string::npos; start = end + 1)
    out.push_back(json::parse(text.substr(start, end - start)));
  return out;
}

void wait_steps(const fs::path& dir, size_t steps, const Process& p) {
  for (auto until = Clock::now() + std::chrono::minutes(2); Clock::now() < until && steps_written(dir) < steps;)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE_MESSAGE(steps_written(dir) >= steps, "fewer than " << steps << " steps in two minutes:\n" << read(p.log));
}

// Headless chromium: `url` loaded with `seconds` of the page's own time to poll and draw, then
// the DOM as it stands (and a screenshot, when `png` is given).
std::string chromium(const std::string& url, const fs::path& png = {}) {
  // A profile of its own each time: a chromium left over from an earlier run would lock a shared one.
  char profile[] = "/tmp/troupe_chromium_XXXXXX";
  REQUIRE(mkdtemp(profile) != nullptr);
  struct Remove {
    fs::path dir;
    ~Remove() { fs::remove_all(dir); }
  } remove{profile};
  const std::string common = "timeout 120 chromium --headless --no-sandbox --disable-gpu --no-first-run "
                             "--user-data-dir=" + shell_quote(profile) + " --virtual-time-budget=4000 ";
  if (!png.empty()) {
    fs::remove(png);
    auto shot = run_command(common + "--window-size=1280,1500 --screenshot=" + shell_quote(png.string()) + " " +
                            shell_quote(url) + " 2>&1");
    REQUIRE_MESSAGE(fs::exists(png), "chromium wrote no screenshot (scripts/setup.sh installs chromium):\n" << shot.out);
    CHECK(fs::file_size(png) > 20'000);  // a drawn page, not a blank one
  }
  auto r = run_command(common + "--dump-dom " + shell_quote(url) + " 2>/dev/null");
  REQUIRE_MESSAGE(r.status == 0, "chromium failed (scripts/setup.sh installs it):\n" << r.out);
  return r.out;
}

std::string unescape(std::string s) {
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{{"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&amp;", "&"}})
    for (size_t at; (at = s.find(from)) != std::string::npos;) s.replace(at, from.size(), to);
  return s;
}

// What the page's charts hold, as it wrote them into <pre id="chart-data"> from dygraphs.
json chart_data(const std::string& dom) {
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(dom, m, std::regex(R"(<pre id="chart-data">([^<]*)</pre>)")), dom);
  return json::parse(unescape(m[1].str()));
}

// Each actor box: name -> state.
std::map<std::string, std::string> actor_states(const std::string& dom) {
  std::map<std::string, std::string> out;
  const std::regex box(R"re(data-name="([^"]+)" data-state="([^"]*)")re");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), box); it != std::sregex_iterator(); ++it)
    out[(*it)[1].str()] = (*it)[2].str();
  return out;
}

std::string run_state(const std::string& dom) {
  std::smatch m;
  return std::regex_search(dom, m, std::regex(R"re(data-run-state="([^"]+)")re")) ? m[1].str() : "";
}

// Every point of every series equals that step's value in metrics.jsonl; returns the points per series.
std::map<std::string, size_t> check_points(const json& charts, const std::vector<json>& lines) {
  std::map<int64_t, const json*> by_step;
  for (const auto& l : lines) by_step[l["step"].get<int64_t>()] = &l;
  std::map<std::string, size_t> counts;
  for (const auto& [chart, series] : charts.items())
    for (const auto& [metric, points] : series.items()) {
      counts[metric] = points.size();
      for (const auto& p : points) {
        const auto step = p[0].get<int64_t>();
        REQUIRE_MESSAGE(by_step.count(step), chart << " " << metric << ": step " << step << " is not in metrics.jsonl");
        const json& line = *by_step[step];
        REQUIRE_MESSAGE(line.contains(metric), metric << " at step " << step);
        const double want = line[metric].get<double>(), got = p[1].get<double>();
        CHECK_MESSAGE(std::fabs(got - want) <= 1e-12 * std::max(1.0, std::fabs(want)), metric << " at step " << step);
      }
    }
  return counts;
}

}  // namespace

TEST_CASE("the dashboard of a running run: its curves hold the run's points, its actors their states") {
  const fs::path dir = fixtures() / "dashboard_running";
  fs::remove_all(dir);
  Process run(troupe_run("tiny_arithmetic_grpo", task_args() + " run.dir=" + shell_quote(dir.string()) +
                                                    " run.dashboard=127.0.0.1:0"),
              fixtures() / "dashboard_running.log");
  const std::string url = run.wait_for(R"(dashboard at (http://127\.0\.0\.1:\d+/))");
  {  // Up before the run has written anything (the model still loading): the run is there, not a 404.
    httplib::Client client(url.substr(0, url.size() - 1));
    client.set_read_timeout(30, 0);
    auto res = client.Get("/api/run?name=dashboard_running");
    REQUIRE(res);
    CHECK_MESSAGE(res->status == 200, res->body);
  }
  wait_steps(dir, 3, run);
  const auto dom = chromium(url, fixtures() / "dashboard_running.png");
  const auto charts = chart_data(dom);
  const auto lines = metrics_so_far(dir);
  const auto counts = check_points(charts, lines);
  MESSAGE("points per series: " << json(counts).dump());
  // Loaded after 3 steps, with 4 s of its own time to poll: at least those 3 are drawn.
  for (const char* metric : {"reward/mean", "loss", "kl", "staleness/mean", "tokens_per_s", "time/generate_s", "time/step_s"}) {
    REQUIRE_MESSAGE(counts.count(metric), metric << " is not drawn: " << charts.dump());
    CHECK(counts.at(metric) >= 3);
  }
  CHECK(charts.contains("reward"));
  CHECK(charts["reward"].contains("reward/correct/mean"));  // each reward by its name in the config
  CHECK(run_state(dom) == "running");
  const auto actors = actor_states(dom);
  MESSAGE("actors: " << json(actors).dump());
  REQUIRE(actors.count("generator 0"));
  REQUIRE(actors.count("reward"));
  REQUIRE(actors.count("trainer"));
  for (const auto& [name, state] : actors) CHECK_MESSAGE(state != "failed", name);
  CHECK(std::set<std::string>{"generating", "waiting", "loading weights"}.count(actors.at("generator 0")));
  CHECK(std::set<std::string>{"training", "waiting"}.count(actors.at("trainer")));
  // The latest samples: a prompt of the task, with its completion.
  CHECK(dom.find("<td class=\"text\">") != std::string::npos);

  // SIGTERM ends it at once; status.json says it was stopped, not that it failed.
  kill(run.pid, SIGTERM);
  CHECK(run.wait_exit() == 128 + SIGTERM);
  const auto status = json::parse(read(dir / "status.json"));
  CHECK(status["state"] == "stopped");
  CHECK(status["error"].get<std::string>().find("SIGTERM") != std::string::npos);
}

TEST_CASE("troupe dashboard shows a run killed mid-way as failed, with every step it made") {
  const fs::path runs = fixtures() / "dashboard_runs", dir = runs / "killed";
  fs::remove_all(runs);
  fs::create_directories(runs);
  Process run(troupe_run("tiny_arithmetic_grpo", task_args() + " run.dir=" + shell_quote(dir.string())),
              fixtures() / "dashboard_killed.log");
  Process dashboard("exec " + shell_quote(env_dir("TROUPE_BIN").string()) + " dashboard " + shell_quote(runs.string()) +
                        " --listen 127.0.0.1:0",
                    fixtures() / "dashboard_server.log");
  const std::string url = dashboard.wait_for(R"(at (http://127\.0\.0\.1:\d+/))");
  wait_steps(dir, 2, run);
  // Killed as the kernel kills: no chance to write its end.
  const auto pid = json::parse(read(dir / "status.json"))["pid"].get<pid_t>();
  REQUIRE(pid == run.pid);  // the run's own process (troupe_run execs it), never 0 (this process group)
  kill(pid, SIGKILL);
  run.wait_exit();
  const auto dom = chromium(url + "?run=killed", fixtures() / "dashboard_killed.png");
  CHECK(run_state(dom) == "failed");
  CHECK(dom.find("gone without writing its end") != std::string::npos);
  const auto lines = metrics_so_far(dir);
  const auto counts = check_points(chart_data(dom), lines);
  CHECK(counts.at("reward/mean") == lines.size());  // the run has ended: every step it made is drawn
  for (const auto& [name, state] : actor_states(dom)) CHECK_MESSAGE(state == "stopped", name);

  // What the page polls: the lines after those it has, read from where the last poll left off;
  // a metrics.jsonl replaced since (a resume rewrites it) is read afresh.
  httplib::Client client(url.substr(0, url.size() - 1));
  client.set_read_timeout(30, 0);
  auto poll = [&](int64_t from) {
    auto res = client.Get("/api/run?name=killed&from=" + std::to_string(from));
    REQUIRE(res);
    REQUIRE_MESSAGE(res->status == 200, res->body);
    return json::parse(res->body);
  };
  auto all = poll(0);
  REQUIRE(all["metrics"].size() == lines.size());
  CHECK(all["next"] == lines.size());
  auto rest = poll(1);
  REQUIRE(rest["metrics"].size() == lines.size() - 1);
  CHECK(rest["metrics"][0] == lines[1]);
  CHECK(poll(lines.size())["metrics"].empty());
  {
    std::ofstream out(dir / "metrics.jsonl.new");
    out << lines[0].dump() << "\n{\"step\": 2, \"loss\": 7.5}\n{\"step\": 3, ";  // the last line still being written
  }
  fs::rename(dir / "metrics.jsonl.new", dir / "metrics.jsonl");
  auto again = poll(0);
  REQUIRE(again["metrics"].size() == 2);
  CHECK(again["metrics"][1]["loss"] == 7.5);
  CHECK(again["next"] == 2);
  CHECK(poll(2)["metrics"].empty());
}

TEST_CASE("a dashboard port in use, a folder that is not there, a malformed address: each a clear error") {
  const fs::path runs = fixtures() / "dashboard_bad";
  fs::create_directories(runs);
  Process first("exec " + shell_quote(env_dir("TROUPE_BIN").string()) + " dashboard " + shell_quote(runs.string()) +
                    " --listen 127.0.0.1:0",
                fixtures() / "dashboard_first.log");
  const std::string port = first.wait_for(R"(at http://127\.0\.0\.1:(\d+)/)");
  const std::string bin = shell_quote(env_dir("TROUPE_BIN").string());
  auto again = run_command(bounded(bin + " dashboard " + shell_quote(runs.string()) + " --listen 127.0.0.1:" + port) + " 2>&1");
  CHECK(again.status == 1);
  CHECK_MESSAGE(again.out.find("--listen: cannot serve the dashboard on 127.0.0.1:" + port + ": Address already in use") !=
                    std::string::npos,
                again.out);
  // The same from troupe run, naming the key and where it was set; nothing is trained.
  const fs::path dir = fixtures() / "dashboard_bad_run";
  fs::remove_all(dir);
  auto run = run_command(bounded(troupe_run("tiny_arithmetic_grpo", task_args() + " run.dir=" + shell_quote(dir.string()) +
                                                                        " run.dashboard=127.0.0.1:" + port)) + " 2>&1");
  CHECK(run.status == 1);
  CHECK_MESSAGE(run.out.find("override 'run.dashboard=127.0.0.1:" + port + "': run.dashboard: cannot serve the dashboard on 127.0.0.1:" +
                             port + ": Address already in use") != std::string::npos,
                run.out);
  CHECK(steps_written(dir) == 0);
  auto missing = run_command(bounded(bin + " dashboard " + shell_quote((runs / "nothing_here").string())) + " 2>&1");
  CHECK(missing.status == 1);
  CHECK_MESSAGE(missing.out.find("nothing_here: not a folder") != std::string::npos, missing.out);
  auto malformed = run_command(bounded(troupe_run("tiny_arithmetic_grpo", task_args() + " run.dashboard=8265")) + " 2>&1");
  CHECK(malformed.status == 1);
  CHECK_MESSAGE(malformed.out.find("run.dashboard: expected HOST:PORT") != std::string::npos, malformed.out);
}
