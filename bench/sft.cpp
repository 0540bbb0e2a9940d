// troupe's side of bench/sft_throughput.py: SFT steps (AdamW, clipping, loss on every token)
// over fixed rows of token ids from a JSON file, timed after warm-up steps; prints one JSON
// line with tokens/s and the process's peak RSS. Not a test: no assertions on speed or memory.
// Under torchrun (RANK, WORLD_SIZE, ...) each rank trains its share of every batch, data
// parallel with --sharding, and prints its own line (bench/sft_parallel.py).
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "trainer/data_parallel.hpp"
#include "trainer/trainer.hpp"

namespace {
// A field of /proc/self/status in MiB (VmHWM: peak resident set, VmRSS: now); -1 elsewhere.
double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;  // kB
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  std::string model_path, rows_path, dtype_name = "float32";
  int64_t batch = 4, steps = 3, warmup = 1, threads = 0;
  double lr = 1e-5, max_grad_norm = 1.0;
  bool checkpointing = false, no_prefetch = false;
  std::string sharding = "none";
  CLI::App app{"Time troupe's SFT training steps"};
  app.add_option("--model", model_path)->required();
  app.add_option("--rows", rows_path, "JSON list of token-id rows, batch x (warmup + steps) of them")->required();
  app.add_option("--batch", batch, "rows per optimizer step (one micro-batch)");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--threads", threads, "0: LibTorch's default");
  app.add_option("--dtype", dtype_name);
  app.add_option("--lr", lr);
  app.add_option("--max-grad-norm", max_grad_norm);
  app.add_flag("--activation-checkpointing", checkpointing);
  app.add_option("--sharding", sharding, "under torchrun: none, zero1, zero2 or zero3")
      ->check(CLI::IsMember({"none", "zero1", "zero2", "zero3"}));
  app.add_flag("--no-prefetch", no_prefetch, "zero3: gather each layer only when it computes");
  CLI11_PARSE(app, argc, argv);

  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  auto dtype = dtype_name == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  auto m = troupe::load_model(model_path, {.dtype = dtype, .tokenizer = false});
  auto rows = nlohmann::json::parse(std::ifstream(rows_path)).get<std::vector<std::vector<int32_t>>>();
  if (static_cast<int64_t>(rows.size()) < batch * (warmup + steps)) {
    std::cerr << "bench_sft: " << rows_path << " has " << rows.size() << " rows, need " << batch * (warmup + steps)
              << "\n";
    return 1;
  }
  const troupe::ParallelEnv env = troupe::parallel_env();
  // This rank's rows of each batch: contiguous, in rank order.
  const int64_t first = batch * env.rank / env.world_size, last = batch * (env.rank + 1) / env.world_size;
  // Collated up front so the timed loop holds only the steps.
  std::vector<std::vector<troupe::sft::Batch>> step_batches;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    std::vector<troupe::sft::Sequence> seqs;
    for (int64_t r = first; r < last; ++r) {
      const auto& ids = rows[s * batch + r];
      seqs.push_back({.ids = ids, .loss_mask = std::vector<uint8_t>(ids.size(), 1)});
    }
    step_batches.push_back(troupe::sft::micro_batches(seqs, {.packing = false}));
  }
  const double rss_loaded = status_mib("VmRSS");

  troupe::TrainerConfig config;
  config.optimizer.lr = lr;
  config.optimizer.max_grad_norm = max_grad_norm;
  config.activation_checkpointing = checkpointing;
  troupe::Trainer trainer(m.model, config);
  if (env.distributed()) {
    auto group = troupe::ProcessGroup::connect(env, torch::kCPU, std::chrono::minutes(10));
    troupe::shard_trainer(trainer, group, troupe::sharding_of(sharding), config.optimizer);
    trainer.data_parallel()->set_prefetch(!no_prefetch);
  }
  std::vector<double> losses;
  int64_t tokens = 0;
  auto start = std::chrono::steady_clock::now();
  std::clock_t cpu_start = std::clock();
  for (int64_t s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      start = std::chrono::steady_clock::now();
      cpu_start = std::clock();
    }
    auto metrics = trainer.sft_step(step_batches[s]);
    losses.push_back(metrics.loss);
    if (s >= warmup) tokens += batch * static_cast<int64_t>(rows[s * batch].size());
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;  // all threads
  std::string show = at::show_config();
  nlohmann::json out = {{"rank", env.rank},
                        {"world_size", env.world_size},
                        {"tokens_per_s", tokens / seconds},
                        {"seconds_per_step", seconds / steps},
                        {"cpu_seconds_per_step", cpu_seconds / steps},
                        {"losses", losses},
                        {"rss_loaded_mib", rss_loaded},
                        {"peak_rss_mib", status_mib("VmHWM")},
                        {"threads", at::get_num_threads()},
                        {"mkl", show.find("USE_MKL=ON") != std::string::npos || show.find("MKL") != std::string::npos},
                        {"mkldnn", show.find("USE_MKLDNN=ON") != std::string::npos}};
  std::cout << out.dump() << std::endl;
  return 0;
}
