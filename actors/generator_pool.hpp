// The controller's view of its generators: which are live, which prompts each holds until they
// are trained or reported failed, and where the next prompts go. A generator that goes away
// (its worker process killed, hung past the heartbeat timeout, or leaving) hands its unfinished
// prompts back: they go to the live generators, or are held until one joins. Generators can
// join at any time (a dead one's slot is reused first). Plain data, no messaging.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "actors/protocol.hpp"

namespace troupe {

class GeneratorPool {
 public:
  struct Slot {
    generator_actor handle;
    bool live = false;
    bool reserved = false;  // promised to a worker that is still building its generator
    int64_t pid = 0;      // its worker process; 0: in the run's own process
    bool remote() const { return pid != 0; }  // in a worker process: its loss is survivable
    int64_t loaded = -1;  // the newest weight version it has loaded
    int64_t handed = 0;   // prompts handed to it since the last report
    std::map<int64_t, PromptItem> held;  // ticket -> prompt, until trained or failed
  };
  using Sends = std::vector<std::pair<generator_actor, PromptBatch>>;

  // A slot for a generator about to join (a dead slot is reused first); returns its index.
  int64_t reserve();
  void join(int64_t index, generator_actor handle, int64_t pid);
  // Each prompt goes to generator (ticket mod slots) when that one is live, else to the next
  // live one; with none live the prompts are held for the next to join.
  Sends assign(std::vector<PromptItem> prompts);
  // The generator behind `who` went away: its unfinished prompts are assigned anew, except those
  // that have now gone down with kMaxHolders generators (a prompt that kills whoever takes it):
  // those are given up. Returns its index, or -1 when `who` is none of the pool's.
  static constexpr int kMaxHolders = 3;
  int64_t lose(const caf::actor_addr& who, Sends& resend, std::vector<PromptItem>& given_up);
  // What was held while no generator was live, for one that just joined.
  Sends take_held();
  void done(const std::vector<int64_t>& tickets);
  void loaded(int64_t index, int64_t version);
  // The oldest version a live generator holds (-1 while one has loaded none).
  int64_t oldest_loaded() const;

  const std::vector<Slot>& slots() const { return slots_; }
  int64_t live() const;
  int64_t unfinished() const;  // prompts held by generators or by the pool
  bool has(int64_t index) const { return index >= 0 && index < static_cast<int64_t>(slots_.size()); }
  Slot& at(int64_t index) { return slots_.at(index); }
  // Prompts handed to each slot since the last call, and the counters reset.
  std::vector<int64_t> take_handed();

 private:
  std::vector<Slot> slots_;
  std::vector<PromptItem> orphans_;  // held while no generator is live
  std::map<int64_t, int> lost_with_;  // ticket -> generators that went away holding it
};

}  // namespace troupe
