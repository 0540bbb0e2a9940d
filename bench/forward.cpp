// troupe's side of bench/forward_throughput.py: forward passes of a model over a fixed random
// batch, timed after a warm-up; prints one JSON line. Not a test: no assertions on speed.
#include <chrono>
#include <iostream>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"

int main(int argc, char** argv) {
  std::string model_path, dtype_name = "float32";
  int64_t batch = 8, seq = 256, iters = 5;
  CLI::App app{"Time troupe's forward pass"};
  app.add_option("--model", model_path)->required();
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--iters", iters);
  app.add_option("--dtype", dtype_name);
  CLI11_PARSE(app, argc, argv);

  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  auto m = troupe::load_model(model_path, {.dtype = dtype, .tokenizer = false});
  c10::InferenceMode inference;  // as transformers' side runs under torch.inference_mode()
  torch::manual_seed(0);
  auto ids = torch::randint(0, m.config.vocab_size, {batch, seq}, torch::kLong);
  auto positions = torch::arange(seq).unsqueeze(0).expand({batch, seq}).contiguous();
  m.model->forward(ids, positions);  // warm-up: first-call allocations and oneDNN primitive caches
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) m.model->forward(ids, positions);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string config = at::show_config();
  nlohmann::json out = {{"tokens_per_s", batch * seq * iters / seconds},
                        {"seconds_per_forward", seconds / iters},
                        {"threads", at::get_num_threads()},
                        {"mkl", config.find("USE_MKL=ON") != std::string::npos || config.find("MKL") != std::string::npos},
                        {"mkldnn", config.find("USE_MKLDNN=ON") != std::string::npos}};
  std::cout << out.dump() << std::endl;
  return 0;
}
