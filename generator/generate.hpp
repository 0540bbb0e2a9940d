// A plain one-sequence generation loop over a KV cache: prefill the prompt, then one token
// at a time. The batched engine with continuous batching builds on the same pieces.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "generator/sampling.hpp"
#include "policy/transformer.hpp"

namespace troupe {

struct GenerateResult {
  std::vector<int32_t> ids;  // completion only, the stop token included when one was hit
  bool stopped = false;      // true: a stop token ended it; false: max_tokens did
};

// `on_token` (optional) sees each new token as soon as it is chosen.
GenerateResult generate(TransformerImpl& model, std::span<const int32_t> prompt, const SamplingParams& params,
                        std::span<const int32_t> stop_ids,
                        const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace troupe
