// 4-bit AWQ linear layers on CPU: y = x @ W^T with W kept as 4-bit codes.
//
//   x       [M, K]      float32, contiguous
//   codes   [N, K / 2]  uint8: within each group of G inputs starting at g*G, byte g*G/2 + j
//                       holds input g*G + j in its low nibble and g*G + j + G/2 in its high
//                       nibble, so both halves unpack into contiguous runs (vectorizable).
//   scales  [N, K / G]  float32
//   zs      [N, K / G]  float32, zero * scale, so W[n, k] = q * s - zs
//
// Small M (decode) is a fused dequantize-GEMV: the codes are read once, straight from memory,
// and  y[m, n] = sum_g s * (x[m, g] . q[n, g]) - zs * sum(x[m, g]).
// Large M dequantizes W to float32 and hands it to torch's GEMM, whose cost then dominates.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

static inline void unpack_group(const uint8_t* __restrict codes, float* __restrict out,
                                int64_t half) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    out[j] = static_cast<float>(codes[j] & 0xF);
    out[j + half] = static_cast<float>(codes[j] >> 4);
  }
}

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                  const torch::Tensor& zs, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(), "codes: uint8");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group % 2 == 0 && K % group == 0 && codes.size(1) * 2 == K,
              "codes/x/group size disagree");
  TORCH_CHECK(scales.sizes() == zs.sizes() && scales.size(0) == N && scales.size(1) == K / group,
              "scales/zs must be [N, K / group]");
}

torch::Tensor awq_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                       torch::Tensor zs, int64_t group) {
  check(x, codes, scales, zs, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), NG = K / group;
  auto y = torch::empty({M, N}, x.options());
  // Per-group sums of x feed the zero-point term.
  std::vector<float> xsum(M * NG);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < NG; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < group; ++j) s += xp[m * K + g * group + j];
      xsum[m * NG + g] = s;
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(group);
    std::vector<float> acc(M);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < NG; ++g) {
        unpack_group(cp + n * (K / 2) + g * (group / 2), w.data(), group / 2);
        const float s = sp[n * NG + g], z = zp[n * NG + g];
        for (int64_t m = 0; m < M; ++m)
          acc[m] += s * dot(xp + m * K + g * group, w.data(), group) - z * xsum[m * NG + g];
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = acc[m];
    }
  });
  return y;
}

torch::Tensor awq_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor zs,
                             int64_t group) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, NG = K / group;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(), "codes: uint8");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == NG, "scales must be [N, K / group]");
  auto w = torch::empty({N, K}, scales.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zs.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t g = 0; g < NG; ++g) {
        float* out = wp + n * K + g * group;
        unpack_group(cp + n * (K / 2) + g * (group / 2), out, group / 2);
        const float s = sp[n * NG + g], z = zp[n * NG + g];
#pragma omp simd
        for (int64_t j = 0; j < group; ++j) out[j] = out[j] * s - z;
      }
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("awq_gemv", &awq_gemv, "fused 4-bit dequantize-GEMV (small batches)");
  m.def("awq_dequantize", &awq_dequantize, "4-bit codes to a float32 [N, K] weight");
}
