// A thread-safe front for Engine: one background thread owns the engine and steps it while
// it has work; any thread submits requests and gets futures. No HTTP and no disk IO here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "generator/engine.hpp"

namespace troupe {

class EngineLoop {
 public:
  explicit EngineLoop(std::unique_ptr<Engine> engine);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request. The future yields its n completions ordered by index; it throws the
  // Error of Engine::add_request (invalid parameters), or Error when the loop stops first.
  // Requests submitted together share the engine's batch.
  std::future<std::vector<Completion>> submit(std::vector<int32_t> prompt, SamplingParams params);

  // While paused no step runs: running sequences keep their slots, new requests queue.
  // pause() returns once the step in progress (if any) has finished.
  void pause();
  void resume();
  bool paused() const;

  // Copies the weights in between two steps (also while paused) and sets the policy version;
  // the future throws Engine::update_weights' Error (unknown name, wrong shape), nothing copied.
  std::future<void> update_weights(std::map<std::string, torch::Tensor> weights, int64_t version);
  int64_t version() const { return version_.load(); }

  // Fails every unfinished request (its future throws Error), then joins the thread. The step
  // in progress finishes first; later calls and submissions are no-ops that fail at once.
  void stop();
  bool stopped() const;

  // Fixed after construction, so safe to read from any thread.
  const ModelConfig& config() const { return engine_->config(); }
  const EngineOptions& options() const { return engine_->options(); }
  const std::optional<Tokenizer>& tokenizer() const { return engine_->tokenizer(); }

 private:
  struct Submission {
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::promise<std::vector<Completion>> promise;
  };
  struct Update {
    std::map<std::string, torch::Tensor> weights;
    int64_t version;
    std::promise<void> promise;
  };
  struct Pending {
    int64_t n;
    std::vector<Completion> done;
    std::promise<std::vector<Completion>> promise;
  };

  void run();
  void admit(std::deque<Submission> submissions);
  void apply(std::deque<Update> updates);
  void deliver(std::vector<Completion> completions);
  void fail_pending(const std::exception_ptr& error);

  std::unique_ptr<Engine> engine_;  // touched only by the loop thread once it runs
  mutable std::mutex mutex_;
  std::condition_variable wake_;        // the loop thread waits here when there is nothing to do
  std::condition_variable step_ended_;  // pause() waits here for the step in progress
  std::deque<Submission> submitted_;    // guarded by mutex_
  std::deque<Update> updates_;          // guarded by mutex_
  bool paused_ = false;                 // guarded by mutex_
  bool stepping_ = false;               // guarded by mutex_
  bool stopping_ = false;               // guarded by mutex_
  std::map<uint64_t, Pending> pending_; // loop thread only: request id -> its promise
  std::atomic<int64_t> version_{0};
  std::mutex join_mutex_;               // stop() may race with the destructor; one joins
  std::thread thread_;
};

}  // namespace troupe
