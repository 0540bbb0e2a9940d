// The transformer's forward pass, written to compute exactly what transformers computes
// (float32 RMSNorm statistics, float32 RoPE tables, SDPA attention). No training tricks here:
// activation checkpointing and sharding are applied from outside.
#include "policy/transformer.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numbers>

#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"
#include "kernels/fused.hpp"
#include "kernels/packed_linear.hpp"
#include "kernels/decode_attention.hpp"
#include "policy/error.hpp"

namespace troupe {

namespace F = torch::nn::functional;

KVCache KVCache::allocate(const ModelConfig& c, int64_t batch, int64_t capacity, torch::TensorOptions options) {
  KVCache cache;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    cache.k.push_back(torch::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, options));
    cache.v.push_back(torch::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, options));
  }
  return cache;
}

std::pair<KVCache, torch::Tensor> KVCache::per_row(int64_t rows, const torch::Tensor& write, int64_t span,
                                                   const torch::Tensor& keys) const {
  KVCache view;
  for (size_t l = 0; l < k.size(); ++l) {
    view.k.push_back(k[l].narrow(0, 0, rows));
    view.v.push_back(v[l].narrow(0, 0, rows));
  }
  view.write_index = write;
  view.span = span;
  auto mask = (keys.narrow(0, 0, span).unsqueeze(0) <= write.unsqueeze(1)).view({rows, 1, 1, span});
  return {std::move(view), mask};
}

bool batch_invariant_now(bool on, const torch::Tensor& x) {
  return on && !torch::GradMode::is_enabled() && x.is_cpu() &&
         (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64);
}

// The fused kernels (kernels/fused.hpp) compute what the plain ops here compute, to rounding;
// they take over in models set up for inference (set_fused_kernels), where each plain op is a
// kernel launch on a GPU, and on a CPU a dispatch and an allocation (in a one-sequence decode
// step, more than the op's arithmetic). Whether they can take these tensors: one float dtype, no
// autograd; on a GPU contiguous ones, in a build with the CUDA kernels.
bool fused_now(std::initializer_list<const torch::Tensor*> tensors) {
  static const bool built = kernels::fused_cuda_built();
  if (torch::GradMode::is_enabled()) return false;
  const auto& first = **tensors.begin();
  const auto dtype = first.scalar_type();
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16 && dtype != torch::kHalf) return false;
  const bool cpu = first.is_cpu();
  if (!cpu && !(built && first.is_cuda())) return false;
  return std::all_of(tensors.begin(), tensors.end(), [&](const torch::Tensor* t) {
    return t->device() == first.device() && t->scalar_type() == dtype && (cpu || t->is_contiguous());
  });
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (batch_invariant_now(invariant_, x)) return kernels::bi_rms_norm(x, weight_, eps_);
  if (fused_ && fused_now({&x, &weight_})) return kernels::rms_norm_residual(x, torch::Tensor(), weight_, eps_).first;
  auto h = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));  // float64 stays float64
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight_ * h.to(x.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> RMSNormImpl::add_and_norm(const torch::Tensor& x, const torch::Tensor& residual) {
  if (fused_ && !batch_invariant_now(invariant_, x) && fused_now({&x, &residual, &weight_})) return kernels::rms_norm_residual(x, residual, weight_, eps_);
  auto sum = residual + x;
  return {forward(sum), sum};
}

RotaryEmbedding::RotaryEmbedding(const ModelConfig& c) {
  // 1 / theta^(2i / d), in float32 as transformers computes it.
  auto exponent = torch::arange(0, c.head_dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(c.head_dim);
  inv_freq_ = 1.0 / torch::pow(torch::tensor(c.rope_theta, torch::kFloat32), exponent);
  if (c.rope_llama3) {
    // Llama 3.1: wavelengths longer than the original context are slowed by `factor`,
    // short ones kept, and those between interpolated smoothly.
    const auto& s = *c.rope_llama3;
    double old_len = static_cast<double>(s.original_max_position_embeddings);
    double low_freq_wavelen = old_len / s.low_freq_factor;
    double high_freq_wavelen = old_len / s.high_freq_factor;
    auto wavelen = 2 * std::numbers::pi / inv_freq_;
    auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq_ / s.factor, inv_freq_);
    auto smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    auto medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq_ = torch::where(medium, smoothed, scaled);
  }
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::cos_sin(const torch::Tensor& positions,
                                                                   torch::ScalarType dtype, bool invariant) {
  if (inv_freq_.device() != positions.device()) inv_freq_ = inv_freq_.to(positions.device());
  // ATen's vectorized cos and sin may round otherwise than its scalar loop for the last few
  // elements, whose number depends on the batch's shape.
  if (invariant && !torch::GradMode::is_enabled() && positions.is_cpu() &&
      (dtype == torch::kFloat32 || dtype == torch::kFloat64))
    return kernels::bi_rope_cos_sin(positions, inv_freq_, dtype);
  auto freqs = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq_;  // [B, T, hd/2]
  auto emb = torch::cat({freqs, freqs}, -1);                            // [B, T, hd]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

namespace {

torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

// x [B, heads, T, hd]; cos, sin [B, T, hd]. `fused`: the fused kernel where it can run.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool fused) {
  if (fused && fused_now({&cos, &sin}) && x.scalar_type() == cos.scalar_type() && x.device() == cos.device())
    return kernels::rotary(x.is_cuda() ? x.contiguous() : x, cos, sin);  // (at most) one copy and one kernel, for nine
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  return x * c + rotate_half(x) * s;
}

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// A GEMM without autograd: batch-invariant when asked, else ATen's (MKL, oneDNN).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool invariant) {
  return invariant ? kernels::bi_linear(x, w, b) : F::linear(x, w, b);
}

// A projection, its adapter's term added (that term, and so LoRA, is not batch-invariant).
torch::Tensor project(const Projection& p, const torch::Tensor& x, bool training, bool invariant) {
  return invariant ? p.add_lora(kernels::bi_linear(x, p.base->weight, p.base->bias), x, training) : p.forward(x, training);
}

// What identifies the weights a kept copy was made from: each one's data pointer and version.
std::vector<std::pair<const void*, int64_t>> key_of(const std::vector<torch::Tensor>& weights,
                                                    const std::vector<torch::Tensor>& biases) {
  std::vector<std::pair<const void*, int64_t>> key;
  for (const auto& t : weights) key.emplace_back(t.data_ptr(), t._version());
  for (const auto& t : biases) key.emplace_back(t.data_ptr(), t._version());
  return key;
}

// The parts' weights and their biases (those that have one).
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> weights_of(
    std::initializer_list<const Projection*> parts) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto* p : parts) {
    weights.push_back(p->base->weight);
    if (p->base->bias.defined()) biases.push_back(p->base->bias);
  }
  return {std::move(weights), std::move(biases)};
}

torch::Tensor join(const std::vector<torch::Tensor>& ts) {
  return ts.empty() ? torch::Tensor() : ts.size() == 1 ? ts[0] : torch::cat(ts);
}

}  // namespace

torch::Tensor Projection::add_lora(const torch::Tensor& y, const torch::Tensor& x, bool training) const {
  if (!has_lora()) return y;
  // As PEFT: the input is cast to the adapter's dtype (float32 adapters on a bfloat16 base
  // stay float32 through the adapter), and the sum back to the base's.
  auto h = x.to(lora_A.scalar_type());
  if (lora_dropout > 0.0) h = torch::dropout(h, lora_dropout, training);
  auto delta = F::linear(F::linear(h, lora_A), lora_B) * lora_scale;  // (..., r) then (..., out)
  return (y + delta).to(y.scalar_type());
}

torch::Tensor GemmWeights::apply(const torch::Tensor& x, std::initializer_list<const Projection*> parts,
                                 bool invariant) {
  auto [weights, biases] = weights_of(parts);
  return apply(x, weights, biases, invariant);
}

bool GemmWeights::prepare(std::initializer_list<const Projection*> parts, torch::ScalarType activations) {
  auto [weights, biases] = weights_of(parts);
  return prepare(weights, biases, activations);
}

bool GemmWeights::prepare(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
                          torch::ScalarType activations) {
  if (!keep) return false;
  if (format != WeightFormat::full) return refresh(weights, biases, activations);
  auto weight = fused(weights, true);  // as apply fuses them (the biases too, read at each call)
  fused(biases, true);
  return repack(weight, weights, biases, activations);
}

bool GemmWeights::repack(const torch::Tensor& weight, const std::vector<torch::Tensor>& weights,
                         const std::vector<torch::Tensor>& biases, torch::ScalarType activations) {
  if (!keep || !kernels::packed_linear_pays(weight, activations)) {
    packed_ = torch::Tensor();
    key_.clear();
    return false;
  }
  auto key = key_of(weights, biases);  // only here: unkept or unpacked GEMMs pay nothing for it
  if (packed_.defined() && key == key_) return false;
  packed_ = torch::Tensor();  // the stale copy freed before the new one is made
  packed_ = kernels::pack_linear_weight(weight);
  key_ = std::move(key);
  return true;
}

bool GemmWeights::refresh(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
                          torch::ScalarType activations) {
  auto key = key_of(weights, biases);
  // Kept and still what a call needs: the same weights and (quantized) activations.
  const bool kept = quantized_.defined() && quantized_.dequantized.defined() == (activations == torch::kFloat32);
  if (keep && key == key_ && kept) return false;
  bias_ = join(biases);
  quantized_ = kernels::quantize_weight(join(weights), weight_bits(format), activations);
  key_ = std::move(key);
  return true;
}

torch::Tensor GemmWeights::apply(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                 const std::vector<torch::Tensor>& biases, bool invariant) {
  // Called without autograd only (see AttentionImpl::forward).
  auto size = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : int64_t{0}; };
  if (format == WeightFormat::full) {
    // Full weights are never copied for good: kept, several parts first move into one buffer of
    // which each part's parameter becomes a view (fused), and from then on that buffer is the
    // fused weight itself. In-place writes (an optimizer step, update_weights) land in it.
    // The one exception: kept in float32, or in bf16 on a CPU with native bf16, the GEMM reads a
    // packed copy of that buffer (kernels/packed_linear.hpp), made again whenever a write moves
    // its version.
    bias_ = torch::Tensor();
    quantized_ = {};
    auto weight = fused(weights, keep), bias = fused(biases, keep);
    if (!weight.defined()) weight = join(weights);  // not kept: a concatenation for this call only
    if (!bias.defined()) bias = join(biases);
    bytes_ = size(weight) + size(bias);
    if (!invariant && (repack(weight, weights, biases, x.scalar_type()) || packed_.defined()))
      return kernels::packed_linear(x, packed_, bias, weight.size(0));
    packed_ = torch::Tensor();
    key_.clear();
    return gemm(x, weight, bias, invariant);
  }
  TORCH_CHECK(!invariant, "batch-invariant kernels take float weights, not ", to_string(format));
  refresh(weights, biases, x.scalar_type());
  torch::Tensor y = kernels::quantized_linear(x, quantized_, bias_);
  bytes_ = quantized_.bytes(x.numel() / x.size(-1)) + size(bias_);
  if (!keep) {  // nothing stale held
    bias_ = torch::Tensor();
    quantized_ = {};
    key_.clear();
  }
  return y;
}

torch::Tensor GemmWeights::adjacent_view(const std::vector<torch::Tensor>& parts) {
  if (parts.empty()) return {};
  if (parts.size() == 1) return parts[0];
  const auto& first = parts[0];
  int64_t rows = 0;
  auto next = static_cast<const char*>(first.data_ptr());
  for (const auto& t : parts) {
    if (!t.is_contiguous() || t.scalar_type() != first.scalar_type() || t.device() != first.device() ||
        t.dim() != first.dim() || (t.dim() == 2 && t.size(1) != first.size(1)) ||
        !t.storage().is_alias_of(first.storage()) || static_cast<const char*>(t.data_ptr()) != next)
      return {};
    next += t.numel() * t.element_size();
    rows += t.size(0);
  }
  if (first.dim() == 1) return first.as_strided({rows}, {1});
  return first.as_strided({rows, first.size(1)}, {first.size(1), 1});
}

torch::Tensor GemmWeights::fused(const std::vector<torch::Tensor>& parts, bool adopt) {
  auto view = adjacent_view(parts);
  if (view.defined() || !adopt || parts.empty()) return view;
  auto joined = torch::cat(parts);
  int64_t row = 0;
  for (auto t : parts) {  // a handle on the parameter itself: set_data changes what it holds
    t.set_data(joined.narrow(0, row, t.size(0)));
    row += t.size(0);
  }
  return joined;
}

AttentionImpl::AttentionImpl(const ModelConfig& c, int64_t layer)
    : layer_(layer), n_heads_(c.num_attention_heads), n_kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
  q_proj_.base = register_module("q_proj", linear(c.hidden_size, n_heads_ * head_dim_, c.qkv_bias));
  k_proj_.base = register_module("k_proj", linear(c.hidden_size, n_kv_heads_ * head_dim_, c.qkv_bias));
  v_proj_.base = register_module("v_proj", linear(c.hidden_size, n_kv_heads_ * head_dim_, c.qkv_bias));
  o_proj_.base = register_module("o_proj", linear(n_heads_ * head_dim_, c.hidden_size, c.o_bias));
  if (c.qk_norm) {
    q_norm_ = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps));
    k_norm_ = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& mask, KVCache* cache) {
  const int64_t B = x.size(0), T = x.size(1);
  // Without autograd (generation, log-probs), q, k and v in one GEMM over the concatenated
  // weights (GemmWeights): one large GEMM runs closer to peak on a CPU than three small ones
  // (about 10% of a decode step). With autograd, three GEMMs: their rows (batch x length) are
  // many, and the concatenated weight and its gradient would cost memory and copies.
  // LoRA adapters add their terms to their own slices.
  std::vector<torch::Tensor> qkv;
  const bool invariant = batch_invariant_now(invariant_, x);
  if (torch::GradMode::is_enabled()) {
    qkv = {q_proj_.base->forward(x), k_proj_.base->forward(x), v_proj_.base->forward(x)};
  } else {
    // (Batch-invariant: each output is its own dot product, so fusing changes no bit.)
    qkv = qkv_.apply(x, {&q_proj_, &k_proj_, &v_proj_}, invariant).split({n_heads_ * head_dim_, n_kv_heads_ * head_dim_, n_kv_heads_ * head_dim_}, -1);
  }
  const bool train = is_training();
  auto q = q_proj_.add_lora(qkv[0], x, train).view({B, T, n_heads_, head_dim_});     // (B, T, nh, hd)
  auto k = k_proj_.add_lora(qkv[1], x, train).view({B, T, n_kv_heads_, head_dim_});  // (B, T, nkv, hd)
  auto v = v_proj_.add_lora(qkv[2], x, train).view({B, T, n_kv_heads_, head_dim_});
  if (q_norm_) {
    q = q_norm_(q);
    k = k_norm_(k);
  }
  q = apply_rope(q.transpose(1, 2), cos, sin, fused_ && !invariant);  // (B, nh, T, hd)
  k = apply_rope(k.transpose(1, 2), cos, sin, fused_ && !invariant);  // (B, nkv, T, hd)
  v = v.transpose(1, 2);

  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor out;
  if (cache && cache->write_index.defined() && !invariant && kernels::decode_attention_supports(q)) {
    // A per-row decode step on a CPU: the cache writes and the attention over each row's shared
    // prefix and own keys, in one kernel (kernels/decode_attention.hpp).
    TORCH_CHECK(T == 1, "per-row KV cache writes take one token per row");
    std::vector<kernels::PrefixPart> parts;
    parts.reserve(cache->prefixes.size());
    for (const auto& group : cache->prefixes) parts.push_back({group.kv->k[layer_], group.kv->v[layer_], group.rows});
    out = kernels::decode_attention(q, k, v, cache->k[layer_], cache->v[layer_], cache->write_index, parts, scale);
  } else {
    TORCH_CHECK(!cache || cache->prefixes.empty(),
                "shared prefixes are read by the CPU's decode attention only (float32 or bfloat16, not batch-invariant)");
    bool causal = !mask.defined() && T > 1;
    if (cache && cache->write_index.defined()) {
      TORCH_CHECK(T == 1 && mask.defined(), "per-row KV cache writes take one token per row and an explicit mask");
      auto rows = torch::arange(B, cache->write_index.options());
      using torch::indexing::Slice;
      cache->k[layer_].index_put_({rows, Slice(), cache->write_index}, k.squeeze(2));  // (B, nkv, hd)
      cache->v[layer_].index_put_({rows, Slice(), cache->write_index}, v.squeeze(2));
      k = cache->k[layer_].narrow(2, 0, cache->span);  // (B, nkv, span, hd)
      v = cache->v[layer_].narrow(2, 0, cache->span);
    } else if (cache) {
      const int64_t start = cache->length;
      TORCH_CHECK(start + T <= cache->capacity(), "KV cache overflow: ", start, " + ", T, " > ", cache->capacity());
      cache->k[layer_].narrow(2, start, T).copy_(k);
      cache->v[layer_].narrow(2, start, T).copy_(v);
      k = cache->k[layer_].narrow(2, 0, start + T);  // (B, nkv, S, hd)
      v = cache->v[layer_].narrow(2, 0, start + T);
      // SDPA's is_causal aligns the top-left corner, which is wrong once keys precede the queries.
      TORCH_CHECK(!causal || start == 0, "a multi-token step over a non-empty KV cache needs an explicit mask");
    }
    std::optional<torch::Tensor> attn_mask;
    if (mask.defined()) attn_mask = mask;
    if (invariant) {
      // One query row at a time over its allowed keys, in key order, whatever the batch: a decode
      // step over the cache and a full causal pass give each query the same bits.
      out = kernels::bi_attention(q, k, v, mask, scale);  // (B, nh, T, hd)
    } else if (T == 1 && n_kv_heads_ != n_heads_) {
      // One decode step: the query heads sharing a key/value head become that head's query
      // rows, (B, nkv, nh/nkv, hd), so attention reads each cached key once instead of
      // repeating the cache per query head (what SDPA's GQA path does on CPU with a mask).
      auto grouped = q.reshape({B, n_kv_heads_, n_heads_ / n_kv_heads_, head_dim_});
      out = at::scaled_dot_product_attention(grouped, k, v, attn_mask, 0.0, false, scale)
                .reshape({B, n_heads_, 1, head_dim_});  // (B, nh, 1, hd)
    } else {
      out = at::scaled_dot_product_attention(q, k, v, attn_mask, 0.0, causal, scale,
                                             /*enable_gqa=*/n_kv_heads_ != n_heads_);  // (B, nh, T, hd)
    }
  }
  out = out.transpose(1, 2).reshape({B, T, n_heads_ * head_dim_});  // (B, T, nh * hd)
  return torch::GradMode::is_enabled() ? project(o_proj_, out, train, invariant)
                                       : o_proj_.add_lora(o_.apply(out, {&o_proj_}, invariant), out, train);
}

void AttentionImpl::set_fused_kernels(bool on) {
  fused_ = on;
  if (q_norm_) {
    q_norm_->set_fused_kernels(on);
    k_norm_->set_fused_kernels(on);
  }
}

void AttentionImpl::set_batch_invariant(bool on) {
  invariant_ = on;
  if (q_norm_) {
    q_norm_->set_batch_invariant(on);
    k_norm_->set_batch_invariant(on);
  }
}

void AttentionImpl::projections(const std::string& prefix, ProjectionList& out) {
  out.emplace_back(prefix + "q_proj", &q_proj_);
  out.emplace_back(prefix + "k_proj", &k_proj_);
  out.emplace_back(prefix + "v_proj", &v_proj_);
  out.emplace_back(prefix + "o_proj", &o_proj_);
}

MLPImpl::MLPImpl(const ModelConfig& c) {
  gate_proj_.base = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  up_proj_.base = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  down_proj_.base = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // gate and up in one GEMM, for the same reason as q, k and v.
  std::vector<torch::Tensor> gate_up;
  const bool invariant = batch_invariant_now(invariant_, x);
  if (torch::GradMode::is_enabled()) {
    gate_up = {gate_proj_.base->forward(x), up_proj_.base->forward(x)};
  } else {
    gate_up = gate_up_.apply(x, {&gate_proj_, &up_proj_}, invariant).chunk(2, -1);
  }
  const bool train = is_training();
  auto gate = gate_proj_.add_lora(gate_up[0], x, train), up = up_proj_.add_lora(gate_up[1], x, train);
  auto h = invariant ? kernels::bi_silu_mul(gate, up) : F::silu(gate) * up;
  return torch::GradMode::is_enabled() ? project(down_proj_, h, train, invariant)
                                       : down_proj_.add_lora(down_.apply(h, {&down_proj_}, invariant), h, train);
}

void MLPImpl::projections(const std::string& prefix, ProjectionList& out) {
  out.emplace_back(prefix + "gate_proj", &gate_proj_);
  out.emplace_back(prefix + "up_proj", &up_proj_);
  out.emplace_back(prefix + "down_proj", &down_proj_);
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c, int64_t layer) {
  self_attn_ = register_module("self_attn", Attention(c, layer));
  mlp_ = register_module("mlp", MLP(c));
  input_layernorm_ = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm_ = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& mask, KVCache* cache) {
  auto [normed, h] = post_attention_layernorm_->add_and_norm(self_attn_(input_layernorm_(x), cos, sin, mask, cache), x);
  return h + mlp_(normed);
}

void DecoderLayerImpl::projections(const std::string& prefix, ProjectionList& out) {
  self_attn_->projections(prefix + "self_attn.", out);
  mlp_->projections(prefix + "mlp.", out);
}

DecoderImpl::DecoderImpl(const ModelConfig& c) : rotary_(c) {
  embed_tokens_ = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  layers_ = register_module("layers", torch::nn::ModuleList());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) layers_->push_back(DecoderLayer(c, l));
  norm_ = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& ids, const torch::Tensor& positions,
                                   const torch::Tensor& mask, KVCache* cache) {
  auto h = embed_tokens_(ids);  // (B, T, H)
  auto [cos, sin] = rotary_.cos_sin(positions, h.scalar_type(), invariant_);
  for (auto& layer : *layers_) h = layer->as<DecoderLayer>()->forward(h, cos, sin, mask, cache);
  if (cache && !cache->write_index.defined()) cache->length += ids.size(1);
  return norm_(h);
}

void DecoderImpl::set_fused_kernels(bool on) {
  norm_->set_fused_kernels(on);
  for (size_t l = 0; l < layers_->size(); ++l) layers_->ptr<DecoderLayerImpl>(l)->set_fused_kernels(on);
}

void DecoderImpl::keep_fused_weights(bool on) {
  for (size_t l = 0; l < layers_->size(); ++l) layers_->ptr<DecoderLayerImpl>(l)->keep_fused_weights(on);
}

int DecoderImpl::prepare_weights(torch::ScalarType activations) {
  int n = 0;
  for (size_t l = 0; l < layers_->size(); ++l) n += layers_->ptr<DecoderLayerImpl>(l)->prepare_weights(activations);
  return n;
}

void DecoderImpl::set_weight_format(WeightFormat f) {
  for (size_t l = 0; l < layers_->size(); ++l) layers_->ptr<DecoderLayerImpl>(l)->set_weight_format(f);
}

int64_t DecoderImpl::gemm_bytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < layers_->size(); ++l) total += layers_->ptr<DecoderLayerImpl>(l)->gemm_bytes();
  return total;
}

void DecoderImpl::set_batch_invariant(bool on) {
  invariant_ = on;
  norm_->set_batch_invariant(on);
  for (size_t l = 0; l < layers_->size(); ++l) layers_->ptr<DecoderLayerImpl>(l)->set_batch_invariant(on);
}

void DecoderImpl::projections(const std::string& prefix, ProjectionList& out) {
  for (size_t l = 0; l < layers_->size(); ++l)
    layers_->ptr<DecoderLayerImpl>(l)->projections(prefix + "layers." + std::to_string(l) + ".", out);
}

TransformerImpl::TransformerImpl(ModelConfig config) : config_(std::move(config)) {
  model_ = register_module("model", Decoder(config_));
  if (!config_.tie_word_embeddings)
    lm_head_ = register_module("lm_head", linear(config_.hidden_size, config_.vocab_size, false));
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& ids, const torch::Tensor& positions,
                                       const torch::Tensor& mask, KVCache* cache) {
  TORCH_CHECK(ids.dim() == 2, "ids must be [B, T], got ", ids.sizes());
  TORCH_CHECK(positions.sizes() == ids.sizes(), "positions ", positions.sizes(), " must match ids ", ids.sizes());
  return model_(ids, positions, mask, cache);
}

void TransformerImpl::set_fused_kernels(bool on) { model_->set_fused_kernels(on); }

void TransformerImpl::keep_fused_weights(bool on) {
  model_->keep_fused_weights(on);
  lm_head_gemm_.keep = on;
}

void TransformerImpl::set_weight_format(WeightFormat format) {
  if (format != WeightFormat::full) {
    if (invariant_) throw Error("model.batch_invariant takes float weights, not " + std::string(to_string(format)));
    auto device = lm_head_weight().device();
    std::string why;
    auto check = [&](const std::string& name, const torch::Tensor& w) {
      if (!kernels::quantized_weight_fits(weight_bits(format), w.size(0), w.size(1), device, &why))
        throw Error(name + " [" + std::to_string(w.size(0)) + ", " + std::to_string(w.size(1)) + "] cannot be " +
                    std::string(to_string(format)) + ": " + why);
    };
    for (const auto& [name, p] : projections()) check(name + ".weight", p->base->weight);
    check(lm_head_ ? "lm_head.weight" : "lm_head.weight (tied to model.embed_tokens.weight)", lm_head_weight());
  }
  model_->set_weight_format(format);
  lm_head_gemm_.format = format;
}

int TransformerImpl::prepare_weights(torch::ScalarType activations) {
  return model_->prepare_weights(activations) + lm_head_gemm_.prepare({lm_head_weight()}, {}, activations);
}

int64_t TransformerImpl::gemm_weight_bytes() const { return model_->gemm_bytes() + lm_head_gemm_.bytes(); }

void TransformerImpl::set_batch_invariant(bool on) {
  invariant_ = on;
  model_->set_batch_invariant(on);
}

ProjectionList TransformerImpl::projections() {
  ProjectionList out;
  model_->projections("model.", out);
  return out;
}

std::vector<std::pair<std::string, const Projection*>> TransformerImpl::projections() const {
  // The walk itself changes nothing; only the pointers it hands out could.
  auto list = const_cast<TransformerImpl*>(this)->projections();
  return {list.begin(), list.end()};
}

torch::Tensor TransformerImpl::lm_head_weight() {
  return lm_head_ ? lm_head_->weight : model_->embed_tokens()->weight;
}

torch::Tensor TransformerImpl::logits(const torch::Tensor& hidden) {
  const bool invariant = batch_invariant_now(invariant_, hidden);
  if (torch::GradMode::is_enabled()) return gemm(hidden, lm_head_weight(), {}, invariant);
  return lm_head_gemm_.apply(hidden, {lm_head_weight()}, {}, invariant);
}

torch::Tensor positions_from_mask(const torch::Tensor& token_mask) {
  return (token_mask.to(torch::kLong).cumsum(-1) - 1).clamp_min(0);
}

torch::Tensor attention_mask(const torch::Tensor& token_mask, const torch::Tensor& positions) {
  TORCH_CHECK(token_mask.dim() == 2 && token_mask.sizes() == positions.sizes(),
              "token_mask ", token_mask.sizes(), " and positions ", positions.sizes(), " must both be [B, T]");
  const int64_t T = positions.size(1);
  auto doc = (positions == 0).to(torch::kLong).cumsum(-1);                          // [B, T]
  auto same_doc = doc.unsqueeze(2) == doc.unsqueeze(1);                             // [B, T, T]
  auto causal = torch::ones({T, T}, torch::dtype(torch::kBool).device(positions.device())).tril();
  auto real_key = token_mask.to(torch::kBool).unsqueeze(1);                     // [B, 1, T]
  auto self = torch::eye(T, torch::dtype(torch::kBool).device(positions.device()));
  return (same_doc.logical_and(causal).logical_and(real_key)).logical_or(self).unsqueeze(1);  // [B, 1, T, T]
}

torch::Tensor attention_mask_unless_causal(const torch::Tensor& token_mask, const torch::Tensor& positions) {
  auto plain = torch::arange(positions.size(1), positions.options()).unsqueeze(0);
  if (token_mask.all().item<bool>() && torch::equal(positions, plain.expand_as(positions))) return {};
  return attention_mask(token_mask, positions);
}

}  // namespace troupe
