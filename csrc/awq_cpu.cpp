// 4-bit AWQ linear layers on CPU: y = x @ W with W kept as 4-bit codes.
//
//   x       [M, K]               float32, contiguous
//   codes   [N' / 32, K / 8, 32] int32: output columns in tiles of 32 (N' = N rounded up,
//                                padding columns hold zeros); word (t, b, j) holds column
//                                32t + j for the 8 inputs 8b..8b+7, input 8b+i in the 4 bits
//                                from (3 + 4i) mod 32 upwards (input 8b+7 wraps from bit 31)
//   s, zs   [N' / 32, K / G, 32] float32 scale and zero * scale, W[k, n] = q s - zs, by tile
//                                (each tile reads its codes and scales front to back); zs
//                                empty: zs = 8 s (a GGUF's Q4_0, w = d (q - 8), kept at 5 bits
//                                a weight instead of 6)
// or, a GGUF's Q4_K kept near its own size (4.75 bits a weight against the form above's 6 and
// the file's 4.5), s = d sc and zs = dmin m:
//   s       [N' / 32, K / G, 2, 32] uint8: per group its 32 columns' 6-bit scale codes sc, then
//                                their min codes m (one cache line)
//   zs      [N' / 32, K / 8G, 2, 32] float32: per 8 groups (a super-block of 256 inputs) the
//                                columns' d, then their dmin
// d and dmin are float16 values and sc, m below 64, so d sc and dmin m are exact in float32:
// both forms give the same products, bit for bit.
//
// A code becomes a float without a conversion instruction. One rotation brings two fields to
// bits 15..22 of a float's mantissa (four rotations a word): input L (odd) at 15..18, input H
// (even) at 19..22. Masked and given the exponent of 16, the bits read v = 16 + qH + qL / 16
// exactly, and v with bits 15..18 cleared reads f = 16 + qH: three logic instructions make
// the two floats (an and-or each, as the GEMM's panels are made, would take four), and
//   xL qL + xH qH = 16 xL v + (xH - 16 xL) f - 16 xH.
// The GEMV multiplies v and f by x rewritten so (xt below: 16 xL at L, xH - 16 xL at H, once
// per call) and takes the constant out per group and row with the sums of x:
//   sum_{k in g} x_k W[k, n] = s (acc - c) - zs sum x_k,   c = 16 sum_{even k in g} x_k,
// in float32: against float64, the error stays within 5e-6 of sum |x W| even for activations
// with a large offset or rare 300x outliers (the earlier reading, 256 + q for odd inputs, had
// up to 1.4e-5), far below 4-bit quantization error.
//
// awq_gemv is a fused dequantize-GEMV over chunks of up to 8 rows: each chunk reads every code
// once, as one sequential stream per tile, and unpacks it once for all rows. At one or two
// rows, the v and f terms feed separate accumulators: 4+ independent FMA chains hide the FMA
// latency.
// awq_gemm is the many-row path: the tiles are split over threads, and each thread decodes a
// panel of one tile (up to kPanelK inputs x 32 columns, 32 KB of float32, in L1) once and
// multiplies every row by it with a register-blocked micro-kernel (panel_rows below: rows x
// 16 or 32 columns of accumulators, x broadcast, FMA), accumulating into y. The weight is
// decoded once per call, as GEMV decodes it once per 8 rows, and never written out whole.
// awq_linear takes the GEMV up to `max_gemv_rows` rows, awq_gemm above; callers pass
// kGemvMaxRows (below; Python reads it as `awq_gemv_max_rows`).
// awq_dequantize writes W^T [K, N] in float32 (for tests and torch fallbacks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "team.h"
#include "vec_math.h"

namespace {

constexpr int64_t kTile = 32;  // output columns per tile: two 16-float vectors
constexpr int64_t kMaxRows = 8;
// Rows up to which callers take the GEMV rather than awq_gemm, as measured in the engine: one
// request's prefill on 4-bit SmolLM2-135M (Zen 5), the two limits' engines alternating, took
// 0.90x as long through the GEMV at 12 rows on AVX2 (1.03x at 16-20, 1.13x at 32) and 0.90x
// at 16 rows on AVX-512 (1.05x at 32). The kernels alone, weights streamed, had the GEMV ahead
// up to 32 rows; the engine's figure decides. The generic build's kernels met at 12-16 rows.
#if defined(__AVX512F__)
constexpr int64_t kGemvMaxRows = 16;
#else
constexpr int64_t kGemvMaxRows = 12;
#endif
// The same with int8 activations (csrc/awq_int8_cpu.cpp, 256-bit code on either flavour).
// AVX2: the int8 GEMV at any rows. Against awq_gemm, two threads, SmolLM2's 576-wide Q4_1
// layers repacked (Zen 5), one layer hot in cache: 1.3-2.5x at 8-12 rows, 1.2-1.6x at 16-128,
// 1.15-1.55x at 256-512; the bundled model in the engine, int8, old vs new build alternated:
// 1.45x at 16 sequences, 1.26x at 64. AVX-512 (its GEMM twice the vector width) keeps the
// float limit: the hot layer had awq_gemm ahead from 8 rows (0.7-0.99x), but in the engine,
// weights streamed, awq_gemm from 7 rows ran 8 and 16 sequences at 0.85x and 0.98x.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kInt8GemvMaxRows = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kInt8GemvMaxRows = kGemvMaxRows;
#endif
constexpr int64_t kPrefetchWords = 16 * kTile;  // 2 KB ahead in the code stream
constexpr float kLowBase = 256.f, kHighBase = 16.f;
constexpr uint32_t kLowExp = 0x43800000;   // 256.0f: mantissa bit 15 weighs 1
constexpr uint32_t kHighExp = 0x41800000;  // 16.0f: mantissa bit 19 weighs 1
constexpr uint32_t kLowField = 0xFu << 15, kHighField = 0xFu << 19;

struct Shape {
  int64_t K, N, NT, G;  // N real columns, NT tiles of 32
};

constexpr float kSymmetricZero = 8.f;  // zs = 8 s where zs is empty
constexpr int64_t kSuperGroups = 8;    // groups per Q4_K super-block

// A layer's scales and zero terms in either form (see the top), read a group at a time.
struct GroupScales {
  const float* s;        // float form: s; Q4_K form: d and dmin
  const float* zs;       // float form: zs, or nullptr for 8 s
  const uint8_t* codes;  // Q4_K form: sc and m; nullptr in the float form

  // Sixteen columns' scales and zero terms: group `tile_group` (t NG + g), columns from `col`.
  void group16(int64_t tile_group, int64_t col, vf16& sv, vf16& zv) const {
    if (codes == nullptr) {
      const int64_t at = tile_group * kTile + col;
      sv = load16(s + at);
      zv = zs ? load16(zs + at) : kSymmetricZero * sv;
      return;
    }
    const uint8_t* c = codes + 2 * tile_group * kTile + col;
    const float* d = s + 2 * (tile_group / kSuperGroups) * kTile + col;
    sv = load16(d) * to_floats(widen_u8(c));
    zv = load16(d + kTile) * to_floats(widen_u8(c + kTile));
  }

#if defined(__AVX2__)
  // Eight columns of the same, for the integer GEMVs (csrc/awq_int16_cpu.cpp, awq_int8_cpu.cpp).
  void group8(int64_t tile_group, int64_t col, __m256& sv, __m256& zv) const {
    if (codes == nullptr) {
      const int64_t at = tile_group * kTile + col;
      sv = _mm256_loadu_ps(s + at);
      zv = zs ? _mm256_loadu_ps(zs + at) : _mm256_mul_ps(sv, _mm256_set1_ps(kSymmetricZero));
      return;
    }
    const uint8_t* c = codes + 2 * tile_group * kTile + col;
    const float* d = s + 2 * (tile_group / kSuperGroups) * kTile + col;
    const auto widen = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(p))));
    };
    sv = _mm256_mul_ps(_mm256_loadu_ps(d), widen(c));
    zv = _mm256_mul_ps(_mm256_loadu_ps(d + kTile), widen(c + kTile));
  }
#endif

  // The GEMVs stream codes, scales and zero terms once, from memory at batch 1: the hardware
  // prefetchers alone left the cores waiting (30 layers' AWQ GEMVs of SmolLM2 on two AVX2
  // threads: 8.5 ms without software prefetches, 6.1 ms with), so the kernels ask ahead, two
  // groups on.
  void prefetch(int64_t tile_group) const {
    const int64_t ahead = tile_group + 2;
    if (codes != nullptr) {
      __builtin_prefetch(codes + 2 * ahead * kTile);
      if (ahead % kSuperGroups == 0)  // the next super-block's d and dmin: four lines
        for (int64_t i = 0; i < 4; ++i)
          __builtin_prefetch(s + 2 * (ahead / kSuperGroups) * kTile + 16 * i);
      return;
    }
    for (const float* p : {s, zs}) {
      if (p == nullptr) continue;
      __builtin_prefetch(p + ahead * kTile);
      __builtin_prefetch(p + ahead * kTile + 16);
    }
  }
};

// The two forms' scales and zero terms (see the top), checked against the tiles' shape.
void check_scales(const at::Tensor& scales, const at::Tensor& zs, int64_t NT, int64_t NG) {
  if (scales.scalar_type() == at::kByte) {
    TORCH_CHECK(NG % kSuperGroups == 0 && scales.is_contiguous() && zs.is_contiguous() &&
                    zs.scalar_type() == at::kFloat &&
                    scales.sizes() == at::IntArrayRef({NT, NG, 2, kTile}) &&
                    zs.sizes() == at::IntArrayRef({NT, NG / kSuperGroups, 2, kTile}),
                "Q4_K scales must be contiguous uint8 [N' / 32, K / group, 2, 32] and zs "
                "float32 [N' / 32, K / (8 group), 2, 32]");
    return;
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  (zs.numel() == 0 || zs.sizes() == scales.sizes()) && zs.is_contiguous() &&
                  zs.scalar_type() == at::kFloat && scales.dim() == 3 &&
                  scales.size(0) == NT && scales.size(1) == NG && scales.size(2) == kTile,
              "scales and zs must be contiguous float32 [N' / 32, K / group, 32] (zs may be "
              "empty: 8 x the scales)");
}

// The scales and zero terms as the kernels read them (after `check`).
GroupScales group_scales(const at::Tensor& scales, const at::Tensor& zs) {
  if (scales.scalar_type() == at::kByte)
    return {zs.data_ptr<float>(), nullptr, scales.data_ptr<uint8_t>()};
  return {scales.data_ptr<float>(), zs.numel() ? zs.data_ptr<float>() : nullptr, nullptr};
}

Shape check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zs,
            int64_t n, int64_t group) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kInt && codes.is_contiguous() &&
                  codes.size(2) == kTile,
              "codes must be contiguous int32 [N' / 32, K / 8, 32]");
  const int64_t NT = codes.size(0), K = codes.size(1) * 8;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0 && n > (NT - 1) * kTile &&
                  n <= NT * kTile,
              "group size must be a multiple of 8 dividing K, and N fit the tiles");
  check_scales(scales, zs, NT, K / group);
  return {K, n, NT, group};
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.size(1) == K, "x must be contiguous float32 [M, K]");
}

// Bits 15..22 of the word rotated left by R (the rest is garbage the caller masks off). Only
// R = 16 needs a true rotation (input 7's field wraps from bit 31 to bit 0); for R = 8 and 24
// one shift brings the same bits; R = 16 swaps the words' halves, one byte shuffle (AVX2 has no
// rotate instruction: shifts and an or took three instructions per 8-lane half).
template <int R>
inline vu16 fields(vu16 w) {
  if constexpr (R == 0) {
    return w;
  } else if constexpr (R == 8) {
    return w << 8;
  } else if constexpr (R == 24) {
    return w >> 8;
  } else {
    static_assert(R == 16);
    return swap_halves(w);
  }
}

// Where x's input k of row m of a pass of M rows lies (see `prepare_x`): AVX-512 puts a
// pass's rows side by side, an input's M values together, so that a block's broadcasts for
// every row come at fixed offsets from one pointer (row after row, each row's address took
// scalar instructions and spilled from 3 rows: 7-16 rows 1.06-1.09x); AVX2 keeps rows after
// one another (side by side cost it 5% at batch 6, its 16 registers spilling either way).
constexpr bool kRowsSideBySide = kLanes == 16;
constexpr int64_t x_at(int64_t k, int64_t m, int64_t M, int64_t K) {
  return kRowsSideBySide ? k * M + m : m * K + k;
}

// Every row's v and f terms for halves [p0, p1) of a tile (see `step`), row by row.
template <int L, int H, int64_t S, int64_t M>
[[gnu::always_inline]] inline void multiply(const float* xt, int64_t K, const vf16 (&v)[2],
                                            const vf16 (&f)[2], vf16 (&acc)[S][M][2],
                                            int64_t p0, int64_t p1) {
  for (int64_t m = 0; m < M; ++m) {
    const float xl = xt[x_at(L, m, M, K)], xh = xt[x_at(H, m, M, K)];
    for (int64_t p = p0; p < p1; ++p) {  // two statements: two FMAs (no reassociation)
      acc[0][m][p] += xl * v[p];
      acc[S - 1][m][p] += xh * f[p];
    }
  }
}

// The two inputs a word rotated left by R puts at bits 15..18 (L) and 19..22 (H), as v and f
// (see the top) times the rewritten xt, into every row's accumulators; with two accumulator
// sets (S = 2, few rows) v and f go to separate ones, for more independent FMA chains.
// One or two rows multiply each half as soon as it is decoded, which keeps their eight
// accumulators in registers (decoding both halves first spilled them: ~15% slower); more
// rows decode both halves, then sweep the rows once (half by half, 8 rows took ~1.3x as long).
// Forced inline: as an ordinary inline function GCC stopped inlining it once the unit grew (a
// scratch copy with one more caller ran the batch-1 GEMV 1.6x slower). The halves' loop is
// unrolled by pragma: GCC otherwise unrolled it only after its scalar replacement of the
// accumulator arrays had given up on the variable half, and at one or two rows (S = 2) the
// accumulators lived on the stack, each FMA chain through a store and a load (AVX-512: the
// GEMV 0.88-0.92x; AVX2 level, as is unrolling `multiply`'s loops too, which at 3-6 rows
// crowded AVX2's 16 registers: 0.88-0.95x).
template <int R, int L, int H, int64_t S, int64_t M>
[[gnu::always_inline]] inline void step(const vu16 (&w)[2], const float* xt, int64_t K,
                                        vf16 (&acc)[S][M][2]) {
  vf16 v[2], f[2];
#pragma GCC unroll 2
  for (int64_t p = 0; p < 2; ++p) {
    const vu16 both = opaque((fields<R>(w[p]) & (kLowField | kHighField)) | kHighExp);
    v[p] = as_floats(both);
    f[p] = as_floats(both & ~kLowField);
    if constexpr (S == 2) multiply<L, H>(xt, K, v, f, acc, p, p + 1);
  }
  if constexpr (S == 1) multiply<L, H>(xt, K, v, f, acc, 0, 2);
}

// Rows [0, M) of y over the 32 columns of tile t: one sequential stream of codes.
template <int64_t M>
void tile_rows(const float* xp, const int32_t* cp, const GroupScales& gs, const float* xsum,
               float* yp, int64_t t, const Shape& s) {
  constexpr int64_t S = M <= 2 ? 2 : 1;
  const int64_t NG = s.K / s.G;
  const int32_t* stream = cp + t * (s.K / 8) * kTile;
  vf16 out[M][2];
  zero(out);
  for (int64_t g = 0; g < NG; ++g) {
    gs.prefetch(t * NG + g);
    vf16 acc[S][M][2];
    zero(acc);
    for (int64_t blk = g * s.G / 8; blk < (g + 1) * s.G / 8; ++blk) {
      const int32_t* words = stream + blk * kTile;
      __builtin_prefetch(words + kPrefetchWords);
      __builtin_prefetch(words + kPrefetchWords + 16);
      const vu16 w[2] = {load16u(words), load16u(words + 16)};
      const float* x = xp + x_at(blk * 8, 0, M, s.K);
      step<0, 3, 4>(w, x, s.K, acc);
      step<8, 1, 2>(w, x, s.K, acc);
      step<24, 5, 6>(w, x, s.K, acc);
      step<16, 7, 0>(w, x, s.K, acc);
    }
    for (int64_t p = 0; p < 2; ++p) {
      vf16 sv, zv;
      gs.group16(t * NG + g, p * 16, sv, zv);
      for (int64_t m = 0; m < M; ++m) {
        const float* sums = xsum + 2 * (m * NG + g);  // sum x, 16 sum x_H
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

// x as the GEMV multiplies it, and per row and group the sums the GEMV subtracts (see the
// top), in scratch kept by the calling thread: xt, M x K values in passes of up to kMaxRows
// rows laid out as `x_at` says (16 x_L at each odd input L, x_H - 16 x_L at the even input H
// that shares L's word rotation: H = L + 1, and 0 with 7; see `step`'s calls), then sums
// [M, K / G, 2] (sum x, 16 sum x_H). At batch 1 the two passes and their
// allocations took ~0.6 us of each ~20 us GEMV; one pass into memory that stays allocated,
// 8 inputs at a time where AVX is (a lane rotation and a blend), takes ~0.06 us at K = 576.
struct Prepared {
  const float* xt;
  const float* sums;
};

#if defined(__AVX__)
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// One group of one row: its rewritten inputs into tg, `stride` floats apart, its two sums
// into sums[0, 2).
inline void prepare_group(const float* xg, int64_t G, float* tg, int64_t stride, float* sums) {
  const v8i prev_lane = {7, 0, 1, 2, 3, 4, 5, 6}, even_lane = {-1, 0, -1, 0, -1, 0, -1, 0};
  v8f lanes = {};
  for (int64_t b = 0; b < G; b += 8) {
    v8f v;
    std::memcpy(&v, xg + b, sizeof v);
    lanes += v;
    const v8f prev = __builtin_shuffle(v, prev_lane);  // lane i: input i - 1 (0: input 7)
    const v8f t = even_lane ? v - 16.f * prev : 16.f * v;
    if (stride == 1)
      std::memcpy(tg + b, &t, sizeof t);
    else
      for (int64_t i = 0; i < 8; ++i) tg[(b + i) * stride] = t[i];
  }
  const float even = (lanes[0] + lanes[2]) + (lanes[4] + lanes[6]);
  sums[0] = even + ((lanes[1] + lanes[3]) + (lanes[5] + lanes[7]));
  sums[1] = 16.f * even;
}
#else  // SSE2, NEON: GCC splits the 8-lane vectors above badly (3x slower than this loop)
inline void prepare_group(const float* xg, int64_t G, float* tg, int64_t stride, float* sums) {
  float lanes[8] = {};
  for (int64_t b = 0; b < G; b += 8) {
    for (int64_t i = 0; i < 8; ++i) lanes[i] += xg[b + i];
    for (int64_t h = 0; h < 8; h += 2) {
      const int64_t l = (h + 7) % 8;
      tg[(b + l) * stride] = 16.f * xg[b + l];
      tg[(b + h) * stride] = xg[b + h] - 16.f * xg[b + l];
    }
  }
  const float even = (lanes[0] + lanes[2]) + (lanes[4] + lanes[6]);
  sums[0] = even + ((lanes[1] + lanes[3]) + (lanes[5] + lanes[7]));
  sums[1] = 16.f * even;
}
#endif

Prepared prepare_x(const float* x, int64_t M, int64_t K, int64_t G) {
  thread_local std::vector<float> scratch;  // grows to the largest call, never shrinks
  const int64_t NG = K / G;
  scratch.resize(std::max<size_t>(scratch.size(), M * K + 2 * M * NG));
  float* xt = scratch.data();
  float* sums = xt + M * K;
  for (int64_t m = 0; m < M; ++m) {  // passes of kMaxRows rows from m0, each [K, R] or [R, K]
    const int64_t m0 = m / kMaxRows * kMaxRows, R = std::min(kMaxRows, M - m0);
    float* pass = xt + m0 * K;
    for (int64_t g = 0; g < NG; ++g)
      prepare_group(x + m * K + g * G, G, pass + x_at(g * G, m - m0, R, K),
                    kRowsSideBySide ? R : 1, sums + 2 * (m * NG + g));
  }
  return {xt, sums};
}

// All tiles for M rows, split over threads.
template <int64_t M>
void gemv_rows(const float* xp, const int32_t* cp, const GroupScales& gs, const float* xsum,
               float* yp, const Shape& s) {
  team::parallel_for(0, s.NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile_rows<M>(xp, cp, gs, xsum, yp, t, s);
  });
}

#include "panel_gemm_cpu.cpp"

// An AWQ layer's operands, checked once: the decoder keeps them for every step. Checked per
// call, the tensors' metadata came from memory each time (after a step's ~90 MB of weights
// has streamed through the caches), ~3% of a batch-1 step of 4-bit SmolLM2.
struct AwqOperands {
  const int32_t* codes;
  GroupScales scales;
  const float* bias;  // none: no bias
  Shape shape;
};

AwqOperands awq_operands(const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& zs, const c10::optional<at::Tensor>& bias,
                         int64_t n, int64_t group) {
  const Shape s = check(codes, scales, zs, n, group);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == n),
              "the bias must be contiguous float32 [n]");
  return {codes.data_ptr<int32_t>(), group_scales(scales, zs),
          bias ? bias->data_ptr<float>() : nullptr, s};
}

// y [M, N] = x [M, K] @ W (+ bias), x and y contiguous float32.
void awq_gemv_rows(const float* x, int64_t M, const AwqOperands& w, float* y) {
  const Shape& s = w.shape;
  const int64_t NG = s.K / s.G;
  const Prepared prep = prepare_x(x, M, s.K, s.G);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    with_rows(std::min(kMaxRows, M - m0), [&]<int64_t R>() {
      gemv_rows<R>(prep.xt + m0 * s.K, w.codes, w.scales, prep.sums + 2 * m0 * NG,
                   y + m0 * s.N, s);
    });
  }
  for (int64_t m = 0; w.bias && m < M; ++m)
    for (int64_t j = 0; j < s.N; ++j) y[m * s.N + j] += w.bias[j];
}

}  // namespace

at::Tensor awq_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zs, int64_t n, int64_t group) {
  const AwqOperands w = awq_operands(codes, scales, zs, c10::nullopt, n, group);
  check_x(x, w.shape.K);
  auto y = at::empty({x.size(0), n}, x.options());
  awq_gemv_rows(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
  return y;
}

// The same product as awq_gemv for any number of rows, by decoded panels (see the top).
at::Tensor awq_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& zs, int64_t n, int64_t group) {
  const Shape s = check(codes, scales, zs, n, group);
  check_x(x, s.K);
  const int64_t M = x.size(0), NG = s.K / s.G;
  auto y = at::empty({M, s.N}, x.options());
  if (M == 0) return y;
  const int32_t* cp = codes.data_ptr<int32_t>();
  const GroupScales gs = group_scales(scales, zs);
  // W[k] = s q - zs = s (256 + q) - (256 s + zs) for the fields read as 256 + q (odd k),
  // and with 16 for the others: one FMA a value.
  auto fill = [&](float* panel, int64_t t, int64_t k0, int64_t kc) {
    for (int64_t blk = k0 / 8; blk < (k0 + kc) / 8; ++blk) {
      const int64_t g = blk * 8 / s.G;
      float* rows = panel + (blk * 8 - k0) * kTile;
      for (int64_t h = 0; h < 2; ++h) {
        const vu16 word = load16u(cp + (t * (s.K / 8) + blk) * kTile + h * 16);
        vf16 sv, zv;
        gs.group16(t * NG + g, h * 16, sv, zv);
        const vf16 zlow = sv * kLowBase + zv, zhigh = sv * kHighBase + zv;
        const vu16 r[4] = {fields<16>(word), fields<8>(word), word, fields<24>(word)};
        for (int64_t i = 0; i < 8; ++i) {  // input i: rotation (i + 1) / 2 % 4
          const vu16 ri = r[(i + 1) / 2 % 4];
          const vf16 v = i % 2 ? sv * as_floats((ri & kLowField) | kLowExp) - zlow
                               : sv * as_floats((ri & kHighField) | kHighExp) - zhigh;
          store16(rows + i * kTile + h * 16, v);
        }
      }
    }
  };
  panel_gemm(x.data_ptr<float>(), M, s.K, s.N, y.data_ptr<float>(), fill);
  return y;
}

at::Tensor awq_dequantize(at::Tensor codes, at::Tensor scales, at::Tensor zs,
                             int64_t n, int64_t group) {
  const Shape s = check(codes, scales, zs, n, group);
  const int64_t Np = s.NT * kTile;
  auto w = at::empty({s.K, Np}, codes.options().dtype(at::kFloat));  // W^T, as x @ w wants
  const int32_t* cp = codes.data_ptr<int32_t>();
  const GroupScales gs = group_scales(scales, zs);
  float* wp = w.data_ptr<float>();
  team::parallel_for(0, s.K / 8, 2, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t g = blk * 8 / s.G;
      for (int64_t t = 0; t < s.NT * 2; ++t) {  // t: 16 columns, half a tile
        const vu16 word = load16u(cp + ((t / 2) * (s.K / 8) + blk) * kTile + t % 2 * 16);
        vf16 sv, zv;
        gs.group16((t / 2) * (s.K / s.G) + g, t % 2 * 16, sv, zv);
        float* row = wp + blk * 8 * Np + t * 16;
        // Input i sits in rotation (i + 1) / 2 % 4 below, at bits 15..18 (odd i) or 19..22.
        const vu16 r[4] = {fields<16>(word), fields<8>(word), word, fields<24>(word)};
        for (int64_t i = 0; i < 8; ++i) {
          const vu16 ri = r[(i + 1) / 2 % 4];
          const vu16 bits = i % 2 ? (ri & kLowField) | kLowExp : (ri & kHighField) | kHighExp;
          store16(row + i * Np, sv * (as_floats(bits) - (i % 2 ? kLowBase : kHighBase)) - zv);
        }
      }
    }
  });
  return s.N == Np ? w : w.narrow(1, 0, s.N);
}

// The whole layer for x [..., K] of any float dtype: the fused GEMV up to `max_gemv_rows` rows
// (its activations of `activation_bits` 32, 16 or 8: float, or quantized for
// csrc/awq_int16_cpu.cpp or csrc/awq_int8_cpu.cpp), else awq_gemm; plus the bias; in
// x's dtype. One call from Python per layer (the reshapes and casts in C++ cost a fraction of
// what they cost as Python calls at batch 1).
at::Tensor awq_gemv_int16(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor zs,
                          int64_t n, int64_t group);
at::Tensor awq_gemv_int8(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor zs,
                         int64_t n, int64_t group);

at::Tensor awq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& zs, const c10::optional<at::Tensor>& bias, int64_t n,
                      int64_t group, int64_t max_gemv_rows, int64_t activation_bits) {
  TORCH_CHECK(activation_bits == 32 || activation_bits == 16 || activation_bits == 8,
              "activation_bits must be 32, 16 or 8, got ", activation_bits);
  // A 2-D float32 x (the decoder's) is used as it is: at batch 1 the reshape, casts and view
  // each cost a dispatcher call and a tensor: ~5% of a batch-1 step of 4-bit SmolLM2.
  const bool plain = x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous();
  const at::Tensor x2 = plain ? x : x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  at::Tensor y;
  if (x2.size(0) > max_gemv_rows)
    y = awq_gemm(x2, codes, scales, zs, n, group);
  else if (activation_bits == 16)
    y = awq_gemv_int16(x2, codes, scales, zs, n, group);
  else if (activation_bits == 8)
    y = awq_gemv_int8(x2, codes, scales, zs, n, group);
  else
    y = awq_gemv(x2, codes, scales, zs, n, group);
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  if (plain) return y;
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape).to(x.scalar_type());
}
