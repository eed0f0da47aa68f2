// The 4-bit AWQ GEMV with int8 activations: byte dot products (vpmaddubsw), as llama.cpp's
// Q4 x Q8 path computes.
//
// Same codes, scales and zero terms as csrc/awq_cpu.cpp (built after it, in the same unit).
// Each row of x is quantized per block of 32 inputs to int8: x_k ~ xb q8_k with
// xb = max |x| / 127 over the block (llama.cpp's Q8_0 blocks), a relative error of at most
// 2^-8 of the block's largest activation. Per group of G inputs (a multiple of 32),
//   sum_k x_k W[k, n] ~ s sum_blocks xb (sum_k q8_k q_k) - zs sum_blocks xb sum_k q8_k,
// each block's sum exact in int16 (|q8 q| <= 127 x 15, 32 products: < 2^15). The zero term
// takes the quantized x's sum, as llama.cpp's Q8_1 blocks do, not the float one: the error is
// then sum_k (s q_k - zs) e_k, with e_k x's rounding, where the float sum leaves s sum_k q_k
// e_k, codes of 0..15 instead of weights centred on zero (about twice the error). SmolLM2's
// Q4_1 file, top-1 agreement with float32 activations over 2,000 positions: 97.65% -> 98.95%.
//
// Why: the float GEMV turns every 4-bit code into a float before its FMA, eight weights an
// FMA (AVX2); the int16 GEMV multiplies 16 codes an instruction. Here one vpmaddubsw
// multiplies 32 codes (unsigned bytes) by 32 activations (signed bytes) and adds pairs: per
// word vector (8 columns x 8 inputs) a rotation and three bit operations make two vectors of
// byte codes, two vpmaddubsw take them with the activations: ~10 instructions per 64 weights
// where the float GEMV needs ~29 (SmolLM2's layers at batch 1 on AVX2: see the README).
// Word layout (csrc/awq_cpu.cpp): input i of a block of 8 sits at bits (3 + 4i) mod 32;
// rotated right by 3, input i sits at bits 4i, so byte j holds inputs 2j (low nibble) and
// 2j + 1 (high nibble).
//
// AVX2 and AVX-512 builds (256-bit code: one vpmaddubsw takes eight columns' words). The
// generic flavour has no vpmaddubsw; `awq_gemv_has_integer()` says so.
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

constexpr int64_t kInt8Block = 32;  // inputs per activation scale
// Software prefetch distance in the code stream: 4 KB (2 KB, the float GEMV's, left the
// integer GEMV waiting on memory: SmolLM2's layers at batch 1 on AVX2 2.2 -> 2.0 ms).
constexpr int64_t kInt8PrefetchWords = 32 * kTile;

#if defined(__AVX2__)
// Row m of x as bytes: for word block b (8 inputs), int32 2b holds inputs 8b + 0, 2, 4, 6 and
// int32 2b + 1 inputs 8b + 1, 3, 5, 7, what one vpmaddubsw lane pairs with a word's low and
// high nibbles. Per block of 32: the scale; per group: the sum of the quantized x.
struct Int8Rows {
  std::vector<int32_t> bytes;  // [M, K / 4]
  std::vector<float> xb;       // [M, K / 32]
  std::vector<float> xsum;     // [M, K / G]
};

inline int32_t pack4(const int8_t (&q)[8], int first) {
  uint32_t v = 0;
  for (int j = 0; j < 4; ++j) v |= static_cast<uint32_t>(static_cast<uint8_t>(q[first + 2 * j])) << (8 * j);
  return static_cast<int32_t>(v);
}

Int8Rows quantize_rows_int8(const float* xp, int64_t M, int64_t K, int64_t G) {
  const int64_t NB = K / kInt8Block, NG = K / G;
  Int8Rows r{std::vector<int32_t>(M * K / 4), std::vector<float>(M * NB),
             std::vector<float>(M * NG, 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t blk = 0; blk < NB; ++blk) {
      const float* x = xp + m * K + blk * kInt8Block;
      const auto [amax, sum] = extent(x, kInt8Block);
      int32_t* out = r.bytes.data() + (m * K + blk * kInt8Block) / 4;
      if (!std::isfinite(sum)) {  // a NaN or infinity: the row's outputs are NaN, as in float
        r.xb[m * NB + blk] = std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + kInt8Block / 4, 0);
        continue;
      }
      r.xb[m * NB + blk] = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t qsum = 0;
      for (int64_t w = 0; w < kInt8Block / 8; ++w) {
        int8_t q[8];
        for (int i = 0; i < 8; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(x[8 * w + i] * inv));
          qsum += q[i];
        }
        out[2 * w] = pack4(q, 0);
        out[2 * w + 1] = pack4(q, 1);
      }
      r.xsum[m * NG + blk * kInt8Block / G] += r.xb[m * NB + blk] * static_cast<float>(qsum);
    }
  return r;
}

struct Int8View {
  const int32_t* bytes;
  const float *xb, *xsum;
};

// Group g of rows [0, M) over the 8 columns [8c, 8c + 8) of tile t: out (a row of 32 floats
// per row of x, from column 8c) += s sum_blocks xb (codes . q8) - zs sum x.
template <int64_t M>
void int8_group(const Int8View& xr, const int32_t* stream, const GroupScales& gs,
                int64_t tile_group, int64_t g, int64_t c, const Shape& s, float* out) {
  const int64_t NG = s.K / s.G, NB = s.K / kInt8Block, words = kInt8Block / 8;
  const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t blk = g * s.G / kInt8Block; blk < (g + 1) * s.G / kInt8Block; ++blk) {
    __m256i dot[M];  // int16: 32 products of at most 127 x 15 per lane pair
    for (int64_t m = 0; m < M; ++m) dot[m] = _mm256_setzero_si256();
    for (int64_t w = blk * words; w < (blk + 1) * words; ++w) {
      const int32_t* word = stream + w * kTile + c * 8;
      __builtin_prefetch(word + kInt8PrefetchWords);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word));
      const __m256i r = _mm256_or_si256(_mm256_srli_epi32(v, 3), _mm256_slli_epi32(v, 29));
      const __m256i even = _mm256_and_si256(r, nibbles);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(r, 4), nibbles);
      for (int64_t m = 0; m < M; ++m) {
        const int32_t* xq = xr.bytes + m * s.K / 4 + 2 * w;
        const __m256i pe = _mm256_maddubs_epi16(even, _mm256_set1_epi32(xq[0]));
        const __m256i po = _mm256_maddubs_epi16(odd, _mm256_set1_epi32(xq[1]));
        dot[m] = _mm256_add_epi16(dot[m], _mm256_add_epi16(pe, po));
      }
    }
    for (int64_t m = 0; m < M; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m], ones)),
                               _mm256_set1_ps(xr.xb[m * NB + blk]), acc[m]);
  }
  __m256 sv, zv;
  gs.group8(tile_group, c * 8, sv, zv);
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * kTile + c * 8;
    __m256 y = _mm256_fmadd_ps(acc[m], sv, _mm256_loadu_ps(o));
    _mm256_storeu_ps(o, _mm256_fnmadd_ps(zv, _mm256_set1_ps(xr.xsum[m * NG + g]), y));
  }
}

// Every row of x over the 32 columns of tile t. The tile's codes are one sequential stream:
// each group's (G / 8 x 128 bytes) is read from memory once, by the first of its four 8-column
// slices, and from L1 by the others, and by every pass of up to kPassRows rows.
constexpr int64_t kPassRows = 4;  // two vectors a row: 4 rows and the decoded codes fit 16 ymm

void int8_tile(const Int8View& xr, int64_t M, const int32_t* cp, const GroupScales& gs,
               float* yp, int64_t t, const Shape& s) {
  const int64_t NG = s.K / s.G, NB = s.K / kInt8Block;
  const int32_t* stream = cp + t * (s.K / 8) * kTile;
  const int64_t n0 = t * kTile, n = std::min(kTile, s.N - n0);
  alignas(32) float out[kPassRows * kTile];
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
    const int64_t rows = std::min(kPassRows, M - m0);
    const Int8View pass{xr.bytes + m0 * s.K / 4, xr.xb + m0 * NB, xr.xsum + m0 * NG};
    std::fill(out, out + rows * kTile, 0.f);
    for (int64_t g = 0; g < NG; ++g) {
      gs.prefetch(t * NG + g);
      for (int64_t c = 0; c < kTile / 8; ++c)
        with_rows(rows, [&]<int64_t R>() {
          int8_group<R>(pass, stream, gs, t * NG + g, g, c, s, out);
        });
    }
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(yp + (m0 + m) * s.N + n0, out + m * kTile, n * sizeof(float));
  }
}
#endif

}  // namespace

// x [M, K] times the 4-bit weight with x quantized to int8 per row and block (see the top).
at::Tensor awq_gemv_int8(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor zs,
                         int64_t n, int64_t group) {
  TORCH_CHECK(awq_gemv_has_integer(), "this kernel flavour (", kIsa, ") has no int8 AWQ GEMV");
  const Shape s = check(codes, scales, zs, n, group);
  check_x(x, s.K);
  TORCH_CHECK(s.G % kInt8Block == 0, "int8 AWQ GEMV: group size ", s.G, " is not a multiple of ",
              kInt8Block);
  const int64_t M = x.size(0);
  auto y = at::empty({M, s.N}, x.options());
#if defined(__AVX2__)
  const Int8Rows xr = quantize_rows_int8(x.data_ptr<float>(), M, s.K, s.G);
  const Int8View rows{xr.bytes.data(), xr.xb.data(), xr.xsum.data()};
  const GroupScales gs = group_scales(scales, zs);
  team::parallel_for(0, s.NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      int8_tile(rows, M, codes.data_ptr<int32_t>(), gs, y.data_ptr<float>(), t, s);
  });
#endif
  return y;
}
