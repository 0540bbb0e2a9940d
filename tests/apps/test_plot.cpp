// `troupe plot` end to end on metrics.jsonl files written here with known values: the image's
// size, the points of each drawn curve (counted in the SVG, seen as pixels in the PNG), bad input.
#include <doctest/doctest.h>
#include <png.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using troupe::test::env_dir;

namespace {

using Run = troupe::test::CommandResult;
std::string quote(const std::string& s) { return troupe::test::shell_quote(s); }

// `troupe ARGS`, stdout and stderr together; `env` goes before it (e.g. PLPLOT_DRV_DIR=...).
Run run_troupe(const std::string& args, const std::string& env = "") {
  return troupe::test::run_command(env + " " + quote(env_dir("TROUPE_BIN").string()) + " " + args +
                                   " < /dev/null 2>&1");
}

fs::path scratch() {
  static const fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("troupe_plot_" + std::to_string(getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// A run folder whose metrics.jsonl has these lines.
fs::path write_run(const std::string& name, const std::vector<nlohmann::json>& lines) {
  auto dir = scratch() / "runs" / name;
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (const auto& j : lines) out << j.dump() << "\n";
  return dir;
}

// Curved values (no three points in a line), so that no renderer may merge segments.
double curve(int s, int steps, double a, double b) { return a + b * (s * s) / double(steps * steps); }

// "tiny": 40 steps of reward/mean and loss; kl is null every 3rd step and missing every 5th
// (so 40 - 13 - 8 + 2 = 21 points), and a string field that is not a metric.
std::vector<nlohmann::json> tiny_lines(int64_t* kl_points) {
  std::vector<nlohmann::json> lines;
  *kl_points = 0;
  for (int s = 1; s <= 40; ++s) {
    nlohmann::json j{{"step", s}, {"reward/mean", curve(s, 40, 0.1, 0.6)}, {"loss", curve(s, 40, 2.0, -1.5)},
                     {"recipe", "grpo"}};
    if (s % 5 == 0) {
    } else if (s % 3 == 0) {
      j["kl"] = nullptr;
    } else {
      j["kl"] = curve(s, 40, 0.01, 0.3);
      ++*kl_points;
    }
    lines.push_back(j);
  }
  return lines;
}

// "other": 25 steps of reward/mean and loss, no kl.
std::vector<nlohmann::json> other_lines() {
  std::vector<nlohmann::json> lines;
  for (int s = 1; s <= 25; ++s)
    lines.push_back({{"step", s}, {"reward/mean", curve(s, 25, 0.3, 0.4)}, {"loss", curve(s, 25, 1.0, -0.8)}});
  return lines;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Width and height from the PNG's IHDR chunk (bytes 16..23, big-endian).
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  std::string b = read_file(p);
  REQUIRE(b.size() > 24);
  REQUIRE(b.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);
  REQUIRE(b.compare(12, 4, "IHDR") == 0);
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(b[at])) << 24) | (uint32_t(uint8_t(b[at + 1])) << 16) |
           (uint32_t(uint8_t(b[at + 2])) << 8) | uint32_t(uint8_t(b[at + 3]));
  };
  return {be32(16), be32(20)};
}

// Pixels within a small distance of an RGB colour, decoded by libpng.
int64_t pixels_near(const fs::path& p, uint32_t rgb) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  REQUIRE(png_image_begin_read_from_file(&image, p.c_str()));
  image.format = PNG_FORMAT_RGB;
  std::vector<png_byte> px(PNG_IMAGE_SIZE(image));
  REQUIRE(png_image_finish_read(&image, nullptr, px.data(), 0, nullptr));
  const int r = (rgb >> 16) & 255, g = (rgb >> 8) & 255, b = rgb & 255;
  int64_t n = 0;
  for (size_t i = 0; i + 2 < px.size(); i += 3)
    if (std::abs(px[i] - r) + std::abs(px[i + 1] - g) + std::abs(px[i + 2] - b) < 40) ++n;
  return n;
}

// The stroked paths of an SVG that cairo wrote: per stroke colour (0xRRGGBB), the number of
// points of each path in document order ("M x y L x y L x y" has 3).
std::map<uint32_t, std::vector<int>> svg_paths(const std::string& svg) {
  std::map<uint32_t, std::vector<int>> out;
  static const std::regex path(R"re(<path [^>]*stroke:rgb\(([0-9.]+)%,([0-9.]+)%,([0-9.]+)%\)[^>]*\bd="([^"]*)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), path); it != std::sregex_iterator(); ++it) {
    auto channel = [&](int k) { return uint32_t(std::lround(std::stod((*it)[k]) * 255 / 100)); };
    const std::string d = (*it)[4];
    int points = 0;
    for (char c : d) points += c == 'M' || c == 'L';
    out[(channel(1) << 16) | (channel(2) << 8) | channel(3)].push_back(points);
  }
  return out;
}

// The curves only: a legend's line sample is a path of 2 points, the curves here have more.
std::vector<int> curves(const std::map<uint32_t, std::vector<int>>& paths, uint32_t colour) {
  std::vector<int> out;
  if (auto it = paths.find(colour); it != paths.end())
    for (int n : it->second)
      if (n > 2) out.push_back(n);
  return out;
}

std::optional<double> svg_attribute(const std::string& svg, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(svg, m, std::regex("<svg[^>]*\\b" + name + "=\"([0-9.]+)pt\""))) return std::nullopt;
  return std::stod(m[1]);
}

constexpr uint32_t kFirstRunColour = 0x1f77b4, kSecondRunColour = 0xff7f0e;  // tab10's first two

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

}  // namespace

TEST_CASE("plot of the tiny run: a PNG of the asked size with the run's curves, points counted per series") {
  int64_t kl_points = 0;
  auto run = write_run("tiny", tiny_lines(&kl_points));
  auto png = scratch() / "tiny.png";
  auto r = run_troupe("plot " + quote(run.string()) + " -o " + quote(png.string()) + " --width 800 --height 500");
  INFO(r.out);
  REQUIRE(r.status == 0);
  // No --metrics: reward/mean and loss, the defaults this run logged (kl is not a default).
  CHECK(has(r.out, run.string() + " reward/mean: 40 points\n"));
  CHECK(has(r.out, run.string() + " loss: 40 points\n"));
  CHECK(!has(r.out, " kl: "));
  CHECK(has(r.out, "wrote " + png.string() + " (800x500 px)"));
  CHECK(png_size(png) == std::pair<uint32_t, uint32_t>{800, 500});
  // Two curves 2 px wide across ~500 px of plot make over 1000 such pixels; the two legend
  // samples alone make under 200.
  const int64_t drawn = pixels_near(png, kFirstRunColour);
  MESSAGE("pixels of the run's colour: " << drawn);
  CHECK(drawn > 600);
  CHECK(pixels_near(png, kSecondRunColour) == 0);
}

TEST_CASE("plot of two runs overlaid as SVG: one path per series with one point per numeric value") {
  int64_t kl_points = 0;
  auto tiny = write_run("tiny", tiny_lines(&kl_points));
  auto other = write_run("other", other_lines());
  REQUIRE(kl_points == 21);
  auto svg_file = scratch() / "two.svg";
  auto r = run_troupe("plot " + quote(tiny.string()) + " " + quote(other.string()) +
                      " --metrics reward/mean,loss,kl -o " + quote(svg_file.string()));
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(has(r.out, tiny.string() + " reward/mean: 40 points\n"));
  CHECK(has(r.out, other.string() + " reward/mean: 25 points\n"));
  CHECK(has(r.out, tiny.string() + " loss: 40 points\n"));
  CHECK(has(r.out, other.string() + " loss: 25 points\n"));
  CHECK(has(r.out, tiny.string() + " kl: 21 points\n"));
  CHECK(has(r.out, other.string() + " kl: 0 points\n"));
  CHECK(has(r.out, other.string() + ": no numeric values of \"kl\"; not drawn"));
  CHECK(has(r.out, "wrote " + svg_file.string() + " (1000x600 pt)"));

  const std::string svg = read_file(svg_file);
  CHECK(svg_attribute(svg, "width") == 1000.0);
  CHECK(svg_attribute(svg, "height") == 600.0);
  auto paths = svg_paths(svg);
  // Panel by panel, in --metrics order: the first run's colour draws 40, 40 and 21 points, the
  // second's 25 and 25 (it has no kl); each legend entry adds a 2-point sample.
  CHECK(curves(paths, kFirstRunColour) == std::vector<int>{40, 40, 21});
  CHECK(curves(paths, kSecondRunColour) == std::vector<int>{25, 25});
  CHECK(std::count(paths[kFirstRunColour].begin(), paths[kFirstRunColour].end(), 2) == 3);
  CHECK(std::count(paths[kSecondRunColour].begin(), paths[kSecondRunColour].end(), 2) == 2);
}

TEST_CASE("plot's defaults: an SFT run draws loss alone; a torn last line is skipped and said") {
  std::vector<nlohmann::json> lines;
  for (int s = 1; s <= 30; ++s) lines.push_back({{"step", s}, {"loss", curve(s, 30, 3.0, -2.0)}, {"lr", 1e-5}});
  auto run = write_run("sft", lines);
  std::ofstream(run / "metrics.jsonl", std::ios::app) << "{\"step\": 31, \"lo";
  auto svg_file = scratch() / "sft.svg";
  auto r = run_troupe("plot " + quote(run.string()) + "/ -o " + quote(svg_file.string()));
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(has(r.out, run.string() + " loss: 30 points\n"));
  CHECK(!has(r.out, "reward/mean"));
  CHECK(has(r.out, (run / "metrics.jsonl").string() + ":31: not a JSON object (a torn last line?); skipped"));
  CHECK(curves(svg_paths(read_file(svg_file)), kFirstRunColour) == std::vector<int>{30});
}

TEST_CASE("plot's bad input: each a clear error naming the folder, metric or file, exit code 1") {
  int64_t kl_points = 0;
  auto tiny = write_run("tiny", tiny_lines(&kl_points));
  auto out = quote((scratch() / "bad.png").string());

  SUBCASE("a folder without metrics.jsonl") {
    auto empty = scratch() / "runs" / "not_a_run";
    fs::create_directories(empty);
    auto r = run_troupe("plot " + quote(empty.string()) + " -o " + out);
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "troupe: error: " + empty.string() + ": no metrics.jsonl in this folder"));
  }
  SUBCASE("a folder that does not exist") {
    auto r = run_troupe("plot " + quote((scratch() / "runs" / "nope").string()) + " -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "troupe: error: " + (scratch() / "runs" / "nope").string() + ": no such run folder"));
  }
  SUBCASE("a metric no run logged: named, with the metrics there are") {
    auto r = run_troupe("plot " + quote(tiny.string()) + " --metrics loss,reward/maen -o " + out);
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "troupe: error: --metrics reward/maen: no run logged a metric \"reward/maen\""));
    CHECK(has(r.out, tiny.string() + " has kl, loss, reward/mean"));
  }
  SUBCASE("a metric that is not a number") {
    auto r = run_troupe("plot " + quote(tiny.string()) + " --metrics recipe -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, (tiny / "metrics.jsonl").string() + ":1: \"recipe\" is a string, not a number"));
  }
  SUBCASE("no default metric in the run") {
    auto run = write_run("grad_only", {{{"step", 1}, {"grad_norm", 0.5}}, {{"step", 2}, {"grad_norm", 0.4}}});
    auto r = run_troupe("plot " + quote(run.string()) + " -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "none of the default metrics (reward/mean, loss)"));
    CHECK(has(r.out, "choose with --metrics"));
  }
  SUBCASE("an empty metrics.jsonl, a line that is not JSON, a line without a step") {
    auto run = write_run("empty", {});
    auto r = run_troupe("plot " + quote(run.string()) + " -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, (run / "metrics.jsonl").string() + ": empty"));
    std::ofstream(run / "metrics.jsonl") << "{\"step\": 1, \"loss\": 1}\nnot json\n{\"step\": 3, \"loss\": 1}\n";
    r = run_troupe("plot " + quote(run.string()) + " -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, (run / "metrics.jsonl").string() + ":2: not a JSON object"));
    std::ofstream(run / "metrics.jsonl") << "{\"step\": 1, \"loss\": 1}\n{\"loss\": 1}\n";
    r = run_troupe("plot " + quote(run.string()) + " -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, (run / "metrics.jsonl").string() + ":2: no numeric \"step\""));
  }
  SUBCASE("an output extension other than .png or .svg") {
    auto r = run_troupe("plot " + quote(tiny.string()) + " -o " + quote((scratch() / "curves.pdf").string()));
    CHECK(r.status == 1);
    CHECK(has(r.out, "troupe plot writes .png or .svg, not .pdf"));
    CHECK(!fs::exists(scratch() / "curves.pdf"));
  }
  SUBCASE("PLplot's cairo driver missing: said before PLplot asks for another device") {
    auto drivers = scratch() / "no_drivers";
    fs::create_directories(drivers);
    auto r = run_troupe("plot " + quote(tiny.string()) + " -o " + out, "PLPLOT_DRV_DIR=" + quote(drivers.string()));
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "needs PLplot's cairo driver"));
    CHECK(has(r.out, drivers.string() + " (PLPLOT_DRV_DIR)"));
    CHECK(has(r.out, "install plplot-driver-cairo"));
  }
  SUBCASE("too many panels for the height") {
    auto r = run_troupe("plot " + quote(tiny.string()) + " --metrics loss,kl,reward/mean --height 150 -o " + out);
    CHECK(r.status == 1);
    CHECK(has(r.out, "--height 150: too small for 3 panels"));
  }
}
