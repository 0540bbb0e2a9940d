#include "kernels/gumbel_max.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>

#include "kernels/avx2.hpp"

namespace troupe::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The running winner of one lane (or of the plain loop): ATen's argmax order, in which a NaN beats
// everything and the first of equals wins.
struct Best {
  float score = kNegInf;
  int64_t index = 0;
  int64_t nan = -1;  // the first NaN's index, if any
};

// The CPU generator's engine, run here inline: what uniform_real_distribution asks of a generator.
struct Engine {
  at::mt19937 mt;
  uint32_t random() { return mt(); }
};

// The next uniform exactly as uniform_(0, 1) makes it for a float tensor (ATen's
// uniform_real_distribution<float> on one 32-bit output of the engine).
inline float next_uniform(Engine& engine) { return at::uniform_real_distribution<float>(0.0f, 1.0f)(&engine); }

int64_t plain(const float* logp, int64_t V, Engine& engine) {
  Best best;
  for (int64_t i = 0; i < V; ++i) {
    const float u = next_uniform(engine);
    const float s = logp[i] - std::log(-std::log(u));
    if (std::isnan(s)) {
      if (best.nan < 0) best.nan = i;
    } else if (s > best.score) {
      best = {s, i, best.nan};
    }
  }
  return best.nan >= 0 ? best.nan : best.index;
}

#if defined(__x86_64__)

// The next n uniforms of the engine into u, as next_uniform makes them one by one: its tempering
// and the conversion to float run on 8 state words at once; fewer than 8 words left before the
// state's renewal (its twist), or before n, go through the engine's own call, which renews it.
__attribute__((target("avx2,fma"))) void draw_uniforms(Engine& engine, float* u, int64_t n) {
  const __m256i low24 = _mm256_set1_epi32((1 << 24) - 1);
  const __m256i b = _mm256_set1_epi32(static_cast<int>(0x9d2c5680u)), c = _mm256_set1_epi32(static_cast<int>(0xefc60000u));
  const __m256 scale = _mm256_set1_ps(1.0f / (1 << 24));
  int64_t i = 0;
  while (i < n) {
    at::mt19937_data_pod state = engine.mt.data();
    const int64_t ready = state.left_ - 1;  // words left before the next twist
    const int64_t take = std::min<int64_t>(ready, n - i) / 8 * 8;
    if (take == 0) {
      for (int64_t j = 0; j < 8 && i < n; ++j) u[i++] = next_uniform(engine);
      continue;
    }
    const uint32_t* words = state.state_.data() + state.next_;
    for (int64_t j = 0; j < take; j += 8) {
      __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + j));
      y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 11));
      y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 7), b));
      y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 15), c));
      y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 18));
      _mm256_storeu_ps(u + i + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(y, low24)), scale));
    }
    state.next_ += static_cast<uint32_t>(take);
    state.left_ -= static_cast<int>(take);
    engine.mt.set_data(state);
    i += take;
  }
}

// The logs are the cost (two per token); most tokens cannot win and skip them. g(u) = -log(-log u)
// is below -log(1 - u) (as -log u > 1 - u), which is at most ln 2 times minus the binary exponent
// of 1 - u (exact in float for these u), read from its bits. A group of 8 whose tokens all have
// logp + that bound (+ a margin far above the logs' rounding) at or below the best score so far
// loses to it, and only its uniforms are drawn. Log-probabilities are at most 0, so scores are
// below 17 and their rounding below 1e-5.
__attribute__((target("avx2,fma"))) int64_t vectorized(const float* logp, int64_t V, Engine& engine) {
  __m256 top = _mm256_set1_ps(kNegInf);
  __m256 leader = top;  // the largest score so far, in every lane
  __m256i top_index = _mm256_setzero_si256();
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  const __m256 one = _mm256_set1_ps(1.0f), ln2 = _mm256_set1_ps(0.69314718f), margin = _mm256_set1_ps(1e-3f);
  const __m256i bias = _mm256_set1_epi32(127);
  int64_t nan = -1;
  // The uniforms of a block of tokens are drawn first, in a tight loop, then read 8 at a time: a
  // vector load of 8 floats just stored one by one would wait on each store.
  constexpr int64_t kDraws = 512;
  alignas(32) float u[kDraws];
  alignas(32) float tail[8];
  for (int64_t i0 = 0; i0 < V; i0 += 8) {
    const int64_t n = std::min<int64_t>(8, V - i0);
    float* ui = u + i0 % kDraws;
    if (i0 % kDraws == 0) draw_uniforms(engine, u, std::min(kDraws, V - i0));
    __m256 lp;
    if (n == 8) {
      lp = _mm256_loadu_ps(logp + i0);
    } else {  // the last group: its missing lanes score -inf and never win
      std::fill_n(tail, 8, kNegInf);
      std::fill_n(ui + n, 8 - n, 0.5f);
      std::memcpy(tail, logp + i0, n * sizeof(float));
      lp = _mm256_load_ps(tail);
    }
    const __m256 uv = _mm256_load_ps(ui);
    const __m256i exponent = _mm256_srli_epi32(_mm256_castps_si256(_mm256_sub_ps(one, uv)), 23);
    const __m256 bound = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(bias, exponent)), ln2, margin);
    // Unordered counts as a candidate: a NaN goes on to the exact scores, where argmax's rule takes it.
    if (!_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(lp, bound), leader, _CMP_NLE_UQ))) {
      index = _mm256_add_epi32(index, eight);
      continue;
    }
    const __m256 e = _mm256_sub_ps(_mm256_setzero_ps(), Sleef_logf8_u10avx2(uv));  // -log u
    const __m256 s = _mm256_sub_ps(lp, Sleef_logf8_u10avx2(e));
    if (nan < 0) {
      const int nans = _mm256_movemask_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
      if (nans) nan = i0 + __builtin_ctz(nans);
    }
    const __m256 gt = _mm256_cmp_ps(s, top, _CMP_GT_OQ);
    if (_mm256_movemask_ps(gt)) {
      top = _mm256_blendv_ps(top, s, gt);
      top_index = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(top_index), _mm256_castsi256_ps(index), gt));
      __m256 m = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
      m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
      leader = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    index = _mm256_add_epi32(index, eight);
  }
  if (nan >= 0) return nan;
  alignas(32) float scores[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(scores, top);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), top_index);
  Best best{scores[0], indices[0]};
  for (int j = 1; j < 8; ++j)
    if (scores[j] > best.score || (scores[j] == best.score && indices[j] < best.index)) best = {scores[j], indices[j]};
  return best.index;
}

#endif

}  // namespace

int64_t gumbel_max(const torch::Tensor& logp, at::Generator& gen, Loop loop) {
  TORCH_CHECK(logp.is_cpu() && logp.scalar_type() == at::kFloat && logp.dim() == 1 && logp.is_contiguous() &&
                  logp.numel() > 0,
              "gumbel_max: logp must be a non-empty contiguous [V] float32 tensor on the CPU, got ", logp.sizes(), " ",
              logp.scalar_type(), " on ", logp.device());
  TORCH_CHECK(logp.numel() < (int64_t{1} << 31), "gumbel_max: ", logp.numel(), " tokens do not fit 32-bit indices");
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  // Under the generator's lock, as uniform_ holds it: its engine runs here, inline, and goes back
  // advanced by V outputs.
  std::lock_guard<std::mutex> lock(gen.mutex());
  Engine engine{cpu->engine()};
  const float* p = logp.data_ptr<float>();
  const int64_t V = logp.numel();
#if defined(__x86_64__)
  const int64_t id = loop == Loop::best && avx2::supported() ? vectorized(p, V, engine) : plain(p, V, engine);
#else
  const int64_t id = plain(p, V, engine);
#endif
  cpu->set_engine(engine.mt);
  return id;
}

}  // namespace troupe::kernels
