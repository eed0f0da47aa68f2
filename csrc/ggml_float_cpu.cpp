// Weights in ggml blocks against float32 x: at few rows each thread walks its share of the
// weight rows once, decoding them in registers (or 256 values at a time into a buffer in L1)
// and taking every row of x through them; at many rows, panels of rows dequantized to float32
// and multiplied by the float32 GEMM. Included by csrc/ggml_cpu.cpp after
// ggml_blocks_cpu.cpp (the block readers and parts).

namespace ggml {
namespace {

// The partial sums of R rows of x against one weight row, held in registers while the row's
// blocks are decoded (taken from and given back to the caller's accumulators). With one
// accumulator a row, every FMA of a one-row GEMV waits for the one before (4 cycles): the
// 8B Q6_K down projection ran at 10 GB/s so, one row as slow as four. Below four rows each
// row keeps kChains accumulators, which callers fill in turn (add<C>), summed at the end.
template <int R, int kMaxChains = 4>
struct RowSums {
  static constexpr int kChains = std::min(kMaxChains, R == 1 ? 4 : (R == 2 ? 2 : 1));
  vf16 a[R][kChains];
  const float* x;
  int64_t ldx;

  RowSums(const vf16* acc, const float* x_, int64_t ldx_) : x(x_), ldx(ldx_) {
    for (int r = 0; r < R; ++r) {
      a[r][0] = acc[r];
      for (int c = 1; c < kChains; ++c) a[r][c] = vf16{};
    }
  }
  // Every row: its chain C += w * x[r][at, at + 16).
  template <int C = 0>
  void add(const vf16& w, int64_t at) {
    for (int r = 0; r < R; ++r) a[r][C % kChains] += w * load16(x + r * ldx + at);
  }
  void store(vf16* acc) const {
    for (int r = 0; r < R; ++r) {
      vf16 sum = a[r][0];
      for (int c = 1; c < kChains; ++c) sum += a[r][c];
      acc[r] = sum;
    }
  }
};

// acc[r] += w[0, count) * x[r * ldx + (0, count)] lane-wise for R rows of x: each vector of
// w is loaded once for the R rows, four vectors a step on RowSums' chains.
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t ldx, int64_t count, vf16* acc) {
  RowSums<R> sums(acc, x, ldx);
  int64_t i = 0;
  for (; i + 64 <= count; i += 64) {
    sums.template add<0>(load16(w + i), i);
    sums.template add<1>(load16(w + i + 16), i + 16);
    sums.template add<2>(load16(w + i + 32), i + 32);
    sums.template add<3>(load16(w + i + 48), i + 48);
  }
  for (; i < count; i += 16) sums.add(load16(w + i), i);
  sums.store(acc);
}

// y[m * ldy + n] for rows n in [n0, n1) of part p and every row m < M of x, the block
// dequantizer `deq` inlined. Each row of x keeps a vector of partial sums over the whole
// weight row (one horizontal sum at its end).
template <typename Deq>
void gemv_rows(const Part& p, Deq deq, int64_t n0, int64_t n1, const float* x, int64_t M,
               int64_t K, const float* bias, float* y, int64_t ldy) {
  alignas(64) float w[kChunk];
  vf16 acc[kMaxRows];
  const int64_t per_chunk = kChunk / p.fmt.values;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = p.data + n * p.stride;
    for (int64_t m = 0; m < M; ++m) acc[m] = vf16{};
    for (int64_t v0 = 0; v0 < K; v0 += kChunk) {
      const int64_t count = std::min(kChunk, K - v0);
      for (int64_t i = 0; i < std::min(per_chunk, count / p.fmt.values); ++i, b += p.fmt.bytes)
        deq(b, w + i * p.fmt.values);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(w, x + m * K + v0, K, count, acc + m);
      for (; m < M; ++m) dot_rows<1>(w, x + m * K + v0, K, count, acc + m);
    }
    const float bn = bias != nullptr ? bias[n] : 0.0f;
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = hsum(acc[m]) + bn;
  }
}

// 16 int8 values widened to floats in registers.
inline vf16 widen_i8(const int8_t* p) {
  vf16 v;
#if defined(__AVX512F__)
  v.p[0] = (vfn)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)(p + 8 * h));
    v.p[h] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
#else
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = p[i];
  v = load16(f);
#endif
  return v;
}

// A Q8_0 block's 32 weights, d q, in registers.
struct Q8Block {
  static constexpr int64_t kBytes = 34;
  static void weights(const uint8_t* b, vf16& w0, vf16& w1) {
    const float d = half(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    w0 = widen_i8(q) * d;
    w1 = widen_i8(q + 16) * d;
  }
  // acc += the block's products with 32 values of x: d (q . x), the scale once a block.
  static void dot(const uint8_t* b, const vf16& x0, const vf16& x1, vf16& acc) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    acc += (widen_i8(q) * x0 + widen_i8(q + 16) * x1) * half(b);
  }
};

// Q8_0 without the buffer: each block's 32 codes widened and scaled in registers, then taken
// through R rows of x (the LM head of many GGUFs: at batch 1 the largest matrix of a step).
template <int R>
inline void q8_0_dot(const uint8_t* row, int64_t blocks, const float* x, int64_t ldx,
                     vf16* acc) {
  RowSums<R> sums(acc, x, ldx);
  for (int64_t i = 0; i < blocks; ++i, row += Q8Block::kBytes) {
    vf16 w0, w1;
    Q8Block::weights(row, w0, w1);
    if (i % 2 == 0) {
      sums.template add<0>(w0, 32 * i);
      sums.template add<1>(w1, 32 * i + 16);
    } else {
      sums.template add<2>(w0, 32 * i);
      sums.template add<3>(w1, 32 * i + 16);
    }
  }
  sums.store(acc);
}

// One row of x for the one-row GEMVs, with its sums over runs of 32 values where the weights'
// decoder reads them (sums32: the K-quants' offsets, once a block) and nullptr elsewhere.
struct XRow {
  const float* x;
  const float* sums32;
};

// Bytes ahead of a step that its weight row is prefetched from where rows are read one at a
// time: the hardware's prefetch alone left a row of 14336 inputs (the 8B down projection) at
// 12-14 GB/s, where x's 14 KB and the weights share a 32 KB L1; with it 20-30 GB/s, as at
// every K.
constexpr int64_t kRowAhead = 2048;

// The weight streams' prefetch hint (__builtin_prefetch's locality): T1, into L2, leaving L1
// to x. Non-temporal prefetches had run 1.05-1.1x T0 on Zen and Ice Lake hosts, and on a
// Sapphire Rapids VM 0.5-0.65x T1 (they stalled the loop: batch-1 decode of the bundled Q4_1
// file, AVX2, int8, 108 against 209-215 tok/s; a Q4_K_M file 101 against 187; a 1B Q4_K_M
// on AVX-512 19 against 28); T0 there ran 0.95-1.05x T1.
constexpr int kRowHint = 2;

// Weight rows are read side by side, W rows a step (kStep bytes of each: a block or a group of
// blocks) at a time, panel after panel (rows are contiguous): a pattern the hardware
// prefetcher does not follow (without software prefetches a Q8_0 LM head of 49152 x 576 ran
// at 0.45x the one-row-at-a-time GEMV). A panel of 2-8 rows up to kStreamPanel bytes
// prefetches, a share each step, the panel that starts at least kStreamAhead bytes past it
// (one short panel ahead is too near); longer panels and rows read one at a time, each row
// its own bytes kRowAhead ahead and, near its end, those of its row in the next panel. Panels
// of 12-64 KB stream too: 4 rows of 8192 inputs (a 1B model's down projection, 22-27 KB)
// read row by row ran at 0.55-0.7x (Q5_K, Q6_K at one row of x on AVX-512), 8B's 14336 at 0.7x.
constexpr int64_t kStreamAhead = 4096, kStreamPanel = 64 << 10;

// The prefetches of a part's panels of W weight rows, set up once a pass: a panel's are a few
// instructions a step, whose bytes take ~10 ns to arrive. kLocality is the stream's hint
// (__builtin_prefetch's: 3 is T0, 0 non-temporal); rows take kRowHint's.
template <int W, int kLocality, int64_t kStep>
class Lookahead {
 public:
  Lookahead(const Part& p, int64_t steps)
      : data_(p.data), stride_(p.stride), stream_(W > 1 && W * p.stride <= kStreamPanel),
        panel_ahead_(W * p.stride + (kStreamAhead - 1) / (W * p.stride) * W * p.stride),
        lines_((W * p.stride + 63) / 64), per_step_((lines_ + steps - 1) / steps) {}

  // Step s's, while the panel from row n is read: a share of the streamed panel, or a row's
  // kStep bytes from kStep / 64 + 1 lines (the next step's first line covers what the last
  // one leaves). (Inlined: a call a step ran 0.57-0.70x.)
  [[gnu::always_inline]] void at(int64_t n, int64_t s) const {
    if (stream_) {
      const uint8_t* panel = data_ + n * stride_ + panel_ahead_;
      for (int64_t l = s * per_step_; l < std::min(lines_, (s + 1) * per_step_); ++l)
        __builtin_prefetch(panel + 64 * l, 0, kLocality);
      return;
    }
    const bool past_row = kStep * s + kRowAhead >= stride_;
    const uint8_t* b = data_ + n * stride_ + kStep * s + kRowAhead +
                       (past_row ? (W - 1) * stride_ : 0);
    for (int w = 0; w < W; ++w, b += stride_)
      for (int64_t l = 0; l <= kStep / 64; ++l) __builtin_prefetch(b + 64 * l, 0, kRowHint);
  }

 private:
  const uint8_t* data_;
  int64_t stride_;
  bool stream_;
  int64_t panel_ahead_;  // bytes from a panel's first row to the panel it streams
  int64_t lines_, per_step_;  // a panel's cache lines, and those a step prefetches
};

// Bytes as GCC vectors: 32 at a time, what one AVX2 register holds (two SSE2 / NEON ones).
typedef uint8_t vb32 __attribute__((vector_size(32)));

inline vb32 load32b(const uint8_t* p) {
  vb32 v;
  std::memcpy(&v, p, 32);
  return v;
}

inline void store32b(uint8_t* p, vb32 v) { std::memcpy(p, &v, 32); }

// The same 32 bytes as 16-bit lanes, for shifts of one instruction (GCC shifts byte vectors
// left by adding them to themselves N times, right by a 16-bit shift and a mask).
typedef uint16_t vh32 __attribute__((vector_size(32)));

// Bytes shifted left by N within 16-bit lanes (the caller masks the bits that crossed into
// the next byte).
template <int N>
inline vb32 shl16(vb32 v) {
  return reinterpret_cast<vb32>(reinterpret_cast<vh32>(v) << N);
}

// Bit N of each byte at bit 4, its other bits zero: one 16-bit shift and a mask (the bits
// that cross into the neighbouring byte land outside bit 4), where a byte shift, a mask and a
// shift back took three.
template <int N>
inline vb32 bit_at_4(vb32 v) {
  if constexpr (N <= 4)
    return shl16<4 - N>(v) & 0x10;
  else
    return reinterpret_cast<vb32>(reinterpret_cast<vh32>(v) >> (N - 4)) & 0x10;
}

// The K-quants without a float buffer. A block's codes are put together 32 bytes at a time
// (a few byte operations per 32 values, where 32-bit lanes took as many per 16) into a
// 256-byte buffer in L1 and its scales widened in one vector (one by one in scalar registers
// they took more instructions than the values); then each run of 16 values is widened,
// scaled and multiplied in registers. A decoder type says how its blocks read:
//   kBytes          bytes a block
//   kRunsPerScale   runs of 16 values under one scale (and offset)
//   kOffset         weight = code * s + o (ggml's (d sc) q - (dmin m)); otherwise the codes
//                   are signed and weight = code * s (Q6_K's (d sc) (q - 32))
//   decode(b, q, s, o)  the block's 256 codes in value order, its scales and offsets
struct KQuantBuffers {
  alignas(64) uint8_t q[256];
  alignas(64) float s[16];
  alignas(64) float o[16] = {};  // (K4Codes fill 8, the rest read as zeros: offset_runs_dot)
};

// Run j's 16 weights from a decoded block.
template <typename Codes>
inline vf16 run_weights(const KQuantBuffers& k, int j) {
  constexpr int kPer = Codes::kRunsPerScale;
  if constexpr (Codes::kOffset)
    return to_floats(widen_u8(k.q + 16 * j)) * k.s[j / kPer] + k.o[j / kPer];
  else
    return widen_i8(reinterpret_cast<const int8_t*>(k.q + 16 * j)) * k.s[j / kPer];
}

// Read the decoded buffers back from memory (a widening load and a broadcast load a run):
// left to itself GCC kept them in registers and took every run out with two or three
// shuffles (vextracti64x2, vpermd and the index it permutes by), on the port the widening
// needs too.
inline void reload_buffers() { asm volatile("" ::: "memory"); }

// Q6_K: per 128 values, the low 4 bits (ql) of runs 0 and 64 share bytes, as do those of 32
// and 96; qh holds the top 2 bits of all four; (d sc) per 16 values, q - 32.
struct Q6KCodes {
  static constexpr int64_t kBytes = 210;
  static constexpr int kRunsPerScale = 1;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* b, KQuantBuffers& k) {
    for (int n = 0; n < 2; ++n) {
      const vb32 lo = load32b(b + 64 * n), hi = load32b(b + 64 * n + 32);
      const vb32 top = load32b(b + 128 + 32 * n);
      uint8_t* out = k.q + 128 * n;
      store32b(out, ((lo & 0xF) | (shl16<4>(top) & 0x30)) - 32);
      store32b(out + 32, ((hi & 0xF) | (shl16<2>(top) & 0x30)) - 32);
      store32b(out + 64, ((lo >> 4) | (top & 0x30)) - 32);
      store32b(out + 96, ((hi >> 4) | ((top >> 2) & 0x30)) - 32);
    }
    store16(k.s, widen_i8(reinterpret_cast<const int8_t*>(b + 192)) * half(b + 208));
  }
};

// Q4_K's and Q5_K's packed 6-bit scales and mins (12 bytes) as 16 bytes, as ggml unpacks
// them a word at a time: the 8 sub-blocks' scale codes, then their min codes. Built in a
// register: four 32-bit stores read back as one vector missed the store forwarding, which
// stalled the int8 tiles' Q4_K decode for 40% of its time.
typedef uint32_t vk4 __attribute__((vector_size(16)));
inline vk4 unpack_k4_scales(const uint8_t* packed) {
#if defined(__AVX2__)
  // The three words as lanes (u0 u2 u1 u2), each shifted and masked at once, their top bits
  // from (u0 u0 u1 u1): 7 vector instructions where the words one by one took ~20. Reads 16
  // bytes: the 4 past the 12 are the block's next field.
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i low = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(
      _mm_srli_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)), 2),
      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return reinterpret_cast<vk4>(_mm_or_si128(low, top));
#else
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  return vk4{u[0] & 0x3f3f3f3f, (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4),
             u[1] & 0x3f3f3f3f, ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4)};
#endif
}

// The first 8 of 16 lanes at lo, the other 8 at hi, stored from registers (a vector on the
// stack read back in halves waits on the store).
inline void store_halves(float* lo, float* hi, vf16 v) {
#if defined(__AVX512F__)
  _mm256_storeu_ps(lo, _mm512_castps512_ps256(v.p[0]));
  _mm256_storeu_ps(hi, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.p[0]), 1)));
#else
  for (int i = 0; i < kParts / 2; ++i) {
    storev(lo + i * kLanes, v.p[i]);
    storev(hi + i * kLanes, v.p[kParts / 2 + i]);
  }
#endif
}

// The same as floats: s[j] = d sc_j, o[j] = -dmin m_j for the 8 sub-blocks.
inline void k4_scales(const uint8_t* packed, float d, float dmin, float* s, float* o) {
  // d for the 8 scales, -dmin for the 8 mins (exact: products by 1 and 0)
  static constexpr float kHalves[2][16] = {{1, 1, 1, 1, 1, 1, 1, 1},
                                           {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}};
  const vf16 factor = load16(kHalves[0]) * d - load16(kHalves[1]) * dmin;
  store_halves(s, o, to_floats(widen_u8((vb16)unpack_k4_scales(packed))) * factor);
}

// Q4_K and Q5_K: 8 sub-blocks of 32 values under 6-bit scales and mins; per 64 values the
// low nibbles of 32 bytes, then their high nibbles (Q5_K: the fifth bits in qh, bits 2j and
// 2j + 1 of byte l for the pair j).
template <bool kFifth>
struct K4Codes {
  static constexpr int64_t kBytes = kFifth ? 176 : 144;
  static constexpr int kRunsPerScale = 2;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* b, KQuantBuffers& k) {
    const uint8_t* qs = b + (kFifth ? 48 : 16);
#if defined(__AVX512BW__)
    // Two pairs a step in one register, the fifth bits picked by a byte test of qh (bits 2j
    // and 2j + 1 in the first half, 2j + 2 and 2j + 3 in the second) and added as 16.
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    [[maybe_unused]] const __m512i qh =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    for (int j = 0; j < 4; j += 2) {
      const __m512i raw = _mm512_loadu_si512(qs + 32 * j);
      __m512i low = _mm512_and_si512(raw, nibble);
      __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      if constexpr (kFifth) {
        const char first = static_cast<char>(1 << 2 * j), second = static_cast<char>(4 << 2 * j);
        const __m512i bit =
            _mm512_inserti64x4(_mm512_set1_epi8(first), _mm256_set1_epi8(second), 1);
        const __m512i sixteen = _mm512_set1_epi8(16);
        low = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(qh, bit), low, sixteen);
        high = _mm512_mask_add_epi8(high, _mm512_test_epi8_mask(qh, _mm512_add_epi8(bit, bit)),
                                    high, sixteen);
      }
      uint8_t* out = k.q + 64 * j;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(low));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm512_castsi512_si256(high));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64), _mm512_extracti64x4_epi64(low, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 96), _mm512_extracti64x4_epi64(high, 1));
    }
#else
    const vb32 qh = load32b(b + 16);
    const auto pair = [&]<int J>() {
      vb32 low = load32b(qs + 32 * J) & 0xF, high = load32b(qs + 32 * J) >> 4;
      if constexpr (kFifth) {
        low |= bit_at_4<2 * J>(qh);
        high |= bit_at_4<2 * J + 1>(qh);
      }
      store32b(k.q + 64 * J, low);
      store32b(k.q + 64 * J + 32, high);
    };
    pair.template operator()<0>();
    pair.template operator()<1>();
    pair.template operator()<2>();
    pair.template operator()<3>();
#endif
    k4_scales(b + 4, half(b), half(b + 2), k.s, k.o);
  }
};

// One weight row through R rows of x, a block decoded once for all of them (RowSums' chains
// taking four runs in turn).
template <int R, typename Codes>
inline void kquant_dot(const uint8_t* b, int64_t blocks, const float* x, int64_t ldx,
                       vf16* acc) {
  RowSums<R> sums(acc, x, ldx);
  KQuantBuffers k;
  for (int64_t i = 0; i < blocks; ++i, b += Codes::kBytes) {
    Codes::decode(b, k);
    reload_buffers();
    for (int j = 0; j < 16; j += 4) {
      sums.template add<0>(run_weights<Codes>(k, j), 256 * i + 16 * j);
      sums.template add<1>(run_weights<Codes>(k, j + 1), 256 * i + 16 * j + 16);
      sums.template add<2>(run_weights<Codes>(k, j + 2), 256 * i + 16 * j + 32);
      sums.template add<3>(run_weights<Codes>(k, j + 3), 256 * i + 16 * j + 48);
    }
  }
  sums.store(acc);
}

// A signed run's 16 codes (Q6_K's) times x, its parts summed into one vector before the
// run's scale: one multiply a run where scaling each part took one a part.
inline vfn signed_run_dot(const KQuantBuffers& k, int j, const vf16& xv) {
  const vf16 c = widen_i8(reinterpret_cast<const int8_t*>(k.q + 16 * j));
  vfn t = c.p[0] * xv.p[0];
  for (int i = 1; i < kParts; ++i) t += c.p[i] * xv.p[i];
  return t;
}

// A decoded block of W offset rows (K4Codes) through its 256 values of x:
// sum (c s + o) x = s sum c x + o sum x, so each run of 32 takes its codes times x and one
// multiply by s, and the offsets one product a block with x's sums of 32 (`sums`): per pair
// of runs a multiply fewer and one broadcast where there were four (Q5_K 8192 x 2048 at one
// row, with the wide decode and the vector scale unpacking: 12.4 -> 15.9 GB/s on AVX-512,
// 10.6 -> 14.2 on AVX2). Summed in another order than c s + o, as llama.cpp does.
template <int W>
inline void offset_runs_dot(const KQuantBuffers (&k)[W], const float* x, const float* sums,
                            vf16* acc) {
  const auto codes = [&](int w, int j) { return to_floats(widen_u8(k[w].q + 16 * j)); };
  for (int j = 0; j < 16; j += 2) {
    const vf16 x0 = load16(x + 16 * j), x1 = load16(x + 16 * j + 16);
    for (int w = 0; w < W; ++w) acc[w] += (codes(w, j) * x0 + codes(w, j + 1) * x1) * k[w].s[j / 2];
  }
  for (int w = 0; w < W; ++w)  // the 8 offsets (lanes of o past them are zero)
    for (int v = 0; v < std::max(1, 8 / kLanes); ++v)
      acc[w].p[v] += loadv(k[w].o + v * kLanes) * loadv(sums + v * kLanes);
}

// W weight rows from row n of p through one row of x (a decode step): each vector of x is
// loaded once for the W rows, and the W accumulators are independent chains. One weight row
// at a time read x again per row, from L2 where it outgrows L1 (the 8B down projection's
// 14336 inputs: 57 KB of x per 11 KB of Q6_K).
template <int W, typename Codes, typename Ahead>
inline void kquant_rows_dot(const Part& p, int64_t n, int64_t blocks, const XRow& xr,
                            const Ahead& ahead, vf16* acc) {
  KQuantBuffers k[W];
  const uint8_t* row = p.data + n * p.stride;
  const float* x = xr.x;
  for (int64_t i = 0; i < blocks; ++i, row += Codes::kBytes) {
    ahead.at(n, i);
    for (int w = 0; w < W; ++w) Codes::decode(row + w * p.stride, k[w]);
    reload_buffers();
    if constexpr (Codes::kOffset) {
      offset_runs_dot<W>(k, x + 256 * i, xr.sums32 + 8 * i, acc);
      continue;
    }
    for (int j = 0; j < 16; ++j) {
      const vf16 xv = load16(x + 256 * i + 16 * j);
      for (int w = 0; w < W; ++w) {
        if constexpr (kParts > 1)  // into one part: the row's sum is every lane's
          acc[w].p[0] += signed_run_dot(k[w], j, xv) * k[w].s[j];
        else
          acc[w] += run_weights<Codes>(k[w], j) * xv;
      }
    }
  }
}

// Q5_0 / Q5_1 without the buffer: value j of a block takes bit j of qh as its fifth bit,
// then ggml's d (q - 16) or d q + m in registers. For Q5_0, q - 16 is built as a signed
// integer: its low four bits, with every bit from 4 up set where the fifth bit is clear
// (-16 + the low bits): no subtraction, and (q - 16) d exact as ggml's. Where a lane takes
// its bit: AVX-512 mask registers; elsewhere a test of the lane's bit (`Q5Bits`) against the
// broadcast word (per-lane shifts ran at half the speed on AVX-512: 1.5x at mask registers).
struct Q5Bits {
  vu16 lo, hi;  // 1 << j and 1 << (16 + j): value j's and value 16 + j's bit of qh
  Q5Bits() {
    for (int i = 0; i < kParts; ++i)
      for (int j = 0; j < kLanes; ++j) {
        lo.p[i][j] = 1u << (i * kLanes + j);
        hi.p[i][j] = 1u << (16 + i * kLanes + j);
      }
  }
};

template <bool kOffset>
inline void q5_values(const uint8_t* b, const Q5Bits& bit, vf16& f0, vf16& f1) {
  const uint32_t qh = word(b + (kOffset ? 4 : 2));
  const uint8_t* qs = b + (kOffset ? 8 : 6);
#if defined(__AVX512F__)
  const vu16 q = widen_u8(qs);
  const uint32_t where = kOffset ? qh : ~qh;  // lanes taking 16 (Q5_1) or -16 (Q5_0)
  constexpr int32_t kAdd = kOffset ? 16 : -16;
  const __m512i lo = (__m512i)(q.p[0] & 0xF), hi = (__m512i)(q.p[0] >> 4);
  const __m512i add = _mm512_set1_epi32(kAdd);
  const __m512i v0 = _mm512_mask_or_epi32(lo, (__mmask16)(where & 0xFFFF), lo, add);
  const __m512i v1 = _mm512_mask_or_epi32(hi, (__mmask16)(where >> 16), hi, add);
  f0.p[0] = (vfn)_mm512_cvtepi32_ps(v0);
  f1.p[0] = (vfn)_mm512_cvtepi32_ps(v1);
  (void)bit;
#elif defined(__AVX2__)
  // In bytes: the 32 codes side by side (low nibbles, then high), each value's bit of qh
  // spread to its byte by a shuffle and tested, the signed value (Q5_0) or the code (Q5_1)
  // formed in the byte, then widened: ~25 instructions a block where the int32 lanes took ~35.
  const __m128i lo4 = _mm_set1_epi8(0x0F), raw = _mm_loadu_si128((const __m128i*)qs);
  const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), lo4),
                                         _mm_and_si128(raw, lo4));
  const __m256i spread = _mm256_shuffle_epi8(  // byte j: the byte of qh holding value j's bit
      _mm256_set1_epi32(static_cast<int32_t>(qh)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit_of = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i taken = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_of), bit_of);
  const __m256i v = kOffset  // Q5_0: -16 + the low bits where the fifth bit is clear
      ? _mm256_or_si256(codes, _mm256_and_si256(taken, _mm256_set1_epi8(16)))
      : _mm256_or_si256(codes, _mm256_andnot_si256(taken, _mm256_set1_epi8(-16)));
  const __m128i v0 = _mm256_castsi256_si128(v), v1 = _mm256_extracti128_si256(v, 1);
  f0.p[0] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
  f0.p[1] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v0, v0)));
  f1.p[0] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
  f1.p[1] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v1, v1)));
  (void)bit;
#else
  const vu16 q = widen_u8(qs);
  const uint32_t where = kOffset ? qh : ~qh;  // lanes taking 16 (Q5_1) or -16 (Q5_0)
  constexpr int32_t kAdd = kOffset ? 16 : -16;
  const vun words = vun{} + where;
  for (int k = 0; k < kParts; ++k) {
    const vin take_lo = (vin)((words & bit.lo.p[k]) == bit.lo.p[k]);  // -1 where taken
    const vin take_hi = (vin)((words & bit.hi.p[k]) == bit.hi.p[k]);
    f0.p[k] = __builtin_convertvector((vin)(q.p[k] & 0xF) | (take_lo & kAdd), vfn);
    f1.p[k] = __builtin_convertvector((vin)(q.p[k] >> 4) | (take_hi & kAdd), vfn);
  }
#endif
}

template <bool kOffset>
inline void q5_weights(const uint8_t* b, const Q5Bits& bit, vf16& w0, vf16& w1) {
  const float d = half(b), m = kOffset ? half(b + 2) : 0.0f;
  vf16 f0, f1;
  q5_values<kOffset>(b, bit, f0, f1);
  w0 = kOffset ? f0 * d + m : f0 * d;
  w1 = kOffset ? f1 * d + m : f1 * d;
}

template <int R, bool kOffset>
inline void q5_dot(const uint8_t* b, int64_t blocks, const float* x, int64_t ldx, vf16* acc) {
  constexpr int64_t kBytes = kOffset ? 24 : 22;
  const Q5Bits bit;
  RowSums<R, 1> sums(acc, x, ldx);  // (more chains left AVX2 short of registers: 0.6-0.9x)
  for (int64_t i = 0; i < blocks; ++i, b += kBytes) {
    vf16 w0, w1;
    q5_weights<kOffset>(b, bit, w0, w1);
    sums.add(w0, 32 * i);
    sums.add(w1, 32 * i + 16);
  }
  sums.store(acc);
}

template <bool kOffset>
struct Q5Block {
  static constexpr int64_t kBytes = kOffset ? 24 : 22;
  static void weights(const uint8_t* b, vf16& w0, vf16& w1) {
    const Q5Bits bit;  // (constants)
    q5_weights<kOffset>(b, bit, w0, w1);
  }
  // acc += the block's products with 32 values of x; Q5_0's d once a block (d (q . x)).
  static void dot(const uint8_t* b, const vf16& x0, const vf16& x1, vf16& acc) {
    const Q5Bits bit;
    vf16 f0, f1;
    if constexpr (kOffset) {
      q5_weights<kOffset>(b, bit, f0, f1);
      acc += f0 * x0;
      acc += f1 * x1;
    } else {
      q5_values<kOffset>(b, bit, f0, f1);
      acc += (f0 * x0 + f1 * x1) * half(b);
    }
  }
};

// A type of 32-value blocks (Block: Q8Block, Q5Block) at one row of x (a decode step): W
// weight rows from row n of p at a time, each vector of x loaded once for all of them, W
// independent chains (the Q8_0 head of 49152 x 576 at two threads: 1.2-1.5x one row at a
// time; Q5_0 layers 1.1-1.45x).
template <int W, typename Block, typename Ahead>
inline void block32_rows_dot(const Part& p, int64_t n, int64_t blocks, const XRow& xr,
                             const Ahead& ahead, vf16* acc) {
  const float* x = xr.x;
  vf16 a[W];  // in registers: stores through acc might alias x
  for (int w = 0; w < W; ++w) a[w] = acc[w];
  const uint8_t* row = p.data + n * p.stride;
  for (int64_t i = 0; i < blocks; ++i, row += Block::kBytes) {
    ahead.at(n, i);
    const vf16 x0 = load16(x + 32 * i), x1 = load16(x + 32 * i + 16);
    for (int w = 0; w < W; ++w) Block::dot(row + w * p.stride, x0, x1, a[w]);
  }
  for (int w = 0; w < W; ++w) acc[w] = a[w];
}

// 16 bfloat16 values as floats (each the upper half of a float32), and 16 float16 ones.
inline vf16 widen_bf16(const uint8_t* p) {
  vu16 v;
#if defined(__AVX512F__)
  v.p[0] = (vun)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h)
    v.p[h] = (vun)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
#else
  for (int i = 0; i < kParts; ++i)
    for (int j = 0; j < kLanes; ++j) {
      uint16_t h;
      std::memcpy(&h, p + 2 * (i * kLanes + j), 2);
      v.p[i][j] = h;
    }
#endif
  return as_floats(v << 16);
}

inline vf16 widen_f16(const uint8_t* p) {
  vf16 v;
#if defined(__AVX512F__)
  v.p[0] = (vfn)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  for (int h = 0; h < 2; ++h)
    v.p[h] = (vfn)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
#else
  float f[16];
  for (int j = 0; j < 16; ++j) f[j] = half(p + 2 * j);
  v = load16(f);
#endif
  return v;
}

// 16-bit weights (a bf16 / fp16 checkpoint, or a GGUF's F16 / BF16) widened in registers.
template <int R, bool kBf16>
inline void half_dot(const uint8_t* b, int64_t blocks, const float* x, int64_t ldx, vf16* acc) {
  RowSums<R> sums(acc, x, ldx);
  auto widen = [](const uint8_t* p) { return kBf16 ? widen_bf16(p) : widen_f16(p); };
  int64_t i = 0;  // 16 values a step
  for (; i + 4 <= 2 * blocks; i += 4, b += 128) {
    sums.template add<0>(widen(b), 16 * i);
    sums.template add<1>(widen(b + 32), 16 * i + 16);
    sums.template add<2>(widen(b + 64), 16 * i + 32);
    sums.template add<3>(widen(b + 96), 16 * i + 48);
  }
  for (; i < 2 * blocks; ++i, b += 32) sums.add(widen(b), 16 * i);
  sums.store(acc);
}

// A register-level decoder's GEMV: rows n0..n1 of p, each through every row of x, kRows at a
// time (8 where 32 registers hold their accumulators, AVX-512; 4 elsewhere), then singly.
// Dot::run<R> decodes a weight row once per R rows of x.
#if defined(__AVX512F__)
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif

template <int64_t kBlock, typename Dot>
void register_gemv_rows(const Part& p, int64_t n0, int64_t n1, const float* x, int64_t M,
                        int64_t K, const float* bias, float* y, int64_t ldy) {
  vf16 acc[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.data + n * p.stride;
    for (int64_t m = 0; m < M; ++m) acc[m] = vf16{};
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows)
      Dot::template run<kRows>(row, K / kBlock, x + m * K, K, acc + m);
    for (; m + 4 <= M; m += 4) Dot::template run<4>(row, K / kBlock, x + m * K, K, acc + m);
    for (; m < M; ++m) Dot::template run<1>(row, K / kBlock, x + m * K, K, acc + m);
    const float bn = bias != nullptr ? bias[n] : 0.0f;
    for (int64_t r = 0; r < M; ++r) y[r * ldy + n] = hsum(acc[r]) + bn;
  }
}

// At one row of x, RowsDot::kRows weight rows at a time (RowsDot::run<W>: kquant_rows_dot,
// block32_rows_dot); at more, register_gemv_rows.
#if defined(__AVX512F__)
constexpr int kWeightRows = 4;  // (8 rows' panels of Q6_K, 13-54 KB, ran at 0.55-0.75x)
constexpr int kQ8WeightRows = 8;
#else
constexpr int kWeightRows = 2;  // (a vf16 is two AVX2 registers: 16 hold 2 rows' work)
constexpr int kQ8WeightRows = 4;  // (Q8_0 holds no buffer: 4 rows' sums fit)
#endif
// The offset K-quants' (offset_runs_dot) hold no run's weights in registers: 4 rows fit on
// AVX2 too (Q4_K / Q5_K 1.12-1.19x over 2; SSE2's 16 registers, 0.97x).
constexpr int kOffsetWeightRows = kLanes >= 8 ? 4 : kWeightRows;

// Whether a decoder's one-row dot reads x's sums over runs of 32 (the K-quants' offsets).
template <typename Codes>
constexpr bool takes_sums32() {
  if constexpr (requires { Codes::kOffset; }) return Codes::kOffset;
  return false;
}

// x's sums over its runs of 32 values, then 16 zeros (read past the last by offset_runs_dot).
inline std::vector<float> sums32(const float* x, int64_t K) {
  std::vector<float> sums(K / 32 + 16, 0.0f);
  for (int64_t i = 0; i < K / 32; ++i) sums[i] = hsum(load16(x + 32 * i) + load16(x + 32 * i + 16));
  return sums;
}

template <int64_t kBlock, typename Dot, typename RowsDot>
void weight_rows_gemv(const Part& p, int64_t n0, int64_t n1, const float* x, int64_t M,
                      int64_t K, const float* bias, float* y, int64_t ldy) {
  if (M > 1) return register_gemv_rows<kBlock, Dot>(p, n0, n1, x, M, K, bias, y, ldy);
  const std::vector<float> sums = RowsDot::kSums32 ? sums32(x, K) : std::vector<float>{};
  const XRow xr{x, sums.data()};
  int64_t n = n0;
  const auto rows = [&]<int W>() {  // W rows at a time while they last
    const Lookahead<W, 3, RowsDot::kStep> ahead(p, K / kBlock);
    for (; n + W <= n1; n += W) {
      vf16 acc[W];
      zero(acc);
      RowsDot::template run<W>(p, n, K / kBlock, xr, ahead, acc);
      for (int w = 0; w < W; ++w)
        y[n + w] = hsum(acc[w]) + (bias != nullptr ? bias[n + w] : 0.0f);
    }
  };
  rows.template operator()<RowsDot::kRows>();
  rows.template operator()<1>();
}

// The register-level decoders as types, for register_gemv_rows.
#define PKV_GGML_DOT(NAME, ...)                                                 \
  struct NAME {                                                                \
    template <int R>                                                           \
    static void run(const uint8_t* b, int64_t blocks, const float* x, int64_t ldx, \
                    vf16* acc) {                                               \
      __VA_ARGS__(b, blocks, x, ldx, acc);                                     \
    }                                                                          \
  };
PKV_GGML_DOT(Q8Dot, q8_0_dot<R>)
PKV_GGML_DOT(Q6KDot, (kquant_dot<R, Q6KCodes>))
PKV_GGML_DOT(Q4KDot, (kquant_dot<R, K4Codes<false>>))
PKV_GGML_DOT(Q5KDot, (kquant_dot<R, K4Codes<true>>))
PKV_GGML_DOT(Q50Dot, q5_dot<R, false>)
PKV_GGML_DOT(Q51Dot, q5_dot<R, true>)
PKV_GGML_DOT(Bf16Dot, half_dot<R, true>)
PKV_GGML_DOT(F16Dot, half_dot<R, false>)
#undef PKV_GGML_DOT

// The side-by-side decoders as types, for weight_rows_gemv: kRows weight rows at a time
// (FN<W, CODES>), a block of kStep bytes each.
#define PKV_GGML_ROWS_DOT(NAME, ROWS, FN, CODES)                                \
  struct NAME {                                                               \
    static constexpr int kRows = ROWS;                                        \
    static constexpr int64_t kStep = CODES::kBytes;                           \
    static constexpr bool kSums32 = takes_sums32<CODES>();                    \
    template <int W, typename Ahead>                                          \
    static void run(const Part& p, int64_t n, int64_t blocks, const XRow& xr, \
                    const Ahead& ahead, vf16* acc) {                          \
      FN<W, CODES>(p, n, blocks, xr, ahead, acc);                             \
    }                                                                         \
  };
PKV_GGML_ROWS_DOT(Q8RowsDot, kQ8WeightRows, block32_rows_dot, Q8Block)
PKV_GGML_ROWS_DOT(Q6KRowsDot, kWeightRows, kquant_rows_dot, Q6KCodes)
PKV_GGML_ROWS_DOT(Q4KRowsDot, kOffsetWeightRows, kquant_rows_dot, K4Codes<false>)
PKV_GGML_ROWS_DOT(Q5KRowsDot, kOffsetWeightRows, kquant_rows_dot, K4Codes<true>)
PKV_GGML_ROWS_DOT(Q50RowsDot, kWeightRows, block32_rows_dot, Q5Block<false>)
PKV_GGML_ROWS_DOT(Q51RowsDot, kWeightRows, block32_rows_dot, Q5Block<true>)
#undef PKV_GGML_ROWS_DOT

// gemv_rows with the part's dequantizer as a compile-time function.
void gemv_part(const Part& p, int64_t type, int64_t n0, int64_t n1, const float* x,
               int64_t M, int64_t K, const float* bias, float* y, int64_t ldy) {
  switch (type) {
#define PKV_GGML_CASE(T, FN)                                                                \
  case T:                                                                                   \
    return gemv_rows(p, [](const uint8_t* b, float* o) { FN(b, o); }, n0, n1, x, M, K, bias, \
                     y, ldy);
    PKV_GGML_CASE(F32, f32)
    PKV_GGML_CASE(Q4_0, q4_0)
    PKV_GGML_CASE(Q4_1, q4_1)
    case Q8_0: return weight_rows_gemv<32, Q8Dot, Q8RowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
    case Q6_K: return weight_rows_gemv<256, Q6KDot, Q6KRowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
    case BF16: return register_gemv_rows<32, Bf16Dot>(p, n0, n1, x, M, K, bias, y, ldy);
    case F16: return register_gemv_rows<32, F16Dot>(p, n0, n1, x, M, K, bias, y, ldy);
    case Q5_0: return weight_rows_gemv<32, Q50Dot, Q50RowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
    case Q5_1: return weight_rows_gemv<32, Q51Dot, Q51RowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
    PKV_GGML_CASE(Q2_K, q2_k)
    PKV_GGML_CASE(Q3_K, q3_k)
    case Q4_K: return weight_rows_gemv<256, Q4KDot, Q4KRowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
    case Q5_K: return weight_rows_gemv<256, Q5KDot, Q5KRowsDot>(p, n0, n1, x, M, K, bias, y, ldy);
#undef PKV_GGML_CASE
    default: TORCH_CHECK(false, "ggml_linear: ggml type ", type, " is not one the kernels read");
  }
}

// Rows of each part dequantized into float32 panels, each multiplied by the float32 linear
// (csrc/gemv_cpu.cpp's f32_linear: torch's mm on a fresh panel of a transposed weight ran 3-10x
// slower here) into the part's columns of y, with its share of the bias. The panel's buffer is kept
// per thread and reused: a fresh one of MBs is a new mapping whose first touch page-faults (as long
// as the dequantizing). One part in one panel, with y the op's own (`fresh`), makes the product y
// itself: copying it cost as much as 1/K of the multiply (an all-MiniLM batch, K = 384: ~6%).
void gemm(const std::vector<Part>& parts, const at::Tensor& x,
          const std::optional<at::Tensor>& bias, at::Tensor& y, bool fresh) {
  const int64_t K = x.size(1);
  const int64_t panel = std::max<int64_t>(256, (int64_t{4} << 20) / K);  // 16 MB of float32
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < panel * K) buffer = at::empty({panel * K}, x.options());
  float* wd = buffer.data_ptr<float>();
  for (const Part& p : parts) {
    for (int64_t r0 = 0; r0 < p.rows; r0 += panel) {
      const int64_t rows = std::min(panel, p.rows - r0);
      at::parallel_for(0, rows, 8, [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r)
          dequantize_run(p, p.data + (r0 + r) * p.stride, 0, K, wd + r * K);
      });
      const at::Tensor w = buffer.narrow(0, 0, rows * K).view({rows, K});
      const auto b = bias ? std::optional(bias->narrow(0, p.col + r0, rows)) : std::nullopt;
      const at::Tensor product = gemv::f32_linear(x, w, b, std::nullopt);
      if (fresh && parts.size() == 1 && rows == p.rows)
        y = product;
      else
        y.narrow(1, p.col + r0, rows).copy_(product);
    }
  }
}

}  // namespace
}  // namespace ggml
