// The engine's own thread: it takes new requests and weight updates only between steps, and
// sleeps on a condition variable when idle or paused. It never retries or reorders requests.
#include "generator/engine_loop.hpp"

#include <algorithm>

#include "policy/error.hpp"

namespace troupe {

namespace {

std::exception_ptr stopped_error() {
  return std::make_exception_ptr(Error("generation engine: stopped before the request finished (server shutting down)"));
}

// vLLM's buckets for the same metrics, so dashboards built for it read troupe's alike.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                         0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kE2eBuckets = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                         30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds) : bounds(std::move(upper_bounds)), counts(bounds.size() + 1, 0) {}

void Histogram::observe(double value) {
  auto at = std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();  // first bound >= value
  ++counts[at];
  sum += value;
  ++count;
}

LoopStats::LoopStats() : time_to_first_token(kTtftBuckets), inter_token_latency(kItlBuckets), e2e_latency(kE2eBuckets) {}

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {
  if (!engine_) throw Error("EngineLoop: no engine");
  version_ = engine_->version();
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { stop(); }

std::future<std::vector<Completion>> EngineLoop::submit(std::vector<int32_t> prompt, SamplingParams params,
                                                    std::shared_ptr<Watch> watch) {
  Submission s{std::move(prompt), std::move(params), {}, std::move(watch), Clock::now()};
  auto future = s.promise.get_future();
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      s.promise.set_exception(stopped_error());
      return future;
    }
    submitted_.push_back(std::move(s));
  }
  wake_.notify_one();
  return future;
}

void EngineLoop::cancel(Watch& watch) {
  watch.cancelled = true;
  {
    std::lock_guard lock(mutex_);
    cancelling_ = true;
  }
  wake_.notify_one();
}

LoopStats EngineLoop::stats() const {
  int64_t queued = 0;
  {
    std::lock_guard lock(mutex_);
    for (const auto& s : submitted_) queued += s.params.n;
  }
  std::lock_guard lock(stats_mutex_);
  LoopStats out = stats_;
  out.waiting += queued;
  return out;
}

void EngineLoop::pause() {
  std::unique_lock lock(mutex_);
  paused_ = true;
  step_ended_.wait(lock, [&] { return !stepping_; });
}

void EngineLoop::resume() {
  {
    std::lock_guard lock(mutex_);
    paused_ = false;
  }
  wake_.notify_one();
}

bool EngineLoop::paused() const {
  std::lock_guard lock(mutex_);
  return paused_;
}

bool EngineLoop::stopped() const {
  std::lock_guard lock(mutex_);
  return stopping_;
}

std::future<void> EngineLoop::update_weights(std::map<std::string, torch::Tensor> weights, int64_t version) {
  Update u{std::move(weights), version, {}};
  auto future = u.promise.get_future();
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      u.promise.set_exception(stopped_error());
      return future;
    }
    updates_.push_back(std::move(u));
  }
  wake_.notify_one();
  return future;
}

void EngineLoop::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  std::lock_guard join_lock(join_mutex_);
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] {
      return stopping_ || cancelling_ || !submitted_.empty() || !updates_.empty() || (!paused_ && engine_->has_work());
    });
    if (stopping_) break;
    cancelling_ = false;
    auto submissions = std::move(submitted_);
    auto updates = std::move(updates_);
    submitted_.clear();
    updates_.clear();
    const bool step = !paused_;
    stepping_ = step;
    lock.unlock();

    admit(std::move(submissions));
    cancel_watched();
    apply(std::move(updates));
    if (step && engine_->has_work()) {
      try {
        auto finished = engine_->step();
        {
          // Before the answers go out: a client may read /metrics as soon as it has its own.
          std::lock_guard stats_lock(stats_mutex_);
          stats_.running = engine_->running();
          stats_.waiting = engine_->waiting();
        }
        deliver(std::move(finished));
        watch_running();
      } catch (...) {
        // A failed step leaves the running sequences in an unknown state: fail their requests
        // and drop them from the engine, and keep serving the next ones.
        fail_pending(std::current_exception());
      }
    }

    {
      std::lock_guard stats_lock(stats_mutex_);
      stats_.running = engine_->running();
      stats_.waiting = engine_->waiting();
    }
    lock.lock();
    stepping_ = false;
    step_ended_.notify_all();
  }
  // Shutting down: nothing more runs, so every waiting caller gets its answer now.
  auto submissions = std::move(submitted_);
  auto updates = std::move(updates_);
  lock.unlock();
  for (auto& s : submissions) s.promise.set_exception(stopped_error());
  for (auto& u : updates) u.promise.set_exception(stopped_error());
  fail_pending(stopped_error());
}

void EngineLoop::admit(std::deque<Submission> submissions) {
  for (auto& s : submissions) {
    try {
      const int64_t n = s.params.n;
      const auto prompt_tokens = static_cast<int64_t>(s.prompt.size());
      uint64_t id = engine_->add_request(std::move(s.prompt), std::move(s.params));
      pending_.emplace(id, Pending{.n = n,
                                  .prompt_tokens = prompt_tokens,
                                  .promise = std::move(s.promise),
                                  .watch = std::move(s.watch),
                                  .submitted = s.submitted,
                                  .clocks = std::vector<SampleClock>(n, SampleClock{.last = s.submitted})});
    } catch (...) {
      s.promise.set_exception(std::current_exception());
    }
  }
}

void EngineLoop::apply(std::deque<Update> updates) {
  for (auto& u : updates) {
    try {
      engine_->update_weights(u.weights, u.version);
      version_ = u.version;
      u.promise.set_value();
    } catch (...) {
      u.promise.set_exception(std::current_exception());
    }
  }
}

void EngineLoop::cancel_watched() {
  for (auto& [id, p] : pending_) {
    if (p.aborted || !p.watch || !p.watch->cancelled) continue;
    engine_->abort(id);
    p.aborted = true;
  }
}

// Latency of the tokens a sample has gained since it was last seen (between two steps, or since
// submit()): they share that time evenly. The request's first token gives the time to first
// token; every later token of a sample, one inter-token latency (a step that admits a sample
// samples two of its tokens: the prefill's and the decode's).
void EngineLoop::observe_tokens(Pending& p, int64_t index, size_t tokens, Clock::time_point now) {
  auto& clock = p.clocks.at(index);
  if (tokens <= clock.tokens) return;
  const double elapsed = std::chrono::duration<double>(now - clock.last).count();
  if (!p.first_token) {
    p.first_token = true;
    stats_.time_to_first_token.observe(std::chrono::duration<double>(now - p.submitted).count());
  }
  const double each = elapsed / static_cast<double>(tokens - clock.tokens);
  for (size_t i = std::max<size_t>(clock.tokens, 1); i < tokens; ++i) stats_.inter_token_latency.observe(each);
  clock = {tokens, now};
}

void EngineLoop::watch_running() {
  const auto now = Clock::now();
  engine_->each_running([&](uint64_t id, int64_t index, const std::vector<int32_t>& ids, const std::vector<float>& logprobs) {
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    Pending& p = it->second;
    {
      std::lock_guard lock(stats_mutex_);
      observe_tokens(p, index, ids.size(), now);
    }
    if (p.watch && p.watch->tokens) p.watch->tokens(index, ids, logprobs);
  });
}

void EngineLoop::deliver(std::vector<Completion> completions) {
  const auto now = Clock::now();
  for (auto& c : completions) {
    auto it = pending_.find(c.request_id);
    if (it == pending_.end()) continue;  // a request already failed (see fail_pending)
    Pending& p = it->second;
    const bool last = static_cast<int64_t>(p.done.size()) + 1 == p.n;
    {
      // Counted before anyone hears of it: a streaming client may read /metrics as soon as its
      // stream ends.
      std::lock_guard lock(stats_mutex_);
      observe_tokens(p, c.index, c.ids.size(), now);
      stats_.generation_tokens += static_cast<int64_t>(c.ids.size());
      ++stats_.finished[finish_reason_name(c.finish_reason)];
      if (last) {
        stats_.prompt_tokens += p.prompt_tokens;
        stats_.e2e_latency.observe(std::chrono::duration<double>(now - p.submitted).count());
      }
    }
    if (p.watch && p.watch->done) p.watch->done(c);
    p.done.push_back(std::move(c));
    if (!last) continue;
    std::sort(p.done.begin(), p.done.end(), [](const Completion& a, const Completion& b) { return a.index < b.index; });
    p.promise.set_value(std::move(p.done));
    pending_.erase(it);
  }
}

void EngineLoop::fail_pending(const std::exception_ptr& error) {
  for (auto& [id, p] : pending_) {
    try {
      engine_->abort(id);
    } catch (...) {
    }
    p.promise.set_exception(error);
  }
  pending_.clear();
}

}  // namespace troupe
