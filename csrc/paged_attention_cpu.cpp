// Paged attention on CPU: every token's K/V is written into its cache slot, then every query
// token attends over its sequence's KV blocks, read straight through the block table (no
// gather copy), with an online softmax per block.
//
//   q            [T, H, D]          float32, rows may be strided (views of a fused qkv)
//   k/v          [T, KVH, D]        float32, the step's new keys and values, likewise
//   k/v_cache    [NB, BS, KVH, row] contiguous (one layer): float32, bfloat16 or float16 rows
//                                   of D, or int8 / fp8 e4m3 codes and a scale
//                                   (csrc/kv_rows.h)
//   slot_mapping [T]                int64   cache slot of each token's K/V
//   block_tables [S, MB]            int32
//   seq_ids      [T]                int32   which sequence each token belongs to
//   kv_lens      [T]                int32   keys the token may see (its position + 1)
//   out          [T, H, D]          contiguous
//   window       > 0: a token sees only its last `window` keys (itself included)
//   soft_cap     > 0: scores become soft_cap * tanh(scores / soft_cap) (Gemma 2)
//
// With a window, blocks wholly before it are never read (they may already be back in the
// pool, their table entries stale).
//
// Decodes (and short chunks) are split over tokens, or (token, KV head) when there are few,
// and a long sequence's keys into parts merged after (flash-decoding), handed out longest
// first; the G = H / KVH query heads that share a KV head go through a block's K/V rows one
// after another while the block sits in L1 (the next block is prefetched into L2, a slice
// before each head's pass: blocks lie anywhere in the pool). Head sizes of 16..128
// (multiples of 16) take a vectorized path: q and the accumulators live in 16-float vectors,
// eight keys' dot products end in one transposed sum (AVX2, AVX-512), the block's scores are
// exponentiated 16 at a time (a polynomial exp, ~1 ulp), and a head's accumulators stay in
// registers across the block's V rows. Other sizes take the scalar loop.
//
// Prefill chunks (runs of at least kMinRun consecutive tokens of one sequence whose kv_lens rise by
// one, the first possibly after a cached prefix) take a tiled, flash-attention style path instead
// (csrc/paged_prefill_cpu.cpp), when D is a multiple of 16: work items are (run, KV head, tile of
// 32-64 tokens), and an item stacks its G query heads' rows (G * tokens of them, pre-scaled) and
// walks key tiles of kTileK keys read through the block table, each with two register-blocked
// matrix products (S = K Q^T, O += P V) and an online softmax per row (the max taken from the S
// product's registers, a cheaper exp for its terms: vexp_neg). K and V rows are read in place from
// the cache (one pointer per key); only Q is transposed (once per item). Keys before the first
// row's window or after the last row's position are never read; tiles that some row must not see
// (the causal diagonal, a window's edge) are masked inside the softmax. Items are handed out
// dearest first from a shared counter (causal items differ in cost).
//
// A float32 cache is read in place. Other formats are widened as they are read: decode widens
// float16, bfloat16 and int8 rows (fp8 too on AVX-512) in registers as its dot products take
// them, fp8 rows on AVX2 and every format on the generic flavour a block's rows of one KV
// head into a buffer that the G query heads then go over in L1 (csrc/kv_readers.h); prefill
// widens a key tile's rows. An 8-bit cache reads a quarter of the bytes, and decode attention
// over long contexts is bound by those bytes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_readers.h"
#include "kv_rows.h"
#include "team.h"
#include "vec_math.h"

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// scores[0, n) -> cap * tanh(scores / cap), 16 at a time (n may be rounded up: the buffer is
// padded), tanh(y) = 1 - 2 / (exp(2y) + 1): a scalar tanh per score cost Gemma 2 ~15% of a
// batch-64 step.
static inline void soft_cap16(float* scores, int64_t n, float cap) {
  const float inv = 2.f / cap;
  for (int64_t c = 0; c < n; c += 16) {
    const vf16 x = load16(scores + c);
    store16(scores + c, cap * (1.f - 2.f / (vexp(x * inv) + 1.f)));
  }
}

#if defined(__AVX__)
// sums[i] = the sum of a[i]'s lanes, i < 8: eight horizontal sums in ten shuffles and adds
// (AVX-512 first folds each vector to 8 lanes), where one at a time takes six each.
static inline void sum8(const vfn* a, float* sums) {
  __m256 y[8];
  for (int i = 0; i < 8; ++i) {
#if defined(__AVX512F__)
    y[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
#else
    y[i] = a[i];
#endif
  }
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
  _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                                       _mm256_permute2f128_ps(q0, q1, 0x31)));
}
#endif

// s[j] = q . K[j] for the keys j in [j0, n) of a block (K: a reader, csrc/kv_readers.h):
// eight keys at a time where the ISA has sum8, one at a time otherwise and for the rest.
template <int64_t DC, typename Reader>
static inline void key_scores(const vf16* q, const Reader& K, int64_t j0, int64_t n,
                              float* s) {
  int64_t j = j0;
#if defined(__AVX__)
  const float* qf = reinterpret_cast<const float*>(q);  // read by memcpy (loadv)
  for (; j + 8 <= n; j += 8) {
    vfn acc[8] = {};
    for (int64_t c = 0; c < 16 * DC; c += kLanes) {
      const vfn qv = loadv(qf + c);
      for (int i = 0; i < 8; ++i) acc[i] += qv * K.load(j + i, c);
    }
    sum8(acc, s + j);
    for (int i = 0; i < 8; ++i) s[j + i] *= K.scale(j + i);  // (x 1.f folds away)
  }
#endif
  for (; j < n; ++j) {
    vf16 d = q[0] * kv_readers::load16(K, j, 0);
    for (int64_t c = 1; c < DC; ++c) d += q[c] * kv_readers::load16(K, j, 16 * c);
    s[j] = hsum(d) * K.scale(j);
  }
}

#if defined(PKV_KV_READS_AVX2)
// acc += the products of 2 * kLanes int8 codes k (sign-extended to int16) and int16s q, in
// pairs summed into acc's int32 lanes: vpdpwssd with AVX512-VNNI or AVX-VNNI, elsewhere
// vpmaddwd and an add.
static inline vin madd_codes(vin acc, const uint8_t* k, const int16_t* q) {
#if defined(__AVX512F__)
  const __m512i kv =
      _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
  const __m512i qv = _mm512_loadu_si512(q);
#if defined(__AVX512VNNI__)
  return reinterpret_cast<vin>(_mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc), kv, qv));
#else
  return acc + reinterpret_cast<vin>(_mm512_madd_epi16(kv, qv));
#endif
#else
  const __m256i kv =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
  const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
#if defined(__AVXVNNI__)
  return reinterpret_cast<vin>(_mm256_dpwssd_avx_epi32(reinterpret_cast<__m256i>(acc), kv, qv));
#else
  return acc + reinterpret_cast<vin>(_mm256_madd_epi16(kv, qv));
#endif
#endif
}

// s[j] = q . K[j] for int8 keys j in [j0, n) of a block, q as int16s times qs (int16_queries):
// integer dot products, exact up to the sums' conversion to float, at two instructions per
// 2 * kLanes values of a key where widening them to floats takes six. Sums stay far inside
// int32: 2 * 32767 * 127 per pair, D / 2 of them at most per lane.
template <int64_t DC>
static inline void int8_key_scores(const int16_t* q, float qs, const kv_readers::I8& K,
                                   int64_t j0, int64_t n, float* s) {
  constexpr int64_t D = 16 * DC, W = 2 * kLanes;
  int64_t j = j0;
  for (; j + 8 <= n; j += 8) {
    vin acc[8] = {};
    for (int64_t c = 0; c < D; c += W)
      for (int i = 0; i < 8; ++i) acc[i] = madd_codes(acc[i], K.p + (j + i) * K.row + c, q + c);
    vfn sums[8];
    for (int i = 0; i < 8; ++i) sums[i] = __builtin_convertvector(acc[i], vfn);
    sum8(sums, s + j);
    for (int i = 0; i < 8; ++i) s[j + i] *= qs * K.scale(j + i);
  }
  for (; j < n; ++j) {
    vin acc = {};
    for (int64_t c = 0; c < D; c += W) acc = madd_codes(acc, K.p + j * K.row + c, q + c);
    s[j] = hsum(__builtin_convertvector(acc, vfn)) * qs * K.scale(j);
  }
}
#endif

// acc += sum_j p[j] V[j] over the keys j in [j0, n) of a block (V: a reader); up to 64
// floats of acc at a time stay in registers across the keys.
template <int64_t DC, typename Reader>
static inline void add_values(const float* p, const Reader& V, int64_t j0, int64_t n,
                              vf16* acc) {
  constexpr int64_t kChunk = DC < 4 ? DC : 4;
  for (int64_t c0 = 0; c0 < DC; c0 += kChunk) {
    vf16 a[kChunk];
    for (int64_t c = 0; c < kChunk; ++c) a[c] = acc[c0 + c];
    for (int64_t j = j0; j < n; ++j) {
      const float w = p[j] * V.scale(j);
      for (int64_t c = 0; c < kChunk; ++c) a[c] += w * kv_readers::load16(V, j, 16 * (c0 + c));
    }
    for (int64_t c = 0; c < kChunk; ++c) acc[c0 + c] = a[c];
  }
}

// Rows [j0, j1) of KV head kh in the block starting at slot0: one prefetch per line, into
// L2 (prefetcht1). Asked into L1 (t0), each line held one of L1's few miss buffers until it
// came: in an hour when the machine streamed ~37 GB/s the decode attention read ~14 GB/s that
// way and ~21 into L2 (Zen 5, two threads, 64 x 128-4,096 keys: 1.4-1.65x on every flavour
// for float32 and 16-bit rows; int8 and fp8 rows, bound by their widening, 1.05-1.09x); in a
// faster hour the two ran level. The rows are a block's pass away, and L2 answers L1's misses
// in ~14 cycles. (Called from a lambda instead, GCC 12 emitted no prefetch at all: check the
// assembly.)
static inline void prefetch_rows(const kv_rows::Rows& R, int64_t slot0, int64_t kh,
                                 int64_t KVH, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const char* p = reinterpret_cast<const char*>(R.row((slot0 + j) * KVH + kh));
    for (int64_t f = 0; f < R.bytes; f += 64) __builtin_prefetch(p + f, 0, 2);
  }
}

// exp(x) for a softmax term (x <= 0: a score less the running max), or 0 where the term is
// below 2^-64. Against a sum of at least 1 (the max's own term) such a term changes nothing a
// float holds; kept, it is the seed of subnormal floats: vexp clamps at e^-87.3, and that
// times an int8 row's scale is subnormal, and on Intel every multiply-add with a subnormal
// operand takes a microcode assist of ~100 cycles. A random-weight 1B model's peaked scores
// ran int8-KV decode attention ~6x slower than float32 that way (64 sequences).
constexpr float kNegligibleTerm = 0x1p-64f;

static inline float softmax_term(float x) {
  const float p = std::exp(x);
  return p < kNegligibleTerm ? 0.f : p;
}

static inline vf16 softmax_terms(vf16 x) {
  vf16 p = vexp(x);
  for (int i = 0; i < kParts; ++i) p.p[i] = p.p[i] < kNegligibleTerm ? 0.f : p.p[i];
  return p;
}

// The sum of s[0, n), s padded to a multiple of 16 (the padding is zeroed here): in vectors,
// then a tree across the lanes. One add after another, 16 keys' terms took one head's softmax
// ~64 cycles of latency a block.
static inline float block_sum(float* s, int64_t n) {
  const int64_t end = (n + 15) / 16 * 16;
  std::fill(s + n, s + end, 0.f);
  vf16 total = load16(s);
  for (int64_t c = 16; c < end; c += 16) total += load16(s + c);
  vfn lanes = total.p[0];
  for (int i = 1; i < kParts; ++i) lanes += total.p[i];
  return hsum_tree(lanes);
}

// State of one token's attention over KV heads [kh0, kh1): G query heads each.
struct VecState {
  std::vector<vf16> q, acc;  // [heads][DC]
  std::vector<float> m, l, scores;  // scores: [heads][BS rounded up to 16]
  std::vector<float> rows;  // a block's widened rows of one KV head (kv_readers::Widened)
  std::vector<int16_t> q16;  // [heads][D]: q for int8 keys (int16_queries)
  std::vector<float> q16_scale;  // [heads]
};

// Each head's (scaled) q as int16s for integer dot products with int8 keys: its values over
// its largest magnitude times 32767, and that factor back. The rounding, at most 2^-16 of the
// largest value, is far below the keys' own 8 bits.
static void int16_queries(VecState& st, int64_t heads, int64_t D) {
  const float* q = reinterpret_cast<const float*>(st.q.data());
  st.q16.resize(heads * D);
  st.q16_scale.resize(heads);
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * D;
    float largest = 0.f;
    for (int64_t d = 0; d < D; ++d) largest = std::max(largest, std::fabs(qh[d]));
    const float to_int = largest > 0.f ? 32767.f / largest : 0.f;
    for (int64_t d = 0; d < D; ++d)
      st.q16[h * D + d] = static_cast<int16_t>(std::nearbyint(qh[d] * to_int));
    st.q16_scale[h] = largest / 32767.f;
  }
}

// Whether keys of D values read by Reader take integer dot products: int8 rows, and D whole
// int16 vectors.
template <typename Reader, int64_t D>
constexpr bool kIntegerKeys = kv_readers::kInt8Rows<Reader> && D % (2 * kLanes) == 0;

// A block's scores s[j] = q . K[j] for query head h.
template <int64_t DC, typename Reader>
static inline void block_scores(const VecState& st, int64_t h, const Reader& K, int64_t j0,
                                int64_t n, float* s) {
#if defined(PKV_KV_READS_AVX2)
  if constexpr (kIntegerKeys<Reader, 16 * DC>) {
    int8_key_scores<DC>(st.q16.data() + h * 16 * DC, st.q16_scale[h], K, j0, n, s);
    return;
  }
#endif
  key_scores<DC>(st.q.data() + h * DC, K, j0, n, s);
}

// One token over its KV heads [kh0, kh1), G query heads each, D = 16 * DC, and the blocks
// [b0, b1) of its keys [lo, len): st holds each head's running max m, sum l and unnormalized
// accumulators (finish() divides them out). Keys are walked row by row across the KV heads,
// so a block's K (then V) is read front to back.
template <int64_t DC, typename Reader>
static void attend_vec(const float* qt, const kv_rows::Rows& K, const kv_rows::Rows& V,
                       const int32_t* table, int64_t len, int64_t lo, int64_t b0, int64_t b1,
                       int64_t BS, int64_t KVH, int64_t kh0, int64_t kh1, int64_t G,
                       float scale, float cap, VecState& st) {
  constexpr int64_t D = 16 * DC;
  const int64_t padded = (BS + 15) / 16 * 16;
  const int64_t h0 = kh0 * G, heads = (kh1 - kh0) * G;
  st.q.resize(heads * DC);
  st.acc.assign(heads * DC, vf16{});
  st.m.assign(heads, -std::numeric_limits<float>::infinity());
  st.l.assign(heads, 0.f);
  st.scores.resize(heads * padded);
  st.rows.resize(BS * D);
  vf16* q = st.q.data();
  vf16* acc = st.acc.data();
  float* scores = st.scores.data();
  std::memcpy(q, qt + h0 * D, heads * D * sizeof(float));
  for (int64_t i = 0; i < heads * DC; ++i) q[i] *= scale;
  if constexpr (kIntegerKeys<Reader, D>) int16_queries(st, heads, D);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = std::min(BS, len - b * BS);
    const int64_t j0 = std::max<int64_t>(0, lo - b * BS);  // first key inside the window
    const int64_t slot0 = static_cast<int64_t>(table[b]) * BS;
    // The next block is elsewhere in memory: each query head's pass over this block first
    // asks for its share of the next block's rows (its KV head's, a G-th of them). Asking
    // for the whole next block at once stalled the core on the cache's miss buffers for
    // ~400 lines: the decode attention of a batch of 256 took 1.3-1.45x as long (into L1;
    // into L2, the whole block at the block's start took 1.2-1.4x as long as the shares).
    const int64_t next_n = b + 1 < b1 ? std::min(BS, len - (b + 1) * BS) : 0;
    const int64_t next = next_n ? static_cast<int64_t>(table[b + 1]) * BS : 0;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const Reader kb = Reader::at(K, slot0 * KVH + kh, KVH, j0, n, st.rows.data());
      for (int64_t i = 0, h = (kh - kh0) * G; i < G; ++i, ++h) {
        prefetch_rows(K, next, kh, KVH, i * next_n / G, (i + 1) * next_n / G);
        block_scores<DC>(st, h, kb, j0, n, scores + h * padded);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* sc = scores + h * padded;
      if (cap > 0.f) soft_cap16(sc, n, cap);
      float block_max = sc[j0];
      for (int64_t j = j0 + 1; j < n; ++j) block_max = std::max(block_max, sc[j]);
      const float m_new = std::max(st.m[h], block_max);
      const float correction = softmax_term(st.m[h] - m_new);
      for (int64_t c = 0; c < n; c += 16) store16(sc + c, softmax_terms(load16(sc + c) - m_new));
      for (int64_t j = 0; j < j0; ++j) sc[j] = 0.f;  // keys before the window
      st.l[h] = st.l[h] * correction + block_sum(sc, n);
      for (int64_t c = 0; c < DC; ++c) acc[h * DC + c] *= correction;
      st.m[h] = m_new;
    }
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const Reader vb = Reader::at(V, slot0 * KVH + kh, KVH, j0, n, st.rows.data());
      for (int64_t i = 0, h = (kh - kh0) * G; i < G; ++i, ++h) {
        prefetch_rows(V, next, kh, KVH, i * next_n / G, (i + 1) * next_n / G);
        add_values<DC>(scores + h * padded, vb, j0, n, acc + h * DC);
      }
    }
  }
}

// Query heads [h0, h0 + heads) of one token, D floats each, from one or more partial results
// over disjoint blocks of its keys (flash-decoding's merge): per head, with m the largest
// running max, out = sum_p acc_p e^(m_p - m) / sum_p l_p e^(m_p - m).
static void finish(const VecState* parts, int64_t count, int64_t h0, int64_t heads, int64_t D,
                   float* ot) {
  for (int64_t h = 0; h < heads; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < count; ++p) m = std::max(m, parts[p].m[h]);
    float l = 0.f;
    float* o = ot + (h0 + h) * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < count; ++p) {
      const VecState& part = parts[p];
      const float w = softmax_term(part.m[h] - m);
      l += part.l[h] * w;
      const float* acc = reinterpret_cast<const float*>(part.acc.data()) + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] += acc[d] * w;
    }
    const float inv = 1.f / l;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

#include "paged_prefill_cpu.cpp"

// work(i, state) for i in [0, count) over the threads, each taking the next i from a shared
// counter, so items of unequal cost (given dearest first) end together; `State` is each
// thread's scratch, kept between calls (at batch 1 its allocations cost about as much as the
// attention of a short sequence).
template <typename State, typename Work>
static void parallel_dynamic(int64_t count, Work&& work) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  team::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local State state;
    for (int64_t i = next++; i < count; i = next++) work(i, state);
  });
}

// Rows of a [T, heads, D] tensor whose last two dimensions are dense.
static void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.stride(2) == 1 &&
                  t.stride(1) == t.size(2),
              "pkv cpu attention: ", name, " must be float32 [T, heads, D] with dense rows");
}

// Every token's K/V rows into its slot, in the cache's format; slots are distinct, so tokens
// never collide.
static void write_kv(const at::Tensor& k, const at::Tensor& v, const kv_rows::Rows& K,
                     const kv_rows::Rows& V, int64_t slots, const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "pkv cpu attention: slot out of range");
  const auto put = [&](const kv_rows::Rows& R, const float* x, int64_t t, int64_t h) {
    kv_rows::store(x, R.kind, D, const_cast<uint8_t*>(R.row(slot[t] * KVH + h)));
  };
  // Quantizing rows costs a division per value: long prefills spread it over the threads.
  at::parallel_for(0, T, K.kind == kv_rows::Kind::F32 ? T : 16, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        put(K, kp + t * k.stride(0) + h * D, t, h);
        put(V, vp + t * v.stride(0) + h * D, t, h);
      }
  });
}

// A decode item: token `token` (an index into the step's per-token list) over KV heads
// [kh0, kh1) and blocks [b0, b1), part `part` of `parts` of its keys (`keys` of them, about).
struct VecItem {
  int64_t token, kh0, kh1, b0, b1, part, parts, keys;
};

// Keys per part of a long sequence, and parts at most (a part costs a merge and a cold start
// of its prefetches).
constexpr int64_t kPartKeys = 256;
constexpr int64_t kMaxParts = 8;

// The decode items of a step, longest first. Many tokens: one per (token, part of its keys),
// all KV heads (blocks read front to back). Few tokens (a batch-1 decode): one per (token, KV
// head, part), so that every core has work. A sequence of kPartKeys keys or more is cut into
// parts that come back together in finish() (flash-decoding): the cores' shares even out
// (three KV heads on two cores had one of them waiting a third of the time, and a batch's
// longest sequence kept one core busy alone). Parts depend on the keys alone, never on the
// threads or the batch, so a token's output is the same however it was scheduled. A split
// (token, KV heads)'s parts follow each other in the list, part 0 first.
template <typename FirstKey>
static std::vector<VecItem> vec_items(const std::vector<int64_t>& tokens, const int32_t* lens,
                                      const FirstKey& first_key, int64_t BS, int64_t KVH) {
  const int64_t NT = tokens.size();
  const bool few = NT < 2 * at::get_num_threads();
  std::vector<VecItem> items;
  for (int64_t i = 0; i < NT; ++i) {
    const int64_t len = lens[tokens[i]], lo = first_key(len);
    const int64_t first = lo / BS, last = (len + BS - 1) / BS, keys = len - lo;
    const int64_t parts = std::clamp<int64_t>(keys / kPartKeys, 1,
                                              std::min(kMaxParts, last - first));
    for (int64_t kh = 0; kh < (few ? KVH : 1); ++kh)
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({i, few ? kh : 0, few ? kh + 1 : KVH,
                         first + p * (last - first) / parts,
                         first + (p + 1) * (last - first) / parts, p, parts, keys / parts});
  }
  // Longest first: a batch lists its oldest (longest) sequences together, and halves of it
  // handed out statically left one core waiting on the other. (Stable: parts stay in order.)
  std::stable_sort(items.begin(), items.end(),
                   [](const VecItem& a, const VecItem& b) { return a.keys > b.keys; });
  return items;
}

// The decode kernel for D = 16 * DC over rows of `kind`: read in registers where the flavour
// can (csrc/kv_readers.h), else through a buffer of the block's widened rows.
template <typename Reader>
static auto vec_kernel_of(int64_t DC) {
  return DC == 1 ? attend_vec<1, Reader> : DC == 2 ? attend_vec<2, Reader>
         : DC == 4 ? attend_vec<4, Reader> : attend_vec<8, Reader>;
}

static auto vec_kernel(kv_rows::Kind kind, int64_t DC) {
  switch (kind) {
    case kv_rows::Kind::F32: return vec_kernel_of<kv_readers::F32>(DC);
#if defined(PKV_KV_READS_F16)
    case kv_rows::Kind::F16: return vec_kernel_of<kv_readers::F16>(DC);
#endif
#if defined(PKV_KV_READS_AVX2)
    case kv_rows::Kind::BF16: return vec_kernel_of<kv_readers::BF16>(DC);
    case kv_rows::Kind::I8: return vec_kernel_of<kv_readers::I8>(DC);
#endif
#if defined(PKV_KV_READS_FP8)
    case kv_rows::Kind::FP8: return vec_kernel_of<kv_readers::FP8>(DC);
#endif
    default: return vec_kernel_of<kv_readers::Widened>(DC);
  }
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_ids, const at::Tensor& kv_lens, double scale,
                     int64_t window, double soft_cap) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  block_tables.is_contiguous() && seq_ids.is_contiguous() &&
                  kv_lens.is_contiguous() && slot_mapping.is_contiguous(),
              "pkv cpu attention: contiguous caches, output and metadata expected");
  const int64_t D = q.size(2);
  TORCH_CHECK(kv_rows::supported(k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "pkv cpu attention: caches must both be float32, bfloat16, float16, int8 or "
              "fp8_e4m3");
  const kv_rows::Rows K = kv_rows::Rows::of(k_cache, D), V = kv_rows::Rows::of(v_cache, D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == D &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(3) * k_cache.element_size() == K.bytes &&
                  slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "pkv cpu attention: k/v, caches and slot_mapping disagree");
  write_kv(k, v, K, V, k_cache.size(0) * k_cache.size(1), slot_mapping);
  const int64_t T = q.size(0), H = q.size(1), QS = q.stride(0);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sid = seq_ids.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const auto first_key = [&](int64_t len) {
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
  };
  // Prefill runs of at least kMinRun tokens go to the tiled path, the rest (decodes, short
  // chunks) to the per-token one below; `tokens` lists the latter.
  std::vector<int64_t> tokens;
  if (D % 16 == 0) {
    std::vector<prefill::Item> items;
    tokens.reserve(T);
    for (int64_t t = 0; t < T;) {
      int64_t e = t + 1;
      while (e < T && sid[e] == sid[t] && lens[e] == lens[e - 1] + 1) ++e;
      if (e - t >= prefill::kMinRun) {
        const int64_t tq = prefill::tile_tokens(G);
        for (int64_t i = t; i < e; i += tq) {
          const int64_t n = std::min(tq, e - i);
          const int64_t span = lens[i + n - 1] - first_key(lens[i]);
          for (int64_t kh = 0; kh < KVH; ++kh) items.push_back({i, n, kh, span * n});
        }
      } else {
        for (int64_t i = t; i < e; ++i) tokens.push_back(i);
      }
      t = e;
    }
    if (!items.empty()) {  // dearest first: causal items differ in cost
      std::stable_sort(items.begin(), items.end(),
                       [](const prefill::Item& a, const prefill::Item& b) {
                         return a.cost > b.cost;
                       });
      parallel_dynamic<prefill::Buffers>(items.size(), [&](int64_t w, prefill::Buffers& buf) {
        const prefill::Item& it = items[w];
        const int32_t* table = bt + static_cast<int64_t>(sid[it.t0]) * MB;
        const auto slot_of = [&](int64_t pos) {
          return static_cast<int64_t>(table[pos / BS]) * BS + pos % BS;
        };
        prefill::attend_item(it, qp, QS, K, V, slot_of, lens, window, H, D, KVH, G, fscale, cap,
                             op, buf);
      });
    }
    if (tokens.empty()) return;
  } else {
    tokens.resize(T);
    for (int64_t t = 0; t < T; ++t) tokens[t] = t;
  }
  const int64_t NT = tokens.size();

  const int64_t DC = D % 16 == 0 ? D / 16 : 0;
  if (DC == 1 || DC == 2 || DC == 4 || DC == 8) {
    const auto run = vec_kernel(K.kind, DC);
    const std::vector<VecItem> items = vec_items(tokens, lens, first_key, BS, KVH);
    // Parts of a token's keys wait in `partial` for the merge; the caller's buffer, reused,
    // named by a reference so that the team's threads fill this thread's.
    thread_local std::vector<VecState> partial_states;
    std::vector<VecState>& partial = partial_states;
    if (partial.size() < items.size()) partial.resize(items.size());
    const auto write_item = [&](const VecItem& it, const VecState* parts) {  // its heads' rows
      finish(parts, it.parts, it.kh0 * G, (it.kh1 - it.kh0) * G, D, op + tokens[it.token] * H * D);
    };
    parallel_dynamic<VecState>(items.size(), [&](int64_t i, VecState& own) {
      const VecItem& it = items[i];
      const int64_t t = tokens[it.token];
      VecState& st = it.parts == 1 ? own : partial[i];
      run(qp + t * QS, K, V, bt + static_cast<int64_t>(sid[t]) * MB, lens[t], first_key(lens[t]),
          it.b0, it.b1, BS, KVH, it.kh0, it.kh1, G, fscale, cap, st);
      if (it.parts == 1) write_item(it, &st);
    });
    for (size_t i = 0; i < items.size(); ++i)  // each split (token, KV heads) once, merged
      if (items[i].parts > 1 && items[i].part == 0) write_item(items[i], &partial[i]);
    return;
  }
  team::parallel_for(0, NT * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS), acc(G * D), m(G), l(G), kbuf(BS * D), vbuf(BS * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = tokens[w / KVH], kh = w % KVH;
      const int64_t len = lens[t], lo = first_key(len);
      const int32_t* table = bt + static_cast<int64_t>(sid[t]) * MB;
      const float* qg = qp + t * QS + kh * G * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = lo / BS; b * BS < len; ++b) {
        const int64_t n = std::min(BS, len - b * BS);
        const int64_t j0 = std::max<int64_t>(0, lo - b * BS);
        const int64_t slot0 = static_cast<int64_t>(table[b]) * BS;
        const kv_readers::F32 kr = kv_readers::float_rows(K, slot0 * KVH + kh, KVH, j0, n,
                                                          kbuf.data());
        const kv_readers::F32 vr = kv_readers::float_rows(V, slot0 * KVH + kh, KVH, j0, n,
                                                          vbuf.data());
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * BS;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = j0; j < n; ++j) {
            s[j] = dot(qg + g * D, kr.p + j * kr.row, D) * fscale;
            if (cap > 0.f) s[j] = cap * std::tanh(s[j] / cap);
            block_max = std::max(block_max, s[j]);
          }
          const float m_new = std::max(m[g], block_max);
          const float correction = softmax_term(m[g] - m_new);
          float* a = acc.data() + g * D;
          l[g] *= correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t j = j0; j < n; ++j) {
            const float p = softmax_term(s[j] - m_new);
            l[g] += p;
            const float* vj = vr.p + j * vr.row;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vj[d];
          }
          m[g] = m_new;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (t * H + kh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}
