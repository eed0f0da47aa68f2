// The K-quants (Q4_K, Q5_K, Q6_K) times int8 activations: byte dot products (vpmaddubsw), as
// llama.cpp multiplies a K-quant by its Q8_K activations; at two rows of x (one, on AVX2) Q8_0
// too, against its Q8_0 activations (below `q8_0_dot`). Included by csrc/ggml_cpu.cpp.
//
// Each row of x is quantized per K-block of 256 inputs: x_k ~ xd q_k, xd = max |x| / 127,
// with the sums of q over each 16 inputs (bsums). Every K-quant weight is a code times a
// scale of 16 or 32 values, plus a term of the same 16 or 32 values, so a block's dot is
//   sum_k x_k w_k ~ xd (d sum_r s_r (codes . q)_r + e sum_16 c_16 bsum_16)
// with, per sub-block, Q4_K / Q5_K: w = (d sc) code - (dmin m): s = sc, c = m, e = -dmin;
// Q6_K: w = (d sc) (code - 32): s = c = sc, e = -32 d. The codes are unsigned bytes (0..63)
// and q signed ones, what vpmaddubsw multiplies: pairs of products stay below 2^15
// (2 x 63 x 127), a block's sums in int32; one conversion to float per block and row.
//
// Why: the float GEMV (ggml_float_cpu.cpp) widens, converts and scales every value before its FMA
// and is bound by that arithmetic (15-25 GB/s); here one vpmaddubsw takes 32 values.
// The error is that of x in 8 bits (at most 2^-8 of the block's largest activation), as
// llama.cpp's. AVX2 takes 32 values an instruction, AVX-512 64; the generic flavour has no
// vpmaddubsw and keeps the float GEMV (the module's `ggml_int8_kquants` says which).

namespace ggml {

#if defined(__AVX2__)
namespace {

constexpr int64_t kQ8Block = 256;

// Rows of x in int8: q [M, K], one scale per block of inputs [M, K / block] and the sums of q
// over each 16 [M, K / 16]. Blocks of 256 for the K-quants (llama.cpp's Q8_K), of 32 for the
// 32-value types (its Q8_0).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  int64_t K = 0;
};

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline int16_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1))));
}

// One block of N (256 or 32) values of x in int8 (q = round(v / d), half to even) and the
// sums of each 16 codes; returns d, NaN where a value is not finite. In vectors: scalar loops
// cost 6% of an 8B decode step, its other thread waiting.
template <int64_t N>
inline float quantize_block(const float* v, int8_t* q, int16_t* bsums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < N; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(x, magnitude));
    sum = _mm256_add_ps(sum, x);  // (carries a NaN or infinity, which max may drop)
  }
  if (!std::isfinite(hsum8(sum))) {  // the row's outputs are NaN, as in float
    std::fill(q, q + N, 0);
    std::fill(bsums, bsums + N / 16, 0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float top = hmax8(amax);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < N; i += 32) {  // packs interleave 128-bit lanes: reorder
    __m256i n[4];
    for (int k = 0; k < 4; ++k)
      n[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), inv));
    bsums[i / 16] = hsum8i(_mm256_add_epi32(n[0], n[1]));
    bsums[i / 16 + 1] = hsum8i(_mm256_add_epi32(n[2], n[3]));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                             _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  return top / 127.f;
}

// Rows x [M, K] into `r` in blocks of `block` inputs (its buffers grown, never shrunk).
void quantize_q8(const float* x, int64_t M, int64_t K, int64_t block, Q8Rows& r) {
  const int64_t NB = M * K / block;
  r.K = K;
  r.q.resize(std::max<size_t>(r.q.size(), M * K));
  r.d.resize(std::max<size_t>(r.d.size(), NB));
  r.bsums.resize(std::max<size_t>(r.bsums.size(), M * K / 16));
  const auto quantize = block == kQ8Block ? quantize_block<kQ8Block> : quantize_block<32>;
  // Split over the threads from 4,096 values up (a tiles pass: 32 rows of x); fewer stay on
  // this thread, where a loop's start and join would cost as much as the work.
  team::parallel_for(0, NB, 4096 / block, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      r.d[b] = quantize(x + b * block, r.q.data() + b * block, r.bsums.data() + block / 16 * b);
  });
}

// A block's scales as the dot reads them: 16 int8 s (one per 16 values), 16 int8 c, d and e.
struct IntScales {
  __m128i s, c;
  float d, e;
};

inline __m256i low_bits(__m256i v, int mask) { return _mm256_and_si256(v, _mm256_set1_epi8(mask)); }

// Bytes shifted by N within 16-bit lanes (the caller masks the bits that crossed bytes).
template <int N>
inline __m256i shift16(__m256i v) {
  if constexpr (N >= 0) return _mm256_slli_epi16(v, N);
  else return _mm256_srli_epi16(v, -N);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

#if defined(__AVX512BW__)
// AVX-512 takes two runs (64 values) an instruction: a and b as one register.
inline __m512i join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
inline __m512i low_bits(__m512i v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi8(mask)); }
#endif

// Q4_K and Q5_K: run r of 32 values is the low (r even) or high nibbles of bytes 32 (r / 2)
// on; Q5_K's fifth bit of value l in the run is bit r of qh byte l.
template <bool kFifth>
struct K4Int {
  static constexpr int64_t kBytes = kFifth ? 176 : 144;
  static IntScales scales(const uint8_t* b) {
    const __m128i both = (__m128i)unpack_k4_scales(b + 4);  // 8 scales, then 8 mins
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return {_mm_shuffle_epi8(both, twice),
            _mm_shuffle_epi8(both, _mm_add_epi8(twice, _mm_set1_epi8(8))), half(b), -half(b + 2)};
  }
  template <int R>
  static __m256i run(const uint8_t* b) {
    const __m256i v = load256(b + (kFifth ? 48 : 16) + 32 * (R / 2));
    __m256i codes = R % 2 == 0 ? low_bits(v, 0xF) : low_bits(_mm256_srli_epi16(v, 4), 0xF);
    if constexpr (kFifth)  // bit R of each qh byte to bit 4
      codes = _mm256_or_si256(codes, low_bits(shift16<4 - R>(load256(b + 16)), 0x10));
    return codes;
  }
#if defined(__AVX512BW__)
  // Runs 2P and 2P + 1: the low and high nibbles of the same 32 bytes.
  template <int P>
  static __m512i pair(const uint8_t* b) {
    const __m256i v = load256(b + (kFifth ? 48 : 16) + 32 * P);
    __m512i codes = low_bits(join(v, _mm256_srli_epi16(v, 4)), 0xF);
    if constexpr (kFifth) {
      const __m256i qh = load256(b + 16);
      codes = _mm512_or_si512(
          codes, low_bits(join(shift16<4 - 2 * P>(qh), shift16<3 - 2 * P>(qh)), 0x10));
    }
    return codes;
  }
#endif
};

// Q6_K: per 128 values (n = R / 4), the low 4 bits of runs 0 and 2 share the bytes of ql
// from 64 n, those of 1 and 3 the next 32; the top 2 bits of run k are bits 2k, 2k + 1 of
// qh bytes 32 n on.
struct Q6KInt {
  static constexpr int64_t kBytes = 210;
  static constexpr float kZero = 32.f;  // the code of value 0
  static IntScales scales(const uint8_t* b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const float d = half(b + 208);
    return {sc, sc, d, -kZero * d};
  }
  template <int R>
  static __m256i run(const uint8_t* b) {
    constexpr int n = R / 4, k = R % 4;
    const __m256i ql = load256(b + 64 * n + 32 * (k % 2)), top = load256(b + 128 + 32 * n);
    const __m256i low = k < 2 ? low_bits(ql, 0xF) : low_bits(_mm256_srli_epi16(ql, 4), 0xF);
    return _mm256_or_si256(low, low_bits(shift16<4 - 2 * k>(top), 0x30));
  }
#if defined(__AVX512BW__)
  // Runs 2P and 2P + 1: the 64 bytes of ql from 64 n, low nibbles (P even) or high.
  template <int P>
  static __m512i pair(const uint8_t* b) {
    constexpr int n = P / 2, k = 2 * (P % 2);
    const __m512i ql = _mm512_loadu_si512(b + 64 * n);
    const __m512i low = k == 0 ? low_bits(ql, 0xF) : low_bits(_mm512_srli_epi16(ql, 4), 0xF);
    const __m256i top = load256(b + 128 + 32 * n);
    return _mm512_or_si512(
        low, low_bits(join(shift16<4 - 2 * k>(top), shift16<2 - 2 * k>(top)), 0x30));
  }
#endif
};

// The int16 scales of run r's 16 pairs: s[2r] for its first 16 values, s[2r + 1] after.
template <int R>
inline __m256i run_scales(__m128i s) {
  const __m128i pick = _mm_setr_epi8(2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R,
                                     2 * R + 1, 2 * R + 1, 2 * R + 1, 2 * R + 1, 2 * R + 1,
                                     2 * R + 1, 2 * R + 1, 2 * R + 1);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, pick));
}

// isum[m] += run R of the block at b against rows m of x.
template <int R, int M, typename Codes>
__attribute__((always_inline)) inline void dot_run(const uint8_t* b, const IntScales& sc,
                                                   const int8_t* const* xq, __m256i* isum) {
  const __m256i codes = Codes::template run<R>(b), s = run_scales<R>(sc.s);
  for (int m = 0; m < M; ++m) {
    const __m256i pairs = _mm256_maddubs_epi16(codes, load256(xq[m] + 32 * R));
    isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(pairs, s));
  }
}

#if defined(__AVX512BW__)
// The int16 scales of runs 2P and 2P + 1 (s duplicated in both halves of `s2`).
template <int P>
inline __m512i pair_scales(__m256i s2) {
  constexpr char a = 4 * P, b = 4 * P + 1, c = 4 * P + 2, d = 4 * P + 3;
  const __m256i pick = _mm256_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b,
                                        c, c, c, c, c, c, c, c, d, d, d, d, d, d, d, d);
  return _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(s2, pick));
}

// isum[m] += runs 2P and 2P + 1 of the block at b against rows m of x (the upper 8 lanes of
// each row's sums folded onto the lower 8 at the block's end).
template <int P, int M, typename Codes>
__attribute__((always_inline)) inline void dot_pair(const uint8_t* b, __m256i s2,
                                                    const int8_t* const* xq, __m512i* isum) {
  const __m512i codes = Codes::template pair<P>(b), s = pair_scales<P>(s2);
  for (int m = 0; m < M; ++m) {
    const __m512i x = _mm512_loadu_si512(xq[m] + 64 * P);
    isum[m] = _mm512_add_epi32(isum[m], _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), s));
  }
}
#endif

// isum[m] += the whole block at b against rows m of x.
template <int M, typename Codes, int... R>
__attribute__((always_inline)) inline void dot_runs(const uint8_t* b, const IntScales& sc,
                                                    const int8_t* const* xq, __m256i* isum,
                                                    std::integer_sequence<int, R...>) {
#if defined(__AVX512BW__)
  __m512i wide[M];
  for (int m = 0; m < M; ++m) wide[m] = _mm512_setzero_si512();
  const __m256i s2 = _mm256_broadcastsi128_si256(sc.s);
  (dot_pair<R, M, Codes>(b, s2, xq, wide), ...);
  for (int m = 0; m < M; ++m)
    isum[m] = _mm256_add_epi32(_mm512_castsi512_si256(wide[m]),
                               _mm512_extracti64x4_epi64(wide[m], 1));
#else
  (dot_run<R, M, Codes>(b, sc, xq, isum), ...);
#endif
}

#if defined(__AVX512BW__)
constexpr int kRunsAtOnce = 4;  // pairs of runs
#else
constexpr int kRunsAtOnce = 8;
#endif

// One weight row through M rows of x (rows m0.. of `x`): acc[m] += its float partial sums.
// (Two or four weight rows at a time, sharing each load of x, ran 2-3x slower.)
template <int M, typename Codes>
inline void q8_dot(const uint8_t* b, const Q8Rows& x, int64_t m0, __m256* acc) {
  const int64_t NB = x.K / kQ8Block;
  for (int64_t i = 0; i < NB; ++i, b += Codes::kBytes) {
    for (int64_t l = 0; l < Codes::kBytes; l += 64)
      __builtin_prefetch(b + kRowAhead + l, 0, kRowHint);
    const IntScales sc = Codes::scales(b);
    const int8_t* xq[M];
    __m256i isum[M];
    for (int m = 0; m < M; ++m) {
      xq[m] = x.q.data() + (m0 + m) * x.K + kQ8Block * i;
      isum[m] = _mm256_setzero_si256();
    }
    dot_runs<M, Codes>(b, sc, xq, isum, std::make_integer_sequence<int, kRunsAtOnce>{});
    const __m256i c = _mm256_cvtepi8_epi16(sc.c);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * NB + i;
      const __m256i corr = _mm256_madd_epi16(c, load256(x.bsums.data() + 16 * at));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(sc.d * x.d[at]),
                               acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(sc.e * x.d[at]), acc[m]);
    }
  }
}

// Weight row n through rows m0..m0 + M of x into y[m * ldy + n].
template <int M, typename Codes>
inline void q8_row(const Part& p, int64_t n, const Q8Rows& x, int64_t m0, const float* bias,
                   float* y, int64_t ldy) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  q8_dot<M, Codes>(p.data + n * p.stride, x, m0, acc);
  for (int m = 0; m < M; ++m) y[m * ldy + n] = hsum8(acc[m]) + (bias ? bias[n] : 0.0f);
}

// row.template operator()<R>(m) over rows [0, M) of x: runs of kRun from m = 0, then the
// one to kRun - 1 left.
template <int kRun, typename Row>
inline void in_runs(int64_t M, const Row& row) {
  int64_t m = 0;
  for (; m + kRun <= M; m += kRun) row.template operator()<kRun>(m);
  [&]<int... R>(std::integer_sequence<int, R...>) {
    ((M - m == R + 1 ? (row.template operator()<R + 1>(m), 0) : 0), ...);
  }(std::make_integer_sequence<int, kRun - 1>{});
}

// Rows of x a K-quant weight row meets per decode of it (q8_gemv_rows): 8 where 32 registers
// hold their sums (AVX-512; 4 before: at 6-11 rows of x 1.06-1.20x, outputs equal), 4 on AVX2
// (6 and 8 there: 0.93-1.22x by shape, x's rows of 8192 inputs crowding L1's sets).
#if defined(__AVX512BW__)
constexpr int kKQuantRun = 8;
#else
constexpr int kKQuantRun = 4;
#endif

// Rows [n0, n1) of part p through rows m0..m0 + M of x, kKQuantRun rows of x at a time.
template <typename Codes>
void q8_gemv_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, int64_t m0,
                  int64_t M, const float* bias, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    in_runs<kKQuantRun>(M, [&]<int R>(int64_t m) {
      q8_row<R, Codes>(p, n, x, m0 + m, bias, y + m * ldy, ldy);
    });
}

// Q5_0 / Q5_1 codes as unsigned bytes (the int8 tiles read them, ggml_tiles_cpu.cpp): the
// nibbles plus 16 where the fifth bit is set; offset: the c_w of w = d c + c_w (Q5_0: -16 d,
// Q5_1: m).
inline __m256i set_bits_as_bytes(uint32_t bits) {  // byte j: 0xFF where bit j is set
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_movm_epi8(bits);
#else
  // Byte j takes qh's byte j / 8 and ORs in every bit but j % 8: all ones where bit j is set.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
#endif
}

template <bool kOffset>
struct Q5Int {
  static constexpr int64_t kBytes = kOffset ? 24 : 22;
  static constexpr float kZero = kOffset ? 0.f : 16.f;  // Q5_0's code of value 0
  static __m256i codes(const uint8_t* b) {  // value j: low nibble of byte j, j + 16: high
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kOffset ? 8 : 6)));
    const __m256i nibbles = low_bits(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), 0xF);
    uint32_t qh;
    std::memcpy(&qh, b + (kOffset ? 4 : 2), 4);
    return _mm256_or_si256(nibbles, _mm256_and_si256(set_bits_as_bytes(qh), _mm256_set1_epi8(16)));
  }
  static float offset(const uint8_t* b) { return half(b + 2); }  // Q5_1's m (kMin types only)
};

// Q8_0 at two rows of x, against x in blocks of 32 (llama.cpp's Q8_0 activations): a block's
// dot is d_w d_x (codes . q), the signed codes by sign transfer (|c| times q with c's sign,
// vpsignb), pairs of products below 2^15 (2 x 128 x 127), the block's sum in int32; at one
// row too where the float GEMV is AVX2's (int8_block32). From three rows the grouped GEMV or
// the tiles.
constexpr int64_t kQ8_0Bytes = 34;

// One Q8_0 weight row through M rows of x (rows m0.. of `x`): acc[m] += its partial sums.
template <int M>
inline void q8_0_dot(const uint8_t* b, const Q8Rows& x, int64_t m0, __m256* acc) {
  const int64_t NB = x.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < NB; ++i, b += kQ8_0Bytes) {
    __builtin_prefetch(b + kRowAhead, 0, kRowHint);
    const __m256i c = load256(b + 2), magnitude = _mm256_sign_epi8(c, c);
    const float d = half(b);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * NB + i;
      const __m256i q = _mm256_sign_epi8(load256(x.q.data() + at * 32), c);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, q), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * x.d[at]), acc[m]);
    }
  }
}

// Rows [n0, n1) of a Q8_0 part through rows m0..m0 + M of x, four rows of x at a time.
void q8_0_gemv_rows(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x, int64_t m0,
                    int64_t M, const float* bias, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    in_runs<4>(M, [&]<int R>(int64_t m) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      q8_0_dot<R>(p.data + n * p.stride, x, m0 + m, acc);
      for (int r = 0; r < R; ++r)
        y[(m + r) * ldy + n] = hsum8(acc[r]) + (bias ? bias[n] : 0.0f);
    });
}

// An int8 part's rows [n0, n1) through rows m0..m0 + M of x: the K-quants' rows of x in
// blocks of 256 (x256), the 32-value types' in blocks of 32 (x32).
void q8_part(const Part& p, int64_t n0, int64_t n1, const Q8Rows& x256, const Q8Rows& x32,
             int64_t m0, int64_t M, const float* bias, float* y, int64_t ldy) {
  switch (p.type) {
    case Q4_K: return q8_gemv_rows<K4Int<false>>(p, n0, n1, x256, m0, M, bias, y, ldy);
    case Q5_K: return q8_gemv_rows<K4Int<true>>(p, n0, n1, x256, m0, M, bias, y, ldy);
    case Q6_K: return q8_gemv_rows<Q6KInt>(p, n0, n1, x256, m0, M, bias, y, ldy);
    case Q8_0: return q8_0_gemv_rows(p, n0, n1, x32, m0, M, bias, y, ldy);
    default: TORCH_CHECK(false, "q8_part: no int8 GEMV here for ggml type ", p.type);
  }
}

}  // namespace

constexpr bool kInt8KQuants = true;

#else
constexpr bool kInt8KQuants = false;
#endif

// Whether a part of ggml type `type` takes int8 activations when they are asked for, and in
// blocks of how many inputs.
inline bool int8_kquant(int64_t type) {
  return kInt8KQuants && (type == Q4_K || type == Q5_K || type == Q6_K);
}
// The 32-value types at few rows of x, where their int8 GEMV is ahead of the float one (two
// threads, old vs new, 3072 x 576 layers, the 49152 x 576 head): Q5_1 at 1-2 rows 1.36-1.53x
// (AVX-512), 1.70-2.08x (AVX2); Q8_0 at 2 rows 1.76-1.95x, at 1 row 0.87-1.05x (the float
// side-by-side GEMV), so it stays float there; from 4 rows (one weight row at a time)
// 0.7-1.3x. Q4_0, Q4_1, Q5_0 and Q5_1 up to kGroupRows rows: a weight row four blocks at a
// time (ggml_groups_cpu.cpp), Q5_0 from 1 to 6 rows 1.3-2.9x the float GEMV or the tiles (two
// threads, 3072 x 576, AVX-512 and AVX2); at 8 rows 0.9x the tiles; a Q5_K_M file (Q5_1) at 1
// and 4 sequences 1.11-1.32x the int8 GEMV above and the float GEMV. Q8_0 alike at 3-6 rows
// where the CPU has VBMI and VNNI (kQ8Groups): the 49152 x 576 head streamed from memory at 4
// rows 1.4x the float GEMV; at 1-2 rows 0.72-0.74x the float GEMV and the int8 one, whose
// eight rows side by side read memory faster (~50 GB/s against ~37).
constexpr int64_t kGroupRows = 6;
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
constexpr bool kQ8Groups = true;
#else
constexpr bool kQ8Groups = false;
#endif
// Whether a part of this type at these rows takes the grouped GEMV (ggml_groups_cpu.cpp).
inline bool int8_grouped(int64_t type, int64_t rows) {
  if (!kInt8KQuants || rows > kGroupRows) return false;
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 ||
         (type == Q8_0 && kQ8Groups && rows >= 3);
}
// Q8_0 at one row: the float GEMV where it has AVX-512 (bandwidth-bound: the int8 GEMV ran a
// Q8_0 file's batch-1 decode 0.97x), the int8 one on AVX2, where the float GEMV is bound by
// its widening and converting (a Q8_0 file's batch 1 1.12x, a Q4_0 file's Q8_0 head 1.06x).
#if defined(__AVX512F__)
constexpr bool kQ8_0OneRowInt8 = false;
#else
constexpr bool kQ8_0OneRowInt8 = true;
#endif
inline bool int8_block32(int64_t type, int64_t rows) {
  return int8_grouped(type, rows) ||
         (kInt8KQuants && type == Q8_0 && (rows == 2 || (rows == 1 && kQ8_0OneRowInt8)));
}

}  // namespace ggml
