// Weights in ggml blocks through a decode batch (14 to 128 rows of x) with float32
// activations. Included by csrc/ggml_cpu.cpp.
//
// The one-weight-row GEMV (register_gemv_rows) takes each decoded weight vector through
// eight rows of x, loading a vector of x for every FMA: at 16 rows x outgrows L1 (576 inputs:
// 36 KB) and the loads, not the FMAs, set the pace (~35% of the FMA peak). Here x is
// transposed once per call, one vector holding one input of every row (kLanes rows), and
// each thread decodes P weight rows at a time into float32 in a buffer of its own, then
// multiplies: per input k, V vectors of x^T and P broadcast weights feed P x V FMAs into
// P x V accumulators, which stay in registers for the whole row. Every weight is decoded once
// for all the rows of x, every vector of x^T loaded once for P weight rows.

namespace ggml {
namespace {

#if defined(__AVX512F__)
constexpr int kAccumulators = 24;  // of 32 vector registers: the rest hold x^T
#else
constexpr int kAccumulators = 12;  // of 16
#endif
// Rows of x a pass takes: two vectors of x^T an input (more, on AVX2, left x^T in L2 with
// 4 loads of it per 12 FMAs: 0.85-1.0x the two-vector passes at 32 rows).
constexpr int64_t kBroadcastRows = 2 * kLanes;
// From here up to kBroadcastMaxRows rows ggml_linear takes this kernel, below it the GEMV. Two
// threads, old vs new build in one process, Q5_0 / Q8_0 576-input layers, Q6_K / Q4_K 1536-
// and 2048-input ones: 1.1-1.7x at 16 rows (AVX-512 and AVX2), 1.3-1.9x at 32 (AVX-512;
// AVX2 1.2-1.6x), 0.8-1.3x at 12 (one vector's lanes part empty on AVX-512; on AVX2 the
// GEMV's Q8_0 / Q6_K ran ahead). The generic flavour's 4 lanes gain from 8 rows.
constexpr int64_t kBroadcastMinRows = std::min<int64_t>(14, 2 * kLanes);
// Up to here, not the float GEMM on dequantized panels (passes in groups, each chunk of weights
// decoded once for a group): two threads, Q5_0 / Q8_0 576-input layers, Q4_K / Q6_K 1536-input
// ones, 896 x 4864 Q5_0, against the GEMM: AVX-512 1.2-1.4x at 64 rows, 1.0-1.4x at 128,
// 0.88-1.05x at 256; AVX2 1.0-1.17x at 64, 0.95-1.08x at 128. 8B shapes (Q4_K 14336 x 4096,
// Q6_K 4096 x 14336): AVX-512 1.14-1.56x at 64 rows, 1.03-1.22x at 128; AVX2 1.03x at 128.
constexpr int64_t kBroadcastMaxRows = 128;

// Values [v0, v0 + count) of a weight row as float32 into out (v0 and count whole blocks), by
// the register-level decoders where a type has one.
template <typename Block>
void decode_block32(const uint8_t* row, int64_t v0, int64_t count, float* out) {
  const uint8_t* b = row + v0 / 32 * Block::kBytes;
  for (int64_t i = 0; i < count; i += 32, b += Block::kBytes) {
    vf16 w0, w1;
    Block::weights(b, w0, w1);
    store16(out + i, w0);
    store16(out + i + 16, w1);
  }
}

template <typename Codes>
void decode_kquant(const uint8_t* row, int64_t v0, int64_t count, float* out) {
  KQuantBuffers k;
  const uint8_t* b = row + v0 / 256 * Codes::kBytes;
  for (int64_t i = 0; i < count; i += 256, b += Codes::kBytes) {
    Codes::decode(b, k);
    reload_buffers();
    for (int j = 0; j < 16; ++j) store16(out + i + 16 * j, run_weights<Codes>(k, j));
  }
}

template <bool kBf16>
void decode_half(const uint8_t* row, int64_t v0, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const uint8_t* b = row + 2 * (v0 + i);
    store16(out + i, kBf16 ? widen_bf16(b) : widen_f16(b));
  }
}

void decode(const Part& p, const uint8_t* row, int64_t v0, int64_t count, float* out) {
  switch (p.type) {
    case Q8_0: return decode_block32<Q8Block>(row, v0, count, out);
    case Q5_0: return decode_block32<Q5Block<false>>(row, v0, count, out);
    case Q5_1: return decode_block32<Q5Block<true>>(row, v0, count, out);
    case Q4_K: return decode_kquant<K4Codes<false>>(row, v0, count, out);
    case Q5_K: return decode_kquant<K4Codes<true>>(row, v0, count, out);
    case Q6_K: return decode_kquant<Q6KCodes>(row, v0, count, out);
    case BF16: return decode_half<true>(row, v0, count, out);
    case F16: return decode_half<false>(row, v0, count, out);
    default: return dequantize_run(p, row, v0, count, out);
  }
}

// Values [v0, v0 + count) of a weight row towards L1 (whole blocks), while a chunk computes.
inline void prefetch_values(const Part& p, const uint8_t* row, int64_t v0, int64_t count) {
  const uint8_t* from = row + v0 / p.fmt.values * p.fmt.bytes;
  const int64_t bytes = count / p.fmt.values * p.fmt.bytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(from + b);
}

// Lanes j of rows r and r + S exchanged where j has bit S set, for the rows with bit S clear:
// the step of a square transpose that swaps the off-diagonal S x S blocks.
template <int S>
inline void exchange_blocks(vfn (&rows)[kLanes]) {
  vin low, high;  // __builtin_shuffle's indices: below kLanes from the first vector
  for (int j = 0; j < kLanes; ++j) {
    low[j] = (j & S) ? kLanes + j - S : j;
    high[j] = (j & S) ? kLanes + j : j + S;
  }
  for (int r = 0; r < kLanes; ++r) {
    if (r & S) continue;
    const vfn a = rows[r], b = rows[r + S];
    rows[r] = __builtin_shuffle(a, b, low);
    rows[r + S] = __builtin_shuffle(a, b, high);
  }
}

// rows[i][j] <-> rows[j][i]: log2(kLanes) steps of kLanes two-vector shuffles.
template <int S = 1>
inline void transpose(vfn (&rows)[kLanes]) {
  if constexpr (S < kLanes) {
    exchange_blocks<S>(rows);
    transpose<2 * S>(rows);
  }
}

// A kernel's outputs, computed a column (weight row) at a time as V vectors of rows of x, held
// in that layout for up to kCols columns and written into y a row at a time. Written a column
// at a time, a column's 4-byte stores fell ldy apart, often a multiple of 4 KB (3072 or 49152
// outputs: every store in one L1 set); in the int8 tiles those stores took 28% of the kernel
// (Q5_0 3072 x 576, 64 rows).
template <int V, int64_t kCols>
class ColumnBuffer {
 public:
  explicit ColumnBuffer(int64_t first) : c0_(first) {}

  void put(int64_t n, const vfn (&column)[V]) {
    for (int v = 0; v < V; ++v) storev(cols_[n - c0_] + v * kLanes, column[v]);
  }

  // Columns [c0, c1) into rows [0, M) of y (+ bias) once the buffer is full or `last`:
  // kLanes columns at a time as square blocks transposed in registers, the rest one value at
  // a time. One value at a time throughout, this took 12% of the int8 tiles' time at 64 rows
  // of 576-input layers.
  void flush_if(bool last, int64_t c1, int64_t M, const float* bias, float* y, int64_t ldy) {
    if (!last && c1 - c0_ < kCols) return;
    int64_t c = c0_;
    for (; c + kLanes <= c1; c += kLanes) {
      const vfn b = bias != nullptr ? loadv(bias + c) : vfn{};
      for (int64_t m0 = 0; m0 < M; m0 += kLanes) {
        vfn block[kLanes];
        for (int j = 0; j < kLanes; ++j) block[j] = loadv(cols_[c + j - c0_] + m0);
        transpose(block);
        for (int64_t m = m0; m < std::min<int64_t>(M, m0 + kLanes); ++m)
          storev(y + m * ldy + c, block[m - m0] + b);
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = c; k < c1; ++k)
        y[m * ldy + k] = cols_[k - c0_][m] + (bias != nullptr ? bias[k] : 0.f);
    c0_ = c1;
  }

 private:
  int64_t c0_;  // the first column held
  alignas(64) float cols_[kCols][V * kLanes];
};

// x [M, K] as x^T of `width` (a multiple of kLanes, >= M) lanes an input: xt[k width + m] =
// x[m][k], zero past row M. At one vector's width (kPairs) two inputs at a time instead, each
// row's pair side by side: xt[k width + 2 m + j] = x[m][k + j] for even k (rows past
// kLanes / 2 in the second vector), for broadcast_chunk's pairs.
void transpose_rows(const float* x, int64_t M, int64_t K, int64_t width, std::vector<float>& xt) {
  xt.assign(K * width, 0.f);
  const bool pairs = width == kLanes;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      xt[pairs ? (k & ~int64_t{1}) * width + 2 * m + (k & 1) : k * width + m] = x[m * K + k];
}

// Passes of x that go through the weights together, each chunk of a tile's weight rows decoded
// once for all of them (here and in ggml_tiles_cpu.cpp): as many as keep their x^T (`bytes` a
// pass) within ~512 KB of L2, at most kMaxGroupPasses. A tile reads all of it per chunk of
// weights; on a Zen 5 (1 MB of L2) 768 KB ran 896 x 4864 Q5_0 (int8) at 64-256 rows
// 1.06-1.16x 256 KB's, other shapes level.
constexpr int64_t kMaxGroupPasses = 16;
inline int64_t group_passes(int64_t bytes) {
  return std::clamp<int64_t>((512 << 10) / bytes, 1, kMaxGroupPasses);
}

// Rows [0, M) of x as groups of passes of `pass_rows` rows (two vectors of x^T an input):
// group(m0, rows, width) for each, `width` lanes a pass, pass_bytes(width) bytes of x^T each.
// A last pass that one vector holds (40 rows: 32 + 8) goes alone at one vector's width, as the
// passes one at a time took it: in the group, two vectors with the second's lanes empty ran
// AVX-512 Q4_K 576 x 1536 at 40-48 rows 0.95x.
template <typename PassBytes, typename Group>
void in_groups(int64_t M, int64_t pass_rows, PassBytes&& pass_bytes, Group&& group) {
  const int64_t rest = M % pass_rows;
  const int64_t tail = pass_rows > kLanes && M > pass_rows && rest > 0 && rest <= kLanes ? rest : 0;
  const int64_t head = M - tail, width = head <= kLanes ? kLanes : pass_rows;
  const int64_t step = group_passes(pass_bytes(width)) * pass_rows;
  for (int64_t m0 = 0; m0 < head; m0 += step) group(m0, std::min(step, head - m0), width);
  if (tail > 0) group(head, tail, kLanes);
}

// A tile of P weight rows' accumulators for each pass of a group (V vectors of rows of x), and
// each pass's outputs on their way into y (ColumnBuffer): the broadcast kernel's and the int8
// tiles'.
template <int P, int V, int64_t kCols>
class PassOutputs {
 public:
  PassOutputs(int64_t passes, int64_t first_col)
      : passes_(passes), out_(passes, ColumnBuffer<V, kCols>(first_col)) {}

  void zero() {
    for (int64_t x = 0; x < passes_; ++x)
      for (int i = 0; i < P; ++i)
        for (int v = 0; v < V; ++v) acc_[x][i][v] = vfn{};
  }

  // chunk(x, acc) for each pass x, its accumulators in registers through the chunk.
  template <typename Chunk>
  __attribute__((always_inline)) void each(Chunk&& chunk) {
    for (int64_t x = 0; x < passes_; ++x) {
      vfn a[P][V];
      std::memcpy(a, acc_[x], sizeof a);
      chunk(x, a);
      std::memcpy(acc_[x], a, sizeof a);
    }
  }

  // Weight rows [n, n + rows) done: into each pass's buffer (passes `pass_rows` rows of x
  // apart, M rows in all, y the first row's outputs), written into y once full or `last`.
  void put(int64_t n, int64_t rows, bool last, int64_t pass_rows, int64_t M, const float* bias,
           float* y, int64_t ldy) {
    for (int64_t x = 0; x < passes_; ++x) {
      const int64_t first = x * pass_rows;
      for (int64_t i = 0; i < rows; ++i) out_[x].put(n + i, acc_[x][i]);
      out_[x].flush_if(last, n + rows, std::min(pass_rows, M - first), bias, y + first * ldy,
                       ldy);
    }
  }

 private:
  int64_t passes_;
  std::vector<ColumnBuffer<V, kCols>> out_;
  vfn acc_[kMaxGroupPasses][P][V];
};

// Two adjacent floats in every pair of lanes (one 64-bit broadcast).
inline vfn broadcast_pair(const float* p) {
  using vu64 = uint64_t __attribute__((vector_size(sizeof(vfn))));
  uint64_t pair;  // as bits: an integer + 0 is the broadcast itself, a float one is an add
  std::memcpy(&pair, p, sizeof pair);
  return (vfn)(vu64{} + pair);
}

// Lane m: lanes 2m and 2m + 1 of a then b summed (a pair layout's rows back in order).
inline vfn sum_pairs(vfn a, vfn b) {
  vin even, odd;
  for (int j = 0; j < kLanes; ++j) {
    even[j] = 2 * j;
    odd[j] = 2 * j + 1;
  }
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// acc[i][v] += w[i][k] xt[k][v] over `count` inputs: P weight rows at w (a row every kChunk
// floats) broadcast against V vectors of x^T an input. At one vector (V = 1) two inputs a
// step, so that each broadcast feeds two multiply-adds as at V = 2: a row's weights for k and
// k + 1 in every pair of lanes against x^T in pairs (transpose_rows), the pairs summed at the
// end. A multiply-add whose weight is broadcast from memory ran at ~60% of one on registers.
template <int P, int V>
__attribute__((always_inline)) inline void broadcast_chunk(const float* w, const float* xt,
                                                           int64_t count, vfn (&acc)[P][V]) {
  if constexpr (V == 1) {
    vfn pairs[P][2] = {};
    for (int64_t k = 0; k < count; k += 2, xt += 2 * kLanes) {
      const vfn x0 = loadv(xt), x1 = loadv(xt + kLanes);
#pragma GCC unroll 32
      for (int i = 0; i < P; ++i) {
        const vfn b = broadcast_pair(w + i * kChunk + k);
        pairs[i][0] += b * x0;
        pairs[i][1] += b * x1;
      }
    }
    for (int i = 0; i < P; ++i) acc[i][0] += sum_pairs(pairs[i][0], pairs[i][1]);
    return;
  }
  for (int64_t k = 0; k < count; ++k, xt += V * kLanes) {
    vfn xv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) xv[v] = loadv(xt + v * kLanes);
#pragma GCC unroll 32
    for (int i = 0; i < P; ++i) {
      const float b = w[i * kChunk + k];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[i][v] += b * xv[v];
    }
  }
}

// Rows [n0, n1) of part p through `passes` passes of x (x^T of each at xts; M rows in all, y
// their first row's outputs), P weight rows at a time, their inputs kChunk at a time (P x
// kChunk floats: at most 24 KB, in L1), each chunk decoded once for every pass.
template <int V>
void broadcast_rows(const Part& p, int64_t n0, int64_t n1, const float* const* xts,
                    int64_t passes, int64_t M, int64_t K, const float* bias, float* y,
                    int64_t ldy) {
  constexpr int P = kAccumulators / 2;  // V = 1 holds two vectors a row too (pairs)
  alignas(64) float w[P * kChunk];
  PassOutputs<P, V, 4 * P> out(passes, n0);
  for (int64_t n = n0; n < n1; n += P) {
    const int64_t rows = std::min<int64_t>(P, n1 - n);
    out.zero();
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t count = std::min(kChunk, K - k0);
      for (int64_t i = 0; i < rows; ++i) {
        const uint8_t* row = p.data + (n + i) * p.stride;
        decode(p, row, k0, count, w + i * kChunk);
        if (k0 + kChunk < K)  // the row's next chunk, or the next tile's row's first one
          prefetch_values(p, row, k0 + kChunk, std::min(kChunk, K - k0 - kChunk));
        else if (n + P + i < n1)
          prefetch_values(p, row + P * p.stride, 0, std::min(kChunk, K));
      }
      for (int64_t i = rows; i < P; ++i) std::fill(w + i * kChunk, w + i * kChunk + count, 0.f);
      out.each([&](int64_t x, vfn (&acc)[P][V]) {
        broadcast_chunk<P, V>(w, xts[x] + k0 * V * kLanes, count, acc);
      });
    }
    out.put(n, rows, n + rows == n1, kBroadcastRows, M, bias, y, ldy);
  }
}

// One vector of x^T an input (`width` kLanes: the call's rows fit one) or two.
void broadcast_part(const Part& p, int64_t n0, int64_t n1, const float* const* xts,
                    int64_t passes, int64_t width, int64_t M, int64_t K, const float* bias,
                    float* y, int64_t ldy) {
  if (width == kLanes) return broadcast_rows<1>(p, n0, n1, xts, passes, M, K, bias, y, ldy);
  return broadcast_rows<2>(p, n0, n1, xts, passes, M, K, bias, y, ldy);
}

// y [M, N] = x [M, K] @ W^T (+ bias), W the parts' rows one after another: passes of
// kBroadcastRows rows of x, transposed once in groups that go through the weights together
// (group_passes), each group split by weight rows between threads.
void broadcast_linear(const std::vector<Part>& ps, const float* x, int64_t M, int64_t K,
                      const float* bias, float* y, int64_t N) {
  // The caller's buffers, reused; named by a reference so that the team's threads read this
  // thread's, not their own thread_local ones.
  thread_local std::vector<std::vector<float>> transposed;
  std::vector<std::vector<float>>& xts = transposed;
  in_groups(M, kBroadcastRows, [&](int64_t width) { return K * width * 4; },
            [&](int64_t m0, int64_t rows, int64_t one_or_two) {
    // One vector's passes take the inputs in pairs: an odd K takes two vectors, half empty.
    const int64_t width = K % 2 == 0 ? one_or_two : 2 * kLanes;
    const int64_t passes = (rows + kBroadcastRows - 1) / kBroadcastRows;
    if (static_cast<int64_t>(xts.size()) < passes) xts.resize(passes);
    std::vector<const float*> at(passes);
    team::parallel_for(0, passes, 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t first = i * kBroadcastRows;
        transpose_rows(x + (m0 + first) * K, std::min(kBroadcastRows, rows - first), K, width,
                       xts[i]);
        at[i] = xts[i].data();
      }
    });
    // One loop over every part's rows: a thread's share may span two parts.
    team::parallel_for(0, rows_of(ps), 16, [&](int64_t a, int64_t b) {
      int64_t first = 0;
      for (const Part& p : ps) {
        const int64_t lo = std::max(a, first), hi = std::min(b, first + p.rows);
        if (lo < hi)
          broadcast_part(p, lo - first, hi - first, at.data(), passes, width, rows, K,
                         bias != nullptr ? bias + p.col : nullptr, y + m0 * N + p.col, N);
        first += p.rows;
      }
    });
  });
}

}  // namespace
}  // namespace ggml
