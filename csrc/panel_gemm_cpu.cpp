// The panel GEMM: y[M, 32-column tile] (+)= x[M, kc] @ panel[kc, 32], for any number of rows.
// Included by csrc/awq_cpu.cpp inside its anonymous namespace (kTile, the vf16 helpers and
// team::parallel_for come from there); csrc/int8_cpu.cpp's GEMM uses it too (one unit:
// csrc/kernels_cpu.cpp).
//
// Each thread takes whole 32-column tiles; per tile and block of kPanelK inputs, the caller's
// `fill` decodes the weights into a float panel (32 KB, in L1), then every row of x is
// multiplied by it with a register-blocked micro-kernel.

// Micro-kernel of R rows x V vf16 column blocks: AVX-512 8 x 32 (16 zmm accumulators), AVX2
// 6 x 16 (12 ymm), SSE2/NEON 2 x 16 (8 xmm); the panel rows and one broadcast fill the rest.
constexpr int64_t kPanelK = 256;  // inputs per panel: 256 x 32 floats = 32 KB
#if defined(__AVX512F__)
constexpr int kPanelRows = 8, kPanelVecs = 2;
#elif defined(__AVX__)
constexpr int kPanelRows = 6, kPanelVecs = 1;
#else
constexpr int kPanelRows = 2, kPanelVecs = 1;
#endif

// Rows [0, R) times columns [16 c0, 16 (c0 + V)) of the panel; y is overwritten when first.
// A block too small to fill the FMA pipes (under 6 native-vector chains) runs even and odd
// inputs into two accumulator sets (S = 2), as the GEMV does at one or two rows.
template <int R, int V>
void panel_block(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                 int64_t ldy, int c0, bool first) {
  constexpr int S = R * V * kParts < 6 ? 2 : 1;
  vf16 acc[S][R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      acc[0][r][v] = first ? vf16{} : load16(y + r * ldy + (c0 + v) * 16);
      if constexpr (S == 2) acc[S - 1][r][v] = vf16{};
    }
  const float* b = panel + c0 * 16;
  int64_t k = 0;
  if constexpr (S == 2) {
    for (; k + 2 <= kc; k += 2, b += 2 * kTile) {
      vf16 w0[V], w1[V];
      for (int v = 0; v < V; ++v) {
        w0[v] = load16(b + v * 16);
        w1[v] = load16(b + kTile + v * 16);
      }
      for (int r = 0; r < R; ++r) {
        const float x0 = x[r * ldx + k], x1 = x[r * ldx + k + 1];
        for (int v = 0; v < V; ++v) {
          acc[0][r][v] += x0 * w0[v];
          acc[S - 1][r][v] += x1 * w1[v];
        }
      }
    }
  }
  for (; k < kc; ++k, b += kTile) {
    vf16 w[V];
    for (int v = 0; v < V; ++v) w[v] = load16(b + v * 16);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int v = 0; v < V; ++v) acc[0][r][v] += xv * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      store16(y + r * ldy + (c0 + v) * 16, S == 2 ? acc[0][r][v] + acc[S - 1][r][v] : acc[0][r][v]);
}

template <int R>
void panel_rows_of(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                   int64_t ldy, bool first) {
  for (int c0 = 0; c0 < 2; c0 += kPanelVecs)
    panel_block<R, kPanelVecs>(x, ldx, panel, kc, y, ldy, c0, first);
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

template <int... R>
constexpr std::array<PanelFn, sizeof...(R)> panel_table(std::integer_sequence<int, R...>) {
  return {&panel_rows_of<R + 1>...};
}

// All M rows of x [M, ldx] (pointing at the panel's first input) times a panel [kc, 32] into
// y [M, ldy] (32 columns), in the fewest blocks of at most kPanelRows rows, their sizes as
// even as can be (8 rows on AVX2: 4 + 4, not 6 + 2).
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t kc,
                float* y, int64_t ldy, bool first) {
  static constexpr auto table = panel_table(std::make_integer_sequence<int, kPanelRows>());
  const int64_t blocks = (M + kPanelRows - 1) / kPanelRows, rows = M / blocks,
                longer = M % blocks;  // the first `longer` blocks take rows + 1
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t r = rows + (b < longer);
    table[r - 1](x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, first);
    m += r;
  }
}

// The GEMM driver: tiles split over threads; per tile and block of kPanelK inputs, `fill`
// writes the float panel [kc, 32], then every row is multiplied by it. The last tile, when N
// pads it, goes through a [M, 32] scratch copied out.
template <typename Fill>
void panel_gemm(const float* xp, int64_t M, int64_t K, int64_t N, float* yp, const Fill& fill) {
  const int64_t NT = (N + kTile - 1) / kTile;
  team::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float panel[kPanelK * kTile];  // 32 KB: L1
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, n = std::min(kTile, N - n0);
      float* y = yp + n0;
      int64_t ldy = N;
      if (n < kTile) {
        scratch.resize(M * kTile);
        y = scratch.data();
        ldy = kTile;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kPanelK) {
        const int64_t kc = std::min(kPanelK, K - k0);
        fill(panel, t, k0, kc);
        panel_rows(xp + k0, K, M, panel, kc, y, ldy, k0 == 0);
      }
      if (n < kTile)
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(yp + m * N + n0, y + m * kTile, n * sizeof(float));
    }
  });
}
