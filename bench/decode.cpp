// troupe's side of bench/decode_llamacpp.py: single-sequence greedy decode with the plain
// KV-cache loop (troupe::generate), EOS ignored. Times the decode steps only (the prefill and
// the first token are timed apart); prints one JSON line with the timings and the token ids.
#include <chrono>
#include <iostream>
#include <sstream>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "generator/generate.hpp"
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
  CLI11_PARSE(app, argc, argv);

  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  std::vector<int32_t> prompt;
  std::stringstream in(prompt_ids);
  for (std::string item; std::getline(in, item, ',');) prompt.push_back(std::stoi(item));

  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  auto m = troupe::load_model(model_path, {.dtype = dtype, .tokenizer = false});
  troupe::SamplingParams greedy{.temperature = 0, .max_tokens = max_tokens, .ignore_eos = true};
  troupe::generate(*m.model, prompt, {.temperature = 0, .max_tokens = 4}, {});  // warm-up

  using clock = std::chrono::steady_clock;
  std::vector<clock::time_point> stamps;  // one per token, taken as soon as it is chosen
  auto start = clock::now();
  auto out = troupe::generate(*m.model, prompt, greedy, {}, [&](int32_t) { stamps.push_back(clock::now()); });
  auto seconds = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  double decode_s = seconds(stamps.front(), stamps.back());  // max_tokens - 1 decode steps
  int64_t steps = static_cast<int64_t>(stamps.size()) - 1;
  nlohmann::json result = {{"tokens_per_s", steps / decode_s},
                           {"ms_per_token", 1e3 * decode_s / steps},
                           {"prefill_ms", 1e3 * seconds(start, stamps.front())},
                           {"prompt_tokens", prompt.size()},
                           {"threads", at::get_num_threads()},
                           {"ids", out.ids}};
  std::cout << result.dump() << std::endl;
  return 0;
}
