// The CPU decode attention (kernels/decode_attention.hpp) against plain float64 softmax attention,
// row by row, over the row's shared prefix (if any) followed by its own keys up to the one it
// writes (nothing from kernels/): outputs and the cache writes, on one thread and on several, in
// float32 and bfloat16, for head sizes its vector loops take (multiples of 8, on a CPU with AVX2)
// and one they leave to its plain loops.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/decode_attention.hpp"

using namespace troupe;

namespace {

struct Shape {
  int64_t nkv, g, hd;
};

}  // namespace

TEST_CASE("decode attention writes each row's key and value, and equals softmax attention over its prefix and own keys") {
  torch::NoGradGuard no_grad;
  const int64_t B = 11, capacity = 80;
  const int threads = at::get_num_threads();
  // SmolLM2's heads (3 key/value heads of 3 queries, 64 wide); one query per key/value head;
  // a head size that is no multiple of 8.
  for (const Shape shape : {Shape{3, 3, 64}, Shape{2, 1, 16}, Shape{2, 2, 12}}) {
    const int64_t nkv = shape.nkv, g = shape.g, hd = shape.hd, nh = nkv * g;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (int n : {1, 2, 4}) {
        const std::string type = c10::toString(dtype);
        CAPTURE(hd);
        CAPTURE(g);
        CAPTURE(type);
        CAPTURE(n);
        at::set_num_threads(n);
        torch::manual_seed(n + hd);
        // q and v as the model has them: views into a wider projection (strided heads).
        auto q = torch::randn({B, 1, nh, hd}).to(dtype).transpose(1, 2);                      // (B, nh, 1, hd)
        auto k_new = torch::randn({B, nkv, 1, hd}).to(dtype);
        auto v_new = torch::randn({B, 1, 2 * nkv * hd}).to(dtype).narrow(2, nkv * hd, nkv * hd)
                         .view({B, 1, nkv, hd}).transpose(1, 2);                             // (B, nkv, 1, hd)
        auto cache_k = torch::randn({B + 2, nkv, capacity, hd}).to(dtype);  // rows past B: untouched
        auto cache_v = torch::randn({B + 2, nkv, capacity, hd}).to(dtype);
        const auto before_k = cache_k.clone(), before_v = cache_v.clone();
        // Own lengths from 1 key to past two blocks of 32; prefixes of 1 to 70 keys; rows 9 and
        // 10 in none.
        auto write = torch::tensor(std::vector<int64_t>{0, 5, 31, 32, 70, 1, 79, 12, 44, 3, 64}, torch::kLong);
        const std::vector<std::vector<int64_t>> members = {{0, 4, 5}, {1}, {2, 3, 6, 8}, {7}};
        const std::vector<int64_t> lengths = {5, 70, 17, 1};
        std::vector<kernels::PrefixPart> parts;
        for (size_t i = 0; i < members.size(); ++i)
          parts.push_back({torch::randn({1, nkv, lengths[i], hd}).to(dtype), torch::randn({1, nkv, lengths[i], hd}).to(dtype),
                           torch::tensor(members[i], torch::kLong)});

        auto out = kernels::decode_attention(q, k_new, v_new, cache_k, cache_v, write, parts, scale);
        REQUIRE((out.sizes() == torch::IntArrayRef{B, nh, 1, hd}));
        REQUIRE((out.scalar_type() == dtype));

        // The writes: each row's new key and value at its position, nothing else changed.
        auto expect_k = before_k.clone(), expect_v = before_v.clone();
        for (int64_t b = 0; b < B; ++b) {
          const int64_t w = write[b].item<int64_t>();
          expect_k[b].select(1, w).copy_(k_new[b].select(1, 0));
          expect_v[b].select(1, w).copy_(v_new[b].select(1, 0));
        }
        CHECK(torch::equal(cache_k, expect_k));
        CHECK(torch::equal(cache_v, expect_v));

        double err = 0;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t w = write[b].item<int64_t>();
          auto k = expect_k[b].narrow(1, 0, w + 1).to(torch::kFloat64), v = expect_v[b].narrow(1, 0, w + 1).to(torch::kFloat64);
          for (size_t i = 0; i < members.size(); ++i)
            for (int64_t row : members[i])
              if (row == b) {
                k = torch::cat({parts[i].k[0].to(torch::kFloat64), k}, 1);  // (nkv, P + w + 1, hd)
                v = torch::cat({parts[i].v[0].to(torch::kFloat64), v}, 1);
              }
          auto qb = q[b].to(torch::kFloat64).reshape({nkv, g, hd});
          auto scores = torch::matmul(qb, k.transpose(1, 2)) * scale;          // (nkv, g, keys)
          auto ref = torch::matmul(torch::softmax(scores, -1), v).reshape({nh, 1, hd});
          err = std::max(err, (out[b].to(torch::kFloat64) - ref).abs().max().item<double>());
        }
        CHECK(err < (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
        MESSAGE("hd ", hd, " g ", g, " threads ", n, " dtype ", type, ": max |out - ref| ", err);
      }
    }
  }
  at::set_num_threads(threads);
}

TEST_CASE("decode attention names what is wrong with its inputs") {
  torch::NoGradGuard no_grad;
  const int64_t B = 2, nkv = 1, hd = 8, capacity = 4;
  auto q = torch::randn({B, 2, 1, hd}), k = torch::randn({B, nkv, 1, hd}), v = torch::randn({B, nkv, 1, hd});
  auto ck = torch::zeros({B, nkv, capacity, hd}), cv = torch::zeros({B, nkv, capacity, hd});
  auto prefix = torch::randn({1, nkv, 3, hd});
  auto call = [&](const torch::Tensor& write, const std::vector<kernels::PrefixPart>& parts, const torch::Tensor& query) {
    kernels::decode_attention(query, k, v, ck, cv, write, parts, 1.0);
  };
  auto ok = torch::tensor(std::vector<int64_t>{0, 1}, torch::kLong);
  CHECK_NOTHROW(call(ok, {}, q));
  CHECK_THROWS_WITH_AS(call(torch::tensor(std::vector<int64_t>{0, 4}, torch::kLong), {}, q),
                       doctest::Contains("write[1] = 4 is outside the cache's capacity 4"), c10::Error);
  const kernels::PrefixPart first{prefix, prefix, torch::tensor(std::vector<int64_t>{0, 1}, torch::kLong)};
  const kernels::PrefixPart second{prefix, prefix, torch::tensor(std::vector<int64_t>{1}, torch::kLong)};
  CHECK_THROWS_WITH_AS(call(ok, {first, second}, q), doctest::Contains("row 1 is in two prefixes"), c10::Error);
  CHECK_THROWS_WITH_AS(call(ok, {}, q.to(torch::kFloat64)), doctest::Contains("float32 or bfloat16"), c10::Error);
  CHECK_THROWS_WITH_AS(call(ok, {}, torch::randn({B, 2, 2, hd})), doctest::Contains("must be [B, nkv * g, 1, hd]"),
                       c10::Error);
}
