#include "actors/generator_pool.hpp"

#include <algorithm>
#include <limits>

namespace troupe {

int64_t GeneratorPool::reserve() {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i].live && !slots_[i].reserved && slots_[i].held.empty()) {
      slots_[i] = Slot{};
      slots_[i].reserved = true;
      return static_cast<int64_t>(i);
    }
  slots_.emplace_back();
  slots_.back().reserved = true;
  return static_cast<int64_t>(slots_.size()) - 1;
}

void GeneratorPool::join(int64_t index, generator_actor handle, int64_t pid) {
  auto& s = slots_.at(index);
  s.handle = std::move(handle);
  s.live = true;
  s.reserved = false;
  s.pid = pid;
  s.loaded = -1;
}

GeneratorPool::Sends GeneratorPool::assign(std::vector<PromptItem> prompts) {
  std::map<int64_t, PromptBatch> parts;
  const int64_t n = static_cast<int64_t>(slots_.size());
  for (auto& p : prompts) {
    int64_t target = -1;
    for (int64_t k = 0; k < n && target < 0; ++k) {
      int64_t i = (p.ticket + k) % n;
      if (slots_[i].live) target = i;
    }
    if (target < 0) {
      orphans_.push_back(std::move(p));
      continue;
    }
    slots_[target].held[p.ticket] = p;
    ++slots_[target].handed;
    parts[target].prompts.push_back(std::move(p));
  }
  Sends out;
  for (auto& [i, batch] : parts) out.emplace_back(slots_[i].handle, std::move(batch));
  return out;
}

int64_t GeneratorPool::lose(const caf::actor_addr& who, Sends& resend, std::vector<PromptItem>& given_up) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    if (!s.live || s.handle.address() != who) continue;
    s.live = false;
    std::vector<PromptItem> again;
    for (auto& [ticket, p] : s.held) (++lost_with_[ticket] >= kMaxHolders ? given_up : again).push_back(std::move(p));
    s.held.clear();
    s.handle = nullptr;
    resend = assign(std::move(again));
    return static_cast<int64_t>(i);
  }
  return -1;
}

GeneratorPool::Sends GeneratorPool::take_held() {
  auto held = std::move(orphans_);
  orphans_.clear();
  return assign(std::move(held));
}

void GeneratorPool::done(const std::vector<int64_t>& tickets) {
  for (auto& s : slots_)
    for (int64_t t : tickets) s.held.erase(t);
}

void GeneratorPool::loaded(int64_t index, int64_t version) {
  if (has(index)) slots_[index].loaded = std::max(slots_[index].loaded, version);
}

int64_t GeneratorPool::oldest_loaded() const {
  int64_t oldest = std::numeric_limits<int64_t>::max();
  for (const auto& s : slots_)
    if (s.live) oldest = std::min(oldest, s.loaded);
  return oldest;
}

int64_t GeneratorPool::live() const {
  return std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.live; });
}

int64_t GeneratorPool::unfinished() const {
  int64_t n = static_cast<int64_t>(orphans_.size());
  for (const auto& s : slots_) n += static_cast<int64_t>(s.held.size());
  return n;
}

std::vector<int64_t> GeneratorPool::take_handed() {
  std::vector<int64_t> out;
  for (auto& s : slots_) {
    out.push_back(s.handed);
    s.handed = 0;
  }
  return out;
}

}  // namespace troupe
