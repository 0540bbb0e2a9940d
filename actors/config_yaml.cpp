// The resolved config back as YAML (runs/NAME/config.yaml), through the same field tables that
// read it, and the one-line summary `troupe validate` prints.
#include <sstream>

#include "actors/config_tables.hpp"

namespace troupe {

using namespace cfg;

namespace {

// A list item: its table's keys, the first one after "- ".
template <class Section>
void write_item(std::ostringstream& out, const Section& c) {
  std::ostringstream item;
  Writer w{item, 4};
  fields(w, c);
  std::string text = item.str();
  out << text.replace(0, 4, "  - ");
}

void write_dataset(std::ostringstream& out, const std::string& name, const DatasetSection& d) {
  write_table(out, 2, name, d);
}

void write_loss(std::ostringstream& out, const LossSection& l) {
  write_table(out, 2, "loss", l);
  Writer{out, 4}.line("clip", "[" + fmt(l.epsilon) + ", " + fmt(l.epsilon_high) + "]");
  write_table(out, 4, "correction", l.correction);
}

}  // namespace

std::string to_yaml(const RunConfig& c) {
  std::ostringstream out;
  out << "# The resolved configuration: every key, defaults filled in (paths relative to the\n"
         "# folder troupe was started from). Run it again with: troupe run " << c.run.dir << "/config.yaml\n";
  Writer top{out, 0};
  fields(top, c);
  write_table(out, 0, "model", c.model);
  if (c.lora) write_table(out, 0, "lora", *c.lora);
  top.line("data", "");
  write_dataset(out, "train", c.data.train);
  if (c.data.eval) write_dataset(out, "eval", *c.data.eval);
  Writer data{out, 2};
  fields(data, c.data);
  write_table(out, 0, "generator", c.generator);
  top.line("rewards", c.rewards.empty() ? "[]" : "");
  for (const auto& r : c.rewards) write_item(out, r);
  write_table(out, 0, "reference", c.reference);
  if (c.teacher) write_table(out, 0, "teacher", *c.teacher);
  write_table(out, 0, "trainer", c.trainer);
  write_loss(out, c.trainer.loss);
  write_table(out, 2, "overlong", c.trainer.overlong);
  if (c.trainer.sft_warmup) write_table(out, 2, "sft_warmup", *c.trainer.sft_warmup);
  write_table(out, 0, "async", c.async);
  write_table(out, 0, "cluster", c.cluster);
  write_table(out, 0, "parallel", c.parallel);
  write_table(out, 0, "run", c.run);
  return out.str();
}

std::string summary(const RunConfig& c) {
  std::ostringstream s;
  const auto& g = c.generator;
  s << "recipe " << to_string(c.recipe) << ", model " << c.model.path << " (" << to_string(c.model.dtype) << ", "
    << c.model.device << ")";
  if (c.lora) s << " + LoRA rank " << c.lora->rank;
  s << ", data " << c.data.train.path;
  if (c.recipe == Recipe::sft || c.recipe == Recipe::lora || c.recipe == Recipe::dpo) {
    s << ", " << c.trainer.steps << " steps x " << c.trainer.batch_size << (c.recipe == Recipe::dpo ? " pairs" : " examples")
      << ", max_length " << c.trainer.max_length << ", lr " << short_num(c.trainer.lr);
    if (c.recipe == Recipe::dpo) s << ", beta " << short_num(c.trainer.loss.beta);
    s << ", run dir " << c.run.dir;
    return s.str();
  }
  s << ", " << g.count << " " << to_string(g.engine)
    << (g.count == 1 ? " generator" : " generators") << " x G=" << g.group_size << ", max_tokens " << g.max_tokens
    << ", rewards ";
  for (size_t i = 0; i < c.rewards.size(); ++i)
    s << (i ? " + " : "") << short_num(c.rewards[i].weight) << " " << c.rewards[i].name << " (" << c.rewards[i].kind << ")";
  if (c.rewards.empty()) s << "none";
  s << ", " << c.trainer.steps << " steps x " << c.trainer.batch_groups << " groups, lr " << short_num(c.trainer.lr)
    << ", beta " << short_num(c.trainer.loss.beta) << (c.reference.enabled ? " (reference on)" : " (no reference)")
    << ", max_staleness " << c.async.max_staleness << ", run dir " << c.run.dir;
  return s.str();
}

}  // namespace troupe
