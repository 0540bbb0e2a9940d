// The dashboard: a page with a run's curves (rewards, loss, KL, mismatch, staleness, tokens/s,
// generation against training time), its actor graph (each actor's state and queue) and its
// latest samples, served over HTTP from the files the run writes (metrics.jsonl, status.json,
// samples.jsonl), so a live run and a finished one read alike. `troupe dashboard runs/` serves
// every run under a folder; `troupe run CONFIG run.dashboard=HOST:PORT` serves the run's own
// folder while it runs. The charts are dygraphs, served from Debian's libjs-dygraphs on this
// machine: the page loads nothing from the internet. No LibTorch, no CAF.
#pragma once

#include <filesystem>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe {

class Dashboard {
 public:
  // Serves `root` (a run folder, or a folder of run folders) on host:port (0: any free one).
  // `one_run`: root is the run itself, even before it has written a file (troupe run's own
  // dashboard, up while the model loads). Throws Error naming `key` (e.g. run.dashboard,
  // --listen) when the address cannot be bound (a port in use), or naming `root` when it is not a folder.
  Dashboard(std::filesystem::path root, const std::string& host, int port, const std::string& key, bool one_run = false);
  ~Dashboard();  // stops serving
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  std::string url() const;  // http://HOST:PORT/
  // Serves in a background thread (troupe run), or in this one until the process ends.
  void serve_in_background();
  void serve_here();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
