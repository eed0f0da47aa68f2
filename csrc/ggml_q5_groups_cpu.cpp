// Q5_0 against one row of int8 x, four blocks of 32 an instruction (AVX-512 with VBMI and
// VNNI). Included by csrc/ggml_cpu.cpp after ggml_q8_cpu.cpp, whose Q8Rows it reads.
//
// Why: a batch-1 step of a Q4_K_M file whose layers are too narrow for the K-quants (the
// 576-wide SmolLM2 or the 896-wide Qwen2.5-0.5B: llama-quantize falls back to Q5_0) spends
// half its time in these layers, and the block-at-a-time GEMV (q8_32_weight_rows) was bound
// by its ~25 instructions a block (decoding 22 bytes: nibbles, the fifth bits, two half
// scales, a byte dot in three instructions, a scalar offset), at ~23 GB/s of the machine's
// ~33. Here four consecutive blocks of a weight row (88 bytes) are gathered into one register
// by two byte permutes (vpermt2b): their 64 bytes of nibbles, and their scales (each repeated
// over the four int32 lanes its block's sums land in) with the fifth bits as two 64-bit masks;
// the fifth bits are added to the nibbles under those masks, and two vpdpbusd take the 128
// products. About six instructions a block.
//
// x is laid out for it once a call (`Q8Groups`): per group of four blocks, the first 16 codes
// of each block side by side (`lo`), the last 16 (`hi`), the offset's share -16 sum(q) in the
// first int32 lane of each block (Q5_0: w = d (c - 16), so the block's dot is
// d dx (c . q - 16 sum q)), and dx repeated over each block's four lanes. A short last group
// has zeros there, and its weight bytes past the row are never loaded (masked loads).

namespace ggml {

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
constexpr bool kQ5Groups = true;

namespace {

constexpr int64_t kQ5Bytes = 22;  // d (f16), qh (32 fifth bits), qs (16 bytes of nibbles)
constexpr int64_t kGroupBytes = 4 * kQ5Bytes;

// One row of x in groups of four blocks of 32 (see the header).
struct Q8Groups {
  std::vector<int8_t> lo, hi;  // [groups, 64]
  std::vector<int32_t> offset;  // [groups, 16]
  std::vector<float> dx;        // [groups, 16]
  int64_t blocks = 0;
};

// Row m of x (quantized in blocks of 32) into `g`.
void group_q8(const Q8Rows& x, int64_t m, Q8Groups& g) {
  const int64_t NB = x.K / 32, G = (NB + 3) / 4;
  g.blocks = NB;
  g.lo.assign(G * 64, 0);
  g.hi.assign(G * 64, 0);
  g.offset.assign(G * 16, 0);
  g.dx.assign(G * 16, 0.f);
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t at = m * NB + b, lane = 16 * (b / 4) + 4 * (b % 4);
    std::memcpy(g.lo.data() + 4 * lane, x.q.data() + 32 * at, 16);
    std::memcpy(g.hi.data() + 4 * lane, x.q.data() + 32 * at + 16, 16);
    g.offset[lane] = -16 * (x.bsums[2 * at] + x.bsums[2 * at + 1]);
    std::fill_n(g.dx.data() + lane, 4, x.d[at]);
  }
}

// Byte indices into a group's 88 bytes (the first 64 in one register, the rest in another):
// the nibbles of block k at bytes 16k.., and (kMeta) block k's scale as halves 8k.., repeated
// four times, then the low and the high 16 fifth bits of each block (two 64-bit masks).
struct GroupIndex {
  __m512i nibbles, meta;
  GroupIndex() {
    alignas(64) uint8_t n[64], m[64] = {};
    for (int j = 0; j < 64; ++j) n[j] = static_cast<uint8_t>(kQ5Bytes * (j / 16) + 6 + j % 16);
    for (int j = 0; j < 32; ++j) m[j] = static_cast<uint8_t>(kQ5Bytes * (j / 8) + j % 2);
    for (int j = 0; j < 16; ++j) {
      m[32 + j] = static_cast<uint8_t>(kQ5Bytes * (j % 8 / 2) + 2 + j % 2 + 2 * (j / 8));
    }
    nibbles = _mm512_load_si512(n);
    meta = _mm512_load_si512(m);
  }
};

// The bytes of a group of `blocks` (1-4) blocks under two load masks: none past them.
inline std::pair<__mmask64, __mmask64> group_masks(int64_t blocks) {
  const int64_t bytes = kQ5Bytes * blocks;
  const auto ones = [](int64_t k) { return k >= 64 ? ~0ULL : (1ULL << k) - 1; };
  return {ones(bytes), bytes > 64 ? ones(bytes - 64) : 0ULL};
}

// W weight rows from row n: acc[w] += each group's scaled sums.
template <int W>
inline void q5_group_rows(const Part& p, int64_t n, const Q8Groups& x, const GroupIndex& ix,
                          const float* bias, float* y) {
  const int64_t G = (x.blocks + 3) / 4;
  __m512 acc[W];
  for (int w = 0; w < W; ++w) acc[w] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  for (int64_t g = 0; g < G; ++g) {
    const auto [first, second] = group_masks(std::min<int64_t>(4, x.blocks - 4 * g));
    const __m512i xlo = _mm512_loadu_si512(x.lo.data() + 64 * g);
    const __m512i xhi = _mm512_loadu_si512(x.hi.data() + 64 * g);
    const __m512i offset = _mm512_loadu_si512(x.offset.data() + 16 * g);
    const __m512 dx = _mm512_loadu_ps(x.dx.data() + 16 * g);
    // Bytes ahead of a group to prefetch: in a row longer than the distance, past its end
    // the next rows' sibling lanes are being read already; skip to this lane's next row.
    const int64_t at = kGroupBytes * g, ahead =
        kQ8Prefetch + (p.stride > kQ8Prefetch && at + kQ8Prefetch >= p.stride
                       ? (W - 1) * p.stride : 0);
    for (int w = 0; w < W; ++w) {
      const uint8_t* b = p.data + (n + w) * p.stride + at;
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 64), _MM_HINT_NTA);
      const __m512i head = _mm512_maskz_loadu_epi8(first, b);
      const __m512i tail = _mm512_maskz_loadu_epi8(second, b + 64);
      const __m512i qs = _mm512_permutex2var_epi8(head, ix.nibbles, tail);
      const __m512i meta = _mm512_permutex2var_epi8(head, ix.meta, tail);
      const __m128i bits = _mm512_extracti32x4_epi32(meta, 2);
      const __mmask64 low_fifth = _cvtu64_mask64(_mm_cvtsi128_si64(bits));
      const __mmask64 high_fifth = _cvtu64_mask64(_mm_extract_epi64(bits, 1));
      __m512i lo = _mm512_and_si512(qs, low4);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), low4);
      lo = _mm512_mask_add_epi8(lo, low_fifth, lo, fifth);
      hi = _mm512_mask_add_epi8(hi, high_fifth, hi, fifth);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(offset, lo, xlo), hi, xhi);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(meta));
      acc[w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, dx), acc[w]);
    }
  }
  for (int w = 0; w < W; ++w)
    y[n + w] = _mm512_reduce_add_ps(acc[w]) + (bias ? bias[n + w] : 0.f);
}

// Rows [n0, n1) of a Q5_0 part through the one row of x in `x`, four weight rows at a time.
void q5_groups_gemv(const Part& p, int64_t n0, int64_t n1, const Q8Groups& x,
                    const float* bias, float* y) {
  static const GroupIndex ix;
  for (; n0 + 4 <= n1; n0 += 4) q5_group_rows<4>(p, n0, x, ix, bias, y);
  for (; n0 < n1; ++n0) q5_group_rows<1>(p, n0, x, ix, bias, y);
}

}  // namespace

#else
constexpr bool kQ5Groups = false;
#endif

}  // namespace ggml
