// run_graph: checks the spec, starts an actor system (with CAF's network layer when generators
// run in worker processes), spawns the controller, which spawns the rest, and waits for its
// RunSummary. The actors themselves live one per file (see graph.hpp).
#include "actors/graph.hpp"

#include <iostream>
#include <thread>

#include <caf/io/all.hpp>

#include "actors/config.hpp"
#include "actors/controller.hpp"
#include "actors/graph_checkpoint.hpp"
#include "actors/rl_recipe.hpp"
#include "actors/worker.hpp"
#include "policy/error.hpp"

namespace troupe {

using namespace caf;

void add_message_types(actor_system_config& config) {
  config.add_message_type<PromptItem>("troupe::PromptItem");
  config.add_message_type<PromptBatch>("troupe::PromptBatch");
  config.add_message_type<RolloutGroup>("troupe::RolloutGroup");
  config.add_message_type<WeightsReady>("troupe::WeightsReady");
  config.add_message_type<WeightsLoaded>("troupe::WeightsLoaded");
  config.add_message_type<ActorBusy>("troupe::ActorBusy");
  config.add_message_type<StepReport>("troupe::StepReport");
  config.add_message_type<RunSummary>("troupe::RunSummary");
  config.add_message_type<WorkerLost>("troupe::WorkerLost");
  config.add_message_type<std::vector<PromptItem>>("std::vector<troupe::PromptItem>");
  config.add_message_type<generator_actor>("troupe::generator_actor");
  config.add_message_type<rollout_sink>("troupe::rollout_sink");
  config.add_message_type<controller_actor>("troupe::controller_actor");
  config.add_message_type<stage_worker>("troupe::stage_worker");
  config.add_message_type<stage_router>("troupe::stage_router");
  // Across processes: only a peer of this very protocol is accepted at the handshake, and a
  // peer that goes silent (hung, or its host gone) is dropped after the connection timeout.
  config.set("middleman.app-identifiers", std::vector<std::string>{app_identifier()});
  config.set("middleman.heartbeat-interval", timespan{std::chrono::milliseconds(500)});
  config.set("middleman.connection-timeout", timespan{std::chrono::seconds(10)});
}

std::string reason_text(const error& reason) {
  if (reason == exit_reason::remote_link_unreachable) return "its process, or the connection to it, was lost";
  const auto& context = reason.context();
  // make_error(code, text) carries the text as the context's last string.
  for (size_t i = context.size(); i > 0; --i)
    if (context.match_element<std::string>(i - 1)) return context.get_as<std::string>(i - 1);
  return to_string(reason);
}

GeneratorSpec generator_spec(const GraphSpec& spec) {
  GeneratorSpec g;
  g.model = spec.model_source.string();
  g.tokenizer = spec.tokenizer_path.string();
  g.dtype = spec.generator_dtype;
  g.device = spec.generator_device;
  g.engine = spec.engine;
  g.sampling = spec.sampling;
  g.seed = spec.seed;
  g.deterministic = spec.deterministic;
  g.threads = spec.generator_threads;
  g.weights_over_http = spec.weight_transport == "http";
  // Worker processes split the cores with the trainer unless the config says otherwise.
  if (spec.generator_processes > 0 && g.threads <= 0)
    g.threads = std::max<int64_t>(1, std::thread::hardware_concurrency() / (spec.generator_processes + 1));
  return g;
}

std::pair<std::string, uint16_t> GraphSpec::listen_address() const {
  if (listen.empty()) return {"127.0.0.1", 0};
  auto address = split_host_port(listen);
  if (!address) throw Error("run_graph: listen " + listen + ": expected HOST:PORT (port 0: any free one)");
  return *address;
}

namespace {

void check(const GraphSpec& spec) {
  if (!spec.make_policy || !spec.next_prompts || !spec.reward) throw Error("run_graph: the spec needs a policy, a data source and a reward");
  if (spec.model_source.empty()) throw Error("run_graph: the spec needs model_source (the generators load its architecture)");
  if (!is_rl_recipe(spec.recipe)) throw Error("run_graph: unknown RL recipe '" + spec.recipe + "'");
  if (spec.batch_groups < 1 || spec.steps < 1 || spec.generators < 1 || spec.max_staleness < 0 || spec.sync_every < 1)
    throw Error("run_graph: batch_groups, steps, generators and sync_every must be >= 1 and max_staleness >= 0");
  if (spec.generator_processes < 0 || spec.reward_processes < 0 || spec.reference_processes < 0)
    throw Error("run_graph: generator_processes, reward_processes and reference_processes must be >= 0");
  if (spec.reward_processes > 0 && spec.reward_specs.empty())
    throw Error("run_graph: reward_processes needs reward_specs (what a reward worker builds)");
  if (spec.weight_transport != "auto" && spec.weight_transport != "http")
    throw Error("run_graph: weight_transport must be auto or http, got " + spec.weight_transport);
  spec.listen_address();
  if (spec.reference_processes > 0 && !spec.reference)
    throw Error("run_graph: reference_processes without a reference (trainer.loss.beta > 0 or reference.enabled)");
  if (!spec.remote_url.empty() && spec.generators != 1)
    throw Error("run_graph: a remote generator drives one server; got " + std::to_string(spec.generators) +
                " generators for " + spec.remote_url);
  if (!spec.remote_url.empty() && spec.generator_processes > 0)
    throw Error("run_graph: a remote generator runs in the run's own process (generator_processes must be 0)");
  if (!spec.remote_url.empty() && spec.weights_dir.empty())
    throw Error("run_graph: a remote generator needs weights_dir, where the server reads new weights");
  if (spec.sync_every > spec.max_staleness + 1)
    throw Error("run_graph: sync_every " + std::to_string(spec.sync_every) + " would break max_staleness " +
                std::to_string(spec.max_staleness) + " (needs sync_every <= max_staleness + 1)");
  // Generators hold the checkpoint's weights only at steps where weights were sent.
  if (spec.checkpoint_every % spec.sync_every != 0)
    throw Error("run_graph: checkpoint_every " + std::to_string(spec.checkpoint_every) + " must be a multiple of sync_every " +
                std::to_string(spec.sync_every));
  if (spec.resume) {
    const auto& r = *spec.resume;
    if (r.step >= spec.steps) throw Error(r.dir.string() + ": the checkpoint is at step " + std::to_string(r.step) +
                                          ", the run has only " + std::to_string(spec.steps) + " steps: nothing to do");
    if (r.first_new_batch != outstanding_end(spec, r.step) ||
        static_cast<int64_t>(r.groups.size()) != (r.first_new_batch - r.step) * spec.batch_groups)
      throw Error(r.dir.string() + ": the checkpoint holds " + std::to_string(r.groups.size()) + " rollout groups of batches [" +
                  std::to_string(r.step) + ", " + std::to_string(r.first_new_batch) + "), which does not match this run's " +
                  "trainer.steps, trainer.batch_groups, async.max_staleness and async.sync_every");
  }
}

}  // namespace

GraphResult run_graph(const GraphSpec& spec) {
  check(spec);
  RunSummary summary;
  {
    actor_system_config config;
    add_message_types(config);
    if (spec.listens()) config.load<io::middleman>();
    actor_system system{config};
    scoped_actor self{system};
    auto controller = spawn_controller(system, &spec, actor{self});
    std::optional<WorkerProcesses> workers;
    if (spec.listens()) {
      // Loopback unless cluster.listen says otherwise: workers elsewhere `troupe worker --connect`.
      const auto [host, wanted] = spec.listen_address();
      auto port = system.middleman().publish(controller, wanted, host.c_str(), /*reuse_addr=*/true);
      if (!port) {
        anon_send_exit(controller, exit_reason::user_shutdown);
        throw Error("run_graph: cannot listen for workers on " + host + ":" + std::to_string(wanted) + ": " +
                    system.render(port.error()));
      }
      std::cout << "troupe run: workers join at " << host << ":" << *port << std::endl;
      std::vector<std::string> roles(spec.generator_processes, "generator");
      roles.insert(roles.end(), spec.reward_processes, "reward");
      roles.insert(roles.end(), spec.reference_processes, "reference");
      const std::string local = host == "0.0.0.0" ? "127.0.0.1" : host;
      if (!roles.empty()) workers.emplace(spec.worker_program, local, *port, roles, spec.worker_restarts);
    }
    // The summary, or the controller's end if it died without one (never a hang).
    self->monitor(controller);
    bool waiting = true;
    while (waiting)
      self->receive([&](RunSummary& s) { summary = std::move(s), waiting = false; },
                    [&](const WorkerLost& lost) {
                      if (workers) workers->kill(static_cast<pid_t>(lost.pid));
                    },
                    [&](down_msg& dm) {
                      if (dm.source != controller.address()) return;
                      summary.error = "the controller stopped: " + (dm.reason ? reason_text(dm.reason) : "without a summary");
                      waiting = false;
                    });
  }  // workers are waited for (or killed), then the system waits for every actor to finish
  GraphResult r;
  r.error = summary.error;
  r.steps = summary.steps;
  for (const auto& line : summary.metrics) r.metrics.push_back(nlohmann::json::parse(line));
  r.issued = std::move(summary.issued);
  r.trained = std::move(summary.trained);
  r.failed = std::move(summary.failed);
  r.filtered = std::move(summary.filtered);
  r.ok = r.error.empty() && r.steps == spec.steps;
  return r;
}

}  // namespace troupe
