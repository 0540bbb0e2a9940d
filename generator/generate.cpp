// The plain generation loop. One sequence, no padding, so masks are implicit: causal for the
// prefill, everything-so-far for each decode step.
#include "generator/generate.hpp"

#include <algorithm>

#include <torch/torch.h>

#include "policy/error.hpp"

namespace troupe {

GenerateResult generate(TransformerImpl& model, std::span<const int32_t> prompt, const SamplingParams& params,
                        std::span<const int32_t> stop_ids, const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw Error("generate: the prompt is empty");
  torch::NoGradGuard no_grad;
  auto weight = model.lm_head_weight();
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(weight.device());
  const int64_t n = static_cast<int64_t>(prompt.size());
  auto cache = KVCache::allocate(model.config(), 1, n + params.max_tokens, weight.options());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(params.seed.value_or(0));

  auto ids = torch::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), opts).unsqueeze(0);  // (1, n)
  auto positions = torch::arange(n, opts).unsqueeze(0);
  GenerateResult result;
  for (int64_t step = 0; step < params.max_tokens; ++step) {
    auto hidden = model.forward(ids, positions, {}, &cache);          // (1, T, H)
    auto logits = model.logits(hidden.select(1, hidden.size(1) - 1));  // (1, V)
    auto next = sample_next(logits.cpu(), params, gen);
    auto id = static_cast<int32_t>(next.item<int64_t>());
    result.ids.push_back(id);
    if (on_token) on_token(id);
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) {
      result.stopped = true;
      break;
    }
    ids = next.view({1, 1}).to(opts);
    positions = torch::full({1, 1}, cache.length, opts);
  }
  return result;
}

}  // namespace troupe
