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

}  // namespace

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {
  if (!engine_) throw Error("EngineLoop: no engine");
  version_ = engine_->version();
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { stop(); }

std::future<std::vector<Completion>> EngineLoop::submit(std::vector<int32_t> prompt, SamplingParams params) {
  Submission s{std::move(prompt), std::move(params), {}};
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
      return stopping_ || !submitted_.empty() || !updates_.empty() || (!paused_ && engine_->has_work());
    });
    if (stopping_) break;
    auto submissions = std::move(submitted_);
    auto updates = std::move(updates_);
    submitted_.clear();
    updates_.clear();
    const bool step = !paused_;
    stepping_ = step;
    lock.unlock();

    admit(std::move(submissions));
    apply(std::move(updates));
    if (step && engine_->has_work()) {
      try {
        deliver(engine_->step());
      } catch (...) {
        // A failed step leaves the running sequences in an unknown state: fail their requests
        // and drop them from the engine, and keep serving the next ones.
        fail_pending(std::current_exception());
      }
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
      uint64_t id = engine_->add_request(std::move(s.prompt), std::move(s.params));
      pending_.emplace(id, Pending{n, {}, std::move(s.promise)});
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

void EngineLoop::deliver(std::vector<Completion> completions) {
  for (auto& c : completions) {
    auto it = pending_.find(c.request_id);
    if (it == pending_.end()) continue;  // a request already failed (see fail_pending)
    Pending& p = it->second;
    p.done.push_back(std::move(c));
    if (static_cast<int64_t>(p.done.size()) < p.n) continue;
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
