// Perplexity of a model over a list of texts: exp of the mean negative log-likelihood of
// every token after the first of each text, texts batched with right padding, shortest first
// (texts of like length share a batch, so that little of it is padding).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "policy/tokenizer.hpp"
#include "policy/transformer.hpp"

namespace troupe {

struct PerplexityResult {
  double perplexity = 0;
  double mean_nll = 0;  // nats per predicted token
  int64_t tokens = 0;   // predicted tokens counted
};

// Texts longer than max_length tokens are cut to max_length.
PerplexityResult perplexity(TransformerImpl& model, const Tokenizer& tokenizer, const std::vector<std::string>& texts,
                            int64_t batch_size = 8, int64_t max_length = 1024);

}  // namespace troupe
