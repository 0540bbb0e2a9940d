// Reference log-probs with their on-disk cache, and the sigmoid DPO loss (the pairs are read
// in dpo_data.cpp). The policy's forward pass and the optimizer step live in trainer.cpp.
#include "trainer/dpo.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "kernels/logprobs.hpp"
#include "policy/error.hpp"
#include "policy/transformer.hpp"

namespace troupe::dpo {
namespace {

constexpr const char* kCacheFormat = "troupe-dpo-reference";
constexpr int kCacheVersion = 1;

// FNV-1a over every pair's ids and masks: the cache's key to the data it was computed on.
std::string fingerprint(std::span<const Pair> pairs) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& p : pairs)
    for (const auto* s : {&p.chosen, &p.rejected}) {
      mix(s->ids.size());
      for (size_t i = 0; i < s->ids.size(); ++i) mix((static_cast<uint64_t>(s->ids[i]) << 1) | s->loss_mask[i]);
    }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

bool read_cache(const std::filesystem::path& file, std::span<Pair> pairs, const ReferenceOptions& o) {
  std::ifstream in(file);
  if (!in) return false;
  const std::string name = file.string();
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || j.value("format", nlohmann::json()) != kCacheFormat)
    throw Error(name + ": not a troupe DPO reference cache (delete it, or point the cache elsewhere)");
  if (j.value("version", nlohmann::json()) != kCacheVersion)
    throw Error(name + ": reference cache version " + j.value("version", nlohmann::json()).dump() + ", expected " +
                std::to_string(kCacheVersion) + " (delete it to recompute)");
  try {
    const auto fp = fingerprint(pairs);
    const std::string cached_fp = j.value("fingerprint", ""), cached_model = j.value("model_id", "");
    const nlohmann::json count = j.value("pairs", nlohmann::json());
    if (!count.is_number_unsigned())
      throw Error(name + ": the reference cache's pairs is " + count.dump() + ", expected a count; delete it to recompute");
    const size_t cached_pairs = count.get<size_t>();
    if (cached_pairs != pairs.size() || cached_fp != fp || cached_model != o.model_id)
      throw Error(name + ": the reference cache was computed for " + std::to_string(cached_pairs) +
                  " pairs (fingerprint " + cached_fp + ", model '" + cached_model + "'), but these are " +
                  std::to_string(pairs.size()) + " pairs (fingerprint " + fp + ", model '" + o.model_id +
                  "'); delete the file to recompute, or use another cache path");
    const auto& chosen = j.at("chosen");
    const auto& rejected = j.at("rejected");
    if (!chosen.is_array() || !rejected.is_array() || chosen.size() != pairs.size() || rejected.size() != pairs.size())
      throw Error(name + ": the reference cache's chosen/rejected lists do not hold one value per pair");
    for (size_t i = 0; i < pairs.size(); ++i) {
      if (!chosen[i].is_number() || !rejected[i].is_number())
        throw Error(name + ": the reference cache's value for pair " + std::to_string(i) + " is not a number");
      pairs[i].ref_chosen = chosen[i].get<double>();
      pairs[i].ref_rejected = rejected[i].get<double>();
    }
  } catch (const nlohmann::json::exception& e) {  // a field of another type than the writer's
    throw Error(name + ": not a troupe DPO reference cache (" + e.what() + "); delete it to recompute");
  }
  return true;
}

void write_cache(const std::filesystem::path& file, std::span<const Pair> pairs, const ReferenceOptions& o) {
  nlohmann::json j{{"format", kCacheFormat}, {"version", kCacheVersion}, {"pairs", pairs.size()},
                   {"fingerprint", fingerprint(pairs)}, {"model_id", o.model_id}};
  auto& chosen = j["chosen"] = nlohmann::json::array();
  auto& rejected = j["rejected"] = nlohmann::json::array();
  for (const auto& p : pairs) {
    chosen.push_back(p.ref_chosen);
    rejected.push_back(p.ref_rejected);
  }
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  // Written beside and renamed, so an interrupted run never leaves half a cache.
  auto tmp = file;
  tmp += ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump() << "\n";
    if (!out) throw Error(tmp.string() + ": cannot write the reference cache");
  }
  std::filesystem::rename(tmp, file);
}

}  // namespace

std::vector<double> sequence_logprobs(TransformerImpl& model, std::span<const sft::Sequence> sequences,
                                      int64_t batch_size, int64_t chunk) {
  torch::NoGradGuard no_grad;
  const auto device = model.lm_head_weight().device();
  const int64_t N = sequences.size(), per = std::max<int64_t>(batch_size, 1);
  std::vector<double> out;
  out.reserve(N);
  for (int64_t s = 0; s < N; s += per) {
    auto batch = sft::collate(sequences.subspan(s, std::min(per, N - s)));
    const int64_t T = batch.ids.size(1);
    if (T < 2) {  // a single token has no target
      out.insert(out.end(), batch.ids.size(0), 0.0);
      continue;
    }
    auto ids = batch.ids.to(device);
    auto positions = batch.positions.to(device);
    auto hidden = model.forward(ids, positions, attention_mask_unless_causal(batch.token_mask.to(device), positions));  // (B, T, H)
    auto logp = kernels::token_logprobs(hidden.narrow(1, 0, T - 1), model.lm_head_weight(), ids.narrow(1, 1, T - 1),
                                        1.0, chunk);                                                       // (B, T-1)
    auto sums = (logp.to(torch::kFloat64) * batch.loss_mask.to(device, torch::kFloat64)).sum(1).cpu();
    auto a = sums.accessor<double, 1>();
    for (int64_t i = 0; i < a.size(0); ++i) out.push_back(a[i]);
  }
  return out;
}

void compute_reference(TransformerImpl& reference, std::span<Pair> pairs, const ReferenceOptions& o) {
  if (!o.cache.empty() && read_cache(o.cache, pairs, o)) return;
  const bool was_training = reference.is_training();
  reference.eval();
  // Chosen and rejected of the same pairs side by side in one forward pass, as TRL's
  // concatenated_forward does.
  std::vector<sft::Sequence> seqs;
  seqs.reserve(2 * pairs.size());
  for (const auto& p : pairs) seqs.push_back(p.chosen);
  for (const auto& p : pairs) seqs.push_back(p.rejected);
  auto sums = sequence_logprobs(reference, seqs, 2 * o.batch_pairs, o.chunk);
  for (size_t i = 0; i < pairs.size(); ++i) {
    pairs[i].ref_chosen = sums[i];
    pairs[i].ref_rejected = sums[pairs.size() + i];
  }
  reference.train(was_training);
  if (!o.cache.empty()) write_cache(o.cache, pairs, o);
}

LossOutput loss(const LossInputs& in, const LossConfig& c) {
  TORCH_CHECK(in.chosen.dim() == 1 && in.rejected.sizes() == in.chosen.sizes() &&
                  in.ref_chosen.sizes() == in.chosen.sizes() && in.ref_rejected.sizes() == in.chosen.sizes(),
              "dpo loss: chosen ", in.chosen.sizes(), ", rejected ", in.rejected.sizes(), ", ref_chosen ",
              in.ref_chosen.sizes(), " and ref_rejected ", in.ref_rejected.sizes(), " must all be [B]");
  TORCH_CHECK(c.label_smoothing >= 0 && c.label_smoothing < 0.5, "dpo loss: label_smoothing must be in [0, 0.5), got ",
              c.label_smoothing);
  const auto ref_c = in.ref_chosen.to(in.chosen.dtype()).detach();
  const auto ref_r = in.ref_rejected.to(in.chosen.dtype()).detach();
  const auto chosen_ratio = in.chosen - ref_c;        // (B) log pi/pi_ref of the chosen response
  const auto rejected_ratio = in.rejected - ref_r;    // (B)
  const auto h = chosen_ratio - rejected_ratio;       // (B)
  const double ls = c.label_smoothing;
  auto losses = -(1 - ls) * torch::log_sigmoid(c.beta * h) - ls * torch::log_sigmoid(-c.beta * h);

  LossOutput out;
  out.loss = losses.mean();
  const auto reward_c = (c.beta * chosen_ratio).detach().to(torch::kFloat64);
  const auto reward_r = (c.beta * rejected_ratio).detach().to(torch::kFloat64);
  out.reward_chosen = reward_c.mean().item<double>();
  out.reward_rejected = reward_r.mean().item<double>();
  out.accuracy = (reward_c > reward_r).to(torch::kFloat64).mean().item<double>();
  out.margin = (reward_c - reward_r).mean().item<double>();
  out.logps_chosen = in.chosen.detach().to(torch::kFloat64).mean().item<double>();
  out.logps_rejected = in.rejected.detach().to(torch::kFloat64).mean().item<double>();
  return out;
}

}  // namespace troupe::dpo
