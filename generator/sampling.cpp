// Next-token selection shared by the plain loop and the engine.
#include "generator/sampling.hpp"

#include <torch/torch.h>

namespace troupe {

torch::Tensor sample_next(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator) {
  if (params.temperature <= 0) return logits.argmax(-1);
  auto probs = (logits.to(torch::kFloat32) / params.temperature).softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, generator).squeeze(-1);
}

}  // namespace troupe
