// `troupe validate` through the binary: a shipped config passes with a one-line summary, bad
// files and bad overrides fail with exit code 1 and the file:line: key message.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using troupe::test::env_dir;
using troupe::test::source;

namespace {

using Run = troupe::test::CommandResult;

std::string quote(const std::string& s) { return troupe::test::shell_quote(s); }

// Runs `troupe ARGS` from the repository root, where config paths are relative to, with `env`
// (NAME=VALUE ...) added to its environment.
Run run_troupe(const std::string& args, const std::string& env = "") {
  std::string cmd = "cd " + quote(source().string()) + " && " + (env.empty() ? "" : "env " + env + " ") +
                    quote(env_dir("TROUPE_BIN").string()) + " " + args + " 2>&1";
  return troupe::test::run_command(cmd);
}

}  // namespace

TEST_CASE("troupe validate: a shipped config is ok, with a summary") {
  auto r = run_troupe("validate configs/smollm2_gsm8k_async_grpo.yaml");
  CAPTURE(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.starts_with("configs/smollm2_gsm8k_async_grpo.yaml: ok (recipe grpo, model "
                          "models/SmolLM2-135M-Instruct.Q4_1.gguf"));
  CHECK(r.out.find("G=8") != std::string::npos);

  auto o = run_troupe("validate configs/demo.yaml trainer.steps=3 generator.group_size=2");
  CAPTURE(o.out);
  CHECK(o.status == 0);
  CHECK(o.out.find("3 steps") != std::string::npos);
  CHECK(o.out.find("G=2") != std::string::npos);
}

TEST_CASE("troupe validate: the last line is the dtype a run computes in here, auto resolved with its reason") {
  auto explicit_fp32 = run_troupe("validate configs/demo.yaml model.dtype=float32");
  CAPTURE(explicit_fp32.out);
  CHECK(explicit_fp32.out.ends_with("\nmodel.dtype: float32\n"));
  // TROUPE_CPU_BF16 overrides the CPU's features, as for every command.
  auto without = run_troupe("validate configs/demo.yaml model.dtype=auto", "TROUPE_CPU_BF16=0");
  CAPTURE(without.out);
  CHECK(without.out.find("model.dtype auto: float32 (bfloat16 is not native on this CPU") != std::string::npos);
  CHECK(without.out.ends_with("\nmodel.dtype: float32\n"));
  auto with = run_troupe("validate configs/demo.yaml model.dtype=auto", "TROUPE_CPU_BF16=1");
  CAPTURE(with.out);
  CHECK(with.out.find("model.dtype auto: bfloat16 (this CPU computes it natively") != std::string::npos);
  CHECK(with.out.ends_with("\nmodel.dtype: bfloat16\n"));
}

TEST_CASE("troupe validate: bad files and overrides exit 1 naming file, line and key") {
  auto bad = fs::temp_directory_path() / "troupe_validate_bad.yaml";
  std::ofstream(bad) << "recipe: grpo\nmodel: {path: models/SmolLM2-135M-Instruct.Q4_1.gguf}\n"
                        "data: {train: {path: ../shared/data/gsm8k/train.jsonl}}\n"
                        "generator:\n  temprature: 0.7\nrewards: [{name: c, kind: format}]\n";
  auto r = run_troupe("validate " + quote(bad.string()));
  CAPTURE(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find(bad.string() + ":5: generator.temprature: unknown key (did you mean temperature?)") != std::string::npos);

  auto o = run_troupe("validate configs/demo.yaml trainer.lr=-1");
  CAPTURE(o.out);
  CHECK(o.status == 1);
  CHECK(o.out.find("configs/demo.yaml, override 'trainer.lr=-1': trainer.lr: must be > 0, got -1") != std::string::npos);

  // Paths are checked by validate (not by parsing): relative to the current folder.
  auto p = run_troupe("validate configs/demo.yaml data.train.path=nowhere.jsonl");
  CAPTURE(p.out);
  CHECK(p.status == 1);
  CHECK(p.out.find("data.train.path: nowhere.jsonl does not exist") != std::string::npos);

  auto m = run_troupe("validate configs/no_such_config.yaml");
  CHECK(m.status == 1);
  CHECK(m.out.find("configs/no_such_config.yaml: no such config file") != std::string::npos);
}
