// 4-bit AWQ linear layers on CPU: y = x @ W with W kept as 4-bit codes.
//
//   x       [M, K]               float32, contiguous
//   codes   [N' / 32, K / 8, 32] int32: output columns in tiles of 32 (N' = N rounded up,
//                                padding columns hold zeros); word (t, b, j) holds column
//                                32t + j for the 8 inputs 8b..8b+7, input 8b+i in the 4 bits
//                                from (3 + 4i) mod 32 upwards (input 8b+7 wraps from bit 31)
//   s, zs   [N' / 32, K / G, 32] float32 scale and zero * scale, W[k, n] = q s - zs, by tile
//                                (each tile reads its codes and scales front to back)
//
// A code becomes a float without a conversion instruction. Its field, rotated into bits
// 15..18 or 19..22 of a float's mantissa and given the exponent of 256 or 16, reads 256 + q
// or 16 + q exactly: one rotate serves two fields (four per word), one and-or makes each
// float. The bases come out per group and row with the sums of x:
//   sum_{k in g} x_k W[k, n] = s (acc - c) - zs sum x_k,   acc = sum x_k (base_k + q_k),
//   c = sum base_k x_k (base 16 for even k, 256 for odd), in float32: the bases cost a few
//   of the 24 bits, far below 4-bit quantization error.
//
// awq_gemv is a fused dequantize-GEMV over chunks of up to 8 rows: each chunk reads every code
// once, as one sequential stream per tile, and unpacks it once for all rows. At one or two
// rows, codes at bits 15..18 and 19..22 feed separate accumulators: 4+ independent FMA
// chains hide the FMA latency.
// awq_dequantize writes W^T [K, N] in float32 for torch's GEMM, which wins at large M.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kTile = 32;  // output columns per tile: two 16-float vectors
constexpr int64_t kMaxRows = 8;
constexpr float kLowBase = 256.f, kHighBase = 16.f;
constexpr uint32_t kLowExp = 0x43800000;   // 256.0f: mantissa bit 15 weighs 1
constexpr uint32_t kHighExp = 0x41800000;  // 16.0f: mantissa bit 19 weighs 1

struct Shape {
  int64_t K, N, NT, G;  // N real columns, NT tiles of 32
};

Shape check(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zs,
            int64_t n, int64_t group) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kInt && codes.is_contiguous() &&
                  codes.size(2) == kTile,
              "codes must be contiguous int32 [N' / 32, K / 8, 32]");
  const int64_t NT = codes.size(0), K = codes.size(1) * 8;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0 && n > (NT - 1) * kTile &&
                  n <= NT * kTile,
              "group size must be a multiple of 8 dividing K, and N fit the tiles");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  zs.sizes() == scales.sizes() && zs.is_contiguous() &&
                  zs.scalar_type() == torch::kFloat && scales.dim() == 3 &&
                  scales.size(0) == NT && scales.size(1) == K / group && scales.size(2) == kTile,
              "scales and zs must be contiguous float32 [N' / 32, K / group, 32]");
  return {K, n, NT, group};
}

template <int R>
inline vu16 rotl(vu16 w) {
  if constexpr (R == 0) {
    return w;
  } else {
    return (w << R) | (w >> (32 - R));
  }
}

// The two inputs a word rotated left by R puts at bits 15..18 (input LOW: 256 + q) and
// 19..22 (input HIGH: 16 + q), into every row's accumulators; with two accumulator sets
// (S = 2, few rows) LOW and HIGH go to separate ones, for more independent FMA chains.
template <int R, int LOW, int HIGH, int64_t S, int64_t M>
inline void step(const vu16 (&w)[2], const float* x, int64_t K, vf16 (&acc)[S][M][2]) {
  vf16 lo[2], hi[2];
  for (int64_t p = 0; p < 2; ++p) {
    const vu16 r = rotl<R>(w[p]);
    lo[p] = as_floats((r & (0xFu << 15)) | kLowExp);
    hi[p] = as_floats((r & (0xFu << 19)) | kHighExp);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float xl = x[m * K + LOW], xh = x[m * K + HIGH];
    for (int64_t p = 0; p < 2; ++p) {  // two statements: two FMAs (no reassociation)
      acc[0][m][p] += xl * lo[p];
      acc[S - 1][m][p] += xh * hi[p];
    }
  }
}

// Rows [0, M) of y over the 32 columns of tile t: one sequential stream of codes.
template <int64_t M>
void tile_rows(const float* xp, const int32_t* cp, const float* sp, const float* zp,
                const float* xsum, float* yp, int64_t t, const Shape& s) {
  constexpr int64_t S = M <= 2 ? 2 : 1;
  const int64_t NG = s.K / s.G;
  const int32_t* stream = cp + t * (s.K / 8) * kTile;
  vf16 out[M][2] = {};
  for (int64_t g = 0; g < NG; ++g) {
    vf16 acc[S][M][2] = {};
    for (int64_t blk = g * s.G / 8; blk < (g + 1) * s.G / 8; ++blk) {
      const int32_t* words = stream + blk * kTile;
      const vu16 w[2] = {load16u(words), load16u(words + 16)};
      const float* x = xp + blk * 8;
      step<0, 3, 4>(w, x, s.K, acc);
      step<8, 1, 2>(w, x, s.K, acc);
      step<24, 5, 6>(w, x, s.K, acc);
      step<16, 7, 0>(w, x, s.K, acc);
    }
    for (int64_t p = 0; p < 2; ++p) {
      const int64_t at = (t * NG + g) * kTile + p * 16;
      const vf16 sv = load16(sp + at), zv = load16(zp + at);
      for (int64_t m = 0; m < M; ++m) {
        const float* sums = xsum + 2 * (m * NG + g);  // sum x, sum base x
        const vf16 a = S == 2 ? acc[0][m][p] + acc[S - 1][m][p] : acc[0][m][p];
        out[m][p] += sv * (a - sums[1]) - zv * sums[0];
      }
    }
  }
  const int64_t n0 = t * kTile, n = std::min(kTile, s.N - n0);
  for (int64_t m = 0; m < M; ++m) {
    if (n == kTile) {
      store16(yp + m * s.N + n0, out[m][0]);
      store16(yp + m * s.N + n0 + 16, out[m][1]);
    } else {  // the last, padded tile
      float full[kTile];
      store16(full, out[m][0]);
      store16(full + 16, out[m][1]);
      std::memcpy(yp + m * s.N + n0, full, n * sizeof(float));
    }
  }
}

// All tiles for M rows, split over threads.
template <int64_t M>
void gemv_rows(const float* xp, const int32_t* cp, const float* sp, const float* zp,
               const float* xsum, float* yp, const Shape& s) {
  at::parallel_for(0, s.NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile_rows<M>(xp, cp, sp, zp, xsum, yp, t, s);
  });
}

void gemv_chunk(const float* xp, const int32_t* cp, const float* sp, const float* zp,
                const float* xsum, float* yp, int64_t rows, const Shape& s) {
  switch (rows) {
    case 1: return gemv_rows<1>(xp, cp, sp, zp, xsum, yp, s);
    case 2: return gemv_rows<2>(xp, cp, sp, zp, xsum, yp, s);
    case 3: return gemv_rows<3>(xp, cp, sp, zp, xsum, yp, s);
    case 4: return gemv_rows<4>(xp, cp, sp, zp, xsum, yp, s);
    case 5: return gemv_rows<5>(xp, cp, sp, zp, xsum, yp, s);
    case 6: return gemv_rows<6>(xp, cp, sp, zp, xsum, yp, s);
    case 7: return gemv_rows<7>(xp, cp, sp, zp, xsum, yp, s);
    default: return gemv_rows<8>(xp, cp, sp, zp, xsum, yp, s);
  }
}

}  // namespace

torch::Tensor awq_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                       torch::Tensor zs, int64_t n, int64_t group) {
  const Shape s = check(codes, scales, zs, n, group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) == s.K, "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), NG = s.K / s.G;
  auto y = torch::empty({M, s.N}, x.options());
  const float* xp = x.data_ptr<float>();
  // Per row and group: sum x (the zero-point term) and sum base_k x_k (the bases).
  std::vector<float> xsum(2 * M * NG, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < s.K; ++k) {
      float* sums = xsum.data() + 2 * (m * NG + k / s.G);
      sums[0] += xp[m * s.K + k];
      sums[1] += (k % 2 ? kLowBase : kHighBase) * xp[m * s.K + k];
    }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    gemv_chunk(xp + m0 * s.K, codes.data_ptr<int32_t>(), scales.data_ptr<float>(),
               zs.data_ptr<float>(), xsum.data() + 2 * m0 * NG, y.data_ptr<float>() + m0 * s.N,
               std::min(kMaxRows, M - m0), s);
  }
  return y;
}

torch::Tensor awq_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor zs,
                             int64_t n, int64_t group) {
  const Shape s = check(codes, scales, zs, n, group);
  const int64_t Np = s.NT * kTile;
  auto w = torch::empty({s.K, Np}, scales.options());  // W^T, as x @ w wants
  const int32_t* cp = codes.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zs.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, s.K / 8, 2, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t g = blk * 8 / s.G;
      for (int64_t t = 0; t < s.NT * 2; ++t) {  // t: 16 columns, half a tile
        const vu16 word = load16u(cp + ((t / 2) * (s.K / 8) + blk) * kTile + t % 2 * 16);
        const int64_t at = ((t / 2) * (s.K / s.G) + g) * kTile + t % 2 * 16;
        const vf16 sv = load16(sp + at), zv = load16(zp + at);
        float* row = wp + blk * 8 * Np + t * 16;
        // Input i sits in rotation (i + 1) / 2 % 4 below, at bits 15..18 (odd i) or 19..22.
        const vu16 r[4] = {rotl<16>(word), rotl<8>(word), word, rotl<24>(word)};
        for (int64_t i = 0; i < 8; ++i) {
          const vu16 ri = r[(i + 1) / 2 % 4];
          const vu16 bits = i % 2 ? (ri & (0xFu << 15)) | kLowExp : (ri & (0xFu << 19)) | kHighExp;
          store16(row + i * Np, sv * (as_floats(bits) - (i % 2 ? kLowBase : kHighBase)) - zv);
        }
      }
    }
  });
  return s.N == Np ? w : w.narrow(1, 0, s.N);
}

// The whole layer for x [..., K] of any float dtype: GEMV up to `max_gemv_rows` rows, else a
// GEMM on the dequantized weight; plus the bias; in x's dtype. One call from Python per layer
// (the reshapes and casts in C++ cost a fraction of what they cost as Python calls at batch 1).
torch::Tensor awq_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                         torch::Tensor zs, c10::optional<torch::Tensor> bias, int64_t n,
                         int64_t group, int64_t max_gemv_rows) {
  const auto x2 = x.reshape({-1, x.size(-1)}).to(torch::kFloat).contiguous();
  auto y = x2.size(0) <= max_gemv_rows
               ? awq_gemv(x2, codes, scales, zs, n, group)
               : at::matmul(x2, awq_dequantize(codes, scales, zs, n, group));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat));
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape).to(x.scalar_type());
}
