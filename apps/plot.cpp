// `troupe plot`: reads runs' metrics.jsonl and has PLplot draw one panel per metric, runs overlaid.
// PLplot does all drawing and file writing; this file only chooses series, ranges and colours.
#include "apps/plot.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <plstream.h>

#include "policy/error.hpp"

#ifndef TROUPE_PLPLOT_DRV_DIR
#define TROUPE_PLPLOT_DRV_DIR ""  // CMake passes pkg-config's drvdir
#endif

namespace troupe {
namespace {

namespace fs = std::filesystem;
using Points = std::vector<std::pair<double, double>>;  // (step, value), by step

struct RunMetrics {
  std::string label;                      // as given on the command line, without a trailing '/'
  std::string name;                       // the run folder's name, for the legend
  fs::path file;                          // its metrics.jsonl
  std::map<std::string, Points> numbers;  // every metric with at least one numeric value
  std::map<std::string, std::string> not_numbers;  // metric -> first "file:line: is a string" seen
};

std::string type_name(const nlohmann::json& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "true/false";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "not a number";
}

RunMetrics read_run(const std::string& arg, std::vector<std::string>& notes) {
  RunMetrics run;
  run.label = arg;
  while (run.label.size() > 1 && run.label.back() == '/') run.label.pop_back();
  fs::path path(run.label);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(run.label + ": no such run folder");
  if (fs::is_directory(path, ec)) {
    run.file = path / "metrics.jsonl";
    if (!fs::exists(run.file, ec))
      throw Error(run.label + ": no metrics.jsonl in this folder (troupe run writes one into run.dir, e.g. runs/NAME)");
    run.name = fs::absolute(path, ec).lexically_normal().filename().string();
    if (run.name.empty()) run.name = fs::absolute(path, ec).lexically_normal().parent_path().filename().string();
  } else {
    run.file = path;  // a metrics.jsonl given directly: the legend names its folder
    run.name = fs::absolute(path, ec).parent_path().filename().string();
  }
  std::ifstream in(run.file);
  if (!in) throw Error(run.file.string() + ": cannot open");

  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  size_t last = lines.size();
  while (last > 0 && lines[last - 1].find_first_not_of(" \t\r") == std::string::npos) --last;
  if (last == 0) throw Error(run.file.string() + ": empty (the run has logged no step yet)");
  for (size_t i = 0; i < last; ++i) {
    if (lines[i].find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = run.file.string() + ":" + std::to_string(i + 1);
    auto j = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      // A run that is still writing (or was killed mid-line) leaves a torn last line.
      if (i + 1 == last) {
        notes.push_back(where + ": not a JSON object (a torn last line?); skipped");
        continue;
      }
      throw Error(where + ": not a JSON object");
    }
    auto step = j.find("step");
    if (step == j.end() || !step->is_number()) throw Error(where + ": no numeric \"step\"");
    const double x = step->get<double>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || value.is_null()) continue;  // null: NaN or not measured this step
      if (value.is_number())
        run.numbers[key].emplace_back(x, value.get<double>());
      else if (!run.not_numbers.count(key))
        run.not_numbers[key] = where + ": \"" + key + "\" is " + type_name(value) + ", not a number";
    }
  }
  for (auto& [key, points] : run.numbers)
    std::stable_sort(points.begin(), points.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return run;
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::vector<std::string> metric_names(const RunMetrics& run) {
  std::vector<std::string> names;
  for (const auto& [key, points] : run.numbers) names.push_back(key);
  return names;
}

// The panels to draw: --metrics as given (each must have numbers in some run), or the defaults
// that some run logged.
std::vector<std::string> choose_metrics(const PlotOptions& o, const std::vector<RunMetrics>& runs) {
  auto logged = [&](const std::string& m) {
    return std::any_of(runs.begin(), runs.end(), [&](const RunMetrics& r) { return r.numbers.count(m) > 0; });
  };
  auto available = [&] {
    std::string s;
    for (const auto& r : runs) {
      auto names = metric_names(r);
      s += (s.empty() ? "" : "; ") + r.label + " has " + (names.empty() ? std::string("none") : join(names, ", "));
    }
    return s;
  };
  std::vector<std::string> chosen;
  if (o.metrics.empty()) {
    for (const auto& m : kDefaultPlotMetrics)
      if (logged(m)) chosen.push_back(m);
    if (chosen.empty())
      throw Error(runs.front().label + ": none of the default metrics (" + join(kDefaultPlotMetrics, ", ") +
                  ") has a numeric value; choose with --metrics (" + available() + ")");
    return chosen;
  }
  for (std::string m : o.metrics) {
    m.erase(0, m.find_first_not_of(" \t"));
    m.erase(m.find_last_not_of(" \t") + 1);
    if (m.empty()) throw Error("--metrics: an empty metric name (metrics are separated by commas)");
    if (std::find(chosen.begin(), chosen.end(), m) != chosen.end()) continue;
    if (!logged(m)) {
      for (const auto& r : runs)
        if (auto bad = r.not_numbers.find(m); bad != r.not_numbers.end()) throw Error(bad->second);
      throw Error("--metrics " + m + ": no run logged a metric \"" + m + "\" with a numeric value (" + available() + ")");
    }
    chosen.push_back(m);
  }
  return chosen;
}

// The output format from the file name's extension. SVG goes through cairo as PNG does (not
// PLplot's own svg device), so both look the same; its text is outlines, so no viewer substitutes a font.
std::string device_for(const std::string& output) {
  std::string ext = fs::path(output).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  if (ext == ".png") return "pngcairo";
  if (ext == ".svg") return "svgcairo";
  if (ext.empty()) throw Error("-o " + output + ": no extension; name a .png or .svg file");
  throw Error("-o " + output + ": troupe plot writes .png or .svg, not " + ext);
}

// PLplot's messages go to stderr on their own; these say what troupe was doing when they came.
std::string g_plplot_abort;
void on_plplot_abort(const char* message) { g_plplot_abort = message ? message : ""; }
int on_plplot_exit(const char* message) {
  std::fprintf(stderr, "troupe: error: PLplot stopped troupe plot: %s\n", message ? message : "");
  return 1;
}

// PLplot looks for its drivers in $PLPLOT_DRV_DIR, else in the folder it was built with. A missing
// driver makes PLplot end the process (no drivers at all) or ask on stdin for another device, so
// look first.
void require_device(const std::string& device) {
  const char* env = std::getenv("PLPLOT_DRV_DIR");
  const std::string dir = env ? env : TROUPE_PLPLOT_DRV_DIR;
  const std::string where = "PLplot's drivers folder " + (dir.empty() ? std::string("(built in)") : dir) +
                            (env ? " (PLPLOT_DRV_DIR)" : "");
  const std::string fix = "install plplot-driver-cairo, or point PLPLOT_DRV_DIR at the folder that holds cairo.so";
  std::error_code ec;
  if (!dir.empty() && !fs::exists(fs::path(dir) / "cairo.driver_info", ec))
    throw Error("troupe plot needs PLplot's cairo driver (device " + device + "), and " + where + " has none; " + fix);
  std::array<const char*, 128> menus{}, names{};
  const char** menu = menus.data();
  const char** name = names.data();
  int count = static_cast<int>(names.size());
  g_plplot_abort.clear();
  plgDevs(&menu, &name, &count);
  for (int i = 0; i < count; ++i)
    if (name[i] && device == name[i]) return;
  throw Error("troupe plot needs PLplot's " + device + " device, and " + where + " has none" +
              (g_plplot_abort.empty() ? "" : " (" + g_plplot_abort + ")") + "; " + fix);
}

// '#' starts a PLplot text escape; "##" is a literal one.
std::string plplot_text(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '#' ? std::string("##") : std::string(1, c);
  return out;
}

// cmap0: 0 background, 1 axes and text, 2 grid, then one colour per run (matplotlib's tab10,
// which stays distinct in print and for the common colour blindnesses).
constexpr int kText = 1, kGrid = 2, kFirstRun = 3;
constexpr std::array<std::array<int, 3>, 10> kRunColours = {{{0x1f, 0x77, 0xb4}, {0xff, 0x7f, 0x0e}, {0x2c, 0xa0, 0x2c},
                                                             {0xd6, 0x27, 0x28}, {0x94, 0x67, 0xbd}, {0x8c, 0x56, 0x4b},
                                                             {0xe3, 0x77, 0xc2}, {0x7f, 0x7f, 0x7f}, {0xbc, 0xbd, 0x22},
                                                             {0x17, 0xbe, 0xcf}}};

void set_colours(plstream& pls) {
  std::vector<PLINT> r{255, 0, 221}, g{255, 0, 221}, b{255, 0, 221};
  for (const auto& c : kRunColours) r.push_back(c[0]), g.push_back(c[1]), b.push_back(c[2]);
  pls.scmap0(r.data(), g.data(), b.data(), static_cast<PLINT>(r.size()));
}

std::pair<double, double> padded(double lo, double hi) {
  if (hi > lo) {
    double pad = (hi - lo) * 0.05;
    return {lo - pad, hi + pad};
  }
  double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.05;
  return {lo - pad, hi + pad};
}

// Panels stacked top to bottom, in PLplot's normalized page coordinates. Margins are in pixels,
// so that text keeps its room whatever the size; the legend goes right of the plot, where it
// never hides a curve.
struct Box {
  double left, right, bottom, top;
};
constexpr int kLeft = 64, kTitle = 28, kTicks = 28, kStepLabel = 22, kMinPanel = 40;
// The legend's room right of the panels: its sample line and frame, and about 9 px a character
// of its longest text at kTextScale (measured on the cairo drivers).
constexpr int kLegendFrame = 100, kLegendChar = 9, kMinRight = 160;
constexpr double kTextScale = 0.7;  // of PLplot's default character height: about 11 px at 90 dpi

std::vector<Box> stacked_panels(int width, int height, size_t count, size_t legend_chars) {
  const int n = static_cast<int>(count);
  const int right = std::max(kMinRight, kLegendFrame + kLegendChar * static_cast<int>(legend_chars));
  const int panel = (height - kStepLabel) / n;  // one panel's share, margins included
  if (panel - kTitle - kTicks < kMinPanel)
    throw Error("--height " + std::to_string(height) + ": too small for " + std::to_string(n) + " panels; use at least " +
                std::to_string(n * (kTitle + kTicks + kMinPanel) + kStepLabel));
  if (width - kLeft - right < 2 * kMinPanel)
    throw Error("--width " + std::to_string(width) + ": too small for the legend; use at least " +
                std::to_string(kLeft + right + 2 * kMinPanel));
  std::vector<Box> panels;
  for (int k = 0; k < n; ++k) {
    const double top_px = k * panel + kTitle, bottom_px = (k + 1) * panel - kTicks;  // from the top
    panels.push_back({.left = double(kLeft) / width,
                        .right = 1.0 - double(right) / width,
                        .bottom = 1.0 - bottom_px / height,
                        .top = 1.0 - top_px / height});
  }
  return panels;
}

// Tick labels as %g (20000, 0.35, 1e-06): PLplot's own would put a "(x10^k)" beside the axis,
// where the panel above or the page's edge crops it. A tick meant to be 0 may arrive as 1e-17.
struct Spans {
  double x, y;
};
void tick_label(PLINT axis, PLFLT value, char* label, PLINT length, PLPointer data) {
  const auto* spans = static_cast<const Spans*>(data);
  if (std::abs(value) < 1e-9 * (axis == PL_X_AXIS ? spans->x : spans->y)) value = 0;
  std::snprintf(label, static_cast<size_t>(length), "%g", value);
}

// One panel: grid, axes, the metric's curve for each run that logged it, and the legend.
void draw_panel(plstream& pls, const Box& v, const std::string& metric, const std::vector<RunMetrics>& runs,
                bool bottom) {
  double x_lo = 0, x_hi = 0, y_lo = 0, y_hi = 0;
  bool first = true;
  for (const auto& r : runs)
    if (auto it = r.numbers.find(metric); it != r.numbers.end())
      for (auto [x, y] : it->second) {
        x_lo = first ? x : std::min(x_lo, x), x_hi = first ? x : std::max(x_hi, x);
        y_lo = first ? y : std::min(y_lo, y), y_hi = first ? y : std::max(y_hi, y);
        first = false;
      }
  if (x_hi == x_lo) x_lo -= 1, x_hi += 1;
  auto [y0, y1] = padded(y_lo, y_hi);
  pls.vpor(v.left, v.right, v.bottom, v.top);
  pls.wind(x_lo, x_hi, y0, y1);
  pls.col0(kGrid);
  pls.box("g", 0, 0, "g", 0, 0);
  pls.col0(kText);
  Spans spans{.x = x_hi - x_lo, .y = y1 - y0};
  pls.slabelfunc(tick_label, &spans);
  pls.box("bcnsto", 0, 0, "bcnstvo", 0, 0);
  pls.slabelfunc(nullptr, nullptr);
  pls.mtex("t", 1.2, 0.5, 0.5, plplot_text(metric).c_str());
  if (bottom) pls.mtex("b", 2.6, 0.5, 0.5, "step");

  std::vector<std::string> texts;
  std::vector<PLINT> opts, colours, styles, text_colours;
  std::vector<PLFLT> widths;
  for (size_t i = 0; i < runs.size(); ++i) {
    auto it = runs[i].numbers.find(metric);
    if (it == runs[i].numbers.end()) continue;
    const PLINT colour = kFirstRun + static_cast<PLINT>(i % kRunColours.size());
    const PLINT style = 1 + static_cast<PLINT>((i / kRunColours.size()) % 8);  // past 10 runs, dashes too
    std::vector<PLFLT> xs, ys;
    for (auto [x, y] : it->second) xs.push_back(x), ys.push_back(y);
    pls.col0(colour);
    pls.lsty(style);
    pls.width(2);
    if (xs.size() == 1)
      pls.poin(1, xs.data(), ys.data(), 17);  // a lone point makes no line: a dot
    else
      pls.line(static_cast<PLINT>(xs.size()), xs.data(), ys.data());
    texts.push_back(plplot_text(runs[i].name + " " + metric));
    opts.push_back(PL_LEGEND_LINE);
    colours.push_back(colour);
    styles.push_back(style);
    widths.push_back(2);
    text_colours.push_back(kText);
  }
  pls.lsty(1);
  pls.width(1);
  std::vector<const char*> text_ptrs;
  for (const auto& t : texts) text_ptrs.push_back(t.c_str());
  PLFLT legend_w = 0, legend_h = 0;
  pls.legend(&legend_w, &legend_h, 0, PL_POSITION_RIGHT | PL_POSITION_OUTSIDE | PL_POSITION_VIEWPORT,
             /*x=*/0.02, /*y=*/0.0, /*plot_width=*/0.06, /*bg_color=*/0, /*bb_color=*/kText, /*bb_style=*/1,
             /*nrow=*/0, /*ncolumn=*/0, static_cast<PLINT>(texts.size()), opts.data(), /*text_offset=*/0.5,
             kTextScale, /*text_spacing=*/1.8, /*text_justification=*/0.0, text_colours.data(), text_ptrs.data(),
             nullptr, nullptr, nullptr, nullptr, colours.data(), styles.data(), widths.data(), nullptr, nullptr,
             nullptr, nullptr);
}

}  // namespace

PlotResult plot_runs(const PlotOptions& o) {
  if (o.runs.empty()) throw Error("troupe plot: name at least one run folder");
  PlotResult result;
  result.device = device_for(o.output);

  std::vector<RunMetrics> runs;
  for (const auto& arg : o.runs) runs.push_back(read_run(arg, result.notes));
  // The legend says the folder's name, or the whole path where two runs share a name.
  std::map<std::string, int> name_count;
  for (const auto& r : runs) ++name_count[r.name];
  for (auto& r : runs)
    if (name_count[r.name] > 1 || r.name.empty()) r.name = r.label;
  const auto metrics = choose_metrics(o, runs);
  for (const auto& m : metrics)
    for (const auto& r : runs) {
      auto it = r.numbers.find(m);
      const int64_t points = it == r.numbers.end() ? 0 : static_cast<int64_t>(it->second.size());
      result.series.push_back({.run = r.label, .metric = m, .points = points});
      if (points == 0) result.notes.push_back(r.label + ": no numeric values of \"" + m + "\"; not drawn");
    }
  size_t legend_chars = 0;  // the longest "RUN METRIC"
  for (const auto& m : metrics)
    for (const auto& r : runs) legend_chars = std::max(legend_chars, r.name.size() + 1 + m.size());
  const auto panels = stacked_panels(o.width, o.height, metrics.size(), legend_chars);

  plsabort(on_plplot_abort);
  plsexit(on_plplot_exit);
  require_device(result.device);
  const fs::path out(o.output);
  std::error_code ec;
  if (!out.parent_path().empty() && !fs::is_directory(out.parent_path(), ec))
    throw Error("-o " + o.output + ": no folder " + out.parent_path().string());
  if (!std::ofstream(out)) throw Error("-o " + o.output + ": cannot write this file");
  {
    plstream pls;
    pls.sdev(result.device.c_str());
    pls.sfnam(o.output.c_str());
    pls.spage(90, 90, o.width, o.height, 0, 0);  // 90 dpi: the text size kTextScale is made for
    set_colours(pls);
    pls.init();
    pls.schr(0, kTextScale);
    pls.adv(0);
    for (size_t k = 0; k < metrics.size(); ++k) draw_panel(pls, panels[k], metrics[k], runs, k + 1 == metrics.size());
  }  // ~plstream ends the page and closes the file
  if (fs::file_size(out, ec) == 0 || ec) throw Error("-o " + o.output + ": PLplot wrote nothing");
  return result;
}

}  // namespace troupe
