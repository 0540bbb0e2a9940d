// Weight-only int8 and int4 GEMMs (ATen's packed CPU kernels for bfloat16 activations, MKL over
// the dequantized weight for float32) against their plain-ATen reference: the weight rounded by
// the same rule, unpacked, times x in float64.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "kernels/weight_only.hpp"

using namespace troupe::kernels;

namespace {
double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return ((a64 - b64).abs().max() / b64.abs().max()).item<double>();
}
}  // namespace

TEST_CASE("int8 and int4 GEMMs equal x times the weight rounded by their rule") {
  torch::manual_seed(0);
  // (N, K, M): the tiny fixtures' projections and vocabulary, SmolLM2's, odd row counts.
  for (auto [N, K, M] : {std::tuple<int64_t, int64_t, int64_t>{96, 64, 1}, {64, 96, 7}, {1000, 64, 3},
                         {1536, 576, 1}, {576, 1536, 5}, {33, 32, 2}, {160, 64, 40}}) {
    CAPTURE(N);
    CAPTURE(K);
    CAPTURE(M);
    auto w = torch::randn({N, K}) * 0.05;
    auto x = torch::randn({M, K});
    auto bias = torch::randn({N});
    for (int64_t bits : {8, 4}) {
      CAPTURE(bits);
      auto w_ref = fake_quantize_reference(w, bits).to(torch::kFloat64);
      // bfloat16 activations: ATen's packed kernel, against float64 over the same bfloat16 inputs;
      // what is left is its order of summation and the rounding of its bfloat16 output.
      auto qb = quantize_weight(w, bits, torch::kBFloat16);
      CHECK(qb.packed.defined());
      CHECK(qb.out_features == N);
      CHECK(qb.in_features == K);
      auto xb = x.to(torch::kBFloat16);
      auto ref_b = torch::matmul(xb.to(torch::kFloat64), w_ref.t()) + bias.to(torch::kBFloat16).to(torch::kFloat64);
      auto yb = quantized_linear(xb, qb, bias);
      REQUIRE((yb.sizes() == ref_b.sizes()));
      CHECK((yb.scalar_type() == torch::kBFloat16));
      double err_b = max_rel_diff(yb, ref_b);
      // float32 activations: the dequantized weight through oneDNN (packed) or MKL, against float64.
      auto q = quantize_weight(w, bits, torch::kFloat32);
      CHECK(q.dequantized.defined());
      auto ref = torch::matmul(x.to(torch::kFloat64), w_ref.t()) + bias.to(torch::kFloat64);  // (M, N)
      auto y = quantized_linear(x, q, bias);
      CHECK((y.scalar_type() == torch::kFloat32));
      double err = max_rel_diff(y, ref);
      MESSAGE("int" << bits << " [" << N << ", " << K << "] x " << M << " rows: max error of the largest output "
                    << err_b << " (bfloat16, packed kernel), " << err << " (float32)");
      CHECK(err_b < 8e-3);  // bfloat16 keeps 8 bits: its output rounds by up to 2^-9 of itself
      CHECK(err < 1e-5);
      // Leading dimensions pass through.
      auto y3 = quantized_linear(xb.unsqueeze(0), qb, {});
      CHECK((y3.sizes() == torch::IntArrayRef({1, M, N})));
    }
  }
}

TEST_CASE("float32's few-row kernel reads the codes and equals x times the weight rounded by the rule") {
  // Decoding one or a few sequences multiplies the int8 or int4 codes themselves (an eighth of
  // float32's bytes for int4); many rows go through oneDNN or MKL over the dequantized copy. Both
  // hold the same policy: each against float64 over the rounded weight, on both thread counts,
  // through the vector loop where this CPU has AVX2 + FMA and through the plain loop (what other
  // CPUs run).
  MESSAGE("few-row kernel: " << (few_rows_vectorized() ? "AVX2 + FMA" : "plain loop"));
  const int threads = torch::get_num_threads();
  for (bool plain : {false, true}) {
    CAPTURE(plain);
    force_few_rows_plain(plain);
    torch::manual_seed(3);
    // (N, K): row counts that are and are not a multiple of four; K = 36 (int8 only) leaves 4 inputs
    // past the last 8 for the scalar tail.
    for (auto [N, K] : {std::pair<int64_t, int64_t>{96, 64}, {1538, 576}, {33, 32}, {7, 96}, {576, 1536}, {10, 36}})
      for (int64_t bits : {8, 4})
        for (int64_t M : {1, 2, 4, 5})
          for (int n : {1, 2}) {
            if (K % kInt4Group != 0 && bits == 4) continue;
            CAPTURE(N);
            CAPTURE(K);
            CAPTURE(bits);
            CAPTURE(M);
            CAPTURE(n);
            torch::set_num_threads(n);
            auto w = torch::randn({N, K}) * 0.05;
            auto x = torch::randn({M, K});
            auto bias = torch::randn({N});
            auto q = quantize_weight(w, bits, torch::kFloat32);
            REQUIRE(q.codes.defined());
            auto ref = torch::matmul(x.to(torch::kFloat64), fake_quantize_reference(w, bits).to(torch::kFloat64).t()) +
                       bias.to(torch::kFloat64);
            auto few = quantized_linear(x, q, bias, FewRows::always);
            auto mkl = quantized_linear(x, q, bias, FewRows::never);
            REQUIRE((few.sizes() == ref.sizes()));
            CHECK(max_rel_diff(few, ref) < 1e-5);
            CHECK(max_rel_diff(mkl, ref) < 1e-5);
            // The automatic choice: the codes up to kFewRows rows, else MKL; and the bytes each reads.
            CHECK(torch::equal(quantized_linear(x, q, bias), M <= kFewRows ? few : mkl));
            const int64_t code_bytes = N * K * bits / 8 + N * (bits == 4 ? 2 * K / kInt4Group : 1) * 4;
            CHECK(q.bytes(M) == (M <= kFewRows ? code_bytes : N * K * 4));
            // Each output row's sum is one fixed order: a row alone gives the bits it gets among others.
            auto alone = quantized_linear(x.narrow(0, M - 1, 1), q, bias, FewRows::always);
            CHECK(torch::equal(alone, few.narrow(0, M - 1, 1)));
          }
  }
  force_few_rows_plain(false);
  torch::set_num_threads(threads);
}

TEST_CASE("the rounding rules: int8 within half a step of the row's scale, int4 of its group's") {
  torch::manual_seed(1);
  auto w = torch::randn({48, 128});
  w[3].fill_(0);  // an all-zero row (and its groups) must stay zero, not divide by zero
  auto w8 = fake_quantize_reference(w, 8), w4 = fake_quantize_reference(w, 4);
  CHECK(torch::isfinite(w8).all().item<bool>());
  CHECK(torch::isfinite(w4).all().item<bool>());
  CHECK(w8[3].abs().max().item<double>() == 0.0);
  CHECK(w4[3].abs().max().item<double>() == 0.0);
  auto step8 = w.abs().amax(1, true) / 127;  // (48, 1)
  CHECK(((w8 - w).abs() <= step8 / 2 + 1e-7).all().item<bool>());
  auto g = w.reshape({48, 128 / kInt4Group, kInt4Group});
  auto step4 = (g.amax(-1, true) - g.amin(-1, true)) / 15;  // (48, 4, 1)
  CHECK((((w4 - w).reshape(g.sizes())).abs() <= step4 / 2 + 1e-6).all().item<bool>());
  // A Q4_1-like weight (16 levels per group of 32, with a minimum) comes back exactly.
  auto levels = torch::randint(0, 16, {8, 64}).to(torch::kFloat32);
  levels.select(1, 0).fill_(0);
  levels.select(1, 1).fill_(15);
  levels.select(1, 32).fill_(0);
  levels.select(1, 33).fill_(15);
  auto q41 = levels * 0.01 - 0.07;
  CHECK(max_rel_diff(fake_quantize_reference(q41, 4), q41) < 1e-6);
  // The packed size: int4 reads an eighth of float32's bytes, int8 a quarter, plus their scales.
  auto q = quantize_weight(w, 4, torch::kBFloat16);
  CHECK(q.packed.numel() * q.packed.element_size() == 48 * 128 / 2);
  CHECK(quantize_weight(w, 8, torch::kBFloat16).bytes() == 48 * 128 + 48 * 2);
}

TEST_CASE("quantize_weight's one-pass rule gives fake_quantize_reference's bits, on every thread count") {
  // Engines requantize with quantize_weight at every sync; the reference is the plain-ATen rule.
  torch::manual_seed(2);
  auto odd = torch::randn({37, 96}) * 3;
  odd[5].fill_(0);                                           // a zero row: the scale's floor
  odd[7].fill_(0.25);                                        // a constant row: every group's range is 0
  odd.index_put_({9, torch::indexing::Slice(0, 32)}, 1e-30);  // a group far below the floor
  // Exact ties, which round to even: int8 with a scale of 1 (the row's largest is 127), and int4
  // with a step of 1 (a group from 0 to 15).
  using torch::indexing::Slice;
  auto ties = torch::tensor({0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 126.5f, 3.5f, 4.5f});
  odd[11].fill_(0);
  odd.index_put_({11, 0}, 127.0f);
  odd.index_put_({11, Slice(1, 9)}, ties);
  odd[12].fill_(0);
  odd.index_put_({12, Slice(0, 2)}, torch::tensor({0.0f, 15.0f}));
  odd.index_put_({12, Slice(2, 10)}, ties.abs().clamp_max(14.5f));
  const int threads = torch::get_num_threads();
  for (auto w : {torch::randn({256, 576}), odd, torch::randn({64, 128}).to(torch::kBFloat16)})
    for (int64_t bits : {8, 4})
      for (int n : {1, 2}) {
        CAPTURE(w.sizes());
        CAPTURE(bits);
        CAPTURE(n);
        torch::set_num_threads(n);
        auto fast = quantize_weight(w, bits, torch::kFloat32).dequantized;
        CHECK(fast.is_mkldnn() == at::hasMKLDNN());  // packed for oneDNN where LibTorch has it
        CHECK(torch::equal(fast.is_mkldnn() ? fast.to_dense() : fast, fake_quantize_reference(w, bits)));
      }
  torch::set_num_threads(threads);
}

TEST_CASE("what a format cannot hold is refused with the reason") {
  std::string why;
  CHECK_FALSE(quantized_weight_fits(4, 64, 48, torch::kCPU, &why));
  CHECK(why == "int4 needs the input size to be a multiple of 32, got 48");
  CHECK(quantized_weight_fits(8, 64, 48, torch::kCPU, &why));
  CHECK_FALSE(quantized_weight_fits(3, 64, 64, torch::kCPU, &why));
  CHECK(why.find("only 8 and 4 bits") != std::string::npos);
  CHECK_FALSE(quantized_weight_fits(8, 64, 64, torch::Device(torch::kCUDA, 0), &why));
  CHECK(why.find("CPU only") != std::string::npos);
  CHECK_THROWS_WITH(quantize_weight(torch::randn({8, 48}), 4, torch::kFloat32),
                    doctest::Contains("multiple of 32"));
}
