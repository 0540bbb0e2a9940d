// A thread-safe front for Engine: one background thread owns the engine and steps it while
// it has work; any thread submits requests and gets futures. No HTTP and no disk IO here.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "generator/engine.hpp"

namespace troupe {

// A latency histogram as Prometheus keeps one: counts per upper bound (not cumulative here),
// the sum and the count of what was observed.
struct Histogram {
  std::vector<double> bounds;   // upper bounds, increasing; +Inf is implied after the last
  std::vector<int64_t> counts;  // [bounds + 1] observations in (bounds[i-1], bounds[i]]
  double sum = 0;
  int64_t count = 0;
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
};

// What the loop has done since it started, for troupe serve's /metrics (vLLM's metrics).
struct LoopStats {
  int64_t running = 0;            // sequences in decode slots
  int64_t waiting = 0;            // samples queued for a slot (submitted or in the engine's queue)
  int64_t prompt_tokens = 0;      // of finished requests, once per request (as usage counts them)
  int64_t generation_tokens = 0;  // of finished samples, aborted ones included
  std::map<std::string, int64_t> finished;  // samples by finish reason: stop, length, abort
  Histogram time_to_first_token;  // seconds from submit() to a request's first token
  Histogram inter_token_latency;  // seconds between two tokens of one sample
  Histogram e2e_latency;          // seconds from submit() to a request's last completion
  LoopStats();
};

class EngineLoop {
 public:
  // A request's live view, for streaming. After every step the loop thread calls `tokens` for
  // each of the request's samples still running, with its ids and log-probs so far, and `done`
  // with each sample as it finishes (before the future, which waits for all n): copy what is
  // new and return, the whole batch waits meanwhile.
  struct Watch {
    std::function<void(int64_t index, const std::vector<int32_t>& ids, const std::vector<float>& logprobs)> tokens;
    std::function<void(const Completion&)> done;
    std::atomic<bool> cancelled{false};
  };

  explicit EngineLoop(std::unique_ptr<Engine> engine);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request. The future yields its n completions ordered by index; it throws the
  // Error of Engine::add_request (invalid parameters), or Error when the loop stops first.
  // Requests submitted together share the engine's batch.
  // `watch`, when given, sees the request's tokens while it runs (see Watch).
  std::future<std::vector<Completion>> submit(std::vector<int32_t> prompt, SamplingParams params,
                                              std::shared_ptr<Watch> watch = nullptr);
  // Aborts a watched request at the loop's next turn (a client that went away): its slots free
  // at once, and its future yields its samples with FinishReason::abort after the next step.
  void cancel(Watch& watch);

  LoopStats stats() const;

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
  using Clock = std::chrono::steady_clock;
  struct Submission {
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::promise<std::vector<Completion>> promise;
    std::shared_ptr<Watch> watch;
    Clock::time_point submitted;
  };
  struct Update {
    std::map<std::string, torch::Tensor> weights;
    int64_t version;
    std::promise<void> promise;
  };
  struct SampleClock {
    size_t tokens = 0;          // tokens seen so far
    Clock::time_point last;     // when the last of them was seen
  };
  struct Pending {
    int64_t n;
    int64_t prompt_tokens;
    std::vector<Completion> done;
    std::promise<std::vector<Completion>> promise;
    std::shared_ptr<Watch> watch;
    Clock::time_point submitted;
    bool first_token = false;         // time_to_first_token observed
    bool aborted = false;             // cancel() reached the engine
    std::vector<SampleClock> clocks;  // [n]
  };

  void run();
  void admit(std::deque<Submission> submissions);
  void apply(std::deque<Update> updates);
  void cancel_watched();
  void deliver(std::vector<Completion> completions);
  void observe_tokens(Pending& p, int64_t index, size_t tokens, Clock::time_point now);  // stats_mutex_ held
  void watch_running();
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
  bool cancelling_ = false;             // guarded by mutex_: a cancel() waits for the loop
  std::map<uint64_t, Pending> pending_; // loop thread only: request id -> its promise
  std::atomic<int64_t> version_{0};
  mutable std::mutex stats_mutex_;
  LoopStats stats_;                     // guarded by stats_mutex_
  std::mutex join_mutex_;               // stop() may race with the destructor; one joins
  std::thread thread_;
};

}  // namespace troupe
