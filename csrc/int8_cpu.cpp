// Weight-only int8 linear layers on CPU (the LM head of 4-bit models): y = x @ W^T, with
// W[n, k] = q[n, k] * scale[n] (symmetric, one scale per output).
//
//   x       [M, K]          float32, contiguous
//   codes   [N / 32, K, 32] int8: outputs in tiles of 32, so one input row of a tile is 32
//                           contiguous bytes, widened into two 16-float vectors
//   scale   [N]             float32
//
// int8_gemv reads every code once per chunk of up to 8 rows, with the accumulators in
// registers; the batch-1 LM head of SmolLM2 drops from 113 MB of float32 to 28 MB read per
// step. int8_gemm is the many-row path: per tile and block of inputs it widens and scales the
// codes into a float panel once and multiplies every row by it (panel_gemm,
// csrc/panel_gemm_cpu.cpp: one unit builds both files), so its cost grows with M at the rate
// of a float GEMM, not of re-reading and re-widening the codes every 8 rows. int8_dequantize
// writes W^T [K, N] in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "team.h"
#include "vec_math.h"

// Its own namespace: csrc/kernels_cpu.cpp builds every kernel in one unit, and the AWQ
// kernels name their tiles and shapes alike.
namespace int8 {
namespace {

constexpr int64_t kTile = 32;
constexpr int64_t kMaxRows = 8;
// Rows up to which callers take int8_gemv rather than int8_gemm, whose fixed cost (widening
// every code once, ~2.3 ms for SmolLM2's 49152 x 576 head) pays off only over long runs of
// rows. On that head streamed from memory (Zen 5) the GEMV took 0.51-0.65x the GEMM's time at 16
// rows, 0.89-0.93x at 128 and 0.92-0.99x at 256 (AVX-512, AVX2); the generic build's met at
// 16-32 rows.
#if defined(__AVX2__) || defined(__AVX512F__)
constexpr int64_t kGemvMaxRows = 128;
#else
constexpr int64_t kGemvMaxRows = 16;
#endif
// 6 KB ahead: the LM head of SmolLM2 at batch 1 (28 MB, from memory) ran ~7% faster than at 2 KB
// (0.92x, medians of 15 alternating calls, AVX2 and AVX-512; 4-12 KB were alike).
constexpr int64_t kPrefetchRows = 192;

// 16 int8 codes to floats: sign-extend to int32 and convert, one native vector at a time.
// GCC 12 scalarizes a direct int8 -> float conversion of vector extensions (byte extracts,
// 6x slower), so AVX-512 and AVX2 say it in intrinsics; elsewhere (SSE2, NEON) a plain loop
// the compiler vectorizes.
inline vf16 widen(const int8_t* p) {
  vf16 f;
#if defined(__AVX512F__)
  f.p[0] = (vfn)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  for (int i = 0; i < kParts; ++i)
    f.p[i] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * i))));
#else
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  f = load16(tmp);
#endif
  return f;
}

struct Shape {
  int64_t K, N;
};

Shape check(const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(2) == kTile,
              "codes must be contiguous int8 [N / 32, K, 32]");
  const int64_t N = codes.size(0) * kTile;
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == N &&
                  scale.is_contiguous(),
              "scale must be contiguous float32 [N]");
  return {codes.size(1), N};
}

// At one or two rows, even and odd inputs feed separate accumulators: four or more
// independent FMA chains hide the FMA latency.
template <int64_t M>
void gemv_rows(const float* xp, const int8_t* cp, const float* sp, float* yp, const Shape& s) {
  constexpr int64_t S = M <= 2 ? 2 : 1;
  team::parallel_for(0, s.N / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* tile = cp + t * s.K * kTile;
      vf16 acc[S][M][2];
      zero(acc);
      int64_t k = 0;
      for (; k + 2 <= s.K; k += 2) {
        __builtin_prefetch(tile + (k + kPrefetchRows) * kTile);  // see kPrefetchRows
        if constexpr (S == 2) {
          // One or two rows use each half row as soon as it is widened: widening all four
          // first kept eight more registers live, and AVX2's sixteen then spilled an
          // accumulator (its chain through memory cost ~25% of the batch-1 LM head).
          for (int64_t i = 0; i < 2; ++i)
            for (int64_t h = 0; h < 2; ++h) {
              const vf16 w = widen(tile + (k + i) * kTile + 16 * h);
              for (int64_t m = 0; m < M; ++m) acc[i][m][h] += xp[m * s.K + k + i] * w;
            }
        } else {  // more rows: widen both inputs' rows, then sweep the rows once
          const vf16 w[2][2] = {{widen(tile + k * kTile), widen(tile + k * kTile + 16)},
                                {widen(tile + (k + 1) * kTile),
                                 widen(tile + (k + 1) * kTile + 16)}};
          for (int64_t m = 0; m < M; ++m) {
            const float x0 = xp[m * s.K + k], x1 = xp[m * s.K + k + 1];
            for (int64_t h = 0; h < 2; ++h) {  // two statements: two FMAs
              acc[0][m][h] += x0 * w[0][h];
              acc[0][m][h] += x1 * w[1][h];
            }
          }
        }
      }
      if (k < s.K) {  // an odd last input
        const vf16 lo = widen(tile + k * kTile), hi = widen(tile + k * kTile + 16);
        for (int64_t m = 0; m < M; ++m) {
          acc[0][m][0] += xp[m * s.K + k] * lo;
          acc[0][m][1] += xp[m * s.K + k] * hi;
        }
      }
      const vf16 sc[2] = {load16(sp + t * kTile), load16(sp + t * kTile + 16)};
      for (int64_t m = 0; m < M; ++m) {
        const vf16 a0 = S == 2 ? acc[0][m][0] + acc[S - 1][m][0] : acc[0][m][0];
        const vf16 a1 = S == 2 ? acc[0][m][1] + acc[S - 1][m][1] : acc[0][m][1];
        store16(yp + m * s.N + t * kTile, a0 * sc[0]);
        store16(yp + m * s.N + t * kTile + 16, a1 * sc[1]);
      }
    }
  });
}

}  // namespace

at::Tensor int8_gemv(at::Tensor x, at::Tensor codes, at::Tensor scale) {
  const Shape s = check(codes, scale);
  check_x(x, s.K);  // csrc/awq_cpu.cpp's
  const int64_t M = x.size(0);
  auto y = at::empty({M, s.N}, x.options());
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    with_rows(std::min(kMaxRows, M - m0), [&]<int64_t R>() {
      gemv_rows<R>(x.data_ptr<float>() + m0 * s.K, codes.data_ptr<int8_t>(),
                   scale.data_ptr<float>(), y.data_ptr<float>() + m0 * s.N, s);
    });
  }
  return y;
}

// The same product as int8_gemv for any number of rows, by widened panels (see the top).
at::Tensor int8_gemm(at::Tensor x, at::Tensor codes, at::Tensor scale) {
  const Shape s = check(codes, scale);
  check_x(x, s.K);  // csrc/awq_cpu.cpp's
  const int64_t M = x.size(0);
  auto y = at::empty({M, s.N}, x.options());
  if (M == 0) return y;
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto fill = [&](float* panel, int64_t t, int64_t k0, int64_t kc) {
    const vf16 sc[2] = {load16(sp + t * kTile), load16(sp + t * kTile + 16)};
    const int8_t* c = cp + (t * s.K + k0) * kTile;
    for (int64_t k = 0; k < kc; ++k) {
      store16(panel + k * kTile, widen(c + k * kTile) * sc[0]);
      store16(panel + k * kTile + 16, widen(c + k * kTile + 16) * sc[1]);
    }
  };
  panel_gemm(x.data_ptr<float>(), M, s.K, s.N, y.data_ptr<float>(), fill);
  return y;
}

at::Tensor int8_dequantize(at::Tensor codes, at::Tensor scale) {
  const Shape s = check(codes, scale);
  auto w = at::empty({s.K, s.N}, scale.options());  // W^T, as x @ w wants
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  team::parallel_for(0, s.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t t = 0; t < s.N / kTile; ++t) {
        const int8_t* c = cp + (t * s.K + k) * kTile;
        float* row = wp + k * s.N + t * kTile;
#pragma omp simd
        for (int64_t j = 0; j < kTile; ++j) row[j] = static_cast<float>(c[j]) * sp[t * kTile + j];
      }
    }
  });
  return w;
}

}  // namespace int8
