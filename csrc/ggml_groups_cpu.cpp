// Q4_0, Q4_1, Q5_0 and Q5_1 (and, with VBMI and VNNI, Q8_0) against 1 to kGroupRows rows of
// int8 x, a weight row four blocks of 32 at a time. Included by csrc/ggml_cpu.cpp after
// ggml_q8_cpu.cpp, whose Q8Rows it reads.
//
// Why: a batch-1 step of a Q4_K_M file whose layers are too narrow for the K-quants (the
// 576-wide SmolLM2 or the 896-wide Qwen2.5-0.5B: llama-quantize falls back to Q5_0) spends
// half its time in these layers, and a block-at-a-time int8 GEMV (now Q8_0's only) was bound
// by its ~25 instructions a block (nibbles, the fifth bits, two half scales converted one at a
// time, a byte dot in three instructions, a scalar offset), at 13-24 GB/s of the machine's ~33.
// At 2-6 rows a weight row's codes, decoded once, meet each row of x in turn. Q8_0 at 3-6 rows
// (the LM head of a small model, a Q8_0 file's every layer) had the float GEMV or the tiles.
// Q4_0 and Q4_1, with int8 x, had the 4-bit tiles' GEMV (6 bits a weight against their 4.5
// and 5: core/layers/int4_tiles.py); Q5_1 the block-at-a-time one at 1-2 rows, else float.
//
// x is laid out for it once a call (`Q8Groups`): per group of four blocks, the first 16 codes
// of each block side by side (`lo`), the last 16 (`hi`), the offset's share -16 sum(q) in the
// first int32 lane of each block (Q5_0: w = d (c - 16), so the block's dot is
// d dx (c . q - 16 sum q); for Q8_0, whose signed codes go in + 128, -128 sum q: eight times
// it, a shift as it is loaded; for Q4_0, w = d (c - 8), half of it), dx repeated over each
// block's four lanes and dx sum q in each block's first lane (`dsum`: Q4_1's and Q5_1's
// w = d c + m adds m dx sum q, one more multiply-add). Then a Q5_0 block's codes are its 16
// nibble bytes, low nibbles against `lo` and high against `hi`, plus 16 where its fifth bit is
// set; its byte products land in the four int32 lanes that its scale, widened from half once
// for the group, multiplies. A short last group has zeros in x, and its weight bytes past the
// row are never loaded.
//
//   AVX-512 with VBMI and VNNI: two byte permutes (vpermt2b) gather the group's 88 bytes into
//   its 64 nibble bytes and into its scales (each repeated four times) and fifth bits (two
//   64-bit masks); the fifth bits are added under the masks, two vpdpbusd take the products.
//   About six instructions a block. Masked loads stop at the row's end. Q8_0 (136 bytes, three
//   registers): four permutes and a blend gather each block's first and last 16 codes and its
//   scale, a xor adds the 128. Q4_0 / Q4_1 (72 / 80 bytes): two permutes gather the nibbles
//   and the scales (Q4_1 its m too); Q5_1 (96 bytes) a third its m's.
//   AVX2 (and AVX-512 without VBMI): a pair of blocks a register (two 16-byte loads each for
//   the nibbles and for the scale and fifth bits), the fifth bits by a byte shuffle and compare,
//   vpmaddubsw / vpmaddwd for the products (with AVX-VNNI two vpdpbusd, which add the offset
//   too). About fourteen a block (Q4_0 / Q4_1 without the fifth bits). A pair of a short group
//   that holds one block loads only that one.

namespace ggml {

#if defined(__AVX2__)
namespace {

constexpr int64_t kQ5Bytes = 22;  // d (f16), qh (32 fifth bits), qs (16 bytes of nibbles)

// Rows of x in groups of four blocks of 32 (see the header); row m's group g at
// g * rows + m: a group's rows side by side. (Row-major, rows of 8192 inputs lay each row's
// group g 4 KB from the next row's, five arrays of them in one set of L1: at 4-6 rows a
// layer of 2048 x 8192 fell from 8-11 GB/s to 2-3 by where the arrays happened to lie.)
struct Q8Groups {
  std::vector<int8_t> lo, hi;                // [groups, rows, 64]
  std::vector<int32_t> offset16;             // [groups, rows, 16]: -16 sum q
  std::vector<float> dx;                     // [groups, rows, 16]
  std::vector<float> dsum;                   // [groups, rows, 16]: dx sum q (Q4_1's m term)
  int64_t blocks = 0, groups = 0;
};

// The M rows of x (quantized in blocks of 32) into `g`.
void group_q8(const Q8Rows& x, int64_t M, Q8Groups& g) {
  const int64_t NB = x.K / 32, G = (NB + 3) / 4;
  g.blocks = NB;
  g.groups = G;
  g.lo.assign(M * G * 64, 0);
  g.hi.assign(M * G * 64, 0);
  g.offset16.assign(M * G * 16, 0);
  g.dx.assign(M * G * 16, 0.f);
  g.dsum.assign(M * G * 16, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < NB; ++b) {
      const int64_t at = m * NB + b, lane = 16 * (b / 4 * M + m) + 4 * (b % 4);
      std::memcpy(g.lo.data() + 4 * lane, x.q.data() + 32 * at, 16);
      std::memcpy(g.hi.data() + 4 * lane, x.q.data() + 32 * at + 16, 16);
      g.offset16[lane] = -16 * (x.bsums[2 * at] + x.bsums[2 * at + 1]);
      g.dsum[lane] = x.d[at] * (x.bsums[2 * at] + x.bsums[2 * at + 1]);
      std::fill_n(g.dx.data() + lane, 4, x.d[at]);
    }
  }
}

// A group's prefetches (see Lookahead), the stream's hint by flavour: T0 with AVX-512's VBMI
// and VNNI (as before), kRowHint's on AVX2 (non-temporal there, T0 had run 0.90-0.94x at 3-6
// rows of x on Zen; on a Sapphire Rapids VM non-temporal ran 0.5x: see kRowHint).
// From memory, one row of x, against each row's own lookahead at every row length, Q4_0:
// AVX2 576 x 1536 1.5-1.7x, 6144 x 3072 1.6-2.1x, 16384 x 2048 2.0x, 3072 x 576 level, the
// stream on 18-32 KB panels 0.70-0.74x; AVX-512, whose panels all took the stream, 2048 x 8192
// 1.29-1.35x and 4096 x 14336 1.30-1.42x by rows, rows on 9 KB panels 0.81x.
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
constexpr int kGroupStreamHint = 3;
#else
constexpr int kGroupStreamHint = kRowHint;
#endif
template <int W, typename Codes>
using Ahead = Lookahead<W, kGroupStreamHint, 4 * Codes::kBytes>;

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
// Masks for loading a group's `bytes` bytes in registers of 64: none past them.
template <int N>
inline std::array<__mmask64, N> load_masks(int64_t bytes) {
  std::array<__mmask64, N> masks;
  for (int i = 0; i < N; ++i) {
    const int64_t k = std::clamp<int64_t>(bytes - 64 * i, 0, 64);
    masks[i] = k == 64 ? ~0ULL : (1ULL << k) - 1;
  }
  return masks;
}

// Byte indices: `at(j)` for each byte j of a register, `at` the group's byte to take.
template <typename At>
inline __m512i byte_index(const At& at) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 64; ++j) idx[j] = static_cast<uint8_t>(at(j));
  return _mm512_load_si512(idx);
}

// Q5_0's group of four 22-byte blocks (88 bytes: two registers): its 64 nibble bytes and
// (`meta`) its scales as halves, each repeated four times, then the low and the high 16
// fifth bits of each block (two 64-bit masks); the fifth bits go in under the masks. Q5_1's
// of four 24-byte blocks (96 bytes) likewise, and its m's (`mins`) as Q4_1's.
template <bool kOffset>
struct Q5Group {
  static constexpr int64_t kBytes = kOffset ? 24 : kQ5Bytes;
  static constexpr int kLoads = 2;
  static constexpr bool kMin = kOffset;
  static constexpr int kBits = kOffset ? 4 : 2, kCodes = kOffset ? 8 : 6;  // qh, qs at
  struct Index {
    __m512i nibbles = byte_index([](int j) { return kBytes * (j / 16) + kCodes + j % 16; });
    __m512i meta = byte_index([](int j) {
      const int k = j - 32;  // the fifth bits' bytes (k >= 16: unused)
      return j < 32 ? kBytes * (j / 8) + j % 2
                    : kBytes * (k % 8 / 2) + kBits + k % 2 + 2 * (k / 8 % 2);
    });
    __m512i mins = kOffset  // Q5_1's m's (Q5_0 has none)
                       ? byte_index([](int j) { return kBytes * (j % 32 / 8) + 2 + j % 2; })
                       : _mm512_setzero_si512();
  };
  static __m512i offset(const int32_t* at) {
    return kOffset ? _mm512_setzero_si512() : _mm512_loadu_si512(at);
  }
  static void decode(const __m512i* r, const Index& ix, __m512i& lo, __m512i& hi, __m512& d,
                     __m512& mins) {
    const __m512i qs = _mm512_permutex2var_epi8(r[0], ix.nibbles, r[1]);
    const __m512i m = _mm512_permutex2var_epi8(r[0], ix.meta, r[1]);
    const __m128i bits = _mm512_extracti32x4_epi32(m, 2);
    const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    lo = _mm512_and_si512(qs, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), low4);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(_mm_cvtsi128_si64(bits)), lo, fifth);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(_mm_extract_epi64(bits, 1)), hi, fifth);
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(m));
    if constexpr (kOffset)
      mins = _mm512_cvtph_ps(
          _mm512_castsi512_si256(_mm512_permutex2var_epi8(r[0], ix.mins, r[1])));
  }
};

// Q8_0's group of four 34-byte blocks (136 bytes: three registers): each block's first 16
// codes, its last 16 (blocks 0-1 from the first two registers, 2-3 from the last two), and its
// scale repeated four times; the signed codes + 128 as unsigned bytes (w = d (c - 128)).
struct Q8Group {
  static constexpr int64_t kBytes = 34;
  static constexpr int kLoads = 3;
  static constexpr bool kMin = false;
  struct Index {
    __m512i first = byte_index([](int j) { return 34 * (j / 16) + 2 + j % 16; });
    __m512i last01 = byte_index([](int j) { return 34 * (j / 16 % 2) + 18 + j % 16; });
    __m512i last23 = byte_index([](int j) { return 34 * (2 + j / 16 % 2) + 18 + j % 16 - 64; });
    __m512i scales = byte_index([](int j) { return 34 * (j / 8 % 4) + j % 2; });
  };
  static __m512i offset(const int32_t* at) {  // -128 sum q
    return _mm512_slli_epi32(_mm512_loadu_si512(at), 3);
  }
  static void decode(const __m512i* r, const Index& ix, __m512i& lo, __m512i& hi, __m512& d,
                     __m512&) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    lo = _mm512_xor_si512(_mm512_permutex2var_epi8(r[0], ix.first, r[1]), flip);
    hi = _mm512_xor_si512(_mm512_mask_blend_epi8(0xFFFFFFFF00000000ULL,
                                                 _mm512_permutex2var_epi8(r[0], ix.last01, r[1]),
                                                 _mm512_permutex2var_epi8(r[1], ix.last23, r[2])),
                          flip);
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(r[0], ix.scales, r[1])));
  }
};

// Q4_0's group of four 18-byte blocks (72 bytes) or Q4_1's of four 20-byte ones (80 bytes),
// two registers: the 64 nibble bytes, each block's scale repeated four times and, for Q4_1,
// its m likewise (`mins`: w = d c + m adds m dx sum q, from x's `dsum`); Q4_0's w = d (c - 8)
// takes -8 sum q, half of x's -16 sum q, in the integer sums.
template <bool kOffset>
struct Q4Group {
  static constexpr int64_t kBytes = kOffset ? 20 : 18;
  static constexpr int kLoads = 2;
  static constexpr bool kMin = kOffset;
  struct Index {
    __m512i nibbles =
        byte_index([](int j) { return kBytes * (j / 16) + (kOffset ? 4 : 2) + j % 16; });
    __m512i meta =  // bytes 0-31: the scales; 32-63: the m's
        byte_index([](int j) { return kBytes * (j % 32 / 8) + 2 * (j / 32) + j % 2; });
  };
  static __m512i offset(const int32_t* at) {
    return kOffset ? _mm512_setzero_si512() : _mm512_srai_epi32(_mm512_loadu_si512(at), 1);
  }
  static void decode(const __m512i* r, const Index& ix, __m512i& lo, __m512i& hi, __m512& d,
                     __m512& mins) {
    const __m512i qs = _mm512_permutex2var_epi8(r[0], ix.nibbles, r[1]);
    const __m512i m = _mm512_permutex2var_epi8(r[0], ix.meta, r[1]);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(qs, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), low4);
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(m));
    if constexpr (kOffset) mins = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(m, 1));
  }
};

// W weight rows from row n through the R rows of x in `x` into y[m * ldy + n..].
template <typename Codes, int W, int R>
inline void group_rows(const Part& p, int64_t n, const Q8Groups& x,
                       const Ahead<W, Codes>& ahead, const float* bias, float* y, int64_t ldy) {
  static const typename Codes::Index ix;
  constexpr int64_t kBytes = 4 * Codes::kBytes;
  const int64_t G = x.groups;
  __m512 acc[W][R];
  for (int w = 0; w < W; ++w)
    for (int m = 0; m < R; ++m) acc[w][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto masks =
        load_masks<Codes::kLoads>(Codes::kBytes * std::min<int64_t>(4, x.blocks - 4 * g));
    ahead.at(n, g);
    for (int w = 0; w < W; ++w) {
      const uint8_t* b = p.data + (n + w) * p.stride + kBytes * g;
      __m512i r[Codes::kLoads];
      for (int i = 0; i < Codes::kLoads; ++i) r[i] = _mm512_maskz_loadu_epi8(masks[i], b + 64 * i);
      __m512i lo, hi;
      __m512 d, mins;
      Codes::decode(r, ix, lo, hi, d, mins);
      for (int m = 0; m < R; ++m) {
        const int64_t at = g * R + m;
        const __m512i sums = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(Codes::offset(x.offset16.data() + 16 * at), lo,
                                _mm512_loadu_si512(x.lo.data() + 64 * at)),
            hi, _mm512_loadu_si512(x.hi.data() + 64 * at));
        acc[w][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                    _mm512_mul_ps(d, _mm512_loadu_ps(x.dx.data() + 16 * at)),
                                    acc[w][m]);
        if constexpr (Codes::kMin)
          acc[w][m] =
              _mm512_fmadd_ps(mins, _mm512_loadu_ps(x.dsum.data() + 16 * at), acc[w][m]);
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int m = 0; m < R; ++m)
      y[m * ldy + n + w] = _mm512_reduce_add_ps(acc[w][m]) + (bias ? bias[n + w] : 0.f);
}

#else
// 16 bytes at `at` of two blocks of `bytes` each from b, or of one (the other lane zero).
inline __m256i load_pair(const uint8_t* b, int64_t bytes, int64_t at, bool two) {
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at));
  if (!two) return _mm256_zextsi128_si256(first);
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(first),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bytes + at)), 1);
}

// The low (or, kHigh, the high) nibbles of a pair's 16 code bytes `qs`.
template <bool kHigh>
inline __m256i pair_nibbles(__m256i qs) {
  return _mm256_and_si256(kHigh ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
}

// The half at byte `at` (0: the scale; 2: Q4_1's m) of each block of a pair, from their first
// 16 bytes `meta` (one 128-bit lane each), repeated over its block's four int32 lanes.
template <int kAt>
inline __m256 pair_halves(__m256i meta) {
  constexpr int kPair = (kAt + 1) << 8 | kAt;  // the half's two bytes
  const __m256i halves = _mm256_shuffle_epi8(meta, _mm256_set1_epi32(kPair << 16 | kPair));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08)));
}

// Q5_0's pair (or Q5_1's, whose m comes in as Q4_1's): the nibbles plus 16 where the fifth
// bit is set (a byte shuffle spreads the fifth bits' bytes over the code bytes, a compare with
// each byte's bit tests them).
template <bool kOffset>
struct Q5Group {
  static constexpr int64_t kBytes = kOffset ? 24 : kQ5Bytes, kCodesAt = kOffset ? 8 : 6;
  static constexpr bool kMin = kOffset;
  template <bool kHigh>
  static __m256i codes(__m256i qs, __m256i meta) {
    // Bytes q, q + 1 of qh hold the fifth bits of the low (or high) 16 values.
    constexpr int64_t q = (kOffset ? 4 : 2) + (kHigh ? 2 : 0);
    constexpr int64_t lo8 = 0x0101010101010101 * q, hi8 = 0x0101010101010101 * (q + 1);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_and_si256(_mm256_shuffle_epi8(meta, _mm256_setr_epi64x(lo8, hi8, lo8, hi8)), bit),
        bit);
    return _mm256_or_si256(pair_nibbles<kHigh>(qs),
                           _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
  static __m256i offset(const int32_t* at) {
    return kOffset ? _mm256_setzero_si256() : load256(at);
  }
};

// Q4_0's pair (w = d (c - 8): -8 sum q, half of x's -16 sum q) or Q4_1's (w = d c + m: the
// m term from x's dx sum q).
template <bool kOffset>
struct Q4Group {
  static constexpr int64_t kBytes = kOffset ? 20 : 18, kCodesAt = kOffset ? 4 : 2;
  static constexpr bool kMin = kOffset;
  template <bool kHigh>
  static __m256i codes(__m256i qs, __m256i) { return pair_nibbles<kHigh>(qs); }
  static __m256i offset(const int32_t* at) {
    return kOffset ? _mm256_setzero_si256() : _mm256_srai_epi32(load256(at), 1);
  }
};

// Pair `pair` of group g (both its blocks, or kTwo false: its first only) of W weight rows
// from row n through the R rows of x in `x`, into acc.
template <typename Codes, int W, int R, bool kTwo>
inline void pair_rows(const Part& p, int64_t n, const Q8Groups& x, int64_t g, int64_t pair,
                      __m256 (&acc)[W][R]) {
  for (int w = 0; w < W; ++w) {
    const uint8_t* b = p.data + (n + w) * p.stride + 4 * Codes::kBytes * g +
                       2 * Codes::kBytes * pair;
    const __m256i meta = load_pair(b, Codes::kBytes, 0, kTwo),
                  qs = load_pair(b, Codes::kBytes, Codes::kCodesAt, kTwo);
    const __m256i lo = Codes::template codes<false>(qs, meta),
                  hi = Codes::template codes<true>(qs, meta);
    const __m256 d = pair_halves<0>(meta);
    __m256 mins;
    if constexpr (Codes::kMin) mins = pair_halves<2>(meta);
    for (int m = 0; m < R; ++m) {
      const int64_t at = 64 * (g * R + m) + 32 * pair;
#if defined(__AVXVNNI__)
      const __m256i sums = _mm256_dpbusd_avx_epi32(
          _mm256_dpbusd_avx_epi32(Codes::offset(x.offset16.data() + at / 4), lo,
                                  load256(x.lo.data() + at)),
          hi, load256(x.hi.data() + at));
#else
      const __m256i pairs = _mm256_add_epi16(
          _mm256_maddubs_epi16(lo, load256(x.lo.data() + at)),
          _mm256_maddubs_epi16(hi, load256(x.hi.data() + at)));  // (< 2 x 2 x 31 x 127)
      const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
                                            Codes::offset(x.offset16.data() + at / 4));
#endif
      acc[w][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                  _mm256_mul_ps(d, _mm256_loadu_ps(x.dx.data() + at / 4)),
                                  acc[w][m]);
      if constexpr (Codes::kMin)
        acc[w][m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x.dsum.data() + at / 4), acc[w][m]);
    }
  }
}

// W weight rows from row n through the R rows of x in `x` into y[m * ldy + n..]. A full
// group's pairs are taken with no test for a short one (testing each pair of each row held a
// thread to 15 GB/s from cache on a Q4_0 layer, 17 without).
template <typename Codes, int W, int R>
inline void group_rows(const Part& p, int64_t n, const Q8Groups& x,
                       const Ahead<W, Codes>& ahead, const float* bias, float* y, int64_t ldy) {
  const int64_t G = x.groups;
  __m256 acc[W][R];
  for (int w = 0; w < W; ++w)
    for (int m = 0; m < R; ++m) acc[w][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    ahead.at(n, g);
    const int64_t blocks = std::min<int64_t>(4, x.blocks - 4 * g);
    if (blocks == 4) {
      pair_rows<Codes, W, R, true>(p, n, x, g, 0, acc);
      pair_rows<Codes, W, R, true>(p, n, x, g, 1, acc);
    } else {  // a short last group's last pair may hold one block
      for (int64_t pair = 0; 2 * pair < blocks; ++pair) {
        if (2 * pair + 1 < blocks) {
          pair_rows<Codes, W, R, true>(p, n, x, g, pair, acc);
        } else {
          pair_rows<Codes, W, R, false>(p, n, x, g, pair, acc);
        }
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int m = 0; m < R; ++m)
      y[m * ldy + n + w] = hsum8(acc[w][m]) + (bias ? bias[n + w] : 0.f);
}
#endif

// Rows [n0, n1) of a grouped part (Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 with VBMI and VNNI) through
// the R rows of x in `x`, W weight rows at a time.
template <int R>
void groups_rows(const Part& p, int64_t n0, int64_t n1, const Q8Groups& x, const float* bias,
                 float* y, int64_t ldy) {
  constexpr int W = R == 1 ? 4 : R == 2 ? 2 : 1;  // (wider spilled the accumulators: measured)
  const auto rows_of_type = [&]<typename Codes>() {
    const Ahead<W, Codes> panels(p, x.groups);
    for (; n0 + W <= n1; n0 += W) group_rows<Codes, W, R>(p, n0, x, panels, bias, y, ldy);
    const Ahead<1, Codes> rows(p, x.groups);
    for (; n0 < n1; ++n0) group_rows<Codes, 1, R>(p, n0, x, rows, bias, y, ldy);
  };
  switch (p.type) {
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    case Q8_0: return rows_of_type.template operator()<Q8Group>();
#endif
    case Q4_0: return rows_of_type.template operator()<Q4Group<false>>();
    case Q4_1: return rows_of_type.template operator()<Q4Group<true>>();
    case Q5_1: return rows_of_type.template operator()<Q5Group<true>>();
    default: return rows_of_type.template operator()<Q5Group<false>>();
  }
}

// Rows [n0, n1) of a grouped part through the M (1 to kGroupRows) rows of x in `x` into
// y [M, ldy].
void groups_gemv(const Part& p, int64_t n0, int64_t n1, const Q8Groups& x, int64_t M,
                 const float* bias, float* y, int64_t ldy) {
  TORCH_CHECK(int8_grouped(p.type, M),
              "groups_gemv: ggml type ", p.type, " has no grouped GEMV here");
  switch (M) {
    case 1: return groups_rows<1>(p, n0, n1, x, bias, y, ldy);
    case 2: return groups_rows<2>(p, n0, n1, x, bias, y, ldy);
    case 3: return groups_rows<3>(p, n0, n1, x, bias, y, ldy);
    case 4: return groups_rows<4>(p, n0, n1, x, bias, y, ldy);
    case 5: return groups_rows<5>(p, n0, n1, x, bias, y, ldy);
    default: return groups_rows<6>(p, n0, n1, x, bias, y, ldy);
  }
}

}  // namespace
#endif

}  // namespace ggml
