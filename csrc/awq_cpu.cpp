// 4-bit AWQ linear layers on CPU: y = x @ W with W kept as 4-bit codes.
//
//   x       [M, K]            float32, contiguous
//   codes   [N / T, K, T / 2] uint8: output columns in tiles of T; for tile t and input k,
//                             byte j holds column t*T + j in its low nibble and column
//                             t*T + j + T/2 in its high nibble, so one input row of a tile
//                             unpacks into T contiguous floats (one or two vector registers)
//   scales  [K / G, N]        float32
//   zs      [K / G, N]        float32, zero * scale, so W[k, n] = q * s - zs
//
// awq_gemv is a fused dequantize-GEMV over chunks of up to 8 rows: each chunk reads every
// code once, straight from memory, unpacks it in registers and multiplies it by x[k]
// broadcast across the tile's columns:
//   y[m, n] = sum_g s[g, n] * (sum_{k in g} x[m, k] q[k, n]) - zs[g, n] * sum_{k in g} x[m, k]
// awq_dequantize writes W^T [K, N] in float32 for torch's GEMM, which wins at large M.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxTile = 32;
constexpr int64_t kMaxRows = 8;

struct Shape {
  int64_t K, N, T, G;
};

Shape check(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zs,
            int64_t group) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "codes must be contiguous uint8 [N / T, K, T / 2]");
  const int64_t T = codes.size(2) * 2, K = codes.size(1), N = codes.size(0) * T;
  TORCH_CHECK(T <= kMaxTile && group > 0 && K % group == 0, "bad tile or group size");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  zs.sizes() == scales.sizes() && zs.is_contiguous() &&
                  scales.size(0) == K / group && scales.size(1) == N,
              "scales and zs must be contiguous float32 [K / group, N]");
  return {K, N, T, group};
}

// The tile width is a template parameter: with a compile-time trip count of 16 bytes the
// compiler widens bytes to 16 float lanes; with a runtime count it picks 64 byte lanes and
// never enters the vector loop.
template <int64_t T>
inline void unpack_row(const uint8_t* __restrict c, float* __restrict w) {
  constexpr int64_t half = T / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    w[j] = static_cast<float>(static_cast<int32_t>(c[j] & 0xF));
    w[j + half] = static_cast<float>(static_cast<int32_t>(c[j] >> 4));
  }
}

}  // namespace

template <int64_t T>
void gemv_tiles(const float* xp, const uint8_t* cp, const float* sp, const float* zp, float* yp,
                const float* xsum, int64_t M, const Shape& s) {
  const int64_t NG = s.K / s.G;
  at::parallel_for(0, s.N / T, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float w[T];
    alignas(64) float acc[kMaxRows][T];
    alignas(64) float out[kMaxRows][T];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = cp + t * s.K * (T / 2);
      const int64_t n0 = t * T;
      for (int64_t m = 0; m < M; ++m) std::fill(out[m], out[m] + T, 0.f);
      for (int64_t g = 0; g < NG; ++g) {
        for (int64_t m = 0; m < M; ++m) std::fill(acc[m], acc[m] + T, 0.f);
        for (int64_t k = g * s.G; k < (g + 1) * s.G; ++k) {
          unpack_row<T>(tile + k * (T / 2), w);
          for (int64_t m = 0; m < M; ++m) {
            const float xv = xp[m * s.K + k];
#pragma omp simd
            for (int64_t j = 0; j < T; ++j) acc[m][j] += xv * w[j];
          }
        }
        const float* sg = sp + g * s.N + n0;
        const float* zg = zp + g * s.N + n0;
        for (int64_t m = 0; m < M; ++m) {
          const float xs = xsum[m * NG + g];
#pragma omp simd
          for (int64_t j = 0; j < T; ++j) out[m][j] += sg[j] * acc[m][j] - zg[j] * xs;
        }
      }
      for (int64_t m = 0; m < M; ++m) std::copy(out[m], out[m] + T, yp + m * s.N + n0);
    }
  });
}

template <int64_t T>
void dequantize_tiles(const uint8_t* cp, const float* sp, const float* zp, float* wp,
                      const Shape& s) {
  at::parallel_for(0, s.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const float* sg = sp + (k / s.G) * s.N;
      const float* zg = zp + (k / s.G) * s.N;
      for (int64_t t = 0; t < s.N / T; ++t) {
        float* row = wp + k * s.N + t * T;
        unpack_row<T>(cp + (t * s.K + k) * (T / 2), row);
#pragma omp simd
        for (int64_t j = 0; j < T; ++j) row[j] = row[j] * sg[t * T + j] - zg[t * T + j];
      }
    }
  });
}

// Tiles of 32 columns, M rows known at compile time: one input row of a tile is 16 bytes,
// widened into two 16-float vectors; the accumulators stay in registers (GCC/Clang vector
// extensions: AVX-512 uses one register per vector, AVX2 two).
typedef float vf16 __attribute__((vector_size(64)));
typedef uint8_t vu16 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// Bytes to floats in two steps (zero-extend, then convert): GCC turns a direct
// uint8 -> float conversion into scalar code.
inline vf16 widen(vu16 b) {
  return __builtin_convertvector(__builtin_convertvector(b, vi16), vf16);
}

template <int64_t M>
void gemv_tiles32(const float* xp, const uint8_t* cp, const float* sp, const float* zp,
                  float* yp, const float* xsum, const Shape& s) {
  const int64_t NG = s.K / s.G;
  at::parallel_for(0, s.N / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = cp + t * s.K * 16;
      const int64_t n0 = t * 32;
      vf16 out[M][2] = {};
      for (int64_t g = 0; g < NG; ++g) {
        vf16 acc[M][2] = {};
        for (int64_t k = g * s.G; k < (g + 1) * s.G; ++k) {
          vu16 b;
          std::memcpy(&b, tile + k * 16, 16);
          const vf16 lo = widen(b & 0xF);
          const vf16 hi = widen(b >> 4);
          for (int64_t m = 0; m < M; ++m) {
            const float xv = xp[m * s.K + k];
            acc[m][0] += xv * lo;
            acc[m][1] += xv * hi;
          }
        }
        vf16 sc[2], zs[2];
        std::memcpy(sc, sp + g * s.N + n0, sizeof(sc));
        std::memcpy(zs, zp + g * s.N + n0, sizeof(zs));
        for (int64_t m = 0; m < M; ++m) {
          const float xs = xsum[m * NG + g];
          out[m][0] += sc[0] * acc[m][0] - zs[0] * xs;
          out[m][1] += sc[1] * acc[m][1] - zs[1] * xs;
        }
      }
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * s.N + n0, out[m], sizeof(out[m]));
    }
  });
}

#define PKV_DISPATCH_TILE(T_VALUE, CALL)                 \
  switch (T_VALUE) {                                     \
    case 32: { constexpr int64_t kT = 32; CALL; break; } \
    case 16: { constexpr int64_t kT = 16; CALL; break; } \
    case 8: { constexpr int64_t kT = 8; CALL; break; }   \
    default: TORCH_CHECK(false, "tile width must be 8, 16 or 32");    \
  }

// One call per chunk of up to 8 rows: every chunk reads the 4-bit codes once more, which
// costs far less than dequantizing W for a float GEMM until the batch is large.
void gemv_chunk(const float* xp, const uint8_t* cp, const float* sp, const float* zp,
                float* yp, const float* xsum, int64_t rows, const Shape& s) {
  if (s.T == 32) {
    switch (rows) {
      case 1: return gemv_tiles32<1>(xp, cp, sp, zp, yp, xsum, s);
      case 2: return gemv_tiles32<2>(xp, cp, sp, zp, yp, xsum, s);
      case 3: return gemv_tiles32<3>(xp, cp, sp, zp, yp, xsum, s);
      case 4: return gemv_tiles32<4>(xp, cp, sp, zp, yp, xsum, s);
      case 5: return gemv_tiles32<5>(xp, cp, sp, zp, yp, xsum, s);
      case 6: return gemv_tiles32<6>(xp, cp, sp, zp, yp, xsum, s);
      case 7: return gemv_tiles32<7>(xp, cp, sp, zp, yp, xsum, s);
      default: return gemv_tiles32<8>(xp, cp, sp, zp, yp, xsum, s);
    }
  }
  PKV_DISPATCH_TILE(s.T, (gemv_tiles<kT>(xp, cp, sp, zp, yp, xsum, rows, s)));
}

torch::Tensor awq_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                       torch::Tensor zs, int64_t group) {
  const Shape s = check(codes, scales, zs, group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) == s.K, "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), NG = s.K / s.G;
  auto y = torch::empty({M, s.N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(M * NG, 0.f);  // per-group sums of x feed the zero-point term
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < s.K; ++k) xsum[m * NG + k / s.G] += xp[m * s.K + k];
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    gemv_chunk(xp + m0 * s.K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
               zs.data_ptr<float>(), y.data_ptr<float>() + m0 * s.N, xsum.data() + m0 * NG,
               std::min(kMaxRows, M - m0), s);
  }
  return y;
}

torch::Tensor awq_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor zs,
                             int64_t group) {
  const Shape s = check(codes, scales, zs, group);
  auto w = torch::empty({s.K, s.N}, scales.options());  // W^T, as x @ w wants
  PKV_DISPATCH_TILE(s.T, (dequantize_tiles<kT>(codes.data_ptr<uint8_t>(),
                                               scales.data_ptr<float>(), zs.data_ptr<float>(),
                                               w.data_ptr<float>(), s)));
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("awq_gemv", &awq_gemv, "fused 4-bit dequantize-GEMV for up to 8 rows");
  m.def("awq_dequantize", &awq_dequantize, "4-bit codes to a float32 W^T [K, N]");
}
