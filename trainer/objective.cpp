// trainer.loss.objective's table: each name in rl_options.hpp finds its function here.
#include "trainer/objective.hpp"

#include <torch/torch.h>

namespace troupe::objective {

namespace {
struct Entry {
  rl::Objective which;
  Terms (*fn)(const Inputs&);
};
constexpr Entry kTable[] = {{rl::Objective::grpo, &grpo}, {rl::Objective::gspo, &gspo}, {rl::Objective::cispo, &cispo}};
}  // namespace

Terms compute(rl::Objective which, const Inputs& in) {
  TORCH_CHECK(in.logprobs.sizes() == in.mask.sizes() && in.prox.sizes() == in.mask.sizes(), "objective ",
              to_string(which), ": logprobs ", in.logprobs.sizes(), " and prox ", in.prox.sizes(), " must be [B, L] like the mask ",
              in.mask.sizes());
  TORCH_CHECK(in.advantages.dim() == 2 && in.advantages.size(0) == in.mask.size(0) &&
                  (in.advantages.size(1) == 1 || in.advantages.size(1) == in.mask.size(1)),
              "objective ", to_string(which), ": advantages ", in.advantages.sizes(), " must be [B, 1] or [B, L] with [B, L] = ",
              in.mask.sizes());
  for (const auto& e : kTable)
    if (e.which == which) return e.fn(in);
  TORCH_CHECK(false, "objective: no function for ", to_string(which));
}

}  // namespace troupe::objective
