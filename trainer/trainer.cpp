// Batches rollouts into right-padded token tensors, computes log-probs chunk by chunk
// (kernels/logprobs) and applies the GRPO, SFT or DPO loss. Activation checkpointing wraps
// the model's decoder layers from outside; sharding is not here: this file trains one replica.
#include "trainer/trainer.hpp"

#include <cmath>
#include <iostream>
#include <mutex>
#include <numbers>
#include <unordered_set>

#include <torch/torch.h>

#include "kernels/logprobs.hpp"
#include "trainer/advantage.hpp"
#include "trainer/correction.hpp"
#include "trainer/data_parallel.hpp"
#include "policy/error.hpp"

namespace troupe {

// The pieces of Transformer's trunk, found by their Hugging Face module names, so that each
// decoder layer can run under CheckpointedLayer. Its forward() mirrors DecoderImpl::forward
// without a cache; test_sft checks that it gives the same loss and gradients.
struct Trainer::Trunk {
  torch::nn::EmbeddingImpl* embed = nullptr;
  std::vector<DecoderLayerImpl*> layers;
  std::vector<std::vector<torch::Tensor>> layer_params;  // [layer] its parameters, in parameters() order
  RMSNormImpl* norm = nullptr;
  RotaryEmbedding rotary;

  explicit Trunk(TransformerImpl& model);
  DataParallel* dp = nullptr;  // zero3: gathers each layer around its use
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask);
};

namespace {

torch::Tensor rng_state(torch::Device device) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(torch::Device device, const torch::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// One decoder layer that keeps only its input: the forward pass runs without a graph, and the
// backward pass runs the layer again with one and differentiates that. The layer's parameters
// are inputs of the node so that their gradients accumulate as usual. The random state is
// saved and replayed (as torch.utils.checkpoint does), so dropout draws the same masks twice.
// Parameters being inputs (rather than the reentrant backward() of torch.utils.checkpoint) keeps
// adapters in the first layer trained when the embedding is frozen; the one visible difference:
// a tensor hook on a layer parameter fires twice per backward pass, with the same gradient.
// The attention mask rides along as a plain argument, not an input of the node: it takes no
// gradient, and it may be undefined (plain causal attention), which a node input may not.
// With zero3 (trainer/data_parallel.hpp) the layer's parameters are whole only inside forward
// and backward: `dp` gathers them there and releases them after, and takes their gradients
// (reduce-scattered into its shards) instead of autograd.
struct MaskArg {
  torch::Tensor mask;
  DataParallel* dp = nullptr;
  int64_t layer = -1;
};

struct CheckpointedLayer : torch::autograd::Function<CheckpointedLayer> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, DecoderLayerImpl* layer,
                               const torch::Tensor& cos, const torch::Tensor& sin, MaskArg mask,
                               at::TensorList params) {
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    ctx->saved_data["params"] = static_cast<int64_t>(params.size());
    // The random state the layer starts from (LoRA's dropout draws from it), to replay it.
    ctx->saved_data["rng_cpu"] = rng_state(torch::kCPU);
    if (!x.is_cpu()) ctx->saved_data["rng_device"] = rng_state(x.device());
    ctx->save_for_backward({x, cos, sin});
    if (mask.mask.defined()) ctx->saved_data["mask"] = mask.mask;
    ctx->saved_data["dp"] = reinterpret_cast<int64_t>(mask.dp);
    ctx->saved_data["index"] = mask.layer;
    if (mask.dp) mask.dp->gather_layer(mask.layer);
    auto out = layer->forward(x, cos, sin, mask.mask, nullptr);  // no graph: autograd is off inside forward
    if (mask.dp) mask.dp->release_layer(mask.layer);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* layer = reinterpret_cast<DecoderLayerImpl*>(ctx->saved_data["layer"].toInt());
    auto* dp = reinterpret_cast<DataParallel*>(ctx->saved_data["dp"].toInt());
    const int64_t index = ctx->saved_data["index"].toInt();
    if (dp) dp->gather_layer(index);
    const auto saved = ctx->get_saved_variables();
    const auto params = layer->parameters();
    // zero3 passes no parameters as inputs: their gradients go to dp, not to autograd.
    const int64_t passed = ctx->saved_data["params"].toInt();
    TORCH_CHECK(dp || static_cast<int64_t>(params.size()) == passed,
                "activation checkpointing: the layer's parameters changed between forward and backward");
    auto x = saved[0].detach().requires_grad_(true);
    torch::Tensor out;
    {
      // Replay the forward pass's random draws, then put back the state the rest of the run is at.
      const auto device = x.device();
      const auto now_cpu = rng_state(torch::kCPU);
      const auto now_device = device.is_cpu() ? torch::Tensor() : rng_state(device);
      set_rng_state(torch::kCPU, ctx->saved_data["rng_cpu"].toTensor());
      if (!device.is_cpu()) set_rng_state(device, ctx->saved_data["rng_device"].toTensor());
      torch::AutoGradMode enable(true);
      auto mask = ctx->saved_data.count("mask") ? ctx->saved_data["mask"].toTensor() : torch::Tensor();
      out = layer->forward(x, saved[1], saved[2], mask, nullptr);
      set_rng_state(torch::kCPU, now_cpu);
      if (!device.is_cpu()) set_rng_state(device, now_device);
    }
    std::vector<torch::Tensor> wrt{x};
    std::vector<size_t> trained;  // indices into params of those that take a gradient
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].requires_grad()) {
        wrt.push_back(params[i]);
        trained.push_back(i);
      }
    auto grads = torch::autograd::grad({out}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
    // One gradient per forward argument: x, layer, cos, sin, mask, then each parameter.
    torch::autograd::variable_list result(5 + passed);
    result[0] = grads[0];
    if (dp) {
      std::vector<torch::Tensor> trained_params, trained_grads;
      for (size_t k = 0; k < trained.size(); ++k) {
        trained_params.push_back(params[trained[k]]);
        trained_grads.push_back(grads[1 + k]);
      }
      dp->reduce_layer_grads(index, trained_params, trained_grads);
      dp->release_layer(index);
      return result;
    }
    for (size_t k = 0; k < trained.size(); ++k) result[5 + trained[k]] = grads[1 + k];
    return result;
  }
};

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
  std::optional<at::TensorAccessor<float, 2>> ref_a;
  if (with_ref) ref_a = ref.accessor<float, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const auto& prompt = *seqs[b].first;
    const auto& completion = *seqs[b].second;
    const int64_t P = prompt.size(), L = completion.size();
    for (int64_t t = 0; t < P; ++t) ids_a[b][t] = prompt[t];
    for (int64_t t = 0; t < L; ++t) {
      ids_a[b][P + t] = completion[t];
      lm_a[b][P + t - 1] = 1;  // position P+t-1 predicts completion token t
      if (!behaviour.empty() && behaviour[b]) mu_a[b][P + t - 1] = (*behaviour[b])[t];
      if (with_ref) (*ref_a)[b][P + t - 1] = (*reference[b])[t];
    }
    for (int64_t t = 0; t < P + L; ++t) tm_a[b][t] = 1;
  }
  return {ids, token_mask, loss_mask, mu, ref};
}

// The final hidden states (B, T, H), through the checkpointed trunk when one is given and
// gradients are on.
torch::Tensor hidden_states(TransformerImpl& model, Trainer::Trunk* trunk, const torch::Tensor& ids,
                            const torch::Tensor& positions, const torch::Tensor& mask) {
  if (trunk && torch::GradMode::is_enabled()) return trunk->forward(ids, positions, mask);
  return model.forward(ids, positions, mask);
}

// log pi(target) for every position of the packed batch: (B, T-1)
torch::Tensor sequence_logprobs(TransformerImpl& model, const Packed& p, int64_t chunk, double temperature,
                                Trainer::Trunk* trunk = nullptr) {
  auto device = model.lm_head_weight().device();
  auto ids = p.ids.to(device);
  auto token_mask = p.token_mask.to(device);
  auto positions = positions_from_mask(token_mask);
  auto hidden = hidden_states(model, trunk, ids, positions, attention_mask_unless_causal(token_mask, positions));  // (B, T, H)
  const int64_t T = ids.size(1);
  if (batch_invariant_now(model.batch_invariant(), hidden))
    return kernels::token_logprobs_invariant(hidden.narrow(1, 0, T - 1), model.lm_head_weight(), ids.narrow(1, 1, T - 1),
                                             temperature, chunk);
  return kernels::token_logprobs(hidden.narrow(1, 0, T - 1), model.lm_head_weight(), ids.narrow(1, 1, T - 1),
                                 temperature, chunk);
}

}  // namespace

Trainer::Trunk::Trunk(TransformerImpl& model) : rotary(model.config()) {
  const auto modules = model.named_modules();
  auto find = [&](const std::string& name) {
    auto* m = modules.find(name);
    if (!m) throw Error("activation checkpointing: the model has no module '" + name + "'");
    return m->get();
  };
  embed = dynamic_cast<torch::nn::EmbeddingImpl*>(find("model.embed_tokens"));
  norm = dynamic_cast<RMSNormImpl*>(find("model.norm"));
  for (int64_t l = 0; l < model.config().num_hidden_layers; ++l) {
    auto* layer = dynamic_cast<DecoderLayerImpl*>(find("model.layers." + std::to_string(l)));
    if (!layer) throw Error("activation checkpointing: model.layers." + std::to_string(l) + " is not a decoder layer");
    layers.push_back(layer);
    layer_params.push_back(layer->parameters());
  }
  if (!embed || !norm) throw Error("activation checkpointing: unexpected module types in the model's trunk");
}

torch::Tensor Trainer::Trunk::forward(const torch::Tensor& ids, const torch::Tensor& positions,
                                      const torch::Tensor& mask) {
  auto h = embed->forward(ids);  // (B, T, H)
  auto [cos, sin] = rotary.cos_sin(positions, h.scalar_type());
  // zero3 with a frozen embedding (LoRA): the node has no parameter inputs, so its input must
  // take a gradient for backward to reach the first layer's adapters.
  if (dp && !h.requires_grad()) h = h.detach().requires_grad_(true);
  for (size_t l = 0; l < layers.size(); ++l)
    // zero3: the parameters are not inputs of the node, whose graph would otherwise keep their
    // gradient accumulators (and so their shapes) from the moment they were released.
    h = CheckpointedLayer::apply(h, layers[l], cos, sin, MaskArg{mask, dp, static_cast<int64_t>(l)},
                                 dp ? at::TensorList() : at::TensorList(layer_params[l]));
  return norm->forward(h);
}

std::vector<std::vector<float>> completion_logprobs(TransformerImpl& model, const RolloutGroup& group, int64_t chunk,
                                                    double temperature) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<const std::vector<int32_t>*, const std::vector<int32_t>*>> seqs;
  for (const auto& c : group.completion_ids) seqs.push_back({&group.prompt_ids, &c});
  auto packed = pack(seqs, {}, {});
  auto logp = sequence_logprobs(model, packed, chunk, temperature).cpu();  // (G, T-1)
  std::vector<std::vector<float>> out;
  const int64_t P = group.prompt_ids.size();
  for (size_t i = 0; i < group.completion_ids.size(); ++i) {
    const int64_t L = group.completion_ids[i].size();
    auto row = logp[i].narrow(0, P - 1, L).contiguous();
    out.emplace_back(row.data_ptr<float>(), row.data_ptr<float>() + L);
  }
  return out;
}

Trainer::Trainer(Transformer model, TrainerConfig config) : Trainer(model, config, model->parameters()) {}

Trainer::Trainer(Transformer model, TrainerConfig config, std::vector<torch::Tensor> params)
    : model_(std::move(model)), config_(config), params_(std::move(params)) {
  if (config_.num_iterations < 1) throw Error("trainer: num_iterations must be at least 1");
  if (params_.empty()) throw Error("trainer: the list of parameters to optimize is empty");
  if (config_.batch_invariant) model_->set_batch_invariant(true);
  std::unordered_set<const void*> optimized;
  for (auto& p : params_) {
    if (!p.defined()) throw Error("trainer: a parameter to optimize is undefined");
    p.requires_grad_(true);
    optimized.insert(p.unsafeGetTensorImpl());
  }
  for (auto& p : model_->parameters())
    if (!optimized.count(p.unsafeGetTensorImpl())) p.requires_grad_(false);
  optimizer_ = std::make_unique<Optimizer>(params_, config_.optimizer);
  if (config_.activation_checkpointing) trunk_ = std::make_unique<Trunk>(*model_);
  model_->train();
}

Trainer::~Trainer() = default;

double Trainer::lr_at(int64_t step) const { return scheduled_lr(config_.optimizer, step); }

void Trainer::set_data_parallel(std::shared_ptr<DataParallel> dp) {
  dp_ = std::move(dp);
  if (dp_) optimizer_.reset();  // the data-parallel optimizer steps instead
  if (dp_ && dp_->shards_parameters()) {
    // zero3 gathers each layer where the checkpointed trunk runs it, forward and backward.
    if (!trunk_) trunk_ = std::make_unique<Trunk>(*model_);
    trunk_->dp = dp_.get();
  }
}

namespace {
// zero3: every parameter whole for a scope (evaluation); a no-op otherwise.
struct WholeParameters {
  explicit WholeParameters(DataParallel* dp) : dp(dp) {
    if (dp) dp->gather_all();
  }
  ~WholeParameters() {
    if (!dp) return;
    try {
      dp->release_all();
    } catch (const std::exception& e) {  // a prefetch that failed in flight: its error is the one to see
      std::cerr << "troupe: " << e.what() << std::endl;
    }
  }
  DataParallel* dp;
};

// A pass through the model that trains nothing, for a rank that has run out of micro-batches
// while others have not: zero3's layer collectives must line up on every rank.
sft::Batch empty_pass() {
  const std::vector<sft::Sequence> one{sft::Sequence{.ids = {0, 0}, .loss_mask = {0, 0}}};
  return sft::collate(one);
}
}  // namespace

double Trainer::finish_step() {
  if (dp_) {
    const double norm = dp_->step(lr_at(version_));
    ++version_;
    return norm;
  }
  const double norm = optimizer_->step(lr_at(version_));
  ++version_;
  return norm;
}

namespace {
// A batch of rollout groups as the GRPO step takes it: packed rows (one per completion, group
// by group), rewards [N, G], and [B] flags for the rows sampled wholly at one policy version.
struct RolloutBatch {
  Packed packed;
  torch::Tensor rewards;    // (N, G) float64, as the rewards gave them
  torch::Tensor overlong_penalty;  // (N, G) float64, added to them for the advantages (0 unless overlong: penalty)
  std::vector<int64_t> version;  // [B] the row's policy version when all its tokens share one, else -1
  int64_t G = 0;
};

RolloutBatch rollout_batch(const std::vector<RolloutGroup>& groups, const rl::Overlong& overlong, bool with_reference) {
  const bool mask_truncated = overlong.mode == rl::OverlongMode::mask;
  RolloutBatch out;
  out.G = groups[0].size();
  const int64_t G = out.G;
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
      keep.push_back(mask_truncated && truncated ? 0.f : 1.f);
      const bool one_version = i < static_cast<int64_t>(g.min_version.size()) &&
                               i < static_cast<int64_t>(g.max_version.size()) && g.min_version[i] == g.max_version[i];
      out.version.push_back(one_version ? g.min_version[i] : -1);
    }
  }
  if (with_reference && (reference.empty() || !reference[0]))
    throw Error("trainer: the loss needs reference (or teacher) log-probs for beta > 0 or distill > 0, but the rollouts carry none");
  out.packed = pack(seqs, behaviour, with_reference ? reference : std::vector<const std::vector<float>*>{});
  out.packed.loss_mask *= torch::tensor(keep).unsqueeze(1);
  out.rewards = torch::tensor(rewards, torch::kFloat64).view({-1, G});
  std::vector<double> lengths;
  for (const auto& g : groups)
    for (const auto& c : g.completion_ids) lengths.push_back(static_cast<double>(c.size()));
  out.overlong_penalty = advantage::overlong_penalty(torch::tensor(lengths, torch::kFloat64).view({-1, G}), overlong);
  return out;
}

// What a step reports about the behaviour weights, summed over micro-batches (and ranks).
struct CorrectionSums {
  double masked = 0, truncated = 0;  // tokens
  double mismatch_k3 = 0, mismatch_tokens = 0;
  torch::Tensor ratio;  // (B, T-1) float64, the raw pi_prox / mu of the rows this rank trained, 0 elsewhere

  void add(const grpo::LossOutput& out, int64_t row, const torch::Tensor& prox, const torch::Tensor& behaviour,
           const torch::Tensor& mask, const torch::Tensor& same_version) {
    masked += out.masked_fraction * out.tokens;
    truncated += out.truncated_fraction * out.tokens;
    auto same = mask * same_version.to(mask.device()).unsqueeze(1);
    mismatch_k3 += correction::k3_sum(prox, behaviour, same).item<double>();
    mismatch_tokens += same.sum().item<double>();
    ratio.narrow(0, row, out.ratio.size(0)).copy_(out.ratio.detach().to(torch::kCPU, torch::kFloat64) * mask.cpu());
  }
  CorrectionMetrics metrics(const torch::Tensor& loss_mask, double tokens) const {
    CorrectionMetrics m;
    m.masked_fraction = tokens > 0 ? masked / tokens : 0.0;
    m.truncated_fraction = tokens > 0 ? truncated / tokens : 0.0;
    m.mismatch_tokens = static_cast<int64_t>(mismatch_tokens);
    m.mismatch_kl = mismatch_tokens > 0 ? mismatch_k3 / mismatch_tokens : 0.0;
    auto values = ratio.masked_select(loss_mask > 0);
    if (values.numel() > 0) {
      auto q = torch::quantile(values, torch::tensor({0.0, 0.05, 0.5, 0.95, 1.0}, torch::kFloat64));
      for (int i = 0; i < 5; ++i) m.ratio_quantiles[i] = q[i].item<double>();
    }
    return m;
  }
};
}  // namespace

StepMetrics Trainer::grpo_step(const std::vector<RolloutGroup>& groups) {
  if (groups.empty()) throw Error("trainer: grpo_step needs at least one rollout group");
  auto batch = rollout_batch(groups, config_.overlong, config_.loss.beta > 0 || config_.loss.distill > 0);
  const auto& packed = batch.packed;
  const int64_t G = batch.G, B = packed.ids.size(0);
  auto lengths = packed.loss_mask.sum(1).view({-1, G});
  auto adv = advantage::compute(config_.advantage, {.rewards = batch.rewards + batch.overlong_penalty, .lengths = lengths,
                                                    .scale = config_.scale_rewards}).view({B});
  std::optional<double> teacher_kl;
  if (config_.loss.distill > 0) {
    // On-policy distillation: the teacher's per-token reverse KL estimate joins the advantage.
    auto teacher = (packed.reference - packed.behaviour).to(torch::kFloat64) * packed.loss_mask;  // (B, T-1)
    adv = adv.unsqueeze(1) * packed.loss_mask + config_.loss.distill * teacher;
    teacher_kl = -teacher.sum().item<double>() / std::max(packed.loss_mask.sum().item<double>(), 1.0);
  }
  // Rows sampled wholly at the trainer's current version: their behaviour log-probs and the
  // trainer's own are of the same weights, so any gap between them is numerical mismatch.
  std::vector<float> same(B);
  for (int64_t b = 0; b < B; ++b) same[b] = batch.version[b] == version_ ? 1.f : 0.f;
  const auto same_version = torch::tensor(same);
  // The whole batch's counts and advantages; with data parallelism every rank was given the
  // whole batch and trains its share of the groups, rows [first, first + rows).
  const double total_tokens = packed.loss_mask.sum().item<double>();
  int64_t first = 0, rows = B;
  if (dp_) {
    auto [begin, end] = rank_share(static_cast<int64_t>(groups.size()), dp_->rank(), dp_->size());
    first = begin * G;
    rows = (end - begin) * G;
  }

  const int64_t micro = config_.micro_batch > 0 ? config_.micro_batch : std::max<int64_t>(rows, 1);
  auto device = model_->lm_head_weight().device();
  auto slice = [&](const torch::Tensor& t, int64_t start, int64_t len) {
    return t.defined() ? t.narrow(0, first + start, len).to(device) : torch::Tensor();
  };
  auto part_of = [&](int64_t start, int64_t len) {
    return Packed{packed.ids.narrow(0, first + start, len), packed.token_mask.narrow(0, first + start, len), {}, {}, {}};
  };
  // The proximal policy is the weights at the start of the step. With one pass they are the
  // current weights, so log pi_prox is simply log pi_theta detached, and no extra forward runs;
  // except with batch-invariant kernels, which only a pass without autograd runs (the first
  // pass's ratio pi_theta / pi_prox is then 1 to float rounding, not exactly). Where the
  // behaviour log-probs are exactly that pass's result, they are taken as they are.
  torch::Tensor prox;
  const bool recompute = !config_.reuse_behaviour_logprobs && (config_.num_iterations > 1 || config_.batch_invariant);
  if (config_.reuse_behaviour_logprobs) {
    prox = packed.behaviour.narrow(0, first, rows).to(device);
  } else if (recompute && rows > 0) {
    torch::NoGradGuard no_grad;
    WholeParameters whole(dp_.get());
    std::vector<torch::Tensor> parts;
    for (int64_t s = 0; s < rows; s += micro)
      parts.push_back(sequence_logprobs(*model_, part_of(s, std::min(micro, rows - s)), config_.logprob_chunk, config_.temperature));
    prox = torch::cat(parts, 0);
  } else if (recompute && dp_ && dp_->shards_parameters()) {
    WholeParameters whole(dp_.get());  // zero3's gather takes every rank, this one with no rows too
  }

  StepMetrics m;
  m.teacher_kl = teacher_kl;
  m.sequences = B;
  m.tokens = static_cast<int64_t>(total_tokens);
  m.reward_mean = batch.rewards.mean().item<double>();
  if (config_.overlong.mode == rl::OverlongMode::penalty) m.overlong_penalty = batch.overlong_penalty.mean().item<double>();
  CorrectionSums corrections{.ratio = torch::zeros(packed.loss_mask.sizes(), torch::kFloat64)};
  for (int64_t iter = 0; iter < config_.num_iterations; ++iter) {
    if (dp_) dp_->begin_step();
    // zero3: as many passes as the rank with the most, so the layer collectives line up.
    const int64_t passes = (rows + micro - 1) / micro;
    for (int64_t extra = dp_ && dp_->shards_parameters() ? dp_->max_passes(passes) - passes : 0; extra > 0; --extra)
      (target_logprobs(empty_pass()).sum() * 0.0).backward();
    double loss_sum = 0, kl_sum = 0, clip_sum = 0, weight_sum = 0;
    for (int64_t s = 0; s < rows; s += micro) {
      const int64_t len = std::min(micro, rows - s);
      auto logp = sequence_logprobs(*model_, part_of(s, len), config_.logprob_chunk, config_.temperature, trunk_.get());
      grpo::LossInputs in{logp,
                          prox.defined() ? prox.narrow(0, s, len) : logp.detach(),
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
      // pi_prox and mu are fixed over the step's passes: the first pass reports them.
      if (iter == 0)
        corrections.add(out, first + s, in.prox_logprobs, in.behaviour_logprobs, in.mask,
                        same_version.narrow(0, first + s, len));
    }
    if (dp_) {
      // Each rank's sums over its rows: their sum is the whole batch's.
      auto t = torch::tensor({loss_sum, kl_sum, clip_sum, weight_sum}, torch::kFloat64);
      dp_->all_reduce_sum(t);
      auto v = t.accessor<double, 1>();
      std::tie(loss_sum, kl_sum, clip_sum, weight_sum) = std::tuple{v[0], v[1], v[2], v[3]};
    }
    m.lr = lr_at(version_);
    m.grad_norm = finish_step();
    m.loss = loss_sum;
    m.kl = total_tokens > 0 ? kl_sum / total_tokens : 0;
    m.clip_fraction = total_tokens > 0 ? clip_sum / total_tokens : 0;
    m.behaviour_weight = total_tokens > 0 ? weight_sum / total_tokens : 0;
  }
  if (dp_) {
    // Rows are each trained by one rank and are 0 elsewhere, so the sums are exact.
    auto t = torch::tensor({corrections.masked, corrections.truncated, corrections.mismatch_k3, corrections.mismatch_tokens},
                           torch::kFloat64);
    dp_->all_reduce_sum(t);
    dp_->all_reduce_sum(corrections.ratio);
    auto v = t.accessor<double, 1>();
    std::tie(corrections.masked, corrections.truncated, corrections.mismatch_k3, corrections.mismatch_tokens) =
        std::tuple{v[0], v[1], v[2], v[3]};
  }
  m.correction = corrections.metrics(packed.loss_mask, total_tokens);
  return m;
}

double Trainer::sft_step(const std::vector<SftExample>& examples) {
  if (examples.empty()) throw Error("trainer: sft_step needs at least one example");
  std::vector<sft::Sequence> seqs;
  for (const auto& e : examples) {
    sft::Sequence s;
    s.ids = e.prompt_ids;
    s.ids.insert(s.ids.end(), e.completion_ids.begin(), e.completion_ids.end());
    s.loss_mask.assign(e.prompt_ids.size(), 0);
    s.loss_mask.resize(s.ids.size(), 1);
    seqs.push_back(std::move(s));
  }
  auto batches = sft::micro_batches(seqs, {.packing = false, .micro_rows = config_.micro_batch});
  return sft_step(batches).loss;
}

torch::Tensor Trainer::target_logprobs(const sft::Batch& batch) {
  const auto device = model_->lm_head_weight().device();
  const int64_t T = batch.ids.size(1);
  auto ids = batch.ids.to(device);
  auto positions = batch.positions.to(device);
  auto mask = attention_mask_unless_causal(batch.token_mask.to(device), positions);
  auto hidden = hidden_states(*model_, trunk_.get(), ids, positions, mask);  // (B, T, H)
  return kernels::token_logprobs(hidden.narrow(1, 0, T - 1), model_->lm_head_weight(), ids.narrow(1, 1, T - 1),
                                 /*temperature=*/1.0, config_.logprob_chunk);  // (B, T-1)
}

SftMetrics Trainer::sft_step(std::span<const sft::Batch> micro_batches) {
  SftMetrics m;
  for (const auto& b : micro_batches) {
    m.tokens += b.tokens;
    m.sequences += b.sequences;
    m.rows += b.ids.defined() ? b.ids.size(0) : 0;
  }
  if (dp_) {
    // This rank's micro-batches are its share of the step: divide by the global count.
    // One collective for the three counts.
    auto counts = torch::tensor({m.tokens, m.sequences, m.rows}, torch::kInt64);
    dp_->all_reduce_sum(counts);
    auto c = counts.accessor<int64_t, 1>();
    std::tie(m.tokens, m.sequences, m.rows) = std::tuple{c[0], c[1], c[2]};
  }
  if (m.tokens == 0) throw Error("trainer: sft_step got no trained tokens (an empty batch, or no assistant tokens)");
  const auto device = model_->lm_head_weight().device();
  if (dp_) dp_->begin_step();
  std::vector<const sft::Batch*> passes;
  for (const auto& b : micro_batches)
    if (b.tokens > 0) passes.push_back(&b);
  const int64_t rounds = dp_ && dp_->shards_parameters() ? dp_->max_passes(passes.size()) : passes.size();
  double nll_sum = 0;
  for (int64_t i = 0; i < rounds; ++i) {
    if (i >= static_cast<int64_t>(passes.size())) {
      (target_logprobs(empty_pass()).sum() * 0.0).backward();
      continue;
    }
    const auto& b = *passes[i];
    auto logp = target_logprobs(b);
    auto nll = -(logp * b.loss_mask.to(device)).sum();
    // Summed, then divided by the whole step's token count: the micro-batches' gradients add
    // up to the gradient of the mean over all of them.
    (nll / static_cast<double>(m.tokens)).backward();
    nll_sum += nll.item<double>();
  }
  m.loss = (dp_ ? dp_->sum(nll_sum) : nll_sum) / m.tokens;
  m.lr = lr_at(version_);
  m.grad_norm = finish_step();
  return m;
}

namespace {
// Evaluation mode (no LoRA dropout) for a scope, then back to what the module was in.
struct EvalMode {
  explicit EvalMode(torch::nn::Module& m) : module(m), was_training(m.is_training()) { m.eval(); }
  ~EvalMode() { module.train(was_training); }
  torch::nn::Module& module;
  bool was_training;
};
}  // namespace

double Trainer::sft_eval(std::span<const sft::Batch> batches) {
  torch::NoGradGuard no_grad;
  EvalMode eval(*model_);
  WholeParameters whole(dp_.get());
  const auto device = model_->lm_head_weight().device();
  double nll_sum = 0;
  int64_t tokens = 0;
  for (const auto& b : batches) {
    if (b.tokens == 0) continue;
    nll_sum += -(target_logprobs(b) * b.loss_mask.to(device)).sum().item<double>();
    tokens += b.tokens;
  }
  if (tokens == 0) throw Error("trainer: sft_eval got no trained tokens");
  return nll_sum / tokens;
}

DpoMetrics Trainer::dpo_pass(std::span<const dpo::Pair> pairs, bool train) {
  // Data parallel training: the loss is a mean over the pairs of every rank.
  DataParallel* dp = train ? dp_.get() : nullptr;
  if (pairs.empty() && !dp) throw Error("trainer: dpo needs at least one preference pair");
  for (const auto& p : pairs)
    if (std::isnan(p.ref_chosen) || std::isnan(p.ref_rejected))
      throw Error("trainer: preference pair" + (p.line ? " from line " + std::to_string(p.line) : std::string()) +
                  " has no reference log-probs (run dpo::compute_reference first)");
  const auto device = model_->lm_head_weight().device();
  const int64_t local_pairs = pairs.size();
  const int64_t B = dp ? static_cast<int64_t>(dp->sum(static_cast<double>(local_pairs))) : local_pairs;
  if (B == 0) throw Error("trainer: dpo needs at least one preference pair");
  const int64_t micro = config_.dpo_micro_pairs > 0 ? config_.dpo_micro_pairs : std::max<int64_t>(local_pairs, 1);
  DpoMetrics m;
  m.pairs = B;
  if (dp && dp->shards_parameters()) {
    // zero3: as many passes as the rank with the most, so the layer collectives line up.
    const int64_t mine = (local_pairs + micro - 1) / micro;
    for (int64_t extra = dp->max_passes(mine) - mine; extra > 0; --extra)
      (target_logprobs(empty_pass()).sum() * 0.0).backward();
  }
  for (int64_t s = 0; s < local_pairs; s += micro) {
    const int64_t n = std::min(micro, local_pairs - s);
    // Chosen rows then rejected rows of the same pairs in one forward pass.
    std::vector<sft::Sequence> seqs;
    std::vector<double> ref_c, ref_r;
    for (int64_t i = s; i < s + n; ++i) {
      seqs.push_back(pairs[i].chosen);
      ref_c.push_back(pairs[i].ref_chosen);
      ref_r.push_back(pairs[i].ref_rejected);
    }
    for (int64_t i = s; i < s + n; ++i) seqs.push_back(pairs[i].rejected);
    auto batch = sft::collate(seqs);
    auto logp = target_logprobs(batch);                                                          // (2n, T-1)
    auto sums = (logp.to(torch::kFloat64) * batch.loss_mask.to(device, torch::kFloat64)).sum(1);  // (2n)
    auto out = dpo::loss({sums.narrow(0, 0, n), sums.narrow(0, n, n), torch::tensor(ref_c, torch::kFloat64).to(device),
                          torch::tensor(ref_r, torch::kFloat64).to(device)},
                         config_.dpo);
    const double share = n / static_cast<double>(B);  // the loss is a mean over pairs
    if (train) (out.loss * share).backward();
    m.loss += out.loss.item<double>() * share;
    m.reward_chosen += out.reward_chosen * share;
    m.reward_rejected += out.reward_rejected * share;
    m.accuracy += out.accuracy * share;
    m.margin += out.margin * share;
    m.logps_chosen += out.logps_chosen * share;
    m.logps_rejected += out.logps_rejected * share;
  }
  if (dp) {
    // Each rank's metrics are its pairs' share of the means: their sum is the whole batch's.
    auto t = torch::tensor({m.loss, m.reward_chosen, m.reward_rejected, m.accuracy, m.margin, m.logps_chosen,
                            m.logps_rejected}, torch::kFloat64);
    dp->all_reduce_sum(t);
    auto v = t.accessor<double, 1>();
    std::tie(m.loss, m.reward_chosen, m.reward_rejected, m.accuracy, m.margin, m.logps_chosen, m.logps_rejected) =
        std::tuple{v[0], v[1], v[2], v[3], v[4], v[5], v[6]};
  }
  return m;
}

DpoMetrics Trainer::dpo_step(std::span<const dpo::Pair> pairs) {
  if (dp_) dp_->begin_step();
  auto m = dpo_pass(pairs, /*train=*/true);
  m.lr = lr_at(version_);
  m.grad_norm = finish_step();
  return m;
}

DpoMetrics Trainer::dpo_eval(std::span<const dpo::Pair> pairs) {
  torch::NoGradGuard no_grad;
  EvalMode eval(*model_);
  WholeParameters whole(dp_.get());
  return dpo_pass(pairs, /*train=*/false);
}

void Trainer::save_state(const std::filesystem::path& file) const {
  if (dp_) return dp_->save_state(file.parent_path(), version_);
  optimizer_->save(file, version_);
}

void Trainer::load_state(const std::filesystem::path& file) {
  if (dp_) {
    version_ = dp_->load_state(file.parent_path());
    return;
  }
  if (!std::filesystem::exists(file) && std::filesystem::exists(file.parent_path() / "layout.json"))
    throw Error(file.parent_path().string() + ": a sharded checkpoint (layout.json, one optimizer file per rank): "
                "resume it with parallel.trainer_ranks or parallel.sharding set");
  version_ = optimizer_->load(file);
}

}  // namespace troupe
