// A block's K or V rows of one KV head as decode attention's dot products read them: kLanes
// values of row j from column c (`load`), and the factor that row's values still need
// (`scale`: an int8 row's, applied once to its score or to its weight in the sum of V rows).
//
// float32 rows are read in place; float16, bfloat16, int8 and fp8 rows are widened in
// registers where the flavour has the instructions (F16C, AVX2), so that the bytes a smaller
// cache saves are not spent again writing and reading a float32 copy (a block's widened rows
// cost float16 ~30% of the attention's time when its rows sit in cache). fp8 rows on AVX2,
// and every format but float32 on the generic flavour, are widened into a buffer first
// (`Widened`), once per KV head for its G query heads, where a reader repeats its widening
// for each of them (fp8 on AVX-512: the reader, level to 1.13x the buffer).
#pragma once

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "kv_rows.h"
#include "vec_math.h"

namespace kv_readers {

// Whether a reader's rows are int8 codes, whose keys decode attention takes in integer dot
// products (csrc/paged_attention_cpu.cpp, int8_key_scores).
template <typename Reader>
constexpr bool kInt8Rows = false;

// Rows of float32, `row` floats apart.
struct F32 {
  const float* p;
  int64_t row;
  vfn load(int64_t j, int64_t c) const { return loadv(p + j * row + c); }
  float scale(int64_t) const { return 1.f; }
  static F32 at(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t, int64_t,
                float*) {
    return {reinterpret_cast<const float*>(R.row(first_row)), KVH * R.D};
  }
};

// Any format, its rows [j0, n) widened into buf (rows D apart) by kv_rows::load.
struct Widened : F32 {
  static Widened at(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t j0,
                    int64_t n, float* buf) {
    for (int64_t j = j0; j < n; ++j)
      kv_rows::load(R.row(first_row + j * KVH), R.kind, R.D, buf + j * R.D);
    return {{buf, R.D}};
  }
};

// Rows [j0, n) as float32 rows: in place for a float32 cache, else widened into buf.
inline F32 float_rows(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t j0,
                      int64_t n, float* buf) {
  return R.kind == kv_rows::Kind::F32 ? F32::at(R, first_row, KVH, j0, n, buf)
                                      : Widened::at(R, first_row, KVH, j0, n, buf);
}

// Rows of 16-bit values, `row` values apart (Self: the reader, which widens them).
template <typename Self>
struct HalfRows {
  const uint16_t* p;
  int64_t row;
  float scale(int64_t) const { return 1.f; }
  static Self at(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t, int64_t,
                 float*) {
    return {{reinterpret_cast<const uint16_t*>(R.row(first_row)), KVH * R.D}};
  }
};

#if defined(__F16C__)
// float16: vcvtph2ps.
struct F16 : HalfRows<F16> {
  vfn load(int64_t j, int64_t c) const {
    const uint16_t* at = p + j * row + c;
#if defined(__AVX512F__)
    return reinterpret_cast<vfn>(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))));
#else
    return reinterpret_cast<vfn>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
#endif
  }
};
#define PKV_KV_READS_F16 1
#endif

#if defined(__AVX2__)
// bfloat16: widened to 32 bits and shifted into a float's top half.
struct BF16 : HalfRows<BF16> {
  vfn load(int64_t j, int64_t c) const {
    const uint16_t* at = p + j * row + c;
#if defined(__AVX512F__)
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    return reinterpret_cast<vfn>(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#else
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    return reinterpret_cast<vfn>(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#endif
  }
};

// Rows of int8 codes and their float scale (kv_rows.h), `row` bytes apart.
struct I8 {
  const uint8_t* p;
  int64_t row, D;
  vfn load(int64_t j, int64_t c) const {
    const uint8_t* at = p + j * row + c;
#if defined(__AVX512F__)
    return reinterpret_cast<vfn>(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))));
#else
    return reinterpret_cast<vfn>(_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)))));
#endif
  }
  float scale(int64_t j) const { return kv_rows::scale_of(p + j * row, D); }
  static I8 at(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t, int64_t,
               float*) {
    return {R.row(first_row), KVH * R.bytes, R.D};
  }
};
template <>
constexpr bool kInt8Rows<I8> = true;
#define PKV_KV_READS_AVX2 1
#endif

#if defined(__AVX512F__)
// Rows of fp8 e4m3 codes and their float scale: four instructions widen 16 codes, as
// float16s worth 2^-8 of their values (kv_rows::e4m3_as_halves); scale() folds the 2^8 back
// into the row's scale. On AVX2, with half the codes an instruction, the buffer of widened
// rows ran 1.17-1.21x this reader (64 x 128 and 1,024 keys), so fp8 rows take the buffer there.
struct FP8 : I8 {
  vfn load(int64_t j, int64_t c) const {
    const __m256i halves = kv_rows::e4m3_as_halves(_mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * row + c))));
    return reinterpret_cast<vfn>(_mm512_cvtph_ps(halves));
  }
  float scale(int64_t j) const { return kv_rows::scale_of(p + j * row, D) * 0x1p8f; }
  static FP8 at(const kv_rows::Rows& R, int64_t first_row, int64_t KVH, int64_t, int64_t,
                float*) {
    return {{R.row(first_row), KVH * R.bytes, R.D}};
  }
};
#define PKV_KV_READS_FP8 1
#endif

// 16 values of row j from column c.
template <typename Reader>
inline vf16 load16(const Reader& r, int64_t j, int64_t c) {
  vf16 v;
  for (int i = 0; i < kParts; ++i) v.p[i] = r.load(j, c + i * kLanes);
  return v;
}

}  // namespace kv_readers
