// The decoder-only transformer (Llama-3, Qwen2, Qwen3, SmolLM2) as LibTorch modules whose
// parameter names are Hugging Face's. forward() stops at the final norm: the LM head is
// applied by the caller, so losses can go chunk by chunk without a [B, T, vocab] tensor.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "kernels/weight_only.hpp"
#include "policy/model_config.hpp"
#include "policy/weight_format.hpp"

namespace troupe {

// Keys and values held once for several rows of a decode batch: a prompt prefilled once for its
// n samples. k[l], v[l] are [1, n_kv, P, head_dim].
struct SharedKV {
  std::vector<torch::Tensor> k, v;
  int64_t length() const { return k.empty() ? 0 : k[0].size(2); }
};

// Keys and values of past positions, allocated once: k[l], v[l] are [B, n_kv, capacity, head_dim].
// Every row shares `length`; rows that started later are told apart by the attention mask.
struct KVCache {
  std::vector<torch::Tensor> k, v;
  int64_t length = 0;
  // Per-row mode, for decoding sequences of different lengths together (the engine): when
  // defined, each row writes its one new key/value at write_index[r] and attends over its keys
  // [0, write_index[r]]; `length` is then unused. On a CPU in float32 or bfloat16 (not
  // batch-invariant) one kernel does both (kernels/decode_attention.hpp); elsewhere the keys
  // [0, span) are read, masked by the caller with the mask per_row gives.
  torch::Tensor write_index;  // [B] long
  int64_t span = 0;
  // Per-row mode with shared prefixes (CPU, float32 or bfloat16, not batch-invariant): the rows
  // of each group attend over their group's SharedKV, then over their own keys as above, in one
  // softmax. Rows in no group attend over their own keys only.
  struct PrefixGroup {
    const SharedKV* kv;
    torch::Tensor rows;  // [G] long: the batch rows whose keys start with kv
  };
  std::vector<PrefixGroup> prefixes;

  static KVCache allocate(const ModelConfig& config, int64_t batch, int64_t capacity,
                          torch::TensorOptions options);
  // The first `rows` rows of this cache in per-row mode (the engine's decode step): row r writes
  // its new key at write[r] and attends over keys [0, span). `keys` holds 0, 1, ... (at least span
  // of them). Returns the view and its mask, keys <= write, shaped [rows, 1, 1, span].
  std::pair<KVCache, torch::Tensor> per_row(int64_t rows, const torch::Tensor& write, int64_t span,
                                            const torch::Tensor& keys) const;
  int64_t capacity() const { return k.empty() ? 0 : k[0].size(2); }
};

// Forward passes without autograd can run batch-invariant kernels (kernels/batch_invariant.hpp,
// CPU float32/float64): each row's result then depends on that row alone, so a token decoded
// with a KV cache beside other sequences gets bit for bit the log-prob a full forward pass over
// its sequence gives. set_batch_invariant turns it on for a module and everything under it.
// With autograd, on CUDA or in bfloat16, the usual ATen kernels run whatever the flag says.
bool batch_invariant_now(bool on, const torch::Tensor& x);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  // (norm(residual + x), residual + x): the residual stream's add and the next norm (one fused
  // kernel in inference, with set_fused_kernels).
  std::pair<torch::Tensor, torch::Tensor> add_and_norm(const torch::Tensor& x, const torch::Tensor& residual);
  void set_batch_invariant(bool on) { invariant_ = on; }
  void set_fused_kernels(bool on) { fused_ = on; }

 private:
  torch::Tensor weight_;
  double eps_;
  bool invariant_ = false;
  bool fused_ = false;
};
TORCH_MODULE(RMSNorm);

// cos/sin tables for rotate-half RoPE, computed in float32 from the position ids.
class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const ModelConfig& config);
  // positions [B, T] -> cos, sin [B, T, head_dim] in `dtype`
  std::pair<torch::Tensor, torch::Tensor> cos_sin(const torch::Tensor& positions, torch::ScalarType dtype,
                                                  bool invariant = false);

 private:
  torch::Tensor inv_freq_;  // [head_dim / 2], float32; deliberately not a buffer, so casts keep it float32
};

// One linear projection of a block, with an optional LoRA adapter computed as PEFT's
// lora.Linear computes it: y = x W^T + b + B(A(dropout(x))) * scale, scale = alpha / r.
// The base is a torch::nn::Linear registered under its HF name; an adapter's A [r, in] and
// B [out, r] are registered under it as lora_A.weight and lora_B.weight, PEFT's names less
// its `base_model.model.` prefix. policy/lora.hpp attaches, merges, saves and loads them.
struct Projection {
  torch::nn::Linear base{nullptr};
  torch::Tensor lora_A, lora_B;  // [r, in], [out, r]; undefined without an adapter
  double lora_scale = 0.0;       // alpha / r (alpha / sqrt(r) with rsLoRA)
  double lora_dropout = 0.0;     // on the adapter's input, in training mode only

  bool has_lora() const { return lora_A.defined(); }
  // y = base(x) [..., out], or its slice of a fused GEMM -> y plus the adapter's term; y itself
  // when there is no adapter. The term is two thin GEMMs (x A^T, then B^T), never W + BA, so
  // training pays no full-size weight gradient.
  torch::Tensor add_lora(const torch::Tensor& y, const torch::Tensor& x, bool training) const;
  torch::Tensor forward(const torch::Tensor& x, bool training) const {
    return add_lora(base.ptr()->forward(x), x, training);
  }
};

// The weights of one GEMM of forward passes without autograd, y = x W^T + b: one projection's,
// or several concatenated along the output dimension (q/k/v, gate/up), since one large GEMM runs
// closer to peak than three small ones; in float, or quantized (kernels/weight_only.hpp) for
// generation engines.
// - full: with `keep` on (engines, evaluation), the parts are moved once into one buffer and each
//   part's parameter becomes a view of its rows, so the fused weight costs no memory and
//   in-place writes (an optimizer step, Engine::update_weights, load_weights) land in it. Without
//   `keep`, a concatenation is made for the call, unless the parts already lie side by side.
// - int8, int4: the quantized copy is rebuilt on every call unless `keep` is on; then kept until a
//   weight changes, seen by a new data pointer or a moved version counter.
// - full float32, or bfloat16 on a CPU with native bf16, kept: a copy in oneDNN's blocked layout
//   is kept the same way (kernels/packed_linear.hpp), since a plain weight is reordered (or copied
//   into MKL's panels) in every call.
struct GemmWeights {
  bool keep = false;
  WeightFormat format = WeightFormat::full;

  // x [..., in] -> [..., sum of the parts' out]; `invariant`: the batch-invariant GEMM (full only).
  torch::Tensor apply(const torch::Tensor& x, std::initializer_list<const Projection*> parts, bool invariant);
  torch::Tensor apply(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                      const std::vector<torch::Tensor>& biases, bool invariant);
  // Quantized (or packed) and kept: quantize now what apply would otherwise quantize in the first
  // pass after the weights changed, for activations of dtype `activations`; true when it did
  // (false when the kept copy is current, for full weights that are not packed, or without `keep`).
  bool prepare(std::initializer_list<const Projection*> parts, torch::ScalarType activations);
  bool prepare(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
               torch::ScalarType activations);
  int64_t bytes() const { return bytes_; }  // what the last GEMM read of its weights (and biases)

 private:
  // parts [out_i, in] (or biases [out_i]) that lie side by side in one storage -> one view
  // [sum out_i, in] over them; undefined when they do not.
  static torch::Tensor adjacent_view(const std::vector<torch::Tensor>& parts);
  // adjacent_view(parts); when they are not side by side and `adopt` is on, they are first moved
  // into one new buffer, of which each part's parameter becomes a view of its rows.
  static torch::Tensor fused(const std::vector<torch::Tensor>& parts, bool adopt);
  // The quantized copy of the weights made afresh unless `keep` is on and it is current; true
  // when it was made.
  bool refresh(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
               torch::ScalarType activations);
  // Full weights: the fused `weight` of the parts `weights` (and `biases`), packed again when
  // `keep` is on, a packed copy pays (packed_linear_pays) and the kept one was made from other
  // weights (key_); true when it packed. Where a packed copy does not pay, none is held.
  bool repack(const torch::Tensor& weight, const std::vector<torch::Tensor>& weights,
              const std::vector<torch::Tensor>& biases, torch::ScalarType activations);

  int64_t bytes_ = 0;
  torch::Tensor bias_;                  // the joined biases of a quantized format
  kernels::QuantizedWeight quantized_;  // format int8 or int4
  torch::Tensor packed_;                // format full: the weight in oneDNN's layout
  std::vector<std::pair<const void*, int64_t>> key_;  // each weight's data pointer and version
};

// Projections by HF module name ("model.layers.0.self_attn.q_proj"), in module order.
using ProjectionList = std::vector<std::pair<std::string, Projection*>>;

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const ModelConfig& config, int64_t layer);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, KVCache* cache);
  void projections(const std::string& prefix, ProjectionList& out);
  void keep_fused_weights(bool on) { qkv_.keep = o_.keep = on; }
  void set_weight_format(WeightFormat f) { qkv_.format = o_.format = f; }
  int prepare_weights(torch::ScalarType activations) {
    return qkv_.prepare({&q_proj_, &k_proj_, &v_proj_}, activations) + o_.prepare({&o_proj_}, activations);
  }
  int64_t gemm_bytes() const { return qkv_.bytes() + o_.bytes(); }
  void set_batch_invariant(bool on);
  void set_fused_kernels(bool on);

 private:
  int64_t layer_, n_heads_, n_kv_heads_, head_dim_;
  Projection q_proj_, k_proj_, v_proj_, o_proj_;
  RMSNorm q_norm_{nullptr}, k_norm_{nullptr};
  GemmWeights qkv_, o_;
  bool invariant_ = false;
  bool fused_ = false;
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  void projections(const std::string& prefix, ProjectionList& out);
  void keep_fused_weights(bool on) { gate_up_.keep = down_.keep = on; }
  void set_weight_format(WeightFormat f) { gate_up_.format = down_.format = f; }
  int prepare_weights(torch::ScalarType activations) {
    return gate_up_.prepare({&gate_proj_, &up_proj_}, activations) + down_.prepare({&down_proj_}, activations);
  }
  int64_t gemm_bytes() const { return gate_up_.bytes() + down_.bytes(); }
  void set_batch_invariant(bool on) { invariant_ = on; }

 private:
  Projection gate_proj_, up_proj_, down_proj_;
  GemmWeights gate_up_, down_;
  bool invariant_ = false;
};
TORCH_MODULE(MLP);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const ModelConfig& config, int64_t layer);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, KVCache* cache);
  void projections(const std::string& prefix, ProjectionList& out);
  void keep_fused_weights(bool on) {
    self_attn_->keep_fused_weights(on);
    mlp_->keep_fused_weights(on);
  }
  void set_weight_format(WeightFormat f) {
    self_attn_->set_weight_format(f);
    mlp_->set_weight_format(f);
  }
  int prepare_weights(torch::ScalarType activations) {
    return self_attn_->prepare_weights(activations) + mlp_->prepare_weights(activations);
  }
  int64_t gemm_bytes() const { return self_attn_->gemm_bytes() + mlp_->gemm_bytes(); }
  void set_batch_invariant(bool on) {
    self_attn_->set_batch_invariant(on);
    mlp_->set_batch_invariant(on);
    input_layernorm_->set_batch_invariant(on);
    post_attention_layernorm_->set_batch_invariant(on);
  }
  void set_fused_kernels(bool on) {
    self_attn_->set_fused_kernels(on);
    input_layernorm_->set_fused_kernels(on);
    post_attention_layernorm_->set_fused_kernels(on);
  }

 private:
  Attention self_attn_{nullptr};
  MLP mlp_{nullptr};
  RMSNorm input_layernorm_{nullptr}, post_attention_layernorm_{nullptr};
};
TORCH_MODULE(DecoderLayer);

// Hugging Face's LlamaModel / Qwen2Model / Qwen3Model: the trunk under the `model.` prefix.
class DecoderImpl : public torch::nn::Module {
 public:
  explicit DecoderImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions,
                        const torch::Tensor& mask, KVCache* cache);
  torch::nn::Embedding& embed_tokens() { return embed_tokens_; }
  void projections(const std::string& prefix, ProjectionList& out);
  void keep_fused_weights(bool on);
  void set_weight_format(WeightFormat f);
  int prepare_weights(torch::ScalarType activations);
  int64_t gemm_bytes() const;
  void set_batch_invariant(bool on);
  void set_fused_kernels(bool on);

 private:
  torch::nn::Embedding embed_tokens_{nullptr};
  torch::nn::ModuleList layers_;
  RMSNorm norm_{nullptr};
  RotaryEmbedding rotary_;
  bool invariant_ = false;
};
TORCH_MODULE(Decoder);

// Hugging Face's *ForCausalLM: `model.*` plus `lm_head.weight` unless embeddings are tied.
class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(ModelConfig config);

  // ids [B, T] -> hidden states [B, T, hidden] after the final norm.
  // positions [B, T]: RoPE positions (see positions_from_mask).
  // mask [B, 1, T, S] bool, true where a query may attend a key, S = cached + T
  //   (see attention_mask); undefined means plain causal attention over the cache and ids.
  // With a cache, keys and values are appended at cache->length, which then advances by T.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions,
                        const torch::Tensor& mask = {}, KVCache* cache = nullptr);

  // hidden [..., hidden] -> logits [..., vocab]; callers keep `hidden` to a chunk.
  torch::Tensor logits(const torch::Tensor& hidden);
  torch::Tensor lm_head_weight();  // the embedding matrix when tied
  const ModelConfig& config() const { return config_; }
  // Fused q/k/v and gate/up GEMMs in forward passes without autograd, over one buffer each of
  // which the projections' weights become views (see GemmWeights): faster decoding at no memory
  // cost; with a quantized weight format, the quantized copies are kept between passes.
  void keep_fused_weights(bool on);
  // The block projections and the LM head in a quantized format in forward passes without
  // autograd (generator.weights); the float parameters stay the source, requantized when they
  // change. An Error naming the weight when the format cannot hold one (weight_format_fits).
  void set_weight_format(WeightFormat format);
  WeightFormat weight_format() const { return lm_head_gemm_.format; }
  // Kept quantized copies (keep_fused_weights, a quantized format) brought up to date with the
  // float parameters now, rather than in the next forward pass: an engine calls it as it takes
  // new weights, so the requantization costs the weight sync, not the next decode step. For
  // activations of dtype `activations`; returns how many GEMMs' weights it quantized.
  int prepare_weights(torch::ScalarType activations);
  // Bytes of weights the last forward pass and LM head read through their GEMMs (block
  // projections and the LM head, in their format): what one decode step streams from memory.
  int64_t gemm_weight_bytes() const;
  // Batch-invariant kernels in forward passes without autograd (see batch_invariant_now), the
  // LM head included: what model.batch_invariant turns on in engines and the trainer alike.
  void set_batch_invariant(bool on);
  bool batch_invariant() const { return invariant_; }
  // The fused kernels of kernels/fused.hpp (RMSNorm with the residual add, rotary embedding) in
  // forward passes without autograd, on the CPU and, in a build with them, on CUDA: each is one
  // kernel in place of 8 or 9 ops, which a decode step pays for in dispatch on a CPU and in
  // launches on a GPU. They round otherwise than the plain ops (an RMSNorm's sum of squares in
  // another order), so they are for inference alone (engines, evaluation): off, a pass without
  // autograd gives a pass with autograd's bits, which a reference model equal to the policy and
  // activation checkpointing's recomputation rely on. Batch-invariant kernels take precedence.
  void set_fused_kernels(bool on);

  // The block projections LoRA can adapt (q/k/v/o_proj, gate/up/down_proj), by HF module name.
  ProjectionList projections();
  std::vector<std::pair<std::string, const Projection*>> projections() const;

 private:
  ModelConfig config_;
  Decoder model_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
  GemmWeights lm_head_gemm_;
  bool invariant_ = false;
};
TORCH_MODULE(Transformer);

// token_mask [B, T] (1 = token, 0 = padding) -> positions [B, T] counting real tokens
// from 0, so left- and right-padded rows get the positions of their unpadded selves.
torch::Tensor positions_from_mask(const torch::Tensor& token_mask);

// [B, 1, T, T] bool: causal, only real keys, and only keys of the same document, where a
// document starts wherever positions is 0 (packed rows restart positions per document).
// Each query may always see itself, so padded rows stay finite (their outputs are unused).
torch::Tensor attention_mask(const torch::Tensor& token_mask, const torch::Tensor& positions);

// The same, except undefined (plain causal attention: forward() then lets SDPA take its causal
// kernel, which never builds [T, T] scores) when every row is one document without padding.
torch::Tensor attention_mask_unless_causal(const torch::Tensor& token_mask, const torch::Tensor& positions);

}  // namespace troupe
