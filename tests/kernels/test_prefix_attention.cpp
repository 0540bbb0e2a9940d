// The shared-prefix decode attention against plain float64 softmax attention, row by row, over
// each row's own prefix (nothing from kernels/): outputs, log-sum-exps and the rows in no part,
// on one thread and on several (the parts are spread over the threads).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/prefix_attention.hpp"

using namespace troupe;

TEST_CASE("prefix attention equals softmax attention over each row's prefix, on any number of threads") {
  torch::NoGradGuard no_grad;
  const int64_t B = 11, nkv = 3, g = 2, hd = 16;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int threads = at::get_num_threads();
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int n : {1, 2, 4}) {
      CAPTURE(n);
      const std::string type = c10::toString(dtype);
      CAPTURE(type);
      at::set_num_threads(n);
      torch::manual_seed(n);
      auto q = torch::randn({B, nkv, g, hd}).to(dtype);
      // Parts of different prefix lengths and sizes; rows 9 and 10 belong to none.
      const std::vector<std::vector<int64_t>> members = {{0, 4, 5}, {1}, {2, 3, 6, 8}, {7}};
      const std::vector<int64_t> lengths = {5, 40, 17, 1};
      std::vector<kernels::PrefixPart> parts;
      for (size_t i = 0; i < members.size(); ++i)
        parts.push_back({torch::randn({1, nkv, lengths[i], hd}).to(dtype), torch::randn({1, nkv, lengths[i], hd}).to(dtype),
                         torch::tensor(members[i], torch::kLong)});
      auto [out, lse] = kernels::prefix_attention(q, parts, scale);
      REQUIRE((out.sizes() == q.sizes()));
      REQUIRE((out.scalar_type() == torch::kFloat32));
      REQUIRE((lse.sizes() == torch::IntArrayRef{B, nkv, g}));

      const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
      double err = 0, err_lse = 0;
      for (size_t i = 0; i < members.size(); ++i) {
        for (int64_t row : members[i]) {
          auto qr = q[row].to(torch::kFloat64);                                        // (nkv, g, hd)
          auto k = parts[i].k[0].to(torch::kFloat64), v = parts[i].v[0].to(torch::kFloat64);  // (nkv, P, hd)
          auto scores = torch::matmul(qr, k.transpose(1, 2)) * scale;                 // (nkv, g, P)
          auto ref = torch::matmul(torch::softmax(scores, -1), v);                    // (nkv, g, hd)
          err = std::max(err, (out[row].to(torch::kFloat64) - ref).abs().max().item<double>());
          err_lse = std::max(err_lse, (lse[row].to(torch::kFloat64) - torch::logsumexp(scores, -1)).abs().max().item<double>());
        }
      }
      CHECK(err < tol);
      CHECK(err_lse < tol);
      for (int64_t row : {9, 10}) {
        CHECK(out[row].abs().max().item<double>() == 0.0);
        CHECK(lse[row].max().item<double>() == -std::numeric_limits<double>::infinity());
      }
      MESSAGE("threads ", n, " dtype ", type, ": max |out - ref| ", err, ", max |lse - ref| ", err_lse);
    }
  }
  at::set_num_threads(threads);
}
