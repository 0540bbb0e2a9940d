// What the tests that drive `troupe run` share: the command line, a run's metrics.jsonl, the
// largest weight difference between two checkpoints' safetensors files, and a free port.
#pragma once

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

namespace troupe::test {

// `troupe run configs/CONFIG.yaml ARGS` from the source folder (as the README runs it).
inline std::string troupe_run(const std::string& config, const std::string& args) {
  return "cd " + shell_quote(source().string()) + " && exec " + shell_quote(env_dir("TROUPE_BIN").string()) +
         " run configs/" + config + ".yaml " + args;
}

// Every line of DIR/metrics.jsonl parsed; a torn line fails the parse.
inline std::vector<nlohmann::json> metrics(const std::filesystem::path& dir) {
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The lines of DIR/metrics.jsonl a running writer has finished, each ending in a newline,
// unparsed: while it writes, a reader can catch it mid-line, which metrics() rightly refuses as
// torn. For polling a live run; metrics() once it has stopped.
inline size_t steps_written(const std::filesystem::path& dir) {
  std::ifstream in(dir / "metrics.jsonl", std::ios::binary);
  return static_cast<size_t>(std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n'));
}

// Largest |a - b| over every float32 tensor of two safetensors files.
inline double max_diff(const std::filesystem::path& a, const std::filesystem::path& b) {
  auto fa = safetensors::File::open(a), fb = safetensors::File::open(b);
  double worst = 0;
  REQUIRE(fa->tensors().size() == fb->tensors().size());
  for (const auto& ta : fa->tensors()) {
    const auto& tb = fb->at(ta.name);
    REQUIRE(ta.nbytes == tb.nbytes);
    REQUIRE(ta.dtype == safetensors::Dtype::F32);
    for (size_t i = 0; i < ta.nbytes / 4; ++i) {
      float x, y;
      std::memcpy(&x, ta.data + 4 * i, 4);
      std::memcpy(&y, tb.data + 4 * i, 4);
      worst = std::max(worst, static_cast<double>(std::fabs(x - y)));
    }
  }
  return worst;
}

// A port free on loopback now (for a launcher's rendezvous).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace troupe::test
