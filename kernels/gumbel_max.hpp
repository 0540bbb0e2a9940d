// Gumbel-max sampling of one row on a CPU, in one pass: the token argmax_i (logp[i] - log(-log u[i]))
// with u[i] drawn from the sequence's generator exactly as `torch::empty_like(logp).uniform_(0, 1,
// gen)` draws them (the same 32-bit outputs of its Mersenne twister, in the same order, turned
// into the same floats), and the generator left where uniform_ leaves it. The ATen ops it replaces
// made and walked five [V] tensors per row (uniform_, log_, neg_, log_, sub), then an argmax:
// about 290 us a row for SmolLM2's 49152 tokens on one Zen 4 core, against about 75 us here. The
// uniforms are drawn 512 at a time into a buffer that stays in L1, 8 words tempered at once, and
// nothing of size V is written.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/types.h>

namespace troupe::kernels {

// logp: [V] float32 on the CPU (log-probabilities; -inf excludes a token), gen: a CPU generator.
// Returns the index ATen's argmax would give on the same scores: the first largest, or the first
// NaN if there is one. On a CPU with AVX2 and FMA the logs are SLEEF's (1 ulp), elsewhere
// std::log; ATen's log_ (MKL's in the torch wheel) may differ from either in the last bit, which
// changes a draw only where two tokens' scores tie to that bit. Most tokens skip the logs: a
// cheap bound shows they cannot win (see the .cpp).
// `loop`: Loop::plain runs the loop of CPUs without AVX2 anywhere, for its test.
enum class Loop { best, plain };
int64_t gumbel_max(const torch::Tensor& logp, at::Generator& gen, Loop loop = Loop::best);

}  // namespace troupe::kernels
