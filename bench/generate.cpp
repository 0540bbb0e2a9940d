// troupe's side of bench/generation_throughput.py: the engine generates n samples of each
// prompt (token ids from a JSON file) to a fixed length; prints one JSON line with timings, the
// bytes its decode steps read at least (below), and this machine's bandwidth by a plain copy.
#include <chrono>
#include <fstream>
#include <map>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench/copy_bandwidth.hpp"
#include "generator/engine.hpp"
#include "kernels/packed_linear.hpp"
#include "policy/checkpoint.hpp"

int main(int argc, char** argv) {
  std::string model_path, prompts_path, dtype_name = "float32", device_name = "cpu";
  int64_t n = 8, max_tokens = 128, max_batch = 128;
  bool batch_invariant = false, no_pack = false;
  std::string prefix_name = "shared", decode_name = "auto";
  CLI::App app{"Time troupe's generation engine"};
  app.add_option("--model", model_path)->required();
  app.add_option("--prompts", prompts_path, "JSON list of token-id lists")->required();
  app.add_option("--n", n);
  app.add_option("--max-tokens", max_tokens);
  app.add_option("--max-batch", max_batch);
  app.add_option("--dtype", dtype_name);
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  app.add_option("--prefix", prefix_name, "separate, copy or shared: the engine's PrefixSharing");
  app.add_option("--decode", decode_name, "auto, eager, graphs or static_eager: the engine's DecodeMode (auto: graphs on CUDA)");
  app.add_flag("--batch-invariant", batch_invariant, "model.batch_invariant: the batch-invariant kernels (CPU)");
  app.add_flag("--no-pack", no_pack, "CPU: multiply by the plain weights, not packed oneDNN copies (A/B)");
  CLI11_PARSE(app, argc, argv);

  const std::map<std::string, troupe::PrefixSharing> prefixes = {
      {"separate", troupe::PrefixSharing::separate}, {"copy", troupe::PrefixSharing::copy}, {"shared", troupe::PrefixSharing::shared}};
  if (!prefixes.count(prefix_name)) {
    std::cerr << "--prefix " << prefix_name << ": expected separate, copy or shared\n";
    return 2;
  }
  const std::map<std::string, troupe::DecodeMode> decodes = {{"auto", troupe::DecodeMode::automatic},
                                                              {"eager", troupe::DecodeMode::eager},
                                                              {"graphs", troupe::DecodeMode::graphs},
                                                              {"static_eager", troupe::DecodeMode::static_eager}};
  if (!decodes.count(decode_name)) {
    std::cerr << "--decode " << decode_name << ": expected auto, eager, graphs or static_eager\n";
    return 2;
  }
  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  troupe::kernels::set_packed_linear(!no_pack);
  try {  // an engine or model that cannot run here is an error message, not an abort
    // Timing needs no device sync: every step brings its sampled ids back to the host.
    auto m = troupe::load_model(model_path, {.dtype = dtype, .device = torch::Device(device_name), .tokenizer = false});
    auto prompts = nlohmann::json::parse(std::ifstream(prompts_path)).get<std::vector<std::vector<int32_t>>>();
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
    troupe::Engine engine(m.model, std::nullopt,
                          {.max_batch = max_batch, .max_seq_len = longest + max_tokens, .batch_invariant = batch_invariant,
                           .prefix = prefixes.at(prefix_name), .decode = decodes.at(decode_name)});
    troupe::SamplingParams params{.n = n, .temperature = 1.0, .max_tokens = max_tokens, .ignore_eos = true, .seed = 0};
    engine.generate({prompts[0]}, {.temperature = 0, .max_tokens = 4});  // warm-up
    auto start = std::chrono::steady_clock::now();
    auto out = engine.generate(prompts, params);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    int64_t tokens = 0;
    for (const auto& c : out) tokens += c.ids.size();
    // What the decode steps read at least: the GEMM weights once a step for the whole batch, and
    // each row's keys and values so far, its group's prompt once per group where the engine
    // shares it (Engine::prefix_sharing), else each row its own copy. Every row has exactly max_tokens tokens (EOS ignored), the first from its
    // prefill; rows beyond max_batch wait for a later wave of decode steps.
    const auto& c = m.model->config();
    const int64_t rows = static_cast<int64_t>(prompts.size()) * n;
    const int64_t steps = (rows + max_batch - 1) / max_batch * (max_tokens - 1);
    const int64_t key_bytes = c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * torch::elementSize(dtype);
    const bool shared = engine.prefix_sharing() == troupe::PrefixSharing::shared;
    int64_t keys = 0;  // keys (and values) read over all decode steps
    for (const auto& p : prompts)
      for (int64_t t = 1; t < max_tokens; ++t)
        keys += shared ? static_cast<int64_t>(p.size()) + n * t : n * (static_cast<int64_t>(p.size()) + t);
    const double weight_bytes = static_cast<double>(m.model->gemm_weight_bytes()) * steps;
    const double kv_bytes = static_cast<double>(keys) * key_bytes;
    std::cout << nlohmann::json{{"seconds", seconds},
                                {"tokens", tokens},
                                {"tokens_per_s", tokens / seconds},
                                {"graphs", engine.decode_graphs()},
                                {"weight_bytes_per_token", weight_bytes / tokens},
                                {"kv_bytes_per_token", kv_bytes / tokens},
                                {"copy_bytes_per_s", troupe::bench::copy_bandwidth(torch::Device(device_name))}}
                     .dump()
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
