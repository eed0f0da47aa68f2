// How K/V rows sit in the paged cache (core/layers/kv_format.py says why): one row is one
// token's keys or values for one KV head.
//
//   kFloat          D float32                  (the attention kernel reads these in place)
//   kBFloat16       D bfloat16                 (widened by a shift)
//   kHalf           D float16                  (widened by F16C where the flavour has it)
//   kChar (int8)    D int8 codes + f32 scale   x = scale * code, scale = max |x| / 127
//   kFloat8_e4m3fn  D e4m3 codes + f32 scale   x = scale * code, scale = max |x| / 448
//
// The tensor's dtype says which. Writes quantize as the torch reference does (the same
// division and rounding, so both write the same bytes); reads widen rows to float32, in
// registers as decode attention reads them or into a buffer (csrc/kv_readers.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kv_rows {

enum class Kind { F32, BF16, F16, I8, FP8 };

constexpr int64_t kScaleBytes = 4;

inline bool supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kChar ||
         t == at::kFloat8_e4m3fn;
}

inline Kind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return Kind::BF16;
    case at::kHalf: return Kind::F16;
    case at::kChar: return Kind::I8;
    case at::kFloat8_e4m3fn: return Kind::FP8;
    default: return Kind::F32;
  }
}

// A cache of one layer ([NB, BS, KVH, row]) as bytes: where row r (slot * KVH + head) starts.
struct Rows {
  const uint8_t* data;
  Kind kind;
  int64_t D, bytes;  // values per row, bytes per row

  static Rows of(const at::Tensor& cache, int64_t D) {
    const Kind k = kind_of(cache.scalar_type());
    const int64_t bytes = k == Kind::F32                       ? D * 4
                          : k == Kind::BF16 || k == Kind::F16 ? D * 2
                                                              : D + kScaleBytes;
    return {static_cast<const uint8_t*>(cache.data_ptr()), k, D, bytes};
  }
  const uint8_t* row(int64_t r) const { return data + r * bytes; }
};

inline float scale_of(const uint8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// e4m3 (no infinities, largest finite 448) from a float of magnitude <= 448, rounded half to
// even as torch's conversion rounds.
inline uint8_t to_e4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &bits, sizeof a);
  if (!(a < 464.f)) return sign | 0x7f;  // NaN (and overflow, which e4m3fn turns into NaN)
  if (a < 0.015625f)  // below 2^-6: subnormal steps of 2^-9 (8 steps is the smallest normal)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  bits += 0x7ffffu + ((bits >> 20) & 1);  // round the mantissa to 3 bits, half to even
  const uint32_t code = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, 0x7f));
}

// x (D floats) into one row of the cache.
inline void store(const float* x, Kind kind, int64_t D, uint8_t* row) {
  if (kind == Kind::F32) {
    std::memcpy(row, x, D * sizeof(float));
    return;
  }
  if (kind == Kind::BF16) {
    for (int64_t d = 0; d < D; ++d) {
      uint32_t u;
      std::memcpy(&u, x + d, sizeof u);
      const uint16_t h = std::isnan(x[d]) ? 0x7fc0
                                         : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
      std::memcpy(row + 2 * d, &h, sizeof h);
    }
    return;
  }
  if (kind == Kind::F16) {  // (c10::Half rounds half to even, as torch's conversion)
    for (int64_t d = 0; d < D; ++d) {
      const c10::Half h(x[d]);
      std::memcpy(row + 2 * d, &h, sizeof h);
    }
    return;
  }
  float amax = 0.f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    amax = std::max(amax, std::fabs(x[d]));
    finite = finite && std::isfinite(x[d]);
  }
  if (!finite) {  // a NaN or infinity: the row reads back as NaN, as a float row would poison
    std::memset(row, 0, D);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(row + D, &nan, sizeof nan);
    return;
  }
  float scale = amax / (kind == Kind::I8 ? 127.f : 448.f);
  // A subnormal scale divides x past the largest code (e4m3's 480 is NaN): such a row, every
  // value below ~1e-36, is stored as zeros (kv_format.py's quantize_rows alike).
  if (scale < std::numeric_limits<float>::min()) scale = 0.f;
  const float div = scale > 0.f ? scale : 1.f;
  for (int64_t d = 0; d < D; ++d) {
    const float v = x[d] / div;
    row[d] = kind == Kind::I8 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)))
                              : to_e4m3(v);
  }
  std::memcpy(row + D, &scale, sizeof scale);
}

#if defined(__AVX2__) && defined(__F16C__)
// e4m3 codes, sign-extended to int16, as float16 bits worth 2^-8 of their values: a code's
// seven magnitude bits moved up seven places land on float16's exponent and mantissa (bias 15
// against e4m3's 7; subnormals on float16's subnormals), its sign already in the top bit, and
// the AND clears the sign's copy on the exponent's top bit. vcvtph2ps then widens them.
inline __m128i e4m3_as_halves(__m128i codes) {
  return _mm_and_si128(_mm_slli_epi16(codes, 7), _mm_set1_epi16(-0x4001));
}
inline __m256i e4m3_as_halves(__m256i codes) {
  return _mm256_and_si256(_mm256_slli_epi16(codes, 7), _mm256_set1_epi16(-0x4001));
}
#endif

// One row of the cache as D floats. Written as plain loops the compiler vectorizes (byte
// widening, an integer-to-float conversion, a multiply; e4m3 by moving its exponent and
// mantissa into a float's and rebiasing, subnormals from their integer mantissa).
inline void load(const uint8_t* row, Kind kind, int64_t D, float* out) {
  switch (kind) {
    case Kind::F32:
      std::memcpy(out, row, D * sizeof(float));
      return;
    case Kind::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const uint32_t u = static_cast<uint32_t>(h[d]) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        out[d] = f;
      }
      return;
    }
    case Kind::F16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      int64_t d = 0;
#if defined(__F16C__)
      for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(h + d))));
#endif
      for (; d < D; ++d) out[d] = c10::detail::fp16_ieee_to_fp32_value(h[d]);
      return;
    }
    case Kind::I8: {
      const float s = scale_of(row, D);
      const int8_t* c = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(c[d]) * s;
      return;
    }
    case Kind::FP8: {
      const float s = scale_of(row, D), sub = s * 0x1p-9f;  // subnormals: mantissa x 2^-9
      int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
      const __m256 s8 = _mm256_set1_ps(s * 0x1p8f);  // float16s worth 2^-8 of the codes
      for (; d + 8 <= D; d += 8) {
        const __m128i halves = e4m3_as_halves(
            _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d))));
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(halves), s8));
      }
#endif
      for (; d < D; ++d) {
        const int32_t u = row[d], mag = u & 0x7f;
        const int32_t nb = (mag << 20) + (120 << 23);
        float normal;
        std::memcpy(&normal, &nb, sizeof normal);
        // Both values, then an integer select and the sign: a float select (or branch)
        // keeps GCC from vectorizing the loop (FP ops may trap), and that was 8x slower.
        const float a = normal * s, b = static_cast<float>(mag) * sub;
        int32_t ab, bb;
        std::memcpy(&ab, &a, sizeof ab);
        std::memcpy(&bb, &b, sizeof bb);
        const int32_t keep = -static_cast<int32_t>(mag >= 8);
        const int32_t sign = static_cast<int32_t>(static_cast<uint32_t>(u & 0x80) << 24);
        const int32_t v = (ab & keep) | (bb & ~keep) | sign;
        std::memcpy(out + d, &v, sizeof v);
      }
      return;
    }
  }
}

}  // namespace kv_rows
