// The generator actor: one inference engine behind a typed handle. It takes prompt batches and
// weight notices, and sends each prompt's finished group of G samples to the rollout sink. It
// is built from a GeneratorSpec, plain data that travels as JSON to a worker process, so the
// same actor runs inside `troupe run` or in `troupe worker` on another process or machine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "actors/protocol.hpp"
#include "policy/tokenizer.hpp"
#include "generator/engine.hpp"
#include "generator/remote_engine.hpp"

namespace troupe {

struct GeneratorSpec {
  std::string model;      // HF folder or .gguf: the architecture; the weights come from the trainer
  std::string tokenizer;  // folder or .gguf to load the tokenizer from (stop strings); empty: none
  std::string dtype = "float32";
  std::string device = "cpu";
  EngineOptions engine;
  SamplingParams sampling;  // n is the group size G
  uint64_t seed = 0;        // each prompt's samples are seeded by (seed, ticket)
  bool deterministic = false;
  int64_t threads = 0;      // intra-op threads; 0: LibTorch's default
  bool weights_over_http = false;  // fetch every version from the trainer's URL, even on its host
};

nlohmann::json to_json(const GeneratorSpec& spec);
GeneratorSpec generator_spec_from_json(const nlohmann::json& j);  // throws Error naming a bad field

// Spawns a built-in generator (detached: its engine blocks). It reports each weight version it
// loads to `controller` and sends finished groups to `next`; an exception ends it with an error
// naming "generator <index>". `tokenizer`: the one spec.tokenizer names, already loaded by the
// caller in this process (shared, not parsed again); absent, the generator loads spec.tokenizer.
generator_actor spawn_generator(caf::actor_system& system, GeneratorSpec spec, rollout_sink next,
                                controller_actor controller, int64_t index,
                                std::optional<Tokenizer> tokenizer = std::nullopt);

// A generator driving a vLLM-compatible server: each prompt batch is one blocking generate()
// (the server batches the requests itself), so weight updates land between batches; they reach
// the server as a safetensors folder under `weights_dir` through its disk route.
struct RemoteGeneratorSpec {
  std::string url;
  RemoteOptions options;
  std::optional<Tokenizer> tokenizer;
  SamplingParams sampling;
  std::string weights_dir;
};
generator_actor spawn_remote_generator(caf::actor_system& system, RemoteGeneratorSpec spec, rollout_sink next,
                                       controller_actor controller, int64_t index);

}  // namespace troupe
