// The PPO step: one no-grad pass with the step's starting weights gives log pi_prox and V_old,
// then KL-shaped per-token rewards, GAE and whitening, then num_iterations optimizer passes of
// the decoupled-PPO policy loss plus the clipped value loss. One replica; no sharding here.
#include "trainer/ppo.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>

#include "kernels/logprobs.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "trainer/advantage.hpp"
#include "trainer/correction.hpp"
#include "trainer/objective.hpp"

namespace troupe {

namespace ppo {

Gae gae(const torch::Tensor& rewards, const torch::Tensor& values, const torch::Tensor& mask, double gamma,
        double lambda) {
  TORCH_CHECK(rewards.dim() == 2 && rewards.sizes() == values.sizes() && rewards.sizes() == mask.sizes(),
              "gae: rewards ", rewards.sizes(), ", values ", values.sizes(), " and mask ", mask.sizes(),
              " must all be [B, L]");
  const auto dtype = torch::promote_types(rewards.scalar_type(), values.scalar_type());
  const auto r = rewards.to(dtype), v = values.detach().to(dtype);
  const auto counted = mask > 0;
  const int64_t L = r.size(1);
  auto adv = torch::zeros_like(r);
  // Backwards over columns, all rows at once; each row carries its next counted position's
  // value and advantage past masked columns.
  auto next_value = torch::zeros({r.size(0)}, r.options());
  auto next_adv = torch::zeros_like(next_value);
  for (int64_t t = L - 1; t >= 0; --t) {
    const auto m = counted.select(1, t);
    const auto v_t = v.select(1, t);
    const auto a_t = r.select(1, t) + gamma * next_value - v_t + gamma * lambda * next_adv;
    adv.select(1, t).copy_(torch::where(m, a_t, torch::zeros_like(a_t)));
    next_value = torch::where(m, v_t, next_value);
    next_adv = torch::where(m, a_t, next_adv);
  }
  auto returns = torch::where(counted, adv + v, torch::zeros_like(adv));
  return {adv, returns};
}

torch::Tensor token_rewards(const torch::Tensor& scores, const torch::Tensor& mask, const torch::Tensor& kl,
                            double kl_coef) {
  TORCH_CHECK(mask.dim() == 2 && scores.dim() == 1 && scores.size(0) == mask.size(0), "token_rewards: scores ",
              scores.sizes(), " must be [B] for mask ", mask.sizes());
  const auto m = (mask > 0).to(torch::kFloat32);
  auto out = torch::zeros(mask.sizes(), mask.options().dtype(torch::kFloat32));
  if (kl.defined() && kl_coef != 0) {
    TORCH_CHECK(kl.sizes() == mask.sizes(), "token_rewards: kl ", kl.sizes(), " must match mask ", mask.sizes());
    out = out - kl_coef * kl.detach().to(torch::kFloat32) * m;
  }
  // The row's last counted column (-1 for a row with none, which gets no score).
  const auto columns = torch::arange(1, mask.size(1) + 1, mask.options().dtype(torch::kLong));
  const auto last = (m.to(torch::kLong) * columns).amax(1) - 1;  // [B]
  const auto has = (last >= 0).to(torch::kFloat32);
  out.scatter_add_(1, last.clamp_min(0).unsqueeze(1), (scores.to(out.device(), torch::kFloat32) * has).unsqueeze(1));
  return out;
}

torch::Tensor whiten(const torch::Tensor& x, const torch::Tensor& mask, double eps) {
  TORCH_CHECK(x.sizes() == mask.sizes(), "whiten: x ", x.sizes(), " and mask ", mask.sizes(), " must match");
  const auto m = (mask > 0).to(x.scalar_type());
  const auto n = m.sum();
  const auto mean = (x * m).sum() / n.clamp_min(1);
  const auto var = ((x - mean).pow(2) * m).sum() / (n - 1).clamp_min(1);
  return (x - mean) * (var + eps).rsqrt() * m;
}

// Per token, with r = pi_theta / pi_prox and w the corrected pi_prox / mu (decoupled PPO, as in
// grpo.cpp but with a per-token advantage A_t; objective grpo is PPO's clip):
//   policy_t = w * objective_t,  grpo's objective_t = -min(r * A_t, clip(r, 1 - eps, 1 + eps_high) * A_t)
//   value_t  = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
//   loss     = mean_t policy_t + vf_coef * mean_t value_t        (means over counted tokens)
LossOutput loss(const LossInputs& in, const LossConfig& c) {
  const auto& shape = in.mask.sizes();
  TORCH_CHECK(in.logprobs.sizes() == shape && in.prox_logprobs.sizes() == shape &&
                  in.behaviour_logprobs.sizes() == shape && in.advantages.sizes() == shape &&
                  in.values.sizes() == shape && in.old_values.sizes() == shape && in.returns.sizes() == shape,
              "ppo loss: logprobs ", in.logprobs.sizes(), ", prox ", in.prox_logprobs.sizes(), ", behaviour ",
              in.behaviour_logprobs.sizes(), ", advantages ", in.advantages.sizes(), ", values ", in.values.sizes(),
              ", old values ", in.old_values.sizes(), ", returns ", in.returns.sizes(), " and mask ", shape,
              " must all be [B, L]");
  const auto mask = (in.mask > 0).to(torch::kFloat32);
  const auto prox = in.prox_logprobs.detach();
  const auto adv = in.advantages.detach();
  auto terms = objective::compute(c.objective, {.logprobs = in.logprobs, .prox = prox, .advantages = adv, .mask = mask,
                                                .epsilon = c.epsilon, .epsilon_high = c.epsilon_high});
  auto weight = correction::weights(prox, in.behaviour_logprobs, mask, c.correction).weight;
  auto policy = weight * terms.per_token;

  const auto returns = in.returns.detach(), old = in.old_values.detach();
  auto unclipped = (in.values - returns).pow(2);
  torch::Tensor value, value_was_clipped;
  if (c.value_clip > 0) {
    auto v_clipped = old + (in.values - old).clamp(-c.value_clip, c.value_clip);
    auto clipped_term = (v_clipped - returns).pow(2);
    value = 0.5 * torch::max(unclipped, clipped_term);
    value_was_clipped = clipped_term.detach() > unclipped.detach();
  } else {
    value = 0.5 * unclipped;
    value_was_clipped = torch::zeros_like(mask, torch::kBool);
  }

  const auto n = mask.sum().clamp_min(1);
  auto policy_loss = (policy * mask).sum() / n;
  auto value_loss = (value * mask).sum() / n;
  LossOutput out;
  out.loss = policy_loss + c.vf_coef * value_loss;
  out.policy_loss = policy_loss.item<double>();
  out.value_loss = value_loss.item<double>();
  const auto counted = mask > 0;
  out.tokens = counted.sum().item<int64_t>();
  if (out.tokens > 0) {
    out.clip_fraction = terms.clipped.logical_and(counted).sum().item<double>() / out.tokens;
    out.value_clip_fraction = value_was_clipped.logical_and(counted).sum().item<double>() / out.tokens;
    out.behaviour_weight = (weight * mask).sum().item<double>() / out.tokens;
  }
  return out;
}

}  // namespace ppo

namespace {

// Sequences as prompt + completion, right-padded; column t of the [B, T-1] tensors is the
// position that predicts token t + 1 (the value of that state, the log-prob of that token).
struct Packed {
  torch::Tensor ids;         // (B, T)
  torch::Tensor token_mask;  // (B, T) 1 on real tokens
  torch::Tensor loss_mask;   // (B, T-1) 1 where the target is a completion token
  torch::Tensor behaviour;   // (B, T-1) log mu of the target, 0 elsewhere
  torch::Tensor reference;   // (B, T-1) log pi_ref of the target, or undefined
};

struct Sequence {
  const std::vector<int32_t>* prompt;
  const std::vector<int32_t>* completion;
  const std::vector<float>* behaviour;  // may be null (values only)
  const std::vector<float>* reference;  // may be null
};

Packed pack(const std::vector<Sequence>& seqs, bool with_reference) {
  const int64_t B = seqs.size();
  int64_t T = 0;
  for (const auto& s : seqs) T = std::max<int64_t>(T, s.prompt->size() + s.completion->size());
  auto ids = torch::zeros({B, T}, torch::kLong);
  auto token_mask = torch::zeros({B, T}, torch::kLong);
  auto loss_mask = torch::zeros({B, std::max<int64_t>(T - 1, 0)}, torch::kFloat32);
  auto mu = torch::zeros_like(loss_mask);
  auto ref = with_reference ? torch::zeros_like(loss_mask) : torch::Tensor();
  auto ids_a = ids.accessor<int64_t, 2>();
  auto tm_a = token_mask.accessor<int64_t, 2>();
  auto lm_a = loss_mask.accessor<float, 2>();
  auto mu_a = mu.accessor<float, 2>();
  auto ref_a = with_reference ? ref.accessor<float, 2>() : mu_a;  // mu_a stands in, unused
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = seqs[b];
    const int64_t P = s.prompt->size(), L = s.completion->size();
    for (int64_t t = 0; t < P; ++t) ids_a[b][t] = (*s.prompt)[t];
    for (int64_t t = 0; t < L; ++t) {
      ids_a[b][P + t] = (*s.completion)[t];
      lm_a[b][P + t - 1] = 1;
      if (s.behaviour) mu_a[b][P + t - 1] = (*s.behaviour)[t];
      if (with_reference) ref_a[b][P + t - 1] = (*s.reference)[t];
    }
    for (int64_t t = 0; t < P + L; ++t) tm_a[b][t] = 1;
  }
  return {ids, token_mask, loss_mask, mu, ref};
}

struct Forward {
  torch::Tensor logprobs;  // (B, T-1) log pi(ids[t+1])
  torch::Tensor values;    // (B, T-1) V of the state at t, float32
};

// One trunk pass feeds both heads: the LM head chunk by chunk, the value head on every position.
Forward forward(TransformerImpl& model, torch::nn::LinearImpl& value_head, const torch::Tensor& ids,
                const torch::Tensor& token_mask, int64_t chunk, double temperature) {
  const auto device = model.lm_head_weight().device();
  auto x = ids.to(device);
  auto tm = token_mask.to(device);
  auto positions = positions_from_mask(tm);
  auto hidden = model.forward(x, positions, attention_mask_unless_causal(tm, positions));  // (B, T, H)
  const int64_t T = x.size(1);
  auto h = hidden.narrow(1, 0, T - 1);                                      // (B, T-1, H)
  auto logp = kernels::token_logprobs(h, model.lm_head_weight(), x.narrow(1, 1, T - 1), temperature, chunk);
  auto values = value_head.forward(h.to(torch::kFloat32)).squeeze(-1);     // (B, T-1)
  return {logp, values};
}

struct Rows {
  int64_t first = 0, count = 0;  // this rank's rows of the batch
  int64_t micro = 1;             // per forward pass
};

// log pi_prox and V_old [B, T-1] of the whole batch at the step's starting weights, without a
// graph. With data parallelism each rank computes its own rows, and the rows are summed across
// ranks (zeros elsewhere, so the sum is exact): every rank then holds the whole batch's.
std::pair<torch::Tensor, torch::Tensor> starting_point(TransformerImpl& model, torch::nn::LinearImpl& value_head,
                                                       const Packed& packed, const torch::Tensor& mask, Rows rows,
                                                       int64_t chunk, double temperature, DataParallel* dp) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> lp, vs;
  for (int64_t s = rows.first; s < rows.first + rows.count; s += rows.micro) {
    const int64_t len = std::min(rows.micro, rows.first + rows.count - s);
    auto f = forward(model, value_head, packed.ids.narrow(0, s, len), packed.token_mask.narrow(0, s, len), chunk, temperature);
    lp.push_back(f.logprobs);
    vs.push_back(f.values);
  }
  if (!dp) return {torch::cat(lp, 0), torch::cat(vs, 0)};
  const auto logprob_dtype = at::promote_types(model.lm_head_weight().scalar_type(), torch::kFloat32);
  auto prox = torch::zeros(mask.sizes(), mask.options().dtype(logprob_dtype));
  auto old_values = torch::zeros(mask.sizes(), mask.options());
  if (rows.count > 0) {
    prox.narrow(0, rows.first, rows.count).copy_(torch::cat(lp, 0));
    old_values.narrow(0, rows.first, rows.count).copy_(torch::cat(vs, 0));
  }
  dp->all_reduce_sum(prox);
  dp->all_reduce_sum(old_values);
  return {prox, old_values};
}

double masked_mean(const torch::Tensor& x, const torch::Tensor& mask) {
  return ((x * mask).sum() / mask.sum().clamp_min(1)).item<double>();
}

double masked_var(const torch::Tensor& x, const torch::Tensor& mask) {
  const auto n = mask.sum().clamp_min(1);
  const auto mean = (x * mask).sum() / n;
  return (((x - mean).pow(2) * mask).sum() / n).item<double>();
}

constexpr const char* kWeight = "v_head.weight";
constexpr const char* kBias = "v_head.bias";

}  // namespace

PpoTrainer::PpoTrainer(Transformer policy, PpoConfig config, uint64_t seed)
    : model_(std::move(policy)), config_(config) {
  if (config_.num_iterations < 1) throw Error("ppo: num_iterations must be at least 1");
  if (config_.kl_coef < 0) throw Error("ppo: kl_coef must be >= 0");
  if (config_.gamma < 0 || config_.gamma > 1 || config_.lambda < 0 || config_.lambda > 1)
    throw Error("ppo: gamma and lambda must be in [0, 1]");
  const int64_t H = model_->config().hidden_size;
  const auto device = model_->lm_head_weight().device();
  value_head_ = torch::nn::Linear(torch::nn::LinearOptions(H, 1));
  {
    torch::NoGradGuard no_grad;
    // Drawn on the CPU from its own generator, so the head is the same on any device and
    // leaves the global random state alone.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    value_head_->weight.copy_(at::normal(0.0, 1.0 / (H + 1), {1, H}, gen, torch::kFloat32));
    value_head_->bias.zero_();
  }
  value_head_->to(device);
  params_ = model_->parameters();
  for (auto& p : value_head_->parameters()) params_.push_back(p);
  for (auto& p : params_) p.requires_grad_(true);
  optimizer_ = std::make_unique<Optimizer>(params_, config_.optimizer);
  model_->train();
}

PpoTrainer::~PpoTrainer() = default;

double PpoTrainer::lr_at(int64_t step) const { return scheduled_lr(config_.optimizer, step); }

PpoMetrics PpoTrainer::step(const std::vector<RolloutGroup>& groups) {
  if (groups.empty()) throw Error("ppo: step needs at least one rollout group");
  std::vector<Sequence> seqs;
  std::vector<float> scores, keep;
  std::vector<double> lengths;
  bool with_reference = true;
  for (const auto& g : groups) {
    const int64_t G = g.size();
    const std::string where = "ppo: prompt " + std::to_string(g.prompt_id);
    if (static_cast<int64_t>(g.reward.size()) != G || static_cast<int64_t>(g.behaviour_logprobs.size()) != G)
      throw Error(where + " has " + std::to_string(G) + " completions but " + std::to_string(g.reward.size()) +
                  " rewards and " + std::to_string(g.behaviour_logprobs.size()) + " log-prob lists");
    if (g.prompt_ids.empty()) throw Error(where + " has an empty prompt");
    if (!g.reference_logprobs.empty() && static_cast<int64_t>(g.reference_logprobs.size()) != G)
      throw Error(where + " has " + std::to_string(g.reference_logprobs.size()) + " reference log-prob lists for " +
                  std::to_string(G) + " completions");
    with_reference = with_reference && !g.reference_logprobs.empty();
    for (int64_t i = 0; i < G; ++i) {
      const auto n = g.completion_ids[i].size();
      if (g.behaviour_logprobs[i].size() != n || (!g.reference_logprobs.empty() && g.reference_logprobs[i].size() != n))
        throw Error(where + " completion " + std::to_string(i) + " has " + std::to_string(n) + " tokens but " +
                    std::to_string(g.behaviour_logprobs[i].size()) + " behaviour log-probs" +
                    (g.reference_logprobs.empty() ? std::string()
                                                  : " and " + std::to_string(g.reference_logprobs[i].size()) +
                                                        " reference log-probs"));
      seqs.push_back({&g.prompt_ids, &g.completion_ids[i], &g.behaviour_logprobs[i],
                      g.reference_logprobs.empty() ? nullptr : &g.reference_logprobs[i]});
      scores.push_back(static_cast<float>(g.reward[i]));
      const bool truncated = i < static_cast<int64_t>(g.truncated.size()) && g.truncated[i];
      keep.push_back(config_.overlong.mode == rl::OverlongMode::mask && truncated ? 0.f : 1.f);
      lengths.push_back(static_cast<double>(n));
    }
  }
  if (config_.kl_coef > 0 && !with_reference)
    throw Error("ppo: kl_coef > 0 but some rollout groups carry no reference log-probs (turn the reference on)");
  with_reference = with_reference && config_.kl_coef > 0;

  const int64_t B = seqs.size();
  auto packed = pack(seqs, with_reference);
  const auto device = model_->lm_head_weight().device();
  const auto mask = (packed.loss_mask * torch::tensor(keep).unsqueeze(1)).to(device);  // (B, T-1)
  const auto behaviour = packed.behaviour.to(device);
  // This rank's rows [first, first + rows): all of them, or its share of the groups.
  int64_t first = 0, rows = B;
  if (dp_) {
    auto [begin, end] = rank_share(static_cast<int64_t>(groups.size()), dp_->rank(), dp_->size());
    rows = 0;
    for (int64_t g = 0; g < end; ++g) (g < begin ? first : rows) += groups[g].size();
  }
  const int64_t micro = config_.micro_batch > 0 ? config_.micro_batch : std::max<int64_t>(rows, 1);

  // The step's starting (proximal) weights: log pi_prox and V_old, without a graph.
  const auto [prox, old_values] = starting_point(*model_, *value_head_, packed, mask, {first, rows, micro},
                                                 config_.logprob_chunk, config_.temperature, dp_.get());

  // Rewards, GAE and whitening on the CPU: [B, T-1] is small, and the recursion is a loop
  // over columns that would cost a few kernel launches per column on a GPU.
  const auto mask_cpu = mask.cpu();
  const auto kl = with_reference ? (prox.cpu() - packed.reference) : torch::Tensor();
  // The overlong penalty (0 unless overlong: penalty) joins the score on the last token.
  const auto shaped = torch::tensor(scores) + advantage::overlong_penalty(torch::tensor(lengths), config_.overlong).to(torch::kFloat32);
  const auto rewards = ppo::token_rewards(shaped, mask_cpu, kl, config_.kl_coef);
  const auto g = ppo::gae(rewards, old_values.cpu(), mask_cpu, config_.gamma, config_.lambda);
  const auto advantages = (config_.whiten_advantages ? ppo::whiten(g.advantages, mask_cpu) : g.advantages).to(device);
  const auto returns = g.returns.to(device);

  PpoMetrics m;
  m.sequences = B;
  m.tokens = mask_cpu.sum().item<int64_t>();
  m.reward_mean = torch::tensor(scores).mean().item<double>();
  m.kl = with_reference ? masked_mean(kl, mask_cpu) : 0.0;
  m.returns_mean = masked_mean(g.returns, mask_cpu);
  m.values_mean = masked_mean(old_values.cpu(), mask_cpu);
  m.advantages_mean = masked_mean(g.advantages, mask_cpu);
  const double var_returns = masked_var(g.returns, mask_cpu);
  m.explained_variance = var_returns > 0 ? 1 - masked_var(g.returns - old_values.cpu(), mask_cpu) / var_returns : 0.0;

  const ppo::LossConfig loss_config{.epsilon = config_.epsilon, .epsilon_high = config_.epsilon_high,
                                    .correction = config_.correction, .value_clip = config_.value_clip,
                                    .vf_coef = config_.vf_coef, .objective = config_.objective};
  const double total = static_cast<double>(m.tokens);
  for (int64_t iter = 0; iter < config_.num_iterations; ++iter) {
    double loss = 0, policy_loss = 0, value_loss = 0, clip = 0, value_clip = 0, weight = 0;
    for (int64_t s = first; s < first + rows; s += micro) {
      const int64_t len = std::min(micro, first + rows - s);
      auto f = forward(*model_, *value_head_, packed.ids.narrow(0, s, len), packed.token_mask.narrow(0, s, len),
                       config_.logprob_chunk, config_.temperature);
      auto out = ppo::loss({f.logprobs, prox.narrow(0, s, len), behaviour.narrow(0, s, len),
                            advantages.narrow(0, s, len), f.values, old_values.narrow(0, s, len),
                            returns.narrow(0, s, len), mask.narrow(0, s, len)},
                           loss_config);
      // Each micro-batch's loss is a mean over its own tokens; weighted by its share of the
      // step's tokens, the accumulated gradient is that of the token mean over the whole batch.
      const double share = total > 0 ? out.tokens / total : 0.0;
      (out.loss * share).backward();
      loss += out.loss.item<double>() * share;
      policy_loss += out.policy_loss * share;
      value_loss += out.value_loss * share;
      clip += out.clip_fraction * share;
      value_clip += out.value_clip_fraction * share;
      weight += out.behaviour_weight * share;
    }
    if (dp_) {
      // Each rank's shares of the token means: their sum is the whole batch's.
      auto t = torch::tensor({loss, policy_loss, value_loss, clip, value_clip, weight}, torch::kFloat64);
      dp_->all_reduce_sum(t);
      auto v = t.accessor<double, 1>();
      std::tie(loss, policy_loss, value_loss, clip, value_clip, weight) = std::tuple{v[0], v[1], v[2], v[3], v[4], v[5]};
    }
    m.loss = loss;
    m.policy_loss = policy_loss;
    m.value_loss = value_loss;
    m.clip_fraction = clip;
    m.value_clip_fraction = value_clip;
    m.behaviour_weight = weight;
    m.lr = lr_at(version_);
    if (dp_) {
      m.grad_norm = dp_->step(m.lr);  // reduce, clip by the global norm, AdamW, gather
      ++version_;
      continue;
    }
    m.grad_norm = optimizer_->step(m.lr);
    ++version_;
  }
  return m;
}

std::vector<std::vector<float>> PpoTrainer::completion_values(const RolloutGroup& group) {
  torch::NoGradGuard no_grad;
  if (group.prompt_ids.empty()) throw Error("ppo: prompt " + std::to_string(group.prompt_id) + " is empty");
  std::vector<Sequence> seqs;
  for (const auto& c : group.completion_ids) seqs.push_back({&group.prompt_ids, &c, nullptr, nullptr});
  auto packed = pack(seqs, false);
  auto values = forward(*model_, *value_head_, packed.ids, packed.token_mask, config_.logprob_chunk, config_.temperature).values.cpu();
  std::vector<std::vector<float>> out;
  const int64_t P = group.prompt_ids.size();
  for (size_t i = 0; i < group.completion_ids.size(); ++i) {
    const int64_t L = group.completion_ids[i].size();
    auto row = values[i].narrow(0, P - 1, L).contiguous();
    out.emplace_back(row.data_ptr<float>(), row.data_ptr<float>() + L);
  }
  return out;
}

std::map<std::string, torch::Tensor> PpoTrainer::value_head_state_dict() const {
  return {{kWeight, value_head_->weight}, {kBias, value_head_->bias}};
}

void PpoTrainer::save_state(const std::filesystem::path& file) const {
  if (dp_) return dp_->save_state(file.parent_path(), version_);
  optimizer_->save(file, version_);
}

void PpoTrainer::load_state(const std::filesystem::path& file) {
  if (dp_) {
    version_ = dp_->load_state(file.parent_path());
    return;
  }
  version_ = optimizer_->load(file);
}

void PpoTrainer::shard(std::shared_ptr<ProcessGroup> group, Sharding mode) {
  if (mode == Sharding::zero3)
    throw Error("ppo: parallel.sharding zero3 is not supported (the policy and value heads' forward pass does not "
                "gather zero3's layers); use none, zero1 or zero2");
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model_->named_parameters()) named.emplace_back(item.key(), item.value());
  for (const auto& [name, t] : value_head_state_dict()) named.emplace_back(name, t);
  dp_ = std::make_shared<DataParallel>(std::move(group), mode, std::move(named), config_.optimizer);
  optimizer_.reset();  // the data-parallel optimizer steps instead
}

void PpoTrainer::save_value_head(const std::filesystem::path& file) const {
  std::vector<torch::Tensor> keep;  // alive for the write
  std::vector<safetensors::TensorRef> refs;
  for (const auto& [name, t] : value_head_state_dict()) {
    keep.push_back(t.detach().to(torch::kCPU, torch::kFloat32).contiguous());
    refs.push_back({name, safetensors::Dtype::F32, keep.back().sizes().vec(), keep.back().data_ptr(),
                    static_cast<size_t>(keep.back().nbytes())});
  }
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  safetensors::write_file(file, refs);
}

void PpoTrainer::load_value_head(const std::filesystem::path& file) {
  const std::string name = file.string();
  if (!std::filesystem::exists(file)) throw Error(name + ": no such value head file");
  auto f = safetensors::File::open(file);
  std::map<std::string, torch::Tensor> loaded;
  for (const auto& view : f->tensors()) {
    if (view.name != kWeight && view.name != kBias)
      throw Error(name + ": unexpected tensor '" + view.name + "' in a value head file (expected " + kWeight +
                  " and " + kBias + ")");
    if (view.dtype != safetensors::Dtype::F32)
      throw Error(name + ": " + view.name + " is " + std::string(safetensors::dtype_name(view.dtype)) +
                  ", a value head is saved as F32");
    auto t = torch::empty(view.shape, torch::kFloat32);
    std::memcpy(t.data_ptr(), view.data, view.nbytes);  // the view need not be aligned
    loaded[view.name] = t;
  }
  torch::NoGradGuard no_grad;
  for (auto& [key, param] : value_head_state_dict()) {
    auto it = loaded.find(key);
    if (it == loaded.end()) throw Error(name + ": the value head file has no '" + key + "'");
    if (it->second.sizes() != param.sizes()) {
      std::string want, got;
      for (auto d : param.sizes()) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : it->second.sizes()) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw Error(name + ": " + key + " is [" + got + "] but this model's value head needs [" + want +
                  "] (saved for a model of another hidden size?)");
    }
    param.copy_(it->second);
  }
  // Sharded: the head's slices of the fp32 masters follow (a sharded optimizer state loaded
  // after this replaces them with the saved masters).
  if (dp_) dp_->reshard();
}

}  // namespace troupe
