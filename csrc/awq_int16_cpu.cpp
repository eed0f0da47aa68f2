// The 4-bit AWQ GEMV with int16 activations: integer dot products instead of float FMAs.
//
// Same codes, scales and zero terms as csrc/awq_cpu.cpp (built after it, in the same unit).
// Each row of x is quantized per group to int16: x_k ~ xs q16_k with xs = max |x| / 32767 over
// the group, so the relative error of an activation is at most 2^-16 of its group's largest,
// far below what float16 activations keep (vLLM's AWQ kernels run in float16). Per group,
//   sum_k x_k W[k, n] ~ xs s (sum_k q16_k q_k) - zs sum_k x_k,
// the first sum exact in int32 (|q16 q| < 2^19, and at most 2048 inputs a group), the zero
// term's sum of x taken from the quantized x (xs sum q16; csrc/awq_int8_cpu.cpp says why).
//
// Why: on AVX2 the float GEMV turns every 4-bit code into a float with two or three vector
// instructions before its FMA (~29 instructions per 64 weights). Here one shift and one
// mask take two codes of a word into the two 16-bit halves of a 32-bit lane, and one vpmaddwd
// multiplies both by their activations and adds them: ~18 instructions per 64 weights.
// Word layout (csrc/awq_cpu.cpp): input i of a block of 8 sits at bits (3 + 4i) mod 32, so
// inputs i and i + 4 are 16 bits apart; inputs 3 and 7 need a rotation (7 wraps past bit 31).
//
// AVX2 and AVX-512 builds (256-bit code: one vpmaddwd takes eight columns). It is for AVX2:
// the AVX-512 float GEMV, with its rotate and ternary-logic instructions, is faster (SmolLM2
// batch 1: 137 vs 103 tok/s). The generic flavour has no vpmaddwd; `awq_gemv_has_integer()`
// says so.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "team.h"

namespace {

constexpr int64_t kMaxInt16Group = 2048;  // keeps a group's int32 sums from overflowing

#if defined(__AVX2__)
// Row m of x as int16 pairs: for block b of 8 inputs, word i (0..3) holds inputs 8b + i (low
// half) and 8b + i + 4 (high half), what one vpmaddwd lane multiplies with a word's codes.
// Per group: the scale xs and the sum of the quantized x.
struct Int16Rows {
  std::vector<int32_t> pairs;  // [M, K / 2]
  std::vector<float> xs, xsum;  // [M, K / G]
};

// The largest |x| and the sum of x[0, n): a block's quantization grid, and whether it is
// finite (also csrc/awq_int8_cpu.cpp's, built after this file).
struct Extent {
  float amax, sum;
};

inline Extent extent(const float* x, int64_t n) {
  Extent e{0.f, 0.f};
  for (int64_t k = 0; k < n; ++k) {
    e.amax = std::max(e.amax, std::fabs(x[k]));
    e.sum += x[k];
  }
  return e;
}

Int16Rows quantize_rows(const float* xp, int64_t M, int64_t K, int64_t G) {
  const int64_t NG = K / G;
  Int16Rows r{std::vector<int32_t>(M * K / 2), std::vector<float>(M * NG),
              std::vector<float>(M * NG)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < NG; ++g) {
      const float* x = xp + m * K + g * G;
      const auto [amax, sum] = extent(x, G);
      int32_t* out = r.pairs.data() + (m * K + g * G) / 2;
      if (!std::isfinite(sum)) {  // a NaN or infinity: the row's outputs are NaN, as in float
        r.xs[m * NG + g] = r.xsum[m * NG + g] = std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + G / 2, 0);
        continue;
      }
      const float xs = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
      r.xs[m * NG + g] = xs;
      int32_t qsum = 0;  // at most 2048 x 32767
      for (int64_t b = 0; b < G / 8; ++b)
        for (int64_t i = 0; i < 4; ++i) {
          const auto lo = static_cast<int16_t>(std::nearbyint(x[8 * b + i] * inv));
          const auto hi = static_cast<int16_t>(std::nearbyint(x[8 * b + i + 4] * inv));
          qsum += lo + hi;
          out[4 * b + i] = static_cast<int32_t>(static_cast<uint16_t>(lo)) |
                           static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
        }
      r.xsum[m * NG + g] = xs * static_cast<float>(qsum);
    }
  return r;
}

// The rows of a pass: int16 pairs [rows, K / 2], per-group scale and sum [rows, K / G].
struct RowsView {
  const int32_t* pairs;
  const float *xs, *xsum;
};

// Rows [0, M) over the 8 columns [8c, 8c + 8) of tile t.
template <int64_t M>
void int16_columns(const RowsView& xr, const int32_t* cp, const GroupScales& gs,
                   float* yp, int64_t t, int64_t c, const Shape& s) {
  const int64_t NG = s.K / s.G, blocks = s.G / 8;
  const __m256i mask = _mm256_set1_epi32(0x000F000F);
  const int32_t* stream = cp + t * (s.K / 8) * kTile + c * 8;
  __m256 out[M];
  for (int64_t m = 0; m < M; ++m) out[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    gs.prefetch(t * NG + g);
    __m256i acc[M];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t blk = g * blocks; blk < (g + 1) * blocks; ++blk) {
      __builtin_prefetch(stream + blk * kTile + kPrefetchWords);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stream + blk * kTile));
      const __m256i p[4] = {
          _mm256_and_si256(_mm256_srli_epi32(w, 3), mask),
          _mm256_and_si256(_mm256_srli_epi32(w, 7), mask),
          _mm256_and_si256(_mm256_srli_epi32(w, 11), mask),
          _mm256_and_si256(_mm256_or_si256(_mm256_srli_epi32(w, 15), _mm256_slli_epi32(w, 17)),
                           mask)};
      for (int64_t m = 0; m < M; ++m) {
        const int32_t* xq = xr.pairs + (m * s.K) / 2 + blk * 4;
        const __m256i d01 = _mm256_add_epi32(_mm256_madd_epi16(p[0], _mm256_set1_epi32(xq[0])),
                                             _mm256_madd_epi16(p[1], _mm256_set1_epi32(xq[1])));
        const __m256i d23 = _mm256_add_epi32(_mm256_madd_epi16(p[2], _mm256_set1_epi32(xq[2])),
                                             _mm256_madd_epi16(p[3], _mm256_set1_epi32(xq[3])));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(d01, d23));
      }
    }
    __m256 sv, zv;
    gs.group8(t * NG + g, c * 8, sv, zv);
    for (int64_t m = 0; m < M; ++m) {
      const __m256 scale = _mm256_mul_ps(sv, _mm256_set1_ps(xr.xs[m * NG + g]));
      out[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), scale, out[m]);
      out[m] = _mm256_fnmadd_ps(zv, _mm256_set1_ps(xr.xsum[m * NG + g]), out[m]);
    }
  }
  const int64_t n0 = t * kTile + c * 8, n = std::min<int64_t>(8, s.N - n0);
  for (int64_t m = 0; m < M; ++m) {
    if (n == 8) {
      _mm256_storeu_ps(yp + m * s.N + n0, out[m]);
    } else {  // the padded end of the last tile
      float part[8];
      _mm256_storeu_ps(part, out[m]);
      std::memcpy(yp + m * s.N + n0, part, n * sizeof(float));
    }
  }
}

template <int64_t M>
void int16_rows(const RowsView& xr, const int32_t* cp, const GroupScales& gs,
                float* yp, const Shape& s) {
  // Work items of 8 columns; the padding-only ones at the end of the last tile are skipped.
  const int64_t items = (s.N + 7) / 8;
  team::parallel_for(0, items, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      int16_columns<M>(xr, cp, gs, yp, i / 4, i % 4, s);
  });
}
#endif

}  // namespace

// Whether this flavour has the integer-activation GEMVs (int16 here, int8 in
// csrc/awq_int8_cpu.cpp): the AVX2 and AVX-512 builds.
bool awq_gemv_has_integer() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// x [M, K] times the 4-bit weight with x quantized to int16 per row and group (see the top).
at::Tensor awq_gemv_int16(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor zs,
                          int64_t n, int64_t group) {
  TORCH_CHECK(awq_gemv_has_integer(), "this kernel flavour (", kIsa, ") has no int16 AWQ GEMV");
  const Shape s = check(codes, scales, zs, n, group);
  check_x(x, s.K);
  TORCH_CHECK(s.G <= kMaxInt16Group, "int16 AWQ GEMV: group size ", s.G, " above ",
              kMaxInt16Group);
  const int64_t M = x.size(0);
  auto y = at::empty({M, s.N}, x.options());
#if defined(__AVX2__)
  // One accumulator a row, four decoded vectors and the products: 8 rows fill the 16 ymm.
  constexpr int64_t kRowsPerPass = 8;
  const Int16Rows xr = quantize_rows(x.data_ptr<float>(), M, s.K, s.G);
  const int64_t NG = s.K / s.G;
  const GroupScales gs = group_scales(scales, zs);
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const RowsView rows{xr.pairs.data() + m0 * s.K / 2, xr.xs.data() + m0 * NG,
                        xr.xsum.data() + m0 * NG};
    with_rows(std::min(kRowsPerPass, M - m0), [&]<int64_t R>() {
      int16_rows<R>(rows, codes.data_ptr<int32_t>(), gs, y.data_ptr<float>() + m0 * s.N, s);
    });
  }
#endif
  return y;
}
