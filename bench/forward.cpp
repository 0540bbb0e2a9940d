// troupe's side of bench/forward_throughput.py: forward passes of a model over a fixed random
// batch, timed after a warm-up; prints one JSON line. Not a test: no assertions on speed.
// --logits FILE also writes the batch's ids and logits (safetensors), for a parity check of
// any --device against another implementation.
#include <chrono>
#include <iostream>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/safetensors.hpp"

int main(int argc, char** argv) {
  std::string model_path, dtype_name = "float32", device_name = "cpu", logits_path;
  int64_t batch = 8, seq = 256, iters = 5;
  CLI::App app{"Time troupe's forward pass"};
  app.add_option("--model", model_path)->required();
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--iters", iters);
  app.add_option("--dtype", dtype_name);
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  app.add_option("--logits", logits_path, "Write input_ids [B, T] and float32 logits [B, T, V] here (safetensors)");
  CLI11_PARSE(app, argc, argv);

  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  const torch::Device device(device_name);
  auto m = troupe::load_model(model_path, {.dtype = dtype, .device = device, .tokenizer = false});
  c10::InferenceMode inference;  // as transformers' side runs under torch.inference_mode()
  torch::manual_seed(0);
  auto ids = torch::randint(0, m.config.vocab_size, {batch, seq}, torch::kLong);  // drawn on the CPU: same ids on any device
  auto positions = torch::arange(seq).unsqueeze(0).expand({batch, seq}).contiguous();
  auto ids_d = ids.to(device), positions_d = positions.to(device);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  m.model->forward(ids_d, positions_d);  // warm-up: first-call allocations and oneDNN primitive caches
  sync();
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) m.model->forward(ids_d, positions_d);
  sync();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!logits_path.empty()) {
    auto logits = m.model->logits(m.model->forward(ids_d, positions_d)).to(torch::kCPU, torch::kFloat32).contiguous();
    namespace st = troupe::safetensors;
    std::vector<st::TensorRef> refs{
        {"input_ids", st::Dtype::I64, ids.sizes().vec(), ids.data_ptr(), static_cast<size_t>(ids.nbytes())},
        {"logits", st::Dtype::F32, logits.sizes().vec(), logits.data_ptr(), static_cast<size_t>(logits.nbytes())}};
    st::write_file(logits_path, refs);
  }
  std::string config = at::show_config();
  nlohmann::json out = {{"tokens_per_s", batch * seq * iters / seconds},
                        {"seconds_per_forward", seconds / iters},
                        {"threads", at::get_num_threads()},
                        {"device", device.str()},
                        {"mkl", config.find("USE_MKL=ON") != std::string::npos || config.find("MKL") != std::string::npos},
                        {"mkldnn", config.find("USE_MKLDNN=ON") != std::string::npos}};
  std::cout << out.dump() << std::endl;
  return 0;
}
