// The tiled, flash-attention style path of csrc/paged_attention_cpu.cpp for prefill chunks
// (runs of at least kMinRun tokens of one sequence; that file's header says how it works),
// also the work of csrc/bidirectional_attention_cpu.cpp's encoder attention. Included by
// csrc/paged_attention_cpu.cpp after the decode path's helpers (dot, soft_cap16, ...).

namespace prefill {

constexpr int64_t kMinRun = 16;  // shorter runs (and decodes) take the per-token path
constexpr int64_t kTileK = 128;  // keys per tile

// Tokens per item: G * tokens rows of about 64-128 (a multiple of 32 but for a run's last).
inline int64_t tile_tokens(int64_t G) { return G >= 3 ? 32 : 64; }

// The products work on native vectors (vfn: kLanes floats), which GCC keeps in registers
// better than arrays of vf16. Register blocking per flavour: S^T tiles of kSR keys x kSC
// vectors of columns, O tiles of kPR rows x kPC vectors of D (accumulators: 16-24 zmm on
// AVX-512, 12 ymm on AVX2, 8 xmm on SSE2/NEON).
#if defined(__AVX512F__)
constexpr int kSR = 8, kSC = 2, kPR = 6, kPC = 4;
#elif defined(__AVX__)
constexpr int kSR = 6, kSC = 2, kPR = 6, kPC = 2;
#else
constexpr int kSR = 2, kSC = 4, kPR = 2, kPC = 4;
#endif

// st[r * MP + kLanes * c ...] = sum_d key[r][d] * qt[d * MP + kLanes * c ...], r < MR, c < NC;
// cmax[kLanes * c ...] takes the max of its column's new scores (the softmax's max, masks aside).
template <int MR, int NC>
static inline void s_tile(const float* const* key, const float* qt, int64_t MP, int64_t D,
                          float* st, float* cmax) {
  vfn acc[MR][NC] = {};
  const float* kr[MR];
  for (int r = 0; r < MR; ++r) kr[r] = key[r];
  for (int64_t d = 0; d < D; ++d) {
    vfn qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = loadv(qt + d * MP + kLanes * c);
    for (int r = 0; r < MR; ++r) {
      const float kv = kr[r][d];
      for (int c = 0; c < NC; ++c) acc[r][c] += kv * qv[c];
    }
  }
  for (int c = 0; c < NC; ++c) {
    vfn mx = loadv(cmax + kLanes * c);
    for (int r = 0; r < MR; ++r) {
      storev(st + r * MP + kLanes * c, acc[r][c]);
      mx = mx > acc[r][c] ? mx : acc[r][c];
    }
    storev(cmax + kLanes * c, mx);
  }
}

// o[r * D + kLanes * c ...] = o[...] * corr[r] + sum_{j < n} pt[j * MP + r] * val[j][kLanes * c ...].
template <int MR, int NC>
static inline void pv_tile(const float* const* val, int64_t n, const float* pt, int64_t MP,
                           const float* corr, float* o, int64_t D) {
  vfn acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = loadv(o + r * D + kLanes * c) * corr[r];
  for (int64_t j = 0; j < n; ++j) {
    vfn vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = loadv(val[j] + kLanes * c);
    for (int r = 0; r < MR; ++r) {
      const float p = pt[j * MP + r];
      for (int c = 0; c < NC; ++c) acc[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) storev(o + r * D + kLanes * c, acc[r][c]);
}

// S^T [n keys x MP columns] = K Q^T (MP: a multiple of 32), and each column's max in cmax.
static void scores(const float* const* key, int64_t n, const float* qt, int64_t MP, int64_t D,
                   float* st, float* cmax) {
  std::fill(cmax, cmax + MP, -std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < MP; c += kSC * kLanes) {
    int64_t j = 0;
    for (; j + kSR <= n; j += kSR)
      s_tile<kSR, kSC>(key + j, qt + c, MP, D, st + j * MP + c, cmax + c);
    for (; j < n; ++j) s_tile<1, kSC>(key + j, qt + c, MP, D, st + j * MP + c, cmax + c);
  }
}

// O [M rows x D] = O * corr + P V, P given as P^T [n x MP].
static void accumulate(const float* const* val, int64_t n, const float* pt, int64_t MP,
                       int64_t M, const float* corr, float* o, int64_t D) {
  const float* vrow[kTileK];
  int64_t d = 0;
  for (; d + kPC * kLanes <= D; d += kPC * kLanes) {
    for (int64_t j = 0; j < n; ++j) vrow[j] = val[j] + d;
    int64_t r = 0;
    for (; r + kPR <= M; r += kPR) pv_tile<kPR, kPC>(vrow, n, pt + r, MP, corr + r, o + r * D + d, D);
    for (; r < M; ++r) pv_tile<1, kPC>(vrow, n, pt + r, MP, corr + r, o + r * D + d, D);
  }
  for (; d < D; d += kLanes) {  // D / kLanes not a multiple of kPC
    for (int64_t j = 0; j < n; ++j) vrow[j] = val[j] + d;
    int64_t r = 0;
    for (; r + kPR <= M; r += kPR) pv_tile<kPR, 1>(vrow, n, pt + r, MP, corr + r, o + r * D + d, D);
    for (; r < M; ++r) pv_tile<1, 1>(vrow, n, pt + r, MP, corr + r, o + r * D + d, D);
  }
}

struct Item {
  int64_t t0, tokens, kh, cost;  // first token, tokens in the tile, KV head, keys x tokens
};

struct Buffers {
  std::vector<float> qt, st, o, m, l, corr, cmax;
  std::vector<float> lo, len;  // per row: its keys are [lo, len) (exact: below 2^24)
  std::vector<const float*> key, val;
  std::vector<float> keys, vals;  // a tile's widened rows (non-float32 caches)
};

// Online softmax over a tile's scores S^T [n x MP] (keys k0 ...), kLanes rows (columns) at a
// time: running max m and sum l per row, corr = exp(m_old - m_new) for the accumulators, and
// st overwritten with P^T. Masked: keys outside a row's [lo, len) get probability 0, and the
// max is taken again over the keys a row sees (unmasked, scores() took it: b.cmax).
template <bool kMasked>
static void softmax_tile(float* st, int64_t n, int64_t MP, int64_t k0, Buffers& b) {
  const vfn ninf = vfn{} - std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < MP; c += kLanes) {
    vfn lo{}, len{};
    if (kMasked) lo = loadv(b.lo.data() + c), len = loadv(b.len.data() + c);
    const auto seen = [&](int64_t j) {  // which of the kLanes rows see key k0 + j
      const vfn pos = vfn{} + static_cast<float>(k0 + j);
      return (pos >= lo) & (pos < len);
    };
    // Unmasked tiles took each row's max from the S product's registers (cmax).
    vfn mx = kMasked ? ninf : loadv(b.cmax.data() + c);
    if (kMasked) {
      for (int64_t j = 0; j < n; ++j) {
        const vfn x = seen(j) ? loadv(st + j * MP + c) : ninf;
        mx = mx > x ? mx : x;
      }
    }
    const vfn m_old = loadv(b.m.data() + c);
    const vfn m_new = m_old > mx ? m_old : mx;  // finite: m starts at -1e30
    vfn sum{};
    for (int64_t j = 0; j < n; ++j) {
      vfn p = vexp_neg(loadv(st + j * MP + c) - m_new);
      if (kMasked) p = seen(j) ? p : vfn{};
      storev(st + j * MP + c, p);
      sum += p;
    }
    const vfn corr = vexp_neg(m_old - m_new);
    storev(b.corr.data() + c, corr);
    storev(b.l.data() + c, loadv(b.l.data() + c) * corr + sum);
    storev(b.m.data() + c, m_new);
  }
}

// One item: tokens [t0, t0 + tokens) of one run (kv_lens rising by one), KV head kh; key
// position pos sits in cache slot slot_of(pos) (through a block table, or in place).
template <typename SlotOf>
static void attend_item(const Item& it, const float* qp, int64_t QS, const kv_rows::Rows& K,
                        const kv_rows::Rows& V, const SlotOf& slot_of, const int32_t* lens,
                        int64_t window, int64_t H, int64_t D, int64_t KVH, int64_t G,
                        float scale, float cap, float* op, Buffers& b) {
  const int64_t M = it.tokens * G, MP = (M + 31) / 32 * 32;
  const bool in_place = K.kind == kv_rows::Kind::F32;
  b.qt.assign(D * MP, 0.f);
  b.st.resize(kTileK * MP);
  b.o.assign(MP * D, 0.f);
  b.m.assign(MP, -1e30f);  // finite: exp(m_old - m_new) stays a number while rows see nothing
  b.l.assign(MP, 0.f);
  b.corr.resize(MP);
  b.cmax.resize(MP);
  b.lo.resize(MP);
  b.len.resize(MP);
  b.key.resize(kTileK);
  b.val.resize(kTileK);
  if (!in_place) b.keys.resize(kTileK * D), b.vals.resize(kTileK * D);
  float* qt = b.qt.data();
  float* st = b.st.data();
  for (int64_t i = 0; i < it.tokens; ++i) {
    const int64_t n = lens[it.t0 + i];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    const float* qrow = qp + (it.t0 + i) * QS + it.kh * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      b.lo[m] = static_cast<float>(lo);
      b.len[m] = static_cast<float>(n);
      for (int64_t d = 0; d < D; ++d) qt[d * MP + m] = qrow[g * D + d] * scale;
    }
  }
  for (int64_t m = M; m < MP; ++m) b.lo[m] = b.lo[M - 1], b.len[m] = b.len[M - 1];
  // Keys any row sees: [first row's window start, last row's length). Rows see all of a
  // tile when it lies in [last row's window start, first row's length).
  const auto first_key = [&](int64_t len) {
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
  };
  const int64_t first_len = lens[it.t0], last_len = lens[it.t0 + it.tokens - 1];
  const int64_t k_begin = first_key(first_len), k_end = last_len;
  const int64_t full_lo = first_key(last_len), full_hi = first_len;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
    const int64_t n = std::min(kTileK, k_end - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = k0 + j;
      const int64_t r = slot_of(pos) * KVH + it.kh;
      if (in_place) {
        b.key[j] = reinterpret_cast<const float*>(K.row(r));
        b.val[j] = reinterpret_cast<const float*>(V.row(r));
      } else {
        kv_rows::load(K.row(r), K.kind, D, b.keys.data() + j * D);
        kv_rows::load(V.row(r), V.kind, D, b.vals.data() + j * D);
        b.key[j] = b.keys.data() + j * D;
        b.val[j] = b.vals.data() + j * D;
      }
    }
    scores(b.key.data(), n, qt, MP, D, st, b.cmax.data());
    if (cap > 0.f) soft_cap16(st, n * MP, cap);  // then the max is taken again (masked)
    if (cap > 0.f || k0 < full_lo || k0 + n > full_hi) {
      softmax_tile<true>(st, n, MP, k0, b);
    } else {
      softmax_tile<false>(st, n, MP, k0, b);
    }
    accumulate(b.val.data(), n, st, MP, M, b.corr.data(), b.o.data(), D);
  }
  for (int64_t i = 0; i < it.tokens; ++i) {
    float* orow = op + (it.t0 + i) * H * D + it.kh * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      const float inv = 1.f / b.l[m];
      for (int64_t d = 0; d < D; ++d) orow[g * D + d] = b.o[m * D + d] * inv;
    }
  }
}

}  // namespace prefill
