// The troupe command line: parses arguments and calls the libraries; nothing else lives here.
// Every troupe::Error (and any other exception) becomes one line on stderr and exit code 1.
#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <malloc.h>
#include <pthread.h>
#include <thread>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "actors/config.hpp"
#include "actors/launch.hpp"
#include "actors/progress_line.hpp"
#include "actors/recipe_run.hpp"
#include "actors/run.hpp"
#include "actors/worker.hpp"
#include "actors/run_status.hpp"
#include "apps/dashboard.hpp"
#include "apps/plot.hpp"
#include "generator/generate.hpp"
#include "generator/server.hpp"
#include "policy/chat_template.hpp"
#include "policy/checkpoint.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"
#include "policy/perplexity.hpp"
#include "reward/score_file.hpp"
#include "trainer/process_group.hpp"
#include "trainer/eval_gsm8k.hpp"

namespace {

using namespace troupe;
namespace fs = std::filesystem;

// --dtype of the commands that compute on the CPU: auto decided here, a slow choice warned about.
torch::Dtype parse_dtype(const std::string& name) {
  auto choice = choose_dtype(name, torch::kCPU, "--dtype");
  if (!choice.note.empty()) std::cerr << "troupe: " << choice.note << std::endl;
  return choice.dtype;
}

const Tokenizer& require_tokenizer(const LoadedModel& m) {
  if (!m.tokenizer) throw Error(m.source.string() + ": no tokenizer.json next to the model");
  return *m.tokenizer;
}

// Stop at the model's end-of-sequence ids and at the template's end-of-turn token.
std::vector<int32_t> stop_ids(const LoadedModel& m, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (int64_t id : m.config.eos_token_ids) ids.push_back(static_cast<int32_t>(id));
  if (auto eos = tok.eos_id()) ids.push_back(*eos);
  for (const char* end_of_turn : {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"})
    if (auto id = tok.token_id(end_of_turn)) ids.push_back(*id);
  return ids;
}

struct GenerateArgs {
  std::string model, prompt, system, dtype = "float32";
  bool chat = false;
  int64_t max_tokens = 128;
  double temperature = 0.0;
  uint64_t seed = 0;
};

int run_generate(const GenerateArgs& a) {
  auto m = load_model(a.model, {.dtype = parse_dtype(a.dtype)});
  const Tokenizer& tok = require_tokenizer(m);
  std::string text = a.prompt;
  if (a.chat) {
    if (!tok.chat_template()) throw Error(a.model + ": the tokenizer has no chat template; drop --chat");
    auto tmpl = ChatTemplate::detect(*tok.chat_template(), a.model);
    std::vector<ChatMessage> messages;
    if (!a.system.empty()) messages.push_back({"system", a.system});
    messages.push_back({"user", a.prompt});
    text = tmpl.render(messages, /*add_generation_prompt=*/true);
  }
  auto prompt = tok.encode(text);
  auto stops = stop_ids(m, tok);
  // Print as tokens arrive, holding back text that ends inside a multi-byte character.
  std::vector<int32_t> done;
  size_t printed = 0;
  auto on_token = [&](int32_t id) {
    if (std::find(stops.begin(), stops.end(), id) != stops.end()) return;
    done.push_back(id);
    std::string s = tok.decode(done);
    if (s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0) return;
    std::cout << s.substr(printed) << std::flush;
    printed = s.size();
  };
  SamplingParams params{.temperature = a.temperature, .max_tokens = a.max_tokens, .seed = a.seed};
  generate(*m.model, prompt, params, stops, on_token);
  std::string s = tok.decode(done);
  std::cout << s.substr(std::min(printed, s.size())) << std::endl;
  return 0;
}

int run_tokenize(const std::string& path, bool decode) {
  auto tok = Tokenizer::load(path);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    if (!decode) {
      std::cout << nlohmann::json(tok.encode(line)).dump() << "\n";
      continue;
    }
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_array())
      throw Error("<stdin>:" + std::to_string(line_no) + ": expected a JSON array of token ids");
    std::vector<int32_t> ids;
    for (const auto& v : j) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
        throw Error("<stdin>:" + std::to_string(line_no) + ": " + v.dump() + " is not a token id (vocabulary size " +
                    std::to_string(tok.vocab_size()) + ")");
      ids.push_back(v.get<int32_t>());
    }
    std::cout << nlohmann::json(tok.decode(ids)).dump() << "\n";
  }
  return 0;
}

std::vector<std::string> read_jsonl_field(const std::string& path, const std::string& field, int64_t limit) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open");
  std::vector<std::string> texts;
  std::string line;
  int64_t line_no = 0;
  while ((limit <= 0 || static_cast<int64_t>(texts.size()) < limit) && std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    std::string where = path + ":" + std::to_string(line_no);
    if (j.is_discarded() || !j.is_object()) throw Error(where + ": not a JSON object");
    auto it = j.find(field);
    if (it == j.end()) throw Error(where + ": no field '" + field + "'");
    if (!it->is_string()) throw Error(where + ": field '" + field + "' is not a string");
    texts.push_back(it->get<std::string>());
  }
  if (texts.empty()) throw Error(path + ": no texts to evaluate");
  return texts;
}

// What each recipe trains, in the order `troupe ls` lists them (RL first, then the trainer alone).
struct RecipeLine {
  Recipe recipe;
  const char* what;
};
constexpr std::array<RecipeLine, 8> kRecipeLines = {{
    {Recipe::grpo, "async GRPO: generators sample G completions per prompt, rewards score them, the policy learns "
                   "from group-relative advantages (actor graph)"},
    {Recipe::ppo, "PPO: GRPO's graph with a value head on the policy's trunk and GAE over KL-shaped rewards "
                  "instead of group-relative advantages (actor graph)"},
    {Recipe::online_dpo, "online DPO: generators sample G completions per prompt, rewards rank them, each "
                         "prompt's best and worst form a DPO pair against the frozen start (actor graph)"},
    {Recipe::reinforce, "REINFORCE with a mean baseline: the plain policy gradient on reward minus the group's "
                        "mean, no clipping (actor graph; the smallest recipe, actors/recipes/reinforce.cpp)"},
    {Recipe::distill, "on-policy distillation: the student samples, a teacher model scores its tokens, and the "
                      "teacher's per-token reverse KL is the advantage (actor graph)"},
    {Recipe::sft, "supervised fine-tuning of all weights on prompt/response or chat JSONL, loss on the responses "
                  "(trainer alone)"},
    {Recipe::lora, "sft with LoRA adapters on the chosen projections, base weights frozen; checkpoints carry the "
                   "PEFT adapter (trainer alone)"},
    {Recipe::dpo, "direct preference optimization on (prompt, chosen, rejected) pairs against the frozen starting "
                  "model (trainer alone)"},
}};
static_assert(kRecipeLines.size() == std::size(kRecipes), "troupe ls: describe every recipe");

// The first line of a config's opening comment, without its '#': what the file is for. A
// sentence that goes on to the next comment line ends in " ...".
std::string opening_comment(const fs::path& path) {
  std::ifstream in(path);
  std::string first, next;
  if (!std::getline(in, first) || first.rfind('#', 0) != 0) return "(no opening comment)";
  auto strip = [](std::string s) {
    s.erase(0, s.find_first_not_of("# \t"));
    s.erase(s.find_last_not_of(" \t\r") + 1);
    return s;
  };
  first = strip(first);
  bool continues = std::getline(in, next) && next.rfind('#', 0) == 0 && !strip(next).empty();
  if (continues && !first.empty() && first.back() != '.') {
    first.erase(first.find_last_not_of(",:;") + 1);
    first += " ...";
  }
  return first;
}

// `troupe ls`: the recipes, then each file in ./configs/ with its recipe and opening comment.
// A config that does not load shows as an error line and the listing goes on; the exit code is
// 1 when any did not load or configs/ is missing.
int run_ls() {
  std::cout << "recipes:\n";
  size_t recipe_width = 0;
  for (const auto& r : kRecipeLines) recipe_width = std::max(recipe_width, to_string(r.recipe).size());
  for (const auto& r : kRecipeLines) {
    std::string name(to_string(r.recipe));
    std::cout << "  " << name << std::string(recipe_width + 2 - name.size(), ' ') << r.what << "\n";
  }
  std::error_code ec;
  const fs::path dir = "configs";
  if (!fs::is_directory(dir, ec)) {
    std::cout << std::flush;
    std::cerr << "troupe: error: no configs/ folder in " << fs::current_path(ec).string()
              << ": run troupe ls from the repository root (config paths are relative to the current folder)"
              << std::endl;
    return 1;
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file(ec) && e.path().filename().string().rfind('.', 0) != 0) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  size_t width = 0;
  for (const auto& f : files) width = std::max(width, f.generic_string().size());
  std::cout << "\nconfigs (troupe run CONFIG; troupe validate CONFIG checks one):\n";
  if (files.empty()) std::cout << "  (configs/ is empty)\n";
  int broken = 0;
  for (const auto& f : files) {
    std::string name = f.generic_string();
    std::cout << "  " << name << std::string(width + 2 - name.size(), ' ');
    try {
      std::string recipe(to_string(load_run_config(name).recipe));
      std::cout << recipe << std::string(recipe_width + 2 - recipe.size(), ' ') << opening_comment(f) << "\n";
    } catch (const std::exception& e) {
      ++broken;
      std::cout << "error: " << e.what() << "\n";
    }
  }
  std::cout << std::flush;
  if (broken) {
    std::cerr << "troupe: error: " << broken << " of " << files.size() << " configs in configs/ did not load" << std::endl;
    return 1;
  }
  return 0;
}

// `troupe plot`: a line per series drawn, then the file; what was skipped goes to stderr.
int run_plot(const PlotOptions& options) {
  auto result = plot_runs(options);
  for (const auto& note : result.notes) std::cerr << "troupe plot: " << note << std::endl;
  for (const auto& s : result.series) std::cout << s.run << " " << s.metric << ": " << s.points << " points\n";
  std::cout << "wrote " << options.output << " (" << options.width << "x" << options.height
            << (result.device == "pngcairo" ? " px" : " pt") << ")" << std::endl;
  return 0;
}

// HOST:PORT given as `key`, split.
std::pair<std::string, int> host_port(const std::string& address, const std::string& key) {
  auto split = split_host_port(address);
  if (!split) throw Error(key + " " + address + ": expected HOST:PORT, e.g. 127.0.0.1:8265 (port 0: any free one)");
  return {split->first, split->second};
}

// `troupe dashboard runs/`: the dashboard of finished and running runs, until Ctrl-C.
int run_dashboard(const std::string& root, const std::string& listen) {
  auto [host, port] = host_port(listen, "--listen");
  Dashboard dashboard(root, host, port, "--listen");
  std::cout << "troupe dashboard: " << root << " at " << dashboard.url() << " (Ctrl-C stops)" << std::endl;
  dashboard.serve_here();
  return 0;
}

}  // namespace

std::atomic<bool> g_stop{false};

// A first Ctrl-C stops the run after the current step, with its checkpoint and metrics as
// usual. A second Ctrl-C, or a SIGTERM, stops it now: metrics.jsonl and failures.jsonl are
// flushed line by line and a checkpoint counts only once its trainer_state.json is in place,
// so exiting at once loses only the step in progress (resume= continues from the last
// checkpoint). The signals are taken by one thread with sigwait, so that it may print and
// flush; they are blocked before any other thread starts, and every thread inherits that.
// `run_dir`'s status.json then says the run was stopped (the dashboard shows it so).
void watch_stop_signals(std::filesystem::path run_dir) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, run_dir] {
    for (;;) {
      int sig = 0;
      if (sigwait(&signals, &sig) != 0) continue;
      if (sig == SIGINT && !g_stop.exchange(true)) {
        std::cerr << "\ntroupe run: Ctrl-C: stopping after this step (Ctrl-C again stops now)" << std::endl;
        continue;
      }
      const std::string why = sig == SIGINT ? "second Ctrl-C" : "SIGTERM";
      std::cerr << "\ntroupe run: " << why << ": stopping now; resume= continues from the last checkpoint" << std::endl;
      troupe::end_run_status(run_dir, "stopped", -1, why + ": stopped at once, the step in progress lost");
      std::cout.flush();
      std::_Exit(128 + sig);
    }
  }).detach();
}

int run_from_config(const std::string& path, const std::vector<std::string>& overrides) {
  auto config = troupe::load_run_config(path, overrides);
  troupe::validate_paths(config);
  if (config.parallel.trainer_ranks > 1 && !troupe::parallel_env().distributed()) {
    // This process starts the ranks (each runs this same command) and supervises them.
    std::vector<std::string> args{"run", path};
    args.insert(args.end(), overrides.begin(), overrides.end());
    return troupe::launch_ranks(std::filesystem::read_symlink("/proc/self/exe").string(), args,
                                {.ranks = static_cast<int>(config.parallel.trainer_ranks),
                                 .threads_per_rank = static_cast<int>(config.trainer.threads)});
  }
  watch_stop_signals(config.run.dir);
  const bool rank0 = troupe::parallel_env().rank == 0;  // the other ranks of a job say nothing twice
  if (rank0) std::cout << "troupe run: " << path << " -> " << config.run.dir << std::endl;
  // After the signal mask: the dashboard's threads inherit it, so Ctrl-C still reaches the run.
  std::unique_ptr<troupe::Dashboard> dashboard;
  if (rank0 && !config.run.dashboard.empty()) {
    auto [host, port] = host_port(config.run.dashboard, "run.dashboard");
    std::filesystem::create_directories(config.run.dir);
    dashboard = std::make_unique<troupe::Dashboard>(config.run.dir, host, port,
                                                    config.origin.at("run.dashboard") + ": run.dashboard", /*one_run=*/true);
    dashboard->serve_in_background();
    std::cout << "troupe run: dashboard at " << dashboard->url() << std::endl;
  }
  auto result = troupe::run_config(config, &g_stop);
  if (!result.ok) {
    std::cerr << "troupe: error: " << result.error << " (after " << result.steps << " of " << config.trainer.steps
              << " steps; metrics so far in " << config.run.dir << "/metrics.jsonl)" << std::endl;
    return 1;
  }
  if (rank0)
    std::cout << "troupe run: done, " << result.steps << " steps; metrics in " << config.run.dir << "/metrics.jsonl\n"
              << troupe::run_folder_summary(config.run.dir) << std::flush;
  return 0;
}

int main(int argc, char** argv) {
  // A fixed threshold: tensors of 1 MB and more are mmapped and go back to the system when freed.
  // glibc's default raises the threshold to the size of each large block freed (up to 32 MB),
  // after which such blocks come from the heaps, and each thread's heap keeps what it frees:
  // model loads and training steps left gigabytes there (the float32 demo peaked at 8.2 GB
  // instead of 6.4 GB).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  CLI::App app{"troupe: asynchronous RL post-training for language models, as one native binary"};
  app.require_subcommand(1);

  GenerateArgs gen;
  auto* generate_cmd = app.add_subcommand("generate", "Generate a completion for one prompt");
  generate_cmd->add_option("--model", gen.model, "Hugging Face folder or .gguf file")->required();
  generate_cmd->add_option("--prompt", gen.prompt, "The prompt text")->required();
  generate_cmd->add_flag("--chat", gen.chat, "Wrap the prompt as a user turn with the model's chat template");
  generate_cmd->add_option("--system", gen.system, "A system message (with --chat)");
  generate_cmd->add_option("--max-tokens", gen.max_tokens, "Most new tokens")->check(CLI::Range(1, 1 << 20));
  generate_cmd->add_option("--temperature", gen.temperature, "0 for greedy")->check(CLI::Range(0.0, 100.0));
  generate_cmd->add_option("--seed", gen.seed, "Sampling seed");
  generate_cmd->add_option("--dtype", gen.dtype, "auto, float32, bfloat16 or float16 (auto: bfloat16 only where computed natively)");

  std::string tokenizer_path;
  bool decode = false;
  auto* tokenize_cmd = app.add_subcommand("tokenize", "Text lines on stdin to JSON arrays of token ids (or back)");
  tokenize_cmd->add_option("--tokenizer", tokenizer_path, "tokenizer.json, a Hugging Face folder or a .gguf file")
      ->required();
  tokenize_cmd->add_flag("--decode", decode, "Read JSON arrays of ids, print JSON strings");

  auto* eval_cmd = app.add_subcommand("eval", "Evaluate a model");
  eval_cmd->require_subcommand(1);
  std::string ppl_model, ppl_data, ppl_field = "text", ppl_dtype = "float32";
  int64_t ppl_limit = 0, ppl_batch = 8, ppl_max_length = 1024;
  auto* ppl_cmd = eval_cmd->add_subcommand("perplexity", "Perplexity over one text field of a JSONL file");
  ppl_cmd->add_option("--model", ppl_model, "Hugging Face folder or .gguf file")->required();
  ppl_cmd->add_option("--data", ppl_data, "JSONL file")->required();
  ppl_cmd->add_option("--field", ppl_field, "The field holding the text");
  ppl_cmd->add_option("--limit", ppl_limit, "Use the first N lines (0: all)")->check(CLI::NonNegativeNumber);
  ppl_cmd->add_option("--batch-size", ppl_batch, "Texts per forward pass")->check(CLI::Range(1, 4096));
  ppl_cmd->add_option("--max-length", ppl_max_length, "Cut texts to this many tokens")->check(CLI::Range(2, 1 << 20));
  ppl_cmd->add_option("--dtype", ppl_dtype, "auto, float32, bfloat16 or float16 (auto: bfloat16 only where computed natively)");
  std::string ppl_weights = "full";
  ppl_cmd->add_option("--weights", ppl_weights, "full, int8 or int4: the GEMM weights (as generator.weights)");

  Gsm8kEvalOptions g8k;
  std::string g8k_model, g8k_dtype = "float32";
  double g8k_temperature = 0;
  auto* gsm8k_cmd = eval_cmd->add_subcommand("gsm8k", "GSM8K accuracy (pass@1, pass@k) with the built-in engine");
  gsm8k_cmd->add_option("--model", g8k_model, "Hugging Face folder or .gguf file")->required();
  gsm8k_cmd->add_option("--data", g8k.data, "JSONL with question and answer fields (GSM8K's test.jsonl)")->required();
  gsm8k_cmd->add_option("--limit", g8k.limit, "Use the first N questions (0: all)")->check(CLI::NonNegativeNumber);
  gsm8k_cmd->add_option("--samples", g8k.samples, "K samples per question; K > 1 also prints pass@K")
      ->check(CLI::Range(1, 4096));
  gsm8k_cmd->add_option("--max-tokens", g8k.max_tokens, "Most new tokens per sample")->check(CLI::Range(1, 1 << 20));
  auto* g8k_temp = gsm8k_cmd->add_option("--temperature", g8k_temperature, "Default: greedy for K = 1, 1.0 for K > 1")
      ->check(CLI::Range(0.0, 100.0));
  gsm8k_cmd->add_option("--batch", g8k.batch, "Sequences decoded together")->check(CLI::Range(1, 4096));
  gsm8k_cmd->add_option("--system", g8k.system, "A system message (default: the chat template's)");
  gsm8k_cmd->add_option("--seed", g8k.seed, "Sampling seed");
  gsm8k_cmd->add_option("--dtype", g8k_dtype, "auto, float32, bfloat16 or float16 (auto: bfloat16 only where computed natively)");

  std::string convert_in, convert_out, convert_dtype = "float32";
  auto* convert_cmd = app.add_subcommand("convert", "Write a model (.gguf or HF folder) as a Hugging Face folder");
  convert_cmd->add_option("model", convert_in, "The .gguf file or Hugging Face folder")->required();
  convert_cmd->add_option("out_dir", convert_out, "The folder to write")->required();
  convert_cmd->add_option("--dtype", convert_dtype, "float32, bfloat16 or float16 on disk");

  ServeOptions srv;
  auto* serve_cmd = app.add_subcommand("serve", "Serve a model over vLLM's OpenAI-compatible HTTP API");
  serve_cmd->add_option("--model", srv.model, "Hugging Face folder or .gguf file")->required();
  serve_cmd->add_option("--host", srv.host, "Address to bind (default loopback only)");
  serve_cmd->add_option("--port", srv.port, "Port; 0 picks a free one")->check(CLI::Range(0, 65535));
  serve_cmd->add_option("--api-key", srv.api_key, "Require 'Authorization: Bearer KEY'");
  serve_cmd->add_option("--served-model-name", srv.served_model_name, "The model name clients use (default: --model)");
  serve_cmd->add_option("--dtype", srv.dtype, "auto, float32, bfloat16 or float16 (auto: bfloat16 only where computed natively)");
  serve_cmd->add_option("--device", srv.device, "cpu or cuda[:N]");
  serve_cmd->add_option("--max-batch", srv.max_batch, "Sequences decoded together")->check(CLI::Range(1, 4096));
  serve_cmd->add_option("--max-seq-len", srv.max_seq_len, "Prompt + completion tokens")->check(CLI::Range(2, 1 << 20));
  serve_cmd->add_option("--seed", srv.seed, "Sampling seed for requests without one");
  serve_cmd->add_option("--max-request-bytes", srv.max_request_bytes, "Largest request body")->check(CLI::Range(1024, 1 << 30));
  serve_cmd->add_option("--max-n", srv.max_n, "Largest n per request")->check(CLI::Range(1, 4096));
  serve_cmd->add_option("--max-tokens", srv.max_tokens, "Largest max_tokens per request")->check(CLI::Range(1, 1 << 20));
  serve_cmd->add_option("--request-timeout", srv.request_timeout_s, "Seconds for a request's headers and body to arrive (else 408)")
      ->check(CLI::Range(1, 3600));
  serve_cmd->add_option("--max-connections", srv.max_connections, "Open connections; past it the oldest idle one closes, or 503")
      ->check(CLI::Range(1, 1 << 20));

  std::string score_reward, score_data;
  auto* score_cmd = app.add_subcommand("score", "Print one reward score per line of a JSONL file (completion, answer)");
  score_cmd->add_option("--reward", score_reward, "math_answer, format, a plugin .so path or an http(s):// URL")
      ->required();
  score_cmd->add_option("data", score_data, "JSONL: completion, answer and optional prompt per line")->required();

  std::string validate_config;
  std::vector<std::string> validate_overrides;
  std::string run_config_path;
  std::vector<std::string> run_overrides;
  auto* run_cmd = app.add_subcommand("run", "Run the actor graph a YAML config describes (async GRPO)");
  run_cmd->add_option("config", run_config_path, "The YAML run config")->required();
  run_cmd->add_option("overrides", run_overrides, "key.path=value overrides, e.g. trainer.steps=20");

  auto* validate_cmd = app.add_subcommand("validate", "Check a run config (keys, types, ranges, paths) without running it");
  validate_cmd->add_option("config", validate_config, "The YAML run config")->required();
  validate_cmd->add_option("overrides", validate_overrides, "key.path=value overrides, as for troupe run");

  std::string worker_connect, worker_role = "generator";
  double worker_timeout_s = 60;
  auto* worker_cmd = app.add_subcommand("worker", "Join a running troupe run as one of its actors (a generator), from any machine");
  worker_cmd->add_option("--connect", worker_connect, "HOST:PORT the run's controller listens on")->required();
  worker_cmd->add_option("--role", worker_role, "What to run: generator, reward or reference")->capture_default_str();
  worker_cmd->add_option("--timeout", worker_timeout_s, "Seconds to keep trying to reach the controller")
      ->capture_default_str()->check(CLI::PositiveNumber);

  std::string dashboard_root, dashboard_listen = "127.0.0.1:8265";
  auto* dashboard_cmd = app.add_subcommand("dashboard", "Serve the dashboard of runs (finished or running) in the browser");
  dashboard_cmd->add_option("runs", dashboard_root, "A run folder, or a folder of them (e.g. runs/)")->required();
  dashboard_cmd->add_option("--listen", dashboard_listen, "HOST:PORT to serve on (loopback unless you choose otherwise)")
      ->capture_default_str();
  dashboard_cmd->footer("The page shows the chosen run's curves (rewards, loss, KL, staleness, tokens/s, generation "
                        "against training time), its actor graph with each actor's state and queue, and its latest "
                        "samples, updated every second from the run's files. During a run, run.dashboard=HOST:PORT "
                        "serves the same page from the run itself.");

  auto* ls_cmd = app.add_subcommand("ls", "List the recipes and the configs in ./configs/ (recipe and summary of each)");

  PlotOptions plot;
  auto* plot_cmd = app.add_subcommand("plot", "Draw runs' metrics.jsonl curves into a PNG or SVG, runs overlaid");
  plot_cmd->add_option("runs", plot.runs, "Run folders (each with a metrics.jsonl), or metrics.jsonl files")->required();
  plot_cmd->add_option("--metrics", plot.metrics, "Comma-separated metrics, one panel each, top to bottom "
                       "(default: reward/mean and loss, those the runs logged)")
      ->delimiter(',')->allow_extra_args(false);
  plot_cmd->add_option("-o,--output", plot.output, "The image; .png or .svg decides the format")->capture_default_str();
  plot_cmd->add_option("--width", plot.width, "Image width in pixels")->capture_default_str()->check(CLI::Range(400, 20000));
  plot_cmd->add_option("--height", plot.height, "Image height in pixels, shared by the panels")
      ->capture_default_str()->check(CLI::Range(150, 20000));
  plot_cmd->footer("Each panel plots one metric against \"step\", one colour per run, legend \"RUN METRIC\". "
                   "A line where the metric is null or missing is skipped (no point there; the curve joins its "
                   "neighbours), and so is a torn last line of a run still writing. Prints the points drawn per "
                   "series. Example: troupe plot runs/a runs/b --metrics reward/mean,kl -o curves.svg");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*generate_cmd) return run_generate(gen);
    if (*tokenize_cmd) return run_tokenize(tokenizer_path, decode);
    if (*serve_cmd) return serve(srv);
    if (*run_cmd) return run_from_config(run_config_path, run_overrides);
    if (*ls_cmd) return run_ls();
    if (*plot_cmd) return run_plot(plot);
    if (*dashboard_cmd) return run_dashboard(dashboard_root, dashboard_listen);
    if (*worker_cmd) {
      auto colon = worker_connect.rfind(':');
      int port = colon == std::string::npos ? -1 : std::atoi(worker_connect.c_str() + colon + 1);
      if (colon == std::string::npos || colon == 0 || port <= 0 || port > 65535)
        throw Error("--connect " + worker_connect + ": expected HOST:PORT, e.g. 10.0.0.5:4242");
      return run_worker(worker_connect.substr(0, colon), static_cast<uint16_t>(port), worker_role, worker_timeout_s);
    }
    if (*validate_cmd) {
      auto config = load_run_config(validate_config, validate_overrides);
      validate_paths(config);
      std::cout << validate_config << ": ok (" << summary(config) << ")" << std::endl;
      // The dtype a run computes in on this machine: what auto chose and why, as troupe run says it.
      const ModelDtype dtype = recipe::resolve_model_dtype(config.model);
      std::cout << "model.dtype: " << to_string(dtype) << std::endl;
      return 0;
    }
    if (*score_cmd) {
      for (double v : score_file(score_reward, score_data)) std::cout << v << "\n";
      return 0;
    }
    if (*ppl_cmd) {
      auto weights = from_name<WeightFormat>(ppl_weights);
      if (!weights) throw Error("--weights " + ppl_weights + ": expected full, int8 or int4");
      auto m = load_model(ppl_model, {.dtype = parse_dtype(ppl_dtype)});
      m.model->eval();
      m.model->keep_fused_weights(true);  // quantized once, not per batch
      m.model->set_fused_kernels(true);
      m.model->set_weight_format(*weights);
      auto texts = read_jsonl_field(ppl_data, ppl_field, ppl_limit);
      auto r = perplexity(*m.model, require_tokenizer(m), texts, ppl_batch, ppl_max_length);
      std::cout << "texts: " << texts.size() << "\ntokens: " << r.tokens << "\nmean_nll: " << r.mean_nll
                << "\nperplexity: " << r.perplexity << std::endl;
      return 0;
    }
    if (*gsm8k_cmd) {
      if (*g8k_temp) g8k.temperature = g8k_temperature;
      auto m = load_model(g8k_model, {.dtype = parse_dtype(g8k_dtype)});
      int64_t shown = 0;  // progress on stderr every tenth of the questions
      auto r = eval_gsm8k(m, g8k, [&](int64_t done, int64_t total) {
        if (done * 10 / total > shown) {
          shown = done * 10 / total;
          std::cerr << "gsm8k: " << done << "/" << total << " questions" << std::endl;
        }
      });
      std::cout << r.accuracy.line("gsm8k") << std::endl;
      return 0;
    }
    if (*convert_cmd) {
      auto m = load_model(convert_in);
      if (convert_dtype == "auto") throw Error("--dtype auto: convert writes a file; name its dtype (float32, bfloat16 or float16)");
      save_hf_dir(m, convert_out, {.dtype = choose_dtype(convert_dtype, torch::kCPU, "--dtype").dtype});
      std::cout << "wrote " << convert_out << std::endl;
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "troupe: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
