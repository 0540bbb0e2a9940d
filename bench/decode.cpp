// troupe's side of bench/decode_llamacpp.py: single-sequence greedy decode with the plain
// KV-cache loop (troupe::generate), EOS ignored, in a weight format (--weights). Times the decode
// steps only (the prefill and the first token are timed apart), the quantization of the weights
// (what a weight sync costs a quantized engine; for full float32 weights, or bf16 on a CPU with
// native bf16, the packing of the weights for oneDNN, unless --no-pack), the GEMM weight bytes a
// decode step reads, and this machine's memory bandwidth by a plain copy; prints one JSON line
// with them and the ids.
#include <chrono>
#include <iostream>
#include <sstream>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench/copy_bandwidth.hpp"
#include "generator/generate.hpp"
#include "kernels/cpu_features.hpp"
#include "kernels/packed_linear.hpp"
#include "kernels/weight_only.hpp"
#include "policy/checkpoint.hpp"

int main(int argc, char** argv) {
  std::string model_path, prompt_ids, dtype_name = "float32";
  int64_t max_tokens = 128, threads = 0;
  CLI::App app{"Time troupe's single-sequence greedy decode"};
  app.add_option("--model", model_path)->required();
  app.add_option("--prompt-ids", prompt_ids, "Comma-separated token ids")->required();
  app.add_option("--max-tokens", max_tokens)->check(CLI::Range(2, 1 << 20));
  app.add_option("--threads", threads, "Intra-op threads; 0 keeps LibTorch's default");
  app.add_option("--dtype", dtype_name);
  std::string weights_name = "full";
  app.add_option("--weights", weights_name, "full, int8 or int4");
  bool no_pack = false;
  app.add_flag("--no-pack", no_pack, "full weights: multiply by the plain weight, not a packed oneDNN copy (A/B)");
  CLI11_PARSE(app, argc, argv);
  troupe::kernels::set_packed_linear(!no_pack);

  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  std::vector<int32_t> prompt;
  std::stringstream in(prompt_ids);
  for (std::string item; std::getline(in, item, ',');) prompt.push_back(std::stoi(item));

  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  auto weights = troupe::from_name<troupe::WeightFormat>(weights_name);
  if (!weights) {
    std::cerr << "--weights " << weights_name << ": expected full, int8 or int4\n";
    return 2;
  }
  auto m = troupe::load_model(model_path, {.dtype = dtype, .tokenizer = false});
  m.model->eval();
  m.model->keep_fused_weights(true);  // as an engine does: weights change only at a sync
  m.model->set_fused_kernels(true);
  m.model->set_weight_format(*weights);
  troupe::SamplingParams greedy{.temperature = 0, .max_tokens = max_tokens, .ignore_eos = true};
  using clock = std::chrono::steady_clock;
  auto seconds = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  // What a weight sync costs a quantized engine: its kept quantized copies made afresh, as
  // Engine::update_weights makes them (the fused q/k/v and gate/up GEMMs, and the LM head), timed
  // apart from decoding.
  double quantize_s = 0;
  {
    torch::NoGradGuard no_grad;
    auto q0 = clock::now();
    if (m.model->prepare_weights(dtype) > 0) quantize_s = seconds(q0, clock::now());
  }
  troupe::generate(*m.model, prompt, {.temperature = 0, .max_tokens = 4}, {});  // warm-up
  std::vector<clock::time_point> stamps;  // one per token, taken as soon as it is chosen
  auto start = clock::now();
  auto out = troupe::generate(*m.model, prompt, greedy, {}, [&](int32_t) { stamps.push_back(clock::now()); });
  double decode_s = seconds(stamps.front(), stamps.back());  // max_tokens - 1 decode steps
  int64_t steps = static_cast<int64_t>(stamps.size()) - 1;
  nlohmann::json result = {{"tokens_per_s", steps / decode_s},
                           {"ms_per_token", 1e3 * decode_s / steps},
                           {"prefill_ms", 1e3 * seconds(start, stamps.front())},
                           {"prompt_tokens", prompt.size()},
                           {"threads", at::get_num_threads()},
                           {"weights", weights_name},
                           {"dtype", dtype_name},
                           {"weight_bytes_per_token", m.model->gemm_weight_bytes()},
                           {"quantize_s", quantize_s},
                           {"copy_bytes_per_s", troupe::bench::copy_bandwidth()},
                           {"cpu_bf16", troupe::cpu_bf16().reason},
                           // int8/int4 over float32 activations, one row: the few-row kernel's loop
                           {"few_rows", troupe::kernels::few_rows_vectorized() ? "AVX2 + FMA loop" : "plain loop"},
                           {"packed", *weights == troupe::WeightFormat::full &&
                                               troupe::kernels::packed_linear_pays(m.model->lm_head_weight(), dtype)},
                           {"ids", out.ids}};
  std::cout << result.dump() << std::endl;
  return 0;
}
