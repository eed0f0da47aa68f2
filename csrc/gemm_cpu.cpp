// Float32 linear layers at decode batch sizes on CPU: y = x @ W^T (+ bias), W in nn.Linear's
// plain layout, without a packed copy of the weight.
//
//   x     [M, K]   float32, contiguous
//   w     [N, K]   float32, contiguous
//   bias  [N]      float32 or empty
//   y     [M, N]
//
// A GEMM keeps a small block of one operand in L1 and broadcasts the other against it. BLAS
// libraries broadcast x and want W packed into column panels: oneDNN packs a copy of W on
// every call (~7% of the product at 256 rows) because pkv keeps one plain copy, the layout
// the GEMVs read. Here the roles are swapped: x is the operand packed, transposed into blocks
// of kBlockRows rows (x^T [K, kBlockRows]: a few hundred KB for a whole batch, in L2), and W
// is broadcast a float at a time straight from its rows. The micro-kernel multiplies kPanel
// weight rows (a panel: kPanel x kc floats, in L1) by one x^T block: kPanel x 2 vectors of
// accumulators, per input one broadcast per weight row and two vector loads of x^T. Each
// thread owns a run of panels and sweeps every block of x through each: the weight is read
// once per kChunkBlocks blocks of x. The accumulators hold y^T, stored transposed.
//
// On a Zen 5, two AVX2 threads, SmolLM2's linears at 256 rows (each layer's own weight, run
// interleaved with oneDNN): qkv 1.05-1.07x oneDNN, o 1.02-1.05x, gate_up level to 1.02x, down
// 0.94-0.97x (~225-235 GFLOP/s of a 257-262 peak); at 32-128 rows 1.1-1.35x. From 512 rows
// oneDNN is level or ahead (down: 243 against 209 GFLOP/s), and with AVX-512 it is level or
// ahead at every size, so f32_linear takes this kernel on the AVX2 flavour up to kMaxRows rows
// only, and on every flavour when it is given an output to write into (no copy).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "f32_operands.h"
#include "vec_math.h"

namespace f32gemm {

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kMaxRows = 256;  // f32_linear takes this kernel up to here, oneDNN above
#else
constexpr int64_t kMaxRows = 0;  // oneDNN (AVX-512: level or ahead; others: not measured)
#endif

namespace {

constexpr int kPanel = 6;                     // weight rows per micro-kernel
constexpr int kVecs = 2;                      // vectors of x^T columns per micro-kernel
constexpr int64_t kBlockRows = kVecs * kLanes;  // rows of x per packed block
constexpr int64_t kChunkBlocks = 16;          // blocks of x swept per pass over the weight
constexpr int64_t kMaxChunkK = 768;           // longer K goes in chunks of about kChunkK
constexpr int64_t kChunkK = 512;

// y[m, i] (= or +=) sum_k w[i][k] xt[k][m] for R weight rows (stride ldw) and the block's
// `rows` rows of x; bias (first chunk only) may be null.
template <int64_t R>
void micro(const float* w, int64_t ldw, int64_t kc, const float* xt, const float* bias,
           float* y, int64_t ldy, int64_t rows, bool first) {
  vfn acc[R][kVecs] = {};
  const float* wr[R];
  for (int64_t i = 0; i < R; ++i) wr[i] = w + i * ldw;
  for (int64_t k = 0; k < kc; ++k) {
    vfn xv[kVecs];
    for (int v = 0; v < kVecs; ++v) xv[v] = loadv(xt + k * kBlockRows + v * kLanes);
    for (int i = 0; i < R; ++i) {
      const float b = wr[i][k];
      for (int v = 0; v < kVecs; ++v) acc[i][v] += b * xv[v];
    }
  }
  float yt[R][kBlockRows];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) storev(&yt[i][v * kLanes], acc[i][v]);
  for (int64_t m = 0; m < rows; ++m) {
    float* out = y + m * ldy;
    for (int i = 0; i < R; ++i)
      out[i] = first ? yt[i][m] + (bias ? bias[i] : 0.f) : out[i] + yt[i][m];
  }
}

// x^T in blocks: xt[b][k][j] = x[b * kBlockRows + j][k], zero past the last row.
at::Tensor pack_transposed(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  at::Tensor xt = at::empty({blocks, K, kBlockRows}, at::kFloat);  // every float written below
  float* xp = xt.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* block = xp + b * K * kBlockRows;
      const int64_t rows = std::min(kBlockRows, M - b * kBlockRows);
      if (rows < kBlockRows) std::fill(block, block + K * kBlockRows, 0.f);
      for (int64_t j = 0; j < rows; ++j) {
        const float* row = x + (b * kBlockRows + j) * K;
        for (int64_t k = 0; k < K; ++k) block[k * kBlockRows + j] = row[k];
      }
    }
  });
  return xt;
}

}  // namespace

// y = x @ w^T (+ bias) by the weight-broadcast kernel above, any number of rows; into `out`
// when given.
at::Tensor f32_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                    const std::optional<at::Tensor>& out) {
  const auto [M, K, N, has_bias] = check_f32_operands("f32_gemm", x, w, bias);
  at::Tensor y = f32_output("f32_gemm", out, x, M, N);
  if (M == 0 || N == 0) return y;
  if (K == 0) return has_bias ? y.copy_(bias.expand({M, N})) : y.zero_();
  const at::Tensor xt = pack_transposed(x.data_ptr<float>(), M, K);
  const float* xtp = xt.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows, panels = (N + kPanel - 1) / kPanel;
  const int64_t chunks = K <= kMaxChunkK ? 1 : (K + kChunkK - 1) / kChunkK;
  const int64_t kc_max = (K / chunks + 7) / 8 * 8;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunkBlocks) {
      const int64_t b1 = std::min(blocks, b0 + kChunkBlocks);
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kPanel, r = std::min<int64_t>(kPanel, N - n0);
          with_rows(r, [&]<int64_t R>() {  // R = r: at most kPanel
            for (int64_t b = b0; b < b1; ++b)
              micro<R>(wp + n0 * K + k0, K, kc, xtp + (b * K + k0) * kBlockRows,
                       bp ? bp + n0 : nullptr, yp + b * kBlockRows * N + n0, N,
                       std::min(kBlockRows, M - b * kBlockRows), k0 == 0);
          });
        }
      }
    }
  });
  return y;
}

}  // namespace f32gemm
