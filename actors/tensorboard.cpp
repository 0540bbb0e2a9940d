// TensorBoard event files written with our own protobuf messages (tensorboard.proto) and
// Boost's CRC32C; see tensorboard.hpp. No protobuf header leaves this file.
#include "actors/tensorboard.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include <boost/crc.hpp>

#include "actors/tensorboard.pb.h"
#include "policy/error.hpp"

namespace troupe {

namespace fs = std::filesystem;
namespace pb = troupe::tensorboard;

namespace {

// CRC32C (Castagnoli): reflected polynomial 0x1EDC6F41, as TensorBoard's records use it.
using Crc32c = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || !*name) return "localhost";
  return name;
}

bool is_event_file(const fs::path& p) { return p.filename().string().rfind("events.out.tfevents.", 0) == 0; }

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// The events of one file, up to the first record that is cut short or fails its CRC (a writer
// killed mid-record).
std::vector<pb::Event> read_events(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<pb::Event> out;
  char head[12], tail[4];
  while (in.read(head, 12)) {
    if (masked_crc32c(head, 8) != get_le(head + 8, 4)) break;
    std::string data(get_le(head, 8), '\0');
    if (!in.read(data.data(), static_cast<std::streamsize>(data.size())) || !in.read(tail, 4)) break;
    if (masked_crc32c(data.data(), data.size()) != get_le(tail, 4)) break;
    pb::Event e;
    if (!e.ParseFromString(data)) break;
    out.push_back(std::move(e));
  }
  return out;
}

// What the replaced files showed, in order: (step, wall time) per metrics line and per samples line.
struct Shown {
  std::vector<std::pair<int64_t, double>> metrics, samples;
};

Shown shown_in(const fs::path& dir) {
  Shown s;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (is_event_file(e.path())) files.push_back(e.path());
  std::sort(files.begin(), files.end());  // TensorBoard reads a folder's files in name order too
  for (const auto& f : files)
    for (const auto& e : read_events(f)) {
      if (!e.has_summary()) continue;
      const bool text = e.summary().value_size() > 0 && e.summary().value(0).has_tensor();
      (text ? s.samples : s.metrics).emplace_back(e.step(), e.wall_time());
    }
  return s;
}

// The lines of a JSONL file that parse as objects with a numeric "step"; a torn line is skipped.
std::vector<nlohmann::json> step_lines(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer()) out.push_back(std::move(j));
  }
  return out;
}

// Line i keeps the wall time the old files gave line i, when that was the same step.
double wall_time_of(const std::vector<std::pair<int64_t, double>>& shown, size_t i, int64_t step, double now) {
  return i < shown.size() && shown[i].first == step ? shown[i].second : now;
}

// float32 as TensorBoard keeps it; beyond float32's range +-inf (a plain cast would be undefined).
float to_float32(double v) {
  constexpr double top = std::numeric_limits<float>::max();
  if (v > top || v < -top) return v > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
  return static_cast<float>(v);
}

std::vector<EventWriter::Scalar> scalars_of(const nlohmann::json& line) {
  std::vector<EventWriter::Scalar> out;
  for (const auto& [key, value] : line.items())
    if (key != "step" && value.is_number()) out.push_back({key, to_float32(value.get<double>())});
  return out;
}

// Each line indented four spaces: a markdown code block, shown as written whatever it holds.
std::string code_block(const std::string& text) {
  std::string out = "    ";
  for (char c : text) {
    out += c;
    if (c == '\n') out += "    ";
  }
  return out + "\n";
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

}  // namespace

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

uint32_t masked_crc32c(const void* data, size_t n) {
  Crc32c crc;
  crc.process_bytes(data, n);
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

struct EventWriter::File {
  std::ofstream out;
};

EventWriter::EventWriter(const fs::path& dir) : file_(std::make_unique<File>()) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const auto seconds = static_cast<int64_t>(wall_time_now());
  path_ = dir / ("events.out.tfevents." + std::to_string(seconds) + "." + hostname());
  file_->out.open(path_, std::ios::binary | std::ios::trunc);
  if (!file_->out) throw Error(path_.string() + ": cannot open for writing (TensorBoard events; check run.dir)");
  pb::Event e;
  e.set_wall_time(wall_time_now());
  e.set_file_version("brain.Event:2");
  record(e.SerializeAsString());
  flush();
}

EventWriter::~EventWriter() = default;

void EventWriter::record(const std::string& bytes) {
  std::string head;
  put_le(head, bytes.size(), 8);
  put_le(head, masked_crc32c(head.data(), 8), 4);
  std::string tail;
  put_le(tail, masked_crc32c(bytes.data(), bytes.size()), 4);
  file_->out << head << bytes << tail;
  if (!file_->out) throw Error(path_.string() + ": cannot write (disk full?)");
}

void EventWriter::flush() {
  file_->out.flush();
  if (!file_->out) throw Error(path_.string() + ": cannot write (disk full?)");
}

void EventWriter::scalars(int64_t step, const std::vector<Scalar>& values, double wall_time) {
  pb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  e.mutable_summary();  // even empty: one summary event per metrics line, as the replay counts them
  for (const auto& s : values) {
    auto* v = e.mutable_summary()->add_value();
    v->set_tag(s.tag);
    v->set_simple_value(s.value);
  }
  record(e.SerializeAsString());
  flush();
}

void EventWriter::text(const std::string& tag, int64_t step, const std::string& markdown, double wall_time) {
  pb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  auto* t = v->mutable_tensor();
  t->set_dtype(pb::DT_STRING);
  t->mutable_tensor_shape();  // no dims: a scalar string
  t->add_string_val(markdown);
  record(e.SerializeAsString());
  flush();
}

std::string samples_markdown(const nlohmann::json& line) {
  std::string out;
  int64_t k = 0;
  for (const auto& s : line.value("samples", nlohmann::json::array())) {
    out += "**sample " + std::to_string(++k) + "**";
    if (s.contains("reward") && s["reward"].is_number()) out += ": reward " + number(s["reward"].get<double>());
    if (s.contains("rewards") && s["rewards"].is_object() && !s["rewards"].empty()) {
      std::string parts;
      for (const auto& [name, r] : s["rewards"].items())
        if (r.is_number()) parts += (parts.empty() ? "" : ", ") + name + " " + number(r.get<double>());
      out += " (" + parts + ")";
    }
    out += "\n\nprompt:\n\n" + code_block(s.value("prompt", "")) + "\ncompletion:\n\n" + code_block(s.value("completion", "")) +
           "\n";
  }
  return out;
}

RunBoard::RunBoard(const fs::path& run_dir) {
  const auto dir = run_dir / "tb";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir.string() + ": cannot make the TensorBoard folder (" + ec.message() + ")");
  const Shown shown = shown_in(dir);
  for (const auto& e : fs::directory_iterator(dir))
    if (is_event_file(e.path()) && !fs::remove(e.path(), ec))
      throw Error(e.path().string() + ": cannot remove the old TensorBoard events (" + ec.message() + ")");
  writer_ = std::make_unique<EventWriter>(dir);
  const double now = wall_time_now();
  const auto metrics = step_lines(run_dir / "metrics.jsonl");
  for (size_t i = 0; i < metrics.size(); ++i) {
    const int64_t step = metrics[i]["step"].get<int64_t>();
    writer_->scalars(step, scalars_of(metrics[i]), wall_time_of(shown.metrics, i, step, now));
  }
  const auto samples = step_lines(run_dir / "samples.jsonl");
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t step = samples[i]["step"].get<int64_t>();
    writer_->text("samples", step, samples_markdown(samples[i]), wall_time_of(shown.samples, i, step, now));
  }
}

void RunBoard::metrics(const nlohmann::json& line) {
  if (!line.contains("step") || !line["step"].is_number_integer()) return;
  writer_->scalars(line["step"].get<int64_t>(), scalars_of(line), wall_time_now());
}

void RunBoard::samples(const nlohmann::json& line) {
  if (!line.contains("step") || !line["step"].is_number_integer()) return;
  writer_->text("samples", line["step"].get<int64_t>(), samples_markdown(line), wall_time_now());
}

}  // namespace troupe
