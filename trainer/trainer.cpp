// Batches rollouts into right-padded token tensors, computes log-probs chunk by chunk
// (kernels/logprobs) and applies the GRPO or SFT loss. Sharding and activation
// checkpointing are applied from outside; this file trains one replica.
#include "trainer/trainer.hpp"

#include <cmath>
#include <numbers>

#include <torch/torch.h>

#include "kernels/logprobs.hpp"
#include "policy/error.hpp"

namespace troupe {
namespace {

// Sequences as prompt + completion, right-padded; per-position targets and masks so that
// position t predicts token t + 1.
struct Packed {
  torch::Tensor ids;          // (B, T)
  torch::Tensor token_mask;   // (B, T) 1 on real tokens
  torch::Tensor loss_mask;    // (B, T-1) 1 where the target is a completion token
  torch::Tensor behaviour;    // (B, T-1) log mu of the target, 0 elsewhere
  torch::Tensor reference;    // (B, T-1) log pi_ref of the target, or undefined
};

Packed pack(const std::vector<std::pair<const std::vector<int32_t>*, const std::vector<int32_t>*>>& seqs,
            const std::vector<const std::vector<float>*>& behaviour, const std::vector<const std::vector<float>*>& reference) {
  const int64_t B = seqs.size();
  int64_t T = 0;
  for (auto [p, c] : seqs) T = std::max<int64_t>(T, p->size() + c->size());
  auto ids = torch::zeros({B, T}, torch::kLong);
  auto token_mask = torch::zeros({B, T}, torch::kLong);
  auto loss_mask = torch::zeros({B, std::max<int64_t>(T - 1, 0)}, torch::kFloat32);
  auto mu = torch::zeros_like(loss_mask);
  bool with_ref = !reference.empty() && reference[0] && !reference[0]->empty();
  auto ref = with_ref ? torch::zeros_like(loss_mask) : torch::Tensor();
  auto ids_a = ids.accessor<int64_t, 2>();
  auto tm_a = token_mask.accessor<int64_t, 2>();
  auto lm_a = loss_mask.accessor<float, 2>();
  auto mu_a = mu.accessor<float, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const auto& prompt = *seqs[b].first;
    const auto& completion = *seqs[b].second;
    const int64_t P = prompt.size(), L = completion.size();
    for (int64_t t = 0; t < P; ++t) ids_a[b][t] = prompt[t];
    for (int64_t t = 0; t < L; ++t) {
      ids_a[b][P + t] = completion[t];
      lm_a[b][P + t - 1] = 1;  // position P+t-1 predicts completion token t
      if (!behaviour.empty() && behaviour[b]) mu_a[b][P + t - 1] = (*behaviour[b])[t];
      if (with_ref) ref[b][P + t - 1] = (*reference[b])[t];
    }
    for (int64_t t = 0; t < P + L; ++t) tm_a[b][t] = 1;
  }
  return {ids, token_mask, loss_mask, mu, ref};
}

// log pi(target) for every position of the packed batch: (B, T-1)
torch::Tensor sequence_logprobs(TransformerImpl& model, const Packed& p, int64_t chunk) {
  auto device = model.lm_head_weight().device();
  auto ids = p.ids.to(device);
  auto token_mask = p.token_mask.to(device);
  auto positions = positions_from_mask(token_mask);
  auto hidden = model.forward(ids, positions, attention_mask(token_mask, positions));  // (B, T, H)
  const int64_t T = ids.size(1);
  return kernels::token_logprobs(hidden.narrow(1, 0, T - 1), model.lm_head_weight(), ids.narrow(1, 1, T - 1),
                                 /*temperature=*/1.0, chunk);
}

}  // namespace

std::vector<std::vector<float>> completion_logprobs(TransformerImpl& model, const RolloutGroup& group, int64_t chunk) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<const std::vector<int32_t>*, const std::vector<int32_t>*>> seqs;
  for (const auto& c : group.completion_ids) seqs.push_back({&group.prompt_ids, &c});
  auto packed = pack(seqs, {}, {});
  auto logp = sequence_logprobs(model, packed, chunk).cpu();  // (G, T-1)
  std::vector<std::vector<float>> out;
  const int64_t P = group.prompt_ids.size();
  for (size_t i = 0; i < group.completion_ids.size(); ++i) {
    const int64_t L = group.completion_ids[i].size();
    auto row = logp[i].narrow(0, P - 1, L).contiguous();
    out.emplace_back(row.data_ptr<float>(), row.data_ptr<float>() + L);
  }
  return out;
}

Trainer::Trainer(Transformer model, TrainerConfig config) : model_(std::move(model)), config_(config) {
  if (config_.num_iterations < 1) throw Error("trainer: num_iterations must be at least 1");
  const auto& o = config_.optimizer;
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      model_->parameters(),
      torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  model_->train();
}

Trainer::~Trainer() = default;

double Trainer::lr_at(int64_t step) const {
  const auto& o = config_.optimizer;
  if (o.warmup_steps > 0 && step < o.warmup_steps) return o.lr * (step + 1) / static_cast<double>(o.warmup_steps);
  if (o.total_steps <= o.warmup_steps) return o.lr;
  double progress = std::min(1.0, (step - o.warmup_steps) / static_cast<double>(o.total_steps - o.warmup_steps));
  double cosine = 0.5 * (1 + std::cos(std::numbers::pi * progress));
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine);
}

double Trainer::finish_step() {
  double norm = 0;
  if (config_.optimizer.max_grad_norm > 0) {
    norm = torch::nn::utils::clip_grad_norm_(model_->parameters(), config_.optimizer.max_grad_norm);
  } else {
    for (const auto& p : model_->parameters())
      if (p.grad().defined()) norm += p.grad().pow(2).sum().item<double>();
    norm = std::sqrt(norm);
  }
  double lr = lr_at(version_);
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  optimizer_->step();
  optimizer_->zero_grad();
  ++version_;
  return norm;
}

StepMetrics Trainer::grpo_step(const std::vector<RolloutGroup>& groups) {
  if (groups.empty()) throw Error("trainer: grpo_step needs at least one rollout group");
  const int64_t G = groups[0].size();
  std::vector<std::pair<const std::vector<int32_t>*, const std::vector<int32_t>*>> seqs;
  std::vector<const std::vector<float>*> behaviour, reference;
  std::vector<double> rewards;
  std::vector<float> keep;
  for (const auto& g : groups) {
    if (g.size() != G || static_cast<int64_t>(g.reward.size()) != G || static_cast<int64_t>(g.behaviour_logprobs.size()) != G)
      throw Error("trainer: every rollout group needs the same group size with a reward and log-probs per completion");
    for (int64_t i = 0; i < G; ++i) {
      if (g.behaviour_logprobs[i].size() != g.completion_ids[i].size())
        throw Error("trainer: prompt " + std::to_string(g.prompt_id) + " completion " + std::to_string(i) +
                    " has " + std::to_string(g.completion_ids[i].size()) + " tokens but " +
                    std::to_string(g.behaviour_logprobs[i].size()) + " log-probs");
      seqs.push_back({&g.prompt_ids, &g.completion_ids[i]});
      behaviour.push_back(&g.behaviour_logprobs[i]);
      reference.push_back(g.reference_logprobs.empty() ? nullptr : &g.reference_logprobs[i]);
      rewards.push_back(g.reward[i]);
      bool truncated = i < static_cast<int64_t>(g.truncated.size()) && g.truncated[i];
      keep.push_back(config_.mask_truncated_completions && truncated ? 0.f : 1.f);
    }
  }
  if (config_.loss.beta > 0 && (reference.empty() || !reference[0]))
    throw Error("trainer: beta > 0 but the rollouts carry no reference log-probs");
  const int64_t B = seqs.size();
  auto reward_t = torch::tensor(rewards, torch::kFloat64).view({-1, G});
  auto adv = grpo::advantages(reward_t, config_.scale_rewards).view({B});
  auto packed = pack(seqs, behaviour, config_.loss.beta > 0 ? reference : std::vector<const std::vector<float>*>{});
  packed.loss_mask *= torch::tensor(keep).unsqueeze(1);

  const int64_t micro = config_.micro_batch > 0 ? config_.micro_batch : B;
  auto device = model_->lm_head_weight().device();
  auto slice = [&](const torch::Tensor& t, int64_t start, int64_t len) {
    return t.defined() ? t.narrow(0, start, len).to(device) : torch::Tensor();
  };
  // The proximal policy is the weights at the start of the step. With one pass they are the
  // current weights, so log pi_prox is simply log pi_theta detached, and no extra forward runs.
  torch::Tensor prox;
  if (config_.num_iterations > 1) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> parts;
    for (int64_t s = 0; s < B; s += micro) {
      int64_t len = std::min(micro, B - s);
      Packed part{packed.ids.narrow(0, s, len), packed.token_mask.narrow(0, s, len), {}, {}, {}};
      parts.push_back(sequence_logprobs(*model_, part, config_.logprob_chunk));
    }
    prox = torch::cat(parts, 0);
  }

  const double total_tokens = packed.loss_mask.sum().item<double>();
  StepMetrics m;
  m.sequences = B;
  m.reward_mean = reward_t.mean().item<double>();
  for (int64_t iter = 0; iter < config_.num_iterations; ++iter) {
    double loss_sum = 0, kl_sum = 0, clip_sum = 0, weight_sum = 0;
    for (int64_t s = 0; s < B; s += micro) {
      const int64_t len = std::min(micro, B - s);
      Packed part{packed.ids.narrow(0, s, len), packed.token_mask.narrow(0, s, len), {}, {}, {}};
      // Positions beyond this micro-batch's own length are padding; trim to keep shapes tight.
      auto logp = sequence_logprobs(*model_, part, config_.logprob_chunk);
      grpo::LossInputs in{logp,
                          prox.defined() ? slice(prox, s, len) : logp.detach(),
                          slice(packed.behaviour, s, len),
                          slice(packed.reference, s, len),
                          slice(adv, s, len),
                          slice(packed.loss_mask, s, len)};
      auto out = grpo::loss(in, config_.loss);
      // Each micro-batch's loss is a mean over its own part; weight it by its share of the
      // batch so accumulated gradients equal those of the whole batch at once.
      double share = config_.loss.aggregation == grpo::Aggregation::dapo
                         ? (total_tokens > 0 ? out.tokens / total_tokens : 0.0)
                         : len / static_cast<double>(B);
      (out.loss * share).backward();
      loss_sum += out.loss.item<double>() * share;
      kl_sum += out.kl * out.tokens;
      clip_sum += out.clip_fraction * out.tokens;
      weight_sum += out.behaviour_weight * out.tokens;
    }
    m.lr = lr_at(version_);
    m.grad_norm = finish_step();
    m.loss = loss_sum;
    m.tokens = static_cast<int64_t>(total_tokens);
    m.kl = total_tokens > 0 ? kl_sum / total_tokens : 0;
    m.clip_fraction = total_tokens > 0 ? clip_sum / total_tokens : 0;
    m.behaviour_weight = total_tokens > 0 ? weight_sum / total_tokens : 0;
  }
  return m;
}

double Trainer::sft_step(const std::vector<SftExample>& examples) {
  if (examples.empty()) throw Error("trainer: sft_step needs at least one example");
  std::vector<std::pair<const std::vector<int32_t>*, const std::vector<int32_t>*>> seqs;
  for (const auto& e : examples) seqs.push_back({&e.prompt_ids, &e.completion_ids});
  auto packed = pack(seqs, {}, {});
  auto device = model_->lm_head_weight().device();
  auto logp = sequence_logprobs(*model_, packed, config_.logprob_chunk);
  auto mask = packed.loss_mask.to(device);
  auto loss = -(logp * mask).sum() / mask.sum().clamp_min(1);
  loss.backward();
  finish_step();
  return loss.item<double>();
}

}  // namespace troupe
