#include "kernels/decode_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "kernels/avx2.hpp"

namespace troupe::kernels {
namespace {

constexpr int64_t kBlock = 32;  // keys per update of the running maximum and sum
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One task's running state: for each of its g query heads, the scaled query, the largest score
// so far, the sum of exp(score - largest), the sum of the values weighed by those, and the
// current block's scores (then weights). All float32, in one buffer per thread.
struct State {
  int64_t g = 0, hd = 0;
  float* q = nullptr;    // [g, hd]
  float* m = nullptr;    // [g]
  float* l = nullptr;    // [g]
  float* acc = nullptr;  // [g, hd]
  float* s = nullptr;    // [g, kBlock]
};

// n <= kBlock keys k[j * stride ..] and their values, folded into the state.
template <typename T>
void block_plain(State& st, const T* k, const T* v, int64_t stride, int64_t n) {
  const int64_t hd = st.hd;
  for (int64_t r = 0; r < st.g; ++r) {
    const float* q = st.q + r * hd;
    float* s = st.s + r * kBlock;
    float top = kNegInf;
    for (int64_t j = 0; j < n; ++j) {
      const T* kj = k + j * stride;
      float dot = 0;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * static_cast<float>(kj[d]);
      s[j] = dot;
      top = std::max(top, dot);
    }
    const float m = std::max(st.m[r], top);  // finite: n >= 1
    const float rescale = std::exp(st.m[r] - m);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
    st.m[r] = m;
    st.l[r] = st.l[r] * rescale + sum;
    float* acc = st.acc + r * hd;
    for (int64_t d = 0; d < hd; ++d) acc[d] *= rescale;
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + j * stride;
      for (int64_t d = 0; d < hd; ++d) acc[d] += s[j] * static_cast<float>(vj[d]);
    }
  }
}

#if defined(__x86_64__)

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 8 bfloat16 -> 8 floats: each one's bits are a float's upper half.
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The horizontal sums of a[0..7], in lane order.
__attribute__((target("avx2,fma"))) inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: a[i]'s
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

using avx2::hsum;

__attribute__((target("avx2,fma"))) inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[0 .. 8 * N) * rescale + sum over j < n of p[j] * v[j * stride ..]: N running sums, each
// in a register, so that N fmas are in flight (a single sum waits out each fma's latency).
template <int N, typename T>
__attribute__((target("avx2,fma"))) inline void add_values(float* acc, float rescale, const float* p, const T* v,
                                                           int64_t stride, int64_t n) {
  const __m256 c = _mm256_set1_ps(rescale);
  __m256 a[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const T* vj = v + j * stride;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(w, load8(vj + 8 * i), a[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// block_plain's arithmetic, 8 lanes at a time (hd a multiple of 8): the scores of 8 keys at once,
// from 8 dot products summed across lanes together; the weights' exp from SLEEF; each value row
// added into the query head's sum with its weight broadcast. `zero`: hd zeros, standing in for
// the keys past n in the last group of 8.
template <typename T>
__attribute__((target("avx2,fma"))) void block_avx2(State& st, const T* k, const T* v, int64_t stride, int64_t n,
                                                    const T* zero) {
  const int64_t hd = st.hd, padded = (n + 7) / 8 * 8;
  for (int64_t r = 0; r < st.g; ++r) {
    const float* q = st.q + r * hd;
    float* s = st.s + r * kBlock;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const T* rows[8];
      for (int64_t j = 0; j < 8; ++j) rows[j] = j0 + j < n ? k + (j0 + j) * stride : zero;
      __m256 dot[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) dot[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) dot[j] = _mm256_fmadd_ps(qv, load8(rows[j] + d), dot[j]);
      }
      _mm256_storeu_ps(s + j0, hsum8(dot));
    }
    for (int64_t j = n; j < padded; ++j) s[j] = kNegInf;  // weigh 0 below
    __m256 top = _mm256_set1_ps(kNegInf);
    for (int64_t j0 = 0; j0 < padded; j0 += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j0));
    const float m = std::max(st.m[r], hmax(top));  // finite: n >= 1
    const float rescale = std::exp(st.m[r] - m);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 8) {
      const __m256 p = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j0), mv));
      _mm256_storeu_ps(s + j0, p);
      sum = _mm256_add_ps(sum, p);
    }
    st.m[r] = m;
    st.l[r] = st.l[r] * rescale + hsum(sum);
    float* acc = st.acc + r * hd;
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64) add_values<8>(acc + d, rescale, s, v + d, stride, n);
    for (; d + 32 <= hd; d += 32) add_values<4>(acc + d, rescale, s, v + d, stride, n);
    for (; d < hd; d += 8) add_values<1>(acc + d, rescale, s, v + d, stride, n);
  }
}

#endif

// Keys and values of one (row, key/value head): n rows of hd elements, `stride` apart.
template <typename T>
struct Keys {
  const T* k;
  const T* v;
  int64_t stride, n;
};

template <typename T>
void fold(State& st, const Keys<T>& keys, bool vectorized, const T* zero) {
  for (int64_t j = 0; j < keys.n; j += kBlock) {
    const int64_t n = std::min(kBlock, keys.n - j);
#if defined(__x86_64__)
    if (vectorized) {
      block_avx2(st, keys.k + j * keys.stride, keys.v + j * keys.stride, keys.stride, n, zero);
      continue;
    }
#endif
    block_plain(st, keys.k + j * keys.stride, keys.v + j * keys.stride, keys.stride, n);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& cache_k,
         const at::Tensor& cache_v, const int64_t* write, const std::vector<PrefixPart>& prefixes,
         const std::vector<int64_t>& prefix_of, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(3), nkv = k_new.size(1), g = nh / nkv;
  const bool vectorized = avx2::supported() && hd % 8 == 0;
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  T* ckp = cache_k.data_ptr<T>();
  T* cvp = cache_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // The tasks, in (row, head) order, cut into one run per thread of about equal keys (rows of
  // one group stay together, and so does their prefix in cache): rows' prefixes and lengths
  // differ, and an even split by count left a thread idle. A few keys' work runs on the calling
  // thread: a parallel region costs more.
  const int64_t tasks = B * nkv;
  std::vector<int64_t> ends(1, 0);  // run i: tasks [ends[i], ends[i + 1])
  {
    std::vector<int64_t> keys(B);
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b)
      total += keys[b] = write[b] + 1 + (prefix_of[b] < 0 ? 0 : prefixes[prefix_of[b]].k.size(2));
    const int64_t wanted = total * nh * hd < (int64_t{1} << 15) ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
    int64_t done = 0;
    for (int64_t task = 0; task < tasks; ++task) {
      done += keys[task / nkv];
      if (done * wanted >= total * static_cast<int64_t>(ends.size())) ends.push_back(task + 1);
    }
    ends.back() = tasks;
  }
  const int64_t runs = static_cast<int64_t>(ends.size()) - 1;
  at::parallel_for(0, runs, 1, [&](int64_t first_run, int64_t last_run) {
    const int64_t begin = ends[first_run], end = ends[last_run];
    std::vector<float> buffer(g * (2 * hd + 2 + kBlock));
    const std::vector<T> zero(hd, T(0));
    State st;
    st.g = g;
    st.hd = hd;
    st.q = buffer.data();
    st.acc = st.q + g * hd;
    st.m = st.acc + g * hd;
    st.l = st.m + g;
    st.s = st.l + g;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, h = task % nkv, w = write[b];
      T* own_k = ckp + b * cache_k.stride(0) + h * cache_k.stride(1);
      T* own_v = cvp + b * cache_v.stride(0) + h * cache_v.stride(1);
      std::copy_n(knp + b * k_new.stride(0) + h * k_new.stride(1), hd, own_k + w * cache_k.stride(2));
      std::copy_n(vnp + b * v_new.stride(0) + h * v_new.stride(1), hd, own_v + w * cache_v.stride(2));
      for (int64_t r = 0; r < g; ++r) {
        const T* qr = qp + b * q.stride(0) + (h * g + r) * q.stride(1);
        for (int64_t d = 0; d < hd; ++d) st.q[r * hd + d] = static_cast<float>(qr[d]) * scale;
      }
      std::fill_n(st.m, g, kNegInf);
      std::fill_n(st.l, g, 0.0f);
      std::fill_n(st.acc, g * hd, 0.0f);
      if (prefix_of[b] >= 0) {
        const auto& part = prefixes[prefix_of[b]];
        fold(st,
             Keys<T>{part.k.data_ptr<T>() + h * part.k.stride(1), part.v.data_ptr<T>() + h * part.v.stride(1),
                     part.k.stride(2), part.k.size(2)},
             vectorized, zero.data());
      }
      fold(st, Keys<T>{own_k, own_v, cache_k.stride(2), w + 1}, vectorized, zero.data());
      for (int64_t r = 0; r < g; ++r) {
        T* o = op + (b * nh + h * g + r) * hd;
        const float inv = 1.0f / st.l[r];
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(st.acc[r * hd + d] * inv);
      }
    }
  });
}

void check_same(const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type() && t.is_cpu(), "decode_attention: ", name, " must be ",
              q.scalar_type(), " on the CPU, like q; got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "decode_attention: ", name,
              " must be 4-d with a contiguous last dimension, got sizes ", t.sizes(), " strides ", t.strides());
}

}  // namespace

bool decode_attention_supports(const torch::Tensor& q) {
  return q.is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
         !at::GradMode::is_enabled();
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                               const torch::Tensor& cache_k, const torch::Tensor& cache_v, const torch::Tensor& write_in,
                               const std::vector<PrefixPart>& prefixes, double scale) {
  TORCH_CHECK(decode_attention_supports(q), "decode_attention: q must be float32 or bfloat16 on the CPU, without ",
              "autograd; got ", q.scalar_type(), " on ", q.device());
  check_same("q", q, q);
  for (const auto& [name, t] : {std::pair{"k_new", &k_new}, {"v_new", &v_new}, {"cache_k", &cache_k}, {"cache_v", &cache_v}})
    check_same(name, *t, q);
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(3), nkv = k_new.size(1);
  TORCH_CHECK(q.size(2) == 1 && nkv > 0 && nh % nkv == 0, "decode_attention: q ", q.sizes(),
              " must be [B, nkv * g, 1, hd] for k_new ", k_new.sizes());
  for (const auto* t : {&k_new, &v_new})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({B, nkv, 1, hd}), "decode_attention: k_new and v_new must be [", B, ", ",
                nkv, ", 1, ", hd, "], got ", t->sizes());
  TORCH_CHECK(cache_k.sizes() == cache_v.sizes() && cache_k.size(0) >= B && cache_k.size(1) == nkv &&
                  cache_k.size(3) == hd,
              "decode_attention: the caches ", cache_k.sizes(), " and ", cache_v.sizes(), " must be [>= ", B, ", ", nkv,
              ", capacity, ", hd, "]");
  TORCH_CHECK(write_in.is_cpu() && write_in.scalar_type() == at::kLong && write_in.dim() == 1 && write_in.size(0) == B,
              "decode_attention: write must be [", B, "] long on the CPU, got ", write_in.sizes(), " ",
              write_in.scalar_type());
  auto write = write_in.contiguous();
  const int64_t* w = write.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(w[b] >= 0 && w[b] < cache_k.size(2), "decode_attention: write[", b, "] = ", w[b],
                " is outside the cache's capacity ", cache_k.size(2));
  std::vector<int64_t> prefix_of(B, -1);
  std::vector<PrefixPart> parts;
  parts.reserve(prefixes.size());
  for (size_t i = 0; i < prefixes.size(); ++i) {
    const auto& p = prefixes[i];
    check_same("a prefix's k", p.k, q);
    check_same("a prefix's v", p.v, q);
    TORCH_CHECK(p.k.sizes() == p.v.sizes() && p.k.size(0) == 1 && p.k.size(1) == nkv && p.k.size(3) == hd &&
                    p.k.stride(2) == p.v.stride(2),
                "decode_attention: prefix ", i, "'s keys ", p.k.sizes(), " and values ", p.v.sizes(), " must be [1, ",
                nkv, ", P, ", hd, "], laid out alike");
    auto rows = p.rows.to(at::kLong).contiguous();
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t j = 0; j < rows.numel(); ++j) {
      TORCH_CHECK(r[j] >= 0 && r[j] < B, "decode_attention: prefix ", i, " holds row ", r[j], " of a batch of ", B);
      TORCH_CHECK(prefix_of[r[j]] < 0, "decode_attention: row ", r[j], " is in two prefixes");
      prefix_of[r[j]] = static_cast<int64_t>(i);
    }
    parts.push_back({p.k, p.v, rows});
  }
  auto out = at::empty({B, nh, 1, hd}, q.options());
  AT_DISPATCH_SWITCH(q.scalar_type(), "decode_attention",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       run<scalar_t>(q, k_new, v_new, cache_k, cache_v, w, parts, prefix_of, static_cast<float>(scale), out);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       run<scalar_t>(q, k_new, v_new, cache_k, cache_v, w, parts, prefix_of, static_cast<float>(scale), out);
                     }));
  return out;
}

}  // namespace troupe::kernels
