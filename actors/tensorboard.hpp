// TensorBoard event files: scalars and markdown text, in the record format TensorBoard reads, and
// runs/NAME/tb/ kept equal to metrics.jsonl and samples.jsonl. Deliberately nothing else
// (no histograms, images or graphs) and no reader beyond the wall times of files it replaces.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe {

// Seconds since the epoch, as events carry them.
double wall_time_now();

// One events.out.tfevents.<unix seconds>.<hostname> file in `dir` (made if missing), opened with
// the file_version event. Each record: uint64 length, masked CRC32C of the length, an Event
// protobuf, masked CRC32C of it (TensorBoard's framing). Errors are troupe::Error naming the file.
class EventWriter {
 public:
  explicit EventWriter(const std::filesystem::path& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  struct Scalar {
    std::string tag;
    float value;  // TensorBoard stores scalars as float32 (Summary.Value.simple_value)
  };
  // One event at `step` holding every scalar (a metrics line is one event).
  void scalars(int64_t step, const std::vector<Scalar>& values, double wall_time);
  // Markdown for TensorBoard's text plugin: a scalar string tensor under `tag`.
  void text(const std::string& tag, int64_t step, const std::string& markdown, double wall_time);
  // Everything written so far reaches the file (each call above ends with one).
  void flush();
  const std::filesystem::path& path() const { return path_; }

 private:
  void record(const std::string& bytes);
  std::filesystem::path path_;
  struct File;
  std::unique_ptr<File> file_;
};

// The masked CRC32C TensorBoard's records carry: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// One samples.jsonl line ({"step", "samples": [{"prompt", "completion", "reward", "rewards"}]})
// as the markdown shown under the text tag "samples": prompt and completion as code blocks.
std::string samples_markdown(const nlohmann::json& line);

// runs/NAME/tb/: TensorBoard's view of metrics.jsonl (scalars) and samples.jsonl (text "samples").
// Opening it replaces every event file in tb/ by one holding both files' lines as they are now,
// so a resumed run (whose metrics.jsonl was cut back to its checkpoint) or a run folder used
// again shows exactly what metrics.jsonl holds; lines already shown keep their old wall times.
// Then each step adds to both. Only rank 0 opens one.
class RunBoard {
 public:
  explicit RunBoard(const std::filesystem::path& run_dir);
  // One metrics.jsonl line: every number in it but "step" becomes a scalar of that tag at
  // "step"; null (NaN or nothing trained), booleans, strings, arrays and objects are skipped.
  void metrics(const nlohmann::json& line);
  // One samples.jsonl line, as samples_markdown shows it.
  void samples(const nlohmann::json& line);
  const std::filesystem::path& path() const { return writer_->path(); }

 private:
  std::unique_ptr<EventWriter> writer_;
};

}  // namespace troupe
