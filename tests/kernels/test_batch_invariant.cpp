// The batch-invariant kernels against plain ATen, and their invariance bit for bit: a row alone
// equals the same row inside any batch, at any position, with one thread or two.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"

using namespace troupe::kernels;

namespace {

const std::vector<torch::ScalarType> kDtypes = {torch::kFloat32, torch::kFloat64};

// Agreement with ATen: float32 to ~1e-5 of the values' scale, float64 to 1e-12.
double tolerance(torch::ScalarType dt) { return dt == torch::kFloat32 ? 1e-5 : 1e-12; }

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return 0;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

torch::Tensor randn(std::vector<int64_t> sizes, torch::ScalarType dt) { return torch::randn(sizes, torch::kFloat64).to(dt); }

// Sets the intra-op thread count for a scope.
struct Threads {
  int saved = at::get_num_threads();
  explicit Threads(int n) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(saved); }
};

// First, middle, last, and the edges of 4- and 6-wide tiles.
std::vector<int64_t> positions(int64_t n) {
  std::set<int64_t> p = {0, n / 2, n - 1, (n - 1) / 4 * 4, (n - 1) / 6 * 6, std::max<int64_t>(n - 2, 0)};
  return {p.begin(), p.end()};
}

// The documented lane dot, written out in scalar code.
template <class T>
T lane_dot_spec(const T* a, const T* b, int64_t K) {
  constexpr int L = 64 / int(sizeof(T));
  T acc[L] = {};
  const int64_t KL = K - K % L;
  for (int64_t k = 0; k < KL; k += L)
    for (int l = 0; l < L; ++l) acc[l] = std::fma(a[k + l], b[k + l], acc[l]);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  T s = acc[0];
  for (int64_t k = KL; k < K; ++k) s = std::fma(a[k], b[k], s);
  return s;
}

// Hugging Face's LlamaRMSNorm in ATen.
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto var = x.pow(2).mean(-1, true);
  return w * (x * torch::rsqrt(var + eps));
}

// Softmax attention in ATen with kv heads repeated; allowed [B, 1, Tq, S] bool. Rows with no
// allowed key are left to the caller (softmax gives NaN there).
torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& allowed, double scale) {
  const int64_t rep = q.size(1) / k.size(1);
  auto kr = k.repeat_interleave(rep, 1), vr = v.repeat_interleave(rep, 1);  // [B, H, S, d]
  auto scores = torch::matmul(q, kr.transpose(-2, -1)) * scale;             // [B, H, Tq, S]
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), vr);
}

// Causal with the queries at the last Tq of S positions: [1, 1, Tq, S].
torch::Tensor causal_allowed(int64_t Tq, int64_t S) {
  auto i = torch::arange(Tq).unsqueeze(1), j = torch::arange(S).unsqueeze(0);
  return (j <= i + (S - Tq)).view({1, 1, Tq, S});
}

}  // namespace

TEST_CASE("bi_linear equals torch::linear, any leading dims and strides") {
  torch::manual_seed(0);
  for (auto dt : kDtypes) {
    for (int64_t K : {1, 7, 16, 33, 100, 300}) {
      for (int64_t N : {1, 5, 33, 257}) {
        CAPTURE(dt);
        CAPTURE(K);
        CAPTURE(N);
        auto x = randn({2, K, 3}, dt).transpose(1, 2);  // [2, 3, K], not contiguous
        auto w = randn({N, K}, dt) / std::sqrt(double(K));
        auto b = randn({N}, dt);
        auto got = bi_linear(x, w, b);
        CHECK(got.sizes() == torch::IntArrayRef({2, 3, N}));
        CHECK((got.scalar_type() == dt));
        CHECK(max_abs_diff(got, torch::linear(x, w, b)) < tolerance(dt));
        CHECK(max_abs_diff(bi_linear(x, w, {}), torch::linear(x, w)) < tolerance(dt));
      }
    }
  }
}

TEST_CASE("bi_linear and bi_rms_norm follow the documented lane order, bit for bit") {
  torch::manual_seed(1);
  for (auto dt : kDtypes) {
    for (int64_t K : {1, 8, 15, 16, 17, 40, 577}) {
      CAPTURE(dt);
      CAPTURE(K);
      auto x = randn({7, K}, dt), w = randn({5, K}, dt), b = randn({5}, dt), g = randn({K}, dt);
      auto got = bi_linear(x, w, b);
      auto normed = bi_rms_norm(x, g, 1e-6);
      AT_DISPATCH_FLOATING_TYPES(dt, "spec", [&] {
        using T = scalar_t;
        bool same = true;
        for (int64_t i = 0; i < 7; ++i) {
          const T* xi = x.data_ptr<T>() + i * K;
          for (int64_t j = 0; j < 5; ++j) {
            const T want = lane_dot_spec(xi, w.data_ptr<T>() + j * K, K) + b.data_ptr<T>()[j];
            same = same && got.data_ptr<T>()[i * 5 + j] == want;
          }
          const T inv = T(1) / std::sqrt(lane_dot_spec(xi, xi, K) / T(K) + T(1e-6));
          for (int64_t c = 0; c < K; ++c) same = same && normed.data_ptr<T>()[i * K + c] == g.data_ptr<T>()[c] * (xi[c] * inv);
        }
        CHECK(same);
      });
    }
  }
}

TEST_CASE("bi_linear: a row or a column alone equals it inside any batch, with one thread or two") {
  torch::manual_seed(2);
  for (auto dt : kDtypes) {
    for (int64_t M : {1, 3, 7, 64, 131}) {
      for (int64_t N : {1, 5, 33, 257}) {
        CAPTURE(dt);
        CAPTURE(M);
        CAPTURE(N);
        const int64_t K = 77;  // 4 lane blocks and a tail of 13 (float32) or 5 (float64)
        auto x = randn({M, K}, dt), w = randn({N, K}, dt), b = randn({N}, dt);
        auto full = [&] {
          Threads one(1);
          return bi_linear(x, w, b);  // [M, N]
        }();
        {
          Threads two(2);
          CHECK(torch::equal(bi_linear(x, w, b), full));
        }
        for (int64_t p : positions(M)) {
          CAPTURE(p);
          CHECK(torch::equal(bi_linear(x.slice(0, p, p + 1), w, b)[0], full[p]));
          // The same row at another position of a batch of other rows.
          auto other = randn({M + 5, K}, dt);
          const int64_t q = (p * 7 + 3) % (M + 5);
          other[q] = x[p];
          CHECK(torch::equal(bi_linear(other, w, b)[q], full[p]));
        }
        for (int64_t j : positions(N)) {
          CAPTURE(j);
          auto col = bi_linear(x, w.slice(0, j, j + 1), b.slice(0, j, j + 1));  // [M, 1]
          CHECK(torch::equal(col.select(1, 0), full.select(1, j)));
        }
      }
    }
    // Past one task's block (240 rows x 96 columns), split across two threads.
    auto x = randn({300, 40}, dt), w = randn({300, 40}, dt);
    auto full = bi_linear(x, w, {});
    Threads two(2);
    CHECK(torch::equal(bi_linear(x, w, {}), full));
    CHECK(torch::equal(bi_linear(x.slice(0, 299, 300), w, {})[0], full[299]));
    CHECK(torch::equal(bi_linear(x.slice(0, 241, 242), w.slice(0, 97, 200), {})[0], full[241].slice(0, 97, 200)));
  }
}

TEST_CASE("bi_rms_norm equals Hugging Face RMSNorm; a row alone equals it in the batch") {
  torch::manual_seed(3);
  for (auto dt : kDtypes) {
    for (int64_t D : {1, 16, 33, 576}) {
      CAPTURE(dt);
      CAPTURE(D);
      auto x = randn({3, 37, D}, dt) * 2.0, w = randn({D}, dt);
      auto got = bi_rms_norm(x, w, 1e-5);
      CHECK(max_abs_diff(got, rms_norm_reference(x, w, 1e-5)) < tolerance(dt) * 10);
      auto rows = x.view({-1, D});
      auto flat = got.view({-1, D});
      for (int64_t p : positions(rows.size(0))) CHECK(torch::equal(bi_rms_norm(rows.slice(0, p, p + 1), w, 1e-5)[0], flat[p]));
      Threads two(2);
      CHECK(torch::equal(bi_rms_norm(x, w, 1e-5), got));
    }
  }
}

TEST_CASE("bi_silu_mul equals silu(gate) * up, element by element") {
  torch::manual_seed(4);
  for (auto dt : kDtypes) {
    CAPTURE(dt);
    auto g = randn({5, 40001}, dt) * 4.0, u = randn({5, 40001}, dt);
    auto got = bi_silu_mul(g, u);
    CHECK(max_abs_diff(got, torch::silu(g) * u) < tolerance(dt) * 10);
    CHECK(torch::equal(bi_silu_mul(g[3].slice(0, 17, 1000), u[3].slice(0, 17, 1000)), got[3].slice(0, 17, 1000)));
    Threads two(2);
    CHECK(torch::equal(bi_silu_mul(g, u), got));
  }
}

TEST_CASE("bi_rope_cos_sin is Hugging Face's construction; a sequence alone equals it in the batch") {
  torch::manual_seed(5);
  const int64_t hd = 64;
  auto inv_freq = 1.0 / torch::pow(10000.0, torch::arange(0, hd, 2, torch::kFloat32) / float(hd));  // [hd/2]
  auto pos = torch::randint(0, 5000, {3, 9}, torch::kLong);
  auto freqs = torch::matmul(inv_freq.view({1, -1, 1}).expand({3, -1, 1}), pos.unsqueeze(1).to(torch::kFloat32))
                   .transpose(1, 2);      // [B, T, hd/2]
  auto emb = torch::cat({freqs, freqs}, -1);  // [B, T, hd]
  for (auto dt : kDtypes) {
    CAPTURE(dt);
    auto [cos, sin] = bi_rope_cos_sin(pos, inv_freq, dt);
    CHECK(cos.sizes() == torch::IntArrayRef({3, 9, hd}));
    CHECK((cos.scalar_type() == dt));
    // float32 math either way: ATen's vectorized cos/sin and libm's differ by an ulp or so.
    CHECK(max_abs_diff(cos, emb.cos().to(dt)) < 1e-6);
    CHECK(max_abs_diff(sin, emb.sin().to(dt)) < 1e-6);
    auto [c1, s1] = bi_rope_cos_sin(pos.slice(0, 1, 2), inv_freq, dt);
    CHECK(torch::equal(c1[0], cos[1]));
    CHECK(torch::equal(s1[0], sin[1]));
  }
}

TEST_CASE("bi_attention equals softmax attention with a mask or causal, grouped-query heads") {
  torch::manual_seed(6);
  for (auto dt : kDtypes) {
    for (int64_t d : {8, 19, 64}) {
      CAPTURE(dt);
      CAPTURE(d);
      const int64_t B = 2, H = 4, Hkv = 2, Tq = 21, S = 25;
      const double scale = 1.0 / std::sqrt(double(d));
      auto q = randn({B, H, Tq, d}, dt), k = randn({B, Hkv, S, d}, dt), v = randn({B, Hkv, S, d}, dt);
      auto allowed = torch::rand({B, 1, Tq, S}) < 0.6;
      allowed.select(3, 2).fill_(true);  // every query sees key 2
      CHECK(max_abs_diff(bi_attention(q, k, v, allowed, scale), attention_reference(q, k, v, allowed, scale)) <
            tolerance(dt));
      CHECK(max_abs_diff(bi_attention(q, k, v, {}, scale),
                         attention_reference(q, k, v, causal_allowed(Tq, S).expand({B, 1, Tq, S}), scale)) <
            tolerance(dt));
    }
    // A query with no allowed key gives zeros; so do queries before the first key (Tq > S).
    auto q = randn({1, 2, 3, 8}, dt), k = randn({1, 1, 2, 8}, dt), v = randn({1, 1, 2, 8}, dt);
    auto allowed = torch::ones({1, 1, 3, 2}, torch::kBool);
    allowed[0][0][1].fill_(false);
    auto out = bi_attention(q, k, v, allowed, 0.3);
    CHECK(torch::equal(out.select(2, 1), torch::zeros({1, 2, 8}, dt)));
    auto causal = bi_attention(q, k, v, {}, 0.3);  // query 0 sees j <= -1
    CHECK(torch::equal(causal.select(2, 0), torch::zeros({1, 2, 8}, dt)));
  }
}

TEST_CASE("bi_attention: a decode step over a KV cache equals the full causal pass, bit for bit") {
  torch::manual_seed(7);
  for (auto dt : kDtypes) {
    for (int64_t d : {20, 64}) {
      CAPTURE(dt);
      CAPTURE(d);
      const int64_t B = 3, H = 4, Hkv = 2, T = 19, S = 24;  // S: cache capacity
      const double scale = 1.0 / std::sqrt(double(d));
      auto q = randn({B, H, T, d}, dt), k = randn({B, Hkv, T, d}, dt), v = randn({B, Hkv, T, d}, dt);
      auto full = [&] {
        Threads one(1);
        return bi_attention(q, k, v, {}, scale);  // [B, H, T, d]
      }();
      {
        Threads two(2);
        CHECK(torch::equal(bi_attention(q, k, v, {}, scale), full));
      }
      // Unused cache slots hold NaN: a decode step must never read them into its result.
      auto nan = std::numeric_limits<double>::quiet_NaN();
      auto kc = torch::full({B, Hkv, S, d}, nan, torch::TensorOptions(dt));
      auto vc = torch::full({B, Hkv, S, d}, nan, torch::TensorOptions(dt));
      kc.slice(2, 0, T).copy_(k);
      vc.slice(2, 0, T).copy_(v);
      // One sequence per row, each at its own length: the token at position L_b sees 0..L_b.
      for (std::vector<int64_t> L : {std::vector<int64_t>{0, 0, 0}, {2, 9, 18}, {18, 17, 1}, {5, 5, 5}}) {
        CAPTURE(L[0]);
        CAPTURE(L[1]);
        CAPTURE(L[2]);
        auto qd = torch::empty({B, H, 1, d}, dt);
        auto mask = torch::zeros({B, 1, 1, S}, torch::kBool);
        for (int64_t b = 0; b < B; ++b) {
          qd[b].copy_(q[b].slice(1, L[b], L[b] + 1));
          mask[b][0][0].slice(0, 0, L[b] + 1).fill_(true);
        }
        auto step = bi_attention(qd, kc, vc, mask, scale);  // [B, H, 1, d]
        for (int64_t b = 0; b < B; ++b) CHECK(torch::equal(step[b].select(1, 0), full[b].select(1, L[b])));
      }
      // A chunk of queries at positions 11..14 (causal over the first 15 keys) equals those rows.
      auto chunk = bi_attention(q.slice(2, 11, 15), k.slice(2, 0, 15), v.slice(2, 0, 15), {}, scale);
      CHECK(torch::equal(chunk, full.slice(2, 11, 15)));
    }
  }
}

TEST_CASE("bi_log_softmax equals log_softmax(logits / T); a row alone equals it in the batch") {
  torch::manual_seed(8);
  for (auto dt : kDtypes) {
    for (int64_t V : {1, 17, 1000, 4099}) {
      CAPTURE(dt);
      CAPTURE(V);
      auto logits = randn({6, V}, dt) * 3.0;
      auto temp = torch::tensor({1.0, 0.7, 1.3, 0.25, 2.0, 1.0}, torch::kFloat64);
      auto got = bi_log_softmax(logits, temp);
      auto ref = torch::log_softmax(logits / temp.to(dt).unsqueeze(1), -1);
      CHECK(max_abs_diff(got, ref) < tolerance(dt) * 10);
      for (int64_t p : positions(6)) CHECK(torch::equal(bi_log_softmax(logits.slice(0, p, p + 1), temp.slice(0, p, p + 1))[0], got[p]));
      auto same_t = bi_log_softmax(logits, torch::full({6}, 0.7, torch::kFloat64));
      CHECK(torch::equal(bi_log_softmax(logits, torch::tensor({0.7}, torch::kFloat64)), same_t));
      Threads two(2);
      CHECK(torch::equal(bi_log_softmax(logits, temp), got));
    }
  }
}

TEST_CASE("unsupported dtypes, devices and shapes are refused with the function named") {
  auto x = torch::randn({2, 8}), w = torch::randn({3, 8});
  CHECK_THROWS_WITH(bi_linear(x.to(torch::kBFloat16), w.to(torch::kBFloat16), {}),
                    doctest::Contains("bi_linear: x has dtype BFloat16"));
  CHECK_THROWS_WITH(bi_linear(x, w.to(torch::kFloat64), {}), doctest::Contains("bi_linear: weight has dtype Double"));
  CHECK_THROWS_WITH(bi_linear(x, torch::randn({3, 7}), {}), doctest::Contains("must be [..., K] and [N, K]"));
  CHECK_THROWS_WITH(bi_linear(torch::empty({2, 8}, torch::Device(torch::kMeta)), w, {}),
                    doctest::Contains("CPU only"));
  CHECK_THROWS_WITH(bi_rms_norm(torch::ones({2, 8}, torch::kInt32), torch::ones({8}, torch::kInt32), 1e-6),
                    doctest::Contains("bi_rms_norm: x has dtype Int"));
  CHECK_THROWS_WITH(bi_silu_mul(x, torch::randn({2, 9})), doctest::Contains("bi_silu_mul"));
  CHECK_THROWS_WITH(bi_rope_cos_sin(torch::zeros({1, 4}, torch::kLong), torch::ones({4}), torch::kBFloat16),
                    doctest::Contains("bi_rope_cos_sin: dtype BFloat16"));
  auto q = torch::randn({1, 3, 2, 8}), kv = torch::randn({1, 2, 2, 8});
  CHECK_THROWS_WITH(bi_attention(q, kv, kv, {}, 1.0), doctest::Contains("H a multiple of Hkv"));
  CHECK_THROWS_WITH(bi_attention(kv, kv, kv, torch::ones({1, 1, 2, 2}), 1.0), doctest::Contains("bi_attention: mask"));
  CHECK_THROWS_WITH(bi_log_softmax(x, torch::ones({3})), doctest::Contains("bi_log_softmax: temperature"));
  // No backward: refused while autograd would record, fine under NoGradGuard.
  auto wg = w.clone().requires_grad_(true);
  CHECK_THROWS_WITH(bi_linear(x, wg, {}), doctest::Contains("NoGradGuard"));
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(bi_linear(x, wg, {}), bi_linear(x, w, {})));
}
