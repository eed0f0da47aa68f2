// Weights in ggml blocks through 5 or more rows of x with int8 activations (a decode batch,
// a prefill):
// tiles of weight rows in bytes against x^T in bytes. Included by csrc/ggml_cpu.cpp after
// ggml_q8_cpu.cpp (its code readers and int8 rows of x) and ggml_broadcast_cpu.cpp (the
// ColumnBuffer its outputs go through).
//
// Why: at 16 rows the float kernel (ggml_broadcast_cpu.cpp) spends one FMA per weight and row
// of x, and the int8 GEMVs (ggml_q8_cpu.cpp) take one weight row at a time, converting and
// scaling per row of x and block. Here each thread decodes P weight rows into bytes in L1, x
// is transposed once per pass (one vector holds four inputs of every row, a 32-bit lane a
// row), and per four inputs a broadcast of a weight row's four codes meets each vector of x
// in one byte dot product: vpdpbusd with AVX512-VNNI, 64 multiply-adds an instruction against
// the float kernel's 16 (AVX-VNNI's, in the avxvnni flavour: 32 against 8); elsewhere
// vpmaddubsw, its pairs summed in int16 over up to 32 inputs before vpmaddwd widens them.
//
// Every type reads as unsigned byte codes c with a scale and an offset per S values (S = 32;
// Q6_K 16): w = dw c + mw. Against x quantized per 32 inputs (x ~ dx q, llama.cpp's Q8_0
// activations) a sub-block's dot is dx (dw (c . q) + mw sum q), with
//   Q4_0, Q5_0: c the 4- or 5-bit code, mw = -8 dw, -16 dw;  Q4_1, Q5_1: mw = m;
//   Q8_0 with VNNI: c = its signed code + 128, mw = -128 dw; without (vpmaddubsw's pairs of
//   255 x 127 would saturate): |c| times q with c's sign, pairs up to 2 x 128 x 127, mw = 0;
//   Q4_K, Q5_K: dw = d sc, mw = -dmin m (per 32);  Q6_K: c its 6-bit code, dw = d sc,
//   mw = -32 dw (per 16).
// The error is x's in 8 bits per 32 inputs, as the 32-value types' int8 GEMV's.

namespace ggml {

// Byte dot products in one instruction: AVX512-VNNI's, or AVX-VNNI's at 256 bits (the avxvnni
// flavour).
#if defined(__AVX512VNNI__) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
#define PKV_TILE_VNNI 1
constexpr bool kTileVnni = true;
#else
constexpr bool kTileVnni = false;
#endif

#if defined(__AVX2__)
namespace {

// int16 lanes (twice kLanes of them), for vpmaddubsw's pairs of products.
typedef int16_t vsn __attribute__((vector_size(kLanes * 4)));

// Pairs of products of w's unsigned bytes and x's signed ones, summed in int16 (without VNNI);
// pairs of int16 summed into int32.
#if defined(__AVX512F__)
inline vsn maddubs(vin w, vin x) { return (vsn)_mm512_maddubs_epi16((__m512i)w, (__m512i)x); }
inline vin widen(vsn pairs) {
  return (vin)_mm512_madd_epi16((__m512i)pairs, _mm512_set1_epi16(1));
}
constexpr int64_t kTilePassRows = 2 * kLanes;  // rows of x a pass: two vectors of x^T
constexpr int kTileP1 = 12, kTileP2 = 6;       // weight rows a tile: one or two vectors of x^T
#else
inline vsn maddubs(vin w, vin x) { return (vsn)_mm256_maddubs_epi16((__m256i)w, (__m256i)x); }
inline vin widen(vsn pairs) {
  return (vin)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1));
}
// One vector of x^T a pass: two, with two weight rows a tile, ran 0.95x.
constexpr int64_t kTilePassRows = kLanes;
constexpr int kTileP1 = 6, kTileP2 = 2;
#endif

// acc + the sums of each 32-bit lane's four products of w's unsigned bytes and x's signed ones.
#if defined(PKV_TILE_VNNI) && defined(__AVX512F__)
inline vin dpbusd(vin acc, vin w, vin x) {
  return (vin)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
}
#elif defined(PKV_TILE_VNNI)
inline vin dpbusd(vin acc, vin w, vin x) {
  return (vin)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
}
#endif

// x's bytes with the signs of w's: vpmaddubsw of |w| (unsigned) and these is w x.
#if defined(__AVX512F__)
inline vin signs_of(vin x, vin w) {
  return (vin)_mm512_mask_sub_epi8((__m512i)x, _mm512_movepi8_mask((__m512i)w),
                                   _mm512_setzero_si512(), (__m512i)x);
}
#else
inline vin signs_of(vin x, vin w) { return (vin)_mm256_sign_epi8((__m256i)x, (__m256i)w); }
#endif

inline vin loadi(const int32_t* p) {
  vin v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int kTileMaxP = 12;  // weight rows a thread decodes at a time

inline vin broadcast_codes(const uint8_t* codes) {  // four codes into every 32-bit lane
  int32_t four;
  std::memcpy(&four, codes, 4);
  return vin{} + four;
}

// Where a signed type's codes sit in TileWeights::codes, after their magnitudes.
constexpr int64_t kSignedCodes = kTileMaxP * kChunk;

// P weight rows' codes for a chunk of inputs, with a scale and an offset per S of them (a
// signed type: the codes' magnitudes, then the codes).
struct TileWeights {
  alignas(64) uint8_t codes[2 * kTileMaxP * kChunk];
  alignas(64) float dw[kTileMaxP * kChunk / 16];
  alignas(64) float mw[kTileMaxP * kChunk / 16];
};

// Rows of x for one pass, transposed: q [K / 4][W] holds inputs 4g..4g + 3 of row j in the
// 32-bit lane j of vector g (W lanes, zero past the pass's rows); per 16 inputs t, d [t][W] is
// each row's dx and s [t][W] dx times the sum of those 16 q.
struct TileX {
  std::vector<int32_t> q;
  std::vector<float> d, s;
  int64_t W = 0;
};

// Rows [m0, m0 + rows) of x (in int8 per 32 inputs: x32) as passes of W lanes each (one
// TileX a pass, kTilePassRows rows apart; lanes past `rows` zero); split over the threads by
// pass and inputs, so that each writes whole vectors.
void tile_x(const Q8Rows& x32, int64_t m0, int64_t rows, int64_t K, int64_t W,
            std::vector<TileX>& passes) {
  const int64_t count = (rows + kTilePassRows - 1) / kTilePassRows, units = K / 16;
  if (static_cast<int64_t>(passes.size()) < count) passes.resize(count);
  for (int64_t p = 0; p < count; ++p) {
    passes[p].W = W;
    passes[p].q.resize(K / 4 * W);
    passes[p].d.resize(K / 16 * W);
    passes[p].s.resize(K / 16 * W);
  }
  team::parallel_for(0, count * units, 8, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {  // 16 inputs of one pass: four groups of four
      const int64_t p = u / units, i = u % units, first = m0 + p * kTilePassRows;
      const int64_t live = std::min(kTilePassRows, m0 + rows - first);
      TileX& t = passes[p];
      for (int64_t g = 4 * i; g < 4 * i + 4; ++g)
        for (int64_t m = 0; m < W; ++m) {
          int32_t four = 0;
          if (m < live) std::memcpy(&four, x32.q.data() + (first + m) * K + 4 * g, 4);
          t.q[g * W + m] = four;
        }
      for (int64_t m = 0; m < W; ++m) {
        const float dx = m < live ? x32.d[(first + m) * (K / 32) + i / 2] : 0.f;
        t.d[i * W + m] = dx;
        t.s[i * W + m] = m < live ? dx * x32.bsums[(first + m) * (K / 16) + i] : 0.f;
      }
    }
  });
}

// A type's reader: values [v0, v0 + count) of a weight row (whole blocks) as codes, with each S
// values' scale dw and, for a TileOffset::kMin type, offset mw (count / S of each).
using TileDecoder = void (*)(const uint8_t* row, int64_t v0, int64_t count, uint8_t* codes,
                             float* dw, float* mw);

// How a type's offset mw enters a sub-block's dot dx (dw (c . q) + mw sum q): kMin, its own
// (Q4_1, Q5_1, the K-quants' mins); kZero, a code z of value 0 (mw = -z dw: Q4_0, Q5_0, Q6_K,
// Q8_0 + 128), taken as dw (dx (c . q) - z sx): z sx once per vector of x, a multiply-add
// fewer per weight row and vector of x than mw's own; kSigned, none (signed codes).
enum class TileOffset { kMin, kZero, kSigned };

inline void store_codes(uint8_t* to, __m256i c) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), c);
}

// Q4_0 / Q4_1: value j the low nibble of byte j, j + 16 its high nibble.
template <bool kMin>
struct Q4Tile {
  static constexpr int64_t kBytes = kMin ? 20 : 18;
  static constexpr float kZero = kMin ? 0.f : 8.f;  // Q4_0's code of value 0
  static __m256i codes(const uint8_t* b) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kMin ? 4 : 2)));
    return low_bits(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), 0xF);
  }
  static float offset(const uint8_t* b) { return half(b + 2); }  // Q4_1's m (kMin types only)
};

// Q8_0 with VNNI: its signed codes + 128.
struct Q8Tile {
  static constexpr int64_t kBytes = 34;
  static constexpr float kZero = 128.f;
  static __m256i codes(const uint8_t* b) {
    return _mm256_xor_si256(load256(b + 2), _mm256_set1_epi8(-128));
  }
};

// The 32-value types (Q5_0 / Q5_1 as ggml_q8_cpu.cpp reads them): a block's codes, d, offset.
template <typename Codes>
void tile_block32(const uint8_t* row, int64_t v0, int64_t count, uint8_t* codes, float* dw,
                  float* mw) {
  const uint8_t* b = row + v0 / 32 * Codes::kBytes;
  for (int64_t i = 0; i < count / 32; ++i, b += Codes::kBytes) {
    store_codes(codes + 32 * i, Codes::codes(b));
    dw[i] = half(b);
    if constexpr (Codes::kZero == 0.f) mw[i] = Codes::offset(b);  // else kZero's
  }
}

// Q8_0 without VNNI, whose codes + 128 would overflow vpmaddubsw's pairs: the codes'
// magnitudes (unsigned bytes, -128 as 128) and, kSignedCodes on, the codes themselves, whose
// signs x takes (tile_dots); both kept, not derived per row of x: 1.05-1.15x.
void tile_q8_signed(const uint8_t* row, int64_t v0, int64_t count, uint8_t* codes, float* dw,
                    float*) {
  const uint8_t* b = row + v0 / 32 * Q8Tile::kBytes;
  for (int64_t i = 0; i < count / 32; ++i, b += Q8Tile::kBytes) {
    const __m256i c = load256(b + 2);
    store_codes(codes + 32 * i, _mm256_abs_epi8(c));
    store_codes(codes + kSignedCodes + 32 * i, c);
    dw[i] = half(b);
  }
}

template <typename Codes, int... R>
inline void store_runs(const uint8_t* b, uint8_t* codes, std::integer_sequence<int, R...>) {
  (store_codes(codes + 32 * R, Codes::template run<R>(b)), ...);
}

// Q4_K / Q5_K: eight runs of 32 values, each with its 6-bit scale and min.
template <bool kFifth>
void tile_k4(const uint8_t* row, int64_t v0, int64_t count, uint8_t* codes, float* dw,
             float* mw) {
  using Codes = K4Int<kFifth>;
  const uint8_t* b = row + v0 / 256 * Codes::kBytes;
  for (int64_t i = 0; i < count / 256; ++i, b += Codes::kBytes) {
    store_runs<Codes>(b, codes + 256 * i, std::make_integer_sequence<int, 8>{});
    k4_scales(b + 4, half(b), half(b + 2), dw + 8 * i, mw + 8 * i);
  }
}

// Q6_K: sixteen runs of 16 values, each with its int8 scale.
void tile_q6k(const uint8_t* row, int64_t v0, int64_t count, uint8_t* codes, float* dw,
              float*) {
  const uint8_t* b = row + v0 / 256 * Q6KInt::kBytes;
  for (int64_t i = 0; i < count / 256; ++i, b += Q6KInt::kBytes) {
    store_runs<Q6KInt>(b, codes + 256 * i, std::make_integer_sequence<int, 8>{});
    const vf16 scales = widen_i8(reinterpret_cast<const int8_t*>(b + 192)) * half(b + 208);
    store16(dw + 16 * i, scales);  // as Q6KCodes::decode widens them
  }
}

// A tile type: its reader, how its offset enters (and for TileOffset::kZero the code of value
// 0), the values per scale, and without VNNI the groups of four inputs whose vpmaddubsw pairs
// sum in int16 (G x 2 x largest code x 127 below 2^15: 4-bit codes 8, 5-bit 4; Q6_K's 6-bit
// codes, the one 16-value type, two: tile_part gives them by their values).
struct TileType {
  TileDecoder decode = nullptr;  // nullptr: a type this kernel does not take
  TileOffset offset = TileOffset::kMin;
  float zero = 0.f;
  int values = 32;
  int groups = 4;
};

TileType tile_type(int64_t type) {
  constexpr TileOffset kMin = TileOffset::kMin, kZero = TileOffset::kZero;
  switch (type) {
    case Q4_0: return {tile_block32<Q4Tile<false>>, kZero, Q4Tile<false>::kZero, 32, 8};
    case Q4_1: return {tile_block32<Q4Tile<true>>, kMin, 0.f, 32, 8};
    case Q5_0: return {tile_block32<Q5Int<false>>, kZero, Q5Int<false>::kZero};
    case Q5_1: return {tile_block32<Q5Int<true>>, kMin};
    case Q8_0: return kTileVnni ? TileType{tile_block32<Q8Tile>, kZero, Q8Tile::kZero}
                                : TileType{tile_q8_signed, TileOffset::kSigned};
    case Q4_K: return {tile_k4<false>, kMin, 0.f, 32, 8};
    case Q5_K: return {tile_k4<true>, kMin};
    case Q6_K: return {tile_q6k, kZero, Q6KInt::kZero, 16};
    default: return {};
  }
}

// dots[i][v] = the dot products of S codes of weight row i (from `codes`, a row every kChunk)
// with S inputs of each row of x in vector v (x^T from xq), one row of x a 32-bit lane.
template <int P, int V, int S, TileOffset O, int G>
__attribute__((always_inline)) inline void tile_dots(const uint8_t* codes, const int32_t* xq,
                                                     vin (&dots)[P][V]) {
#pragma GCC unroll 12
  for (int i = 0; i < P; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) dots[i][v] = vin{};
#if defined(PKV_TILE_VNNI)
#pragma GCC unroll 8
  for (int g = 0; g < S / 4; ++g) {
    vin xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) xv[v] = loadi(xq + (g * V + v) * kLanes);
#pragma GCC unroll 12
    for (int i = 0; i < P; ++i) {
      const vin wb = broadcast_codes(codes + i * kChunk + 4 * g);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) dots[i][v] = dpbusd(dots[i][v], wb, xv[v]);
    }
  }
#else
  if constexpr (O == TileOffset::kSigned) {
    // Signed codes (Q8_0): |w| times x with w's sign, pairs of products up to 2 x 128 x 127,
    // widened every group.
#pragma GCC unroll 8
    for (int g = 0; g < S / 4; ++g)
#pragma GCC unroll 12
      for (int i = 0; i < P; ++i) {
        const vin magnitude = broadcast_codes(codes + i * kChunk + 4 * g);
        const vin wb = broadcast_codes(codes + kSignedCodes + i * kChunk + 4 * g);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v)
          dots[i][v] += widen(maddubs(magnitude, signs_of(loadi(xq + (g * V + v) * kLanes), wb)));
      }
    return;
  }
  // vpmaddubsw's pairs summed in int16 over G groups of four inputs before vpmaddwd widens
  // them (TileType::groups), a group's x held across the P rows: G = 8 against 4 for 4-bit
  // codes ran 1.08x.
#pragma GCC unroll 4
  for (int g0 = 0; g0 < S / 4; g0 += G) {
    vsn pairs[P][V];
#pragma GCC unroll 8
    for (int g = g0; g < g0 + G; ++g) {
      vin xv[V];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) xv[v] = loadi(xq + (g * V + v) * kLanes);
#pragma GCC unroll 12
      for (int i = 0; i < P; ++i) {
        const vin wb = broadcast_codes(codes + i * kChunk + 4 * g);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
          const vsn prod = maddubs(wb, xv[v]);
          pairs[i][v] = g == g0 ? prod : pairs[i][v] + prod;
        }
      }
    }
#pragma GCC unroll 12
    for (int i = 0; i < P; ++i)
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) dots[i][v] += widen(pairs[i][v]);
  }
#endif
}

// acc[i][v] += weight row i's chunk of `count` inputs from k0 against vector v of x^T, S inputs
// to a scale: per four inputs one broadcast of each row's codes into P x V dot products.
// `zero`: the code of value 0 (TileOffset::kZero).
template <int P, int V, int S, TileOffset O, int G>
__attribute__((always_inline)) inline void tile_chunk(const TileWeights& w, const TileX& x,
                                                      int64_t k0, int64_t count, float zero,
                                                      vfn (&acc)[P][V]) {
  const int32_t* xq = x.q.data() + k0 / 4 * V * kLanes;
  for (int64_t s = 0; s < count; s += S) {
    vin dots[P][V];
    tile_dots<P, V, S, O, G>(w.codes + s, xq, dots);
    xq += S / 4 * V * kLanes;
    const int64_t t = (k0 + s) / 16;  // x's 16 inputs at the sub-block's start
    vfn dx[V], sx[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      dx[v] = loadv(x.d.data() + (t * V + v) * kLanes);
      if constexpr (O != TileOffset::kSigned) {
        sx[v] = loadv(x.s.data() + (t * V + v) * kLanes);
        if constexpr (S == 32) sx[v] += loadv(x.s.data() + ((t + 1) * V + v) * kLanes);
        if constexpr (O == TileOffset::kZero) sx[v] *= -zero;
      }
    }
    const int64_t j = s / S;
#pragma GCC unroll 12
    for (int i = 0; i < P; ++i) {
      const float dw = w.dw[i * (kChunk / 16) + j];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        const vfn dot = __builtin_convertvector(dots[i][v], vfn);
        if constexpr (O == TileOffset::kZero) {
          acc[i][v] += dw * (dot * dx[v] + sx[v]);
        } else {
          acc[i][v] += dot * (dw * dx[v]);
          if constexpr (O == TileOffset::kMin) acc[i][v] += w.mw[i * (kChunk / 16) + j] * sx[v];
        }
      }
    }
  }
}

// Rows [n0, n1) of part p through `passes` passes of x (x^T in xs; M rows in all, y their
// first row's outputs), P weight rows at a time, kChunk inputs at a time: each chunk of the
// tile's rows is decoded once for every pass (one pass at a time decoded it again for each:
// at 64 rows, AVX2's eight passes spent ~30% of their time decoding Q5_0).
template <int P, int V, int S, TileOffset O, int G>
void tile_rows(const Part& p, TileDecoder decode, float zero, int64_t n0, int64_t n1,
               const TileX* xs, int64_t passes, int64_t M, int64_t K, const float* bias, float* y,
               int64_t ldy) {
  TileWeights w;
  PassOutputs<P, V, 8 * P> out(passes, n0);
  for (int64_t n = n0; n < n1; n += P) {
    const int64_t rows = std::min<int64_t>(P, n1 - n);
    out.zero();
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t count = std::min(kChunk, K - k0);
      for (int64_t i = 0; i < P; ++i) {
        float* dw = w.dw + i * (kChunk / 16);
        float* mw = w.mw + i * (kChunk / 16);
        if (i >= rows) {  // rows past the part's end: zero scales, whatever the codes
          std::fill(dw, dw + kChunk / 16, 0.f);
          std::fill(mw, mw + kChunk / 16, 0.f);
          continue;
        }
        const uint8_t* row = p.data + (n + i) * p.stride;
        decode(row, k0, count, w.codes + i * kChunk, dw, mw);
        if (k0 + kChunk < K)  // the row's next chunk, or the next tile's row's first one
          prefetch_values(p, row, k0 + kChunk, std::min(kChunk, K - k0 - kChunk));
        else if (n + P + i < n1)
          prefetch_values(p, row + P * p.stride, 0, std::min(kChunk, K));
      }
      out.each([&](int64_t x, vfn (&acc)[P][V]) {
        tile_chunk<P, V, S, O, G>(w, xs[x], k0, count, zero, acc);
      });
    }
    out.put(n, rows, n + rows == n1, kTilePassRows, M, bias, y, ldy);
  }
}

template <int S, TileOffset O, int G>
void tile_rows_of(const Part& p, TileDecoder decode, float zero, int64_t n0, int64_t n1,
                  const TileX* xs, int64_t passes, int64_t M, int64_t K, const float* bias,
                  float* y, int64_t ldy) {
  if (xs[0].W == kLanes)
    tile_rows<kTileP1, 1, S, O, G>(p, decode, zero, n0, n1, xs, passes, M, K, bias, y, ldy);
  else
    tile_rows<kTileP2, 2, S, O, G>(p, decode, zero, n0, n1, xs, passes, M, K, bias, y, ldy);
}

void tile_part(const Part& p, int64_t n0, int64_t n1, const TileX* xs, int64_t passes,
               int64_t M, int64_t K, const float* bias, float* y, int64_t ldy) {
  const TileType t = tile_type(p.type);
  const auto rows_of = [&]<int S, TileOffset O, int G = 4>() {
    if constexpr (!kTileVnni && S == 32 && O != TileOffset::kSigned) {
      if (t.groups == 8)
        return tile_rows_of<S, O, 8>(p, t.decode, t.zero, n0, n1, xs, passes, M, K, bias, y, ldy);
    }
    tile_rows_of<S, O, G>(p, t.decode, t.zero, n0, n1, xs, passes, M, K, bias, y, ldy);
  };
  if (t.values == 16) return rows_of.template operator()<16, TileOffset::kZero, 2>();  // Q6_K
  switch (t.offset) {
    case TileOffset::kSigned: return rows_of.template operator()<32, TileOffset::kSigned>();
    case TileOffset::kZero: return rows_of.template operator()<32, TileOffset::kZero>();
    case TileOffset::kMin: return rows_of.template operator()<32, TileOffset::kMin>();
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias), W the parts' rows one after another, x in int8 per 32
// inputs (x32): passes of up to kTilePassRows rows, transposed once in groups that go through
// the weights together (group_passes), each group split by weight rows between threads.
void tile_linear(const std::vector<Part>& ps, const Q8Rows& x32, int64_t M, int64_t K,
                 const float* bias, float* y, int64_t N) {
  // The caller's buffers, reused; named by a reference so that the team's threads read this
  // thread's, not their own thread_local ones.
  thread_local std::vector<TileX> transposed;
  std::vector<TileX>& xs = transposed;
  // x^T a pass: K x W bytes of codes, K / 16 x W scales and sums
  in_groups(M, kTilePassRows, [&](int64_t W) { return K * W * 3 / 2; },
            [&](int64_t m0, int64_t rows, int64_t W) {
    const int64_t passes = (rows + kTilePassRows - 1) / kTilePassRows;
    tile_x(x32, m0, rows, K, W, xs);
    // One loop over every part's rows: a thread's share may span two parts.
    team::parallel_for(0, rows_of(ps), 16, [&](int64_t a, int64_t b) {
      int64_t first = 0;
      for (const Part& p : ps) {
        const int64_t lo = std::max(a, first), hi = std::min(b, first + p.rows);
        if (lo < hi)
          tile_part(p, lo - first, hi - first, xs.data(), passes, rows, K,
                    bias != nullptr ? bias + p.col : nullptr, y + m0 * N + p.col, N);
        first += p.rows;
      }
    });
  });
}

}  // namespace
#endif

// Whether a part of ggml type `type` takes the tile kernel at `rows` rows of x with int8
// activations (each part of a layer on its own): where the type has a reader, from 5 rows
// (12 for the K-quants), any number of rows. Elsewhere the GEMVs and the float GEMM keep them
// (a tile's cost hardly falls with fewer rows). Two threads, against the kernels before them,
// at 4 / 8 / 16 / 64 rows: AVX-512 (VNNI) Q5_0 and Q4_1 3072 x 576 1.0-1.2x / 1.6-1.8x /
// 1.8-2.2x / 1.7x, the Q8_0 head 49152 x 576 1.1x / 1.6x / 1.9x / 1.7-1.9x, Q4_K and Q6_K
// 576 x 1536 at 8 / 12 / 16 / 64 rows 0.7x / 1.0-1.1x / 1.2-1.3x / 1.4-1.5x, 8B shapes (Q4_K
// 14336 x 4096, Q6_K 4096 x 14336) 1.2x / 1.6-1.7x at 12 / 16 rows, 1.9-2.2x at 128-512
// (prefill: against the float GEMM there; Q5_0 and Q8_0 1.2-1.7x), and without VNNI alike
// (Q5_0 1.3-1.6x at 16-512 rows, Q4_K 1.3-1.8x); AVX2 Q5_0 1.0x / 2.1x / 1.5x / 1.2x, Q4_1
// 1.0x / 4.9x / 1.9x / 1.2x. With a chunk's decode shared by a group of passes, AVX2's Q4_K
// and Q6_K tiles against their int8 GEMV at 12 / 16 / 64 / 128 rows 1.0-1.1x / 1.45-1.6x /
// 1.7-1.9x / 1.7-1.9x, and the 32-value types and K-quants at 256-512 rows 1.6-2.1x the
// float GEMM that took them past 128 rows. AVX2's Q8_0 (signed codes) against the float
// kernels at 5 / 8 / 16 / 64 / 128 rows 1.0-1.1x / 1.3-1.75x / 1.35-1.4x / 1.4-1.45x /
// 1.4-1.5x (1536 x 576, 576 x 1536, the 49152 x 576 head), the float GEMM at 256-512 rows
// 1.45-1.7x (896- and 4096-wide layers).
inline bool int8_tile(int64_t type, int64_t rows) {
#if defined(__AVX2__)
  const bool k_quant = format(type).values == 256;
  return tile_type(type).decode != nullptr && rows >= (k_quant ? 12 : 5);
#else
  (void)type, (void)rows;
  return false;
#endif
}

// Whether the tiles take a part of ggml type `type` at `rows` rows: where int8_tile says, but
// not where the grouped GEMV (faster at few rows) takes it.
inline bool int8_tile_part(int64_t type, int64_t rows) {
  return int8_tile(type, rows) && !int8_grouped(type, rows);
}

}  // namespace ggml
