#include "actors/actor_util.hpp"
#include "actors/stage_actors.hpp"
#include "policy/error.hpp"

namespace troupe {

namespace {

data_actor::behavior_type data(data_actor::pointer self, PromptSourceFn next_prompts, int64_t first_ticket) {
  name_failures(self, "data");
  auto next_ticket = std::make_shared<int64_t>(first_ticket);
  return {[=](next_atom, int64_t n, int64_t batch) {
    PromptBatch out{next_prompts(n)};
    if (static_cast<int64_t>(out.prompts.size()) != n)
      throw Error("the data source returned " + std::to_string(out.prompts.size()) + " prompts, " + std::to_string(n) +
                  " were asked for");
    for (int64_t i = 0; i < n; ++i) {
      out.prompts[i].batch = batch;
      out.prompts[i].ticket = (*next_ticket)++;
    }
    return out;
  }};
}

}  // namespace

data_actor spawn_data(caf::actor_system& system, PromptSourceFn next_prompts, int64_t first_ticket) {
  return system.spawn<caf::detached>(data, std::move(next_prompts), first_ticket);
}

}  // namespace troupe
