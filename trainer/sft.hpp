// SFT batches: the records of sft_data.hpp packed into rows whose positions restart per
// document, as token tensors. No model and no optimizer here: Trainer::sft_step consumes the batches.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <torch/types.h>

#include "trainer/sft_data.hpp"

namespace troupe::sft {

// Rows of at most max_length tokens, each a list of indices into `sequences`: best-fit
// decreasing (longest first, each into the fullest row it fits), ties by index, so the result
// depends only on the lengths. Throws Error for a sequence longer than max_length.
std::vector<std::vector<int64_t>> pack(std::span<const Sequence> sequences, int64_t max_length);

// Token tensors for the trainer. Row b holds the sequences rows[b] end to end, then padding.
struct Batch {
  torch::Tensor ids;         // [B, T] long, 0 on padding
  torch::Tensor positions;   // [B, T] long, from 0 in each document (attention_mask stops at 0s); 0 on padding
  torch::Tensor token_mask;  // [B, T] long, 1 on real tokens
  torch::Tensor loss_mask;   // [B, T-1] float, 1 where position t's target ids[t+1] is trained; never across documents
  int64_t sequences = 0;     // documents in the batch
  int64_t tokens = 0;        // trained targets: loss_mask.sum()
};
Batch collate(std::span<const Sequence> sequences, std::span<const std::vector<int64_t>> rows);
// One row per sequence, in order.
Batch collate(std::span<const Sequence> sequences);

struct BatchOptions {
  bool packing = true;       // several sequences per row (positions restart per document)
  int64_t max_length = 2048; // tokens per packed row
  int64_t micro_rows = 0;    // rows per micro-batch (forward/backward); 0: one micro-batch
};
// The sequences of one optimizer step as micro-batches, for Trainer::sft_step.
std::vector<Batch> micro_batches(std::span<const Sequence> sequences, const BatchOptions& options);

}  // namespace troupe::sft
