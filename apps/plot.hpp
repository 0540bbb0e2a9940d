// `troupe plot`: the curves of metrics.jsonl from one or more run folders, drawn by PLplot into
// a PNG or SVG, one panel per metric. It draws what the runs logged: no smoothing, no statistics.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

// Drawn when --metrics is not given: those of these that some run logged (RL runs log both,
// SFT, LoRA and DPO runs log loss).
inline const std::vector<std::string> kDefaultPlotMetrics = {"reward/mean", "loss"};

struct PlotOptions {
  std::vector<std::string> runs;     // run folders (each with a metrics.jsonl), or metrics.jsonl files
  std::vector<std::string> metrics;  // one panel each, top to bottom; empty: kDefaultPlotMetrics
  std::string output = "curves.png";  // .png or .svg: PLplot's pngcairo or svgcairo device
  int width = 1000, height = 600;     // pixels (SVG: user units, written as pt)
};

struct PlotSeries {
  std::string run;     // the run as named on the command line, e.g. runs/gsm8k
  std::string metric;  // e.g. reward/mean
  int64_t points = 0;  // (step, value) points drawn: the lines where the value is a number
};

struct PlotResult {
  std::vector<PlotSeries> series;  // panel by panel, run by run
  std::vector<std::string> notes;  // what was skipped and why: a torn last line, a run without a metric
  std::string device;              // the PLplot device that wrote the file
};

// Reads each run's metrics.jsonl, draws the chosen metrics against "step" and writes
// options.output. Throws troupe::Error naming the folder, file:line or metric on bad input.
PlotResult plot_runs(const PlotOptions& options);

}  // namespace troupe
