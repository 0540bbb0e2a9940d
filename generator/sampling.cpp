// Next-token selection shared by the plain loop and the engine.
#include "generator/sampling.hpp"

#include <limits>

#include <torch/torch.h>

#include "policy/seed.hpp"

namespace troupe {

torch::Tensor sample_next(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator) {
  if (params.temperature <= 0) return logits.argmax(-1);
  auto probs = (logits.to(torch::kFloat32) / params.temperature).softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, generator).squeeze(-1);
}

torch::Tensor truncate_probs(torch::Tensor probs, const SamplingParams& p) {
  return truncate_rows(probs.unsqueeze(0), {&p}).squeeze(0);
}

// min-p and top-k each keep the tokens at or above a threshold (min_p x the row's largest
// probability; the k-th largest), so together they keep p >= the larger threshold, and one
// descending sort serves them and top-p: top-p then drops, in that order, every token whose
// predecessors' kept mass already reaches top_p x the kept total (the first always stays).
torch::Tensor truncate_rows(torch::Tensor probs, const std::vector<const SamplingParams*>& params) {
  const int64_t R = probs.size(0), V = probs.size(1);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == R, "truncate_rows: ", params.size(), " parameter sets for ", R, " rows");
  std::vector<double> min_p(R), top_p(R);
  std::vector<int64_t> kth(R);
  bool cuts = false;
  for (int64_t r = 0; r < R; ++r) {
    const SamplingParams& p = *params[r];
    min_p[r] = p.min_p > 0 ? p.min_p : 0.0;
    kth[r] = (p.top_k > 0 && p.top_k < V ? p.top_k : V) - 1;
    top_p[r] = p.top_p < 1.0 ? p.top_p : std::numeric_limits<double>::infinity();  // inf: nothing dropped
    cuts = cuts || p.min_p > 0 || kth[r] < V - 1 || p.top_p < 1.0;
  }
  if (!cuts) return probs;
  const auto device = probs.device();
  auto column = [&](const auto& values, torch::ScalarType type) {  // (R, 1) on the device
    return torch::tensor(values, torch::kFloat64).to(type).to(device, /*non_blocking=*/true).unsqueeze(1);
  };
  auto [sorted, order] = probs.sort(/*dim=*/1, /*descending=*/true);  // (R, V)
  auto threshold = torch::maximum(column(min_p, probs.scalar_type()) * sorted.narrow(1, 0, 1),
                                  sorted.gather(1, column(kth, torch::kLong)));  // (R, 1)
  auto keep = sorted >= threshold;
  auto kept = sorted.masked_fill(keep.logical_not(), 0);
  auto before = kept.cumsum(1) - kept;  // mass of the kept tokens ranked above each one
  auto drop = before >= column(top_p, probs.scalar_type()) * kept.sum(1, /*keepdim=*/true);
  drop.narrow(1, 0, 1).fill_(false);  // the most likely token always stays
  keep.logical_and_(drop.logical_not());
  return probs.masked_fill(torch::zeros_like(keep).scatter(1, order, keep).logical_not(), 0);
}

namespace {

// x * m mod 2^32 for 0 <= x, m < 2^32 in int64 without overflow: m in two 16-bit halves.
torch::Tensor mul_mod32(const torch::Tensor& x, uint32_t m) {
  auto high = (x * static_cast<int64_t>(m >> 16)).bitwise_and(0xffff).bitwise_left_shift(16);
  return (x * static_cast<int64_t>(m & 0xffff) + high).bitwise_and(0xffffffffLL);
}

// A 32-bit integer mixer (xorshift-multiply, the "lowbias32" constants) on int64 values in [0, 2^32).
torch::Tensor mix32(torch::Tensor x) {
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = mul_mod32(x, 0x7feb352dU);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = mul_mod32(x, 0x846ca68bU);
  return x.bitwise_xor(x.bitwise_right_shift(16));
}

}  // namespace

torch::Tensor hashed_gumbel(const std::vector<uint64_t>& seeds, const std::vector<int64_t>& counters, int64_t vocab,
                            torch::Device device) {
  TORCH_CHECK(seeds.size() == counters.size(), "hashed_gumbel: ", seeds.size(), " seeds for ", counters.size(), " counters");
  const int64_t R = static_cast<int64_t>(seeds.size());
  std::vector<int64_t> low(R), high(R);
  for (int64_t r = 0; r < R; ++r) {
    const uint64_t key = mix_seed(seeds[r], static_cast<uint64_t>(counters[r]));
    low[r] = static_cast<int64_t>(key & 0xffffffffULL);
    high[r] = static_cast<int64_t>(key >> 32);
  }
  auto longs = torch::TensorOptions().dtype(torch::kLong);
  auto column = [&](const std::vector<int64_t>& v) { return torch::tensor(v, longs).to(device, /*non_blocking=*/true).unsqueeze(1); };
  auto x = torch::arange(vocab, longs.device(device)).unsqueeze(0);  // (1, V)
  x = mix32(mix32(x.bitwise_xor(column(low))).bitwise_xor(column(high)));  // (R, V)
  // 23 bits, centred: (k + 0.5) / 2^23 needs 24 significant bits, so float32 holds it exactly and
  // u is never 0 or 1 (whose noise would be infinite).
  auto u = (x.bitwise_right_shift(9).to(torch::kFloat32) + 0.5f) * (1.0f / 8388608.0f);
  return u.log().neg().log().neg();
}

}  // namespace troupe
