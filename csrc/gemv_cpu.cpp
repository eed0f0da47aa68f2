// Float32 linear layers at few rows on CPU: y = x @ W^T (+ bias), W in nn.Linear's plain layout.
//
//   x     [M, K]   float32, contiguous
//   w     [N, K]   float32, contiguous (the weight as loaded: no packed copy)
//   bias  [N]      float32 or empty
//   y     [M, N]
//
// At a few rows a linear layer reads its whole weight to do two FLOPs per float: it is a
// stream from memory, and what matters is how close the stream runs to the memory's speed.
// oneDNN on its packed layout and MKL both run SmolLM2's 30 layers of GEMVs well below it when
// every layer's weight comes from DRAM, as in a decode step (two AVX2 threads: oneDNN ~12 GB/s,
// MKL ~15.5, this kernel ~18-19; a plain read ~18). Here each thread walks groups of four
// weight rows front to back and takes every row of x through the group while its 4 x K floats
// sit in L1: the weight is read from memory once however many rows there are, and x (a few KB
// a row) stays in L2. Software prefetches keep the stream going: a kilobyte ahead in each row
// at one row of x, else the next group spread over the passes of kRowBlock rows (prefetching
// only in the first pass left memory idle through the others: 4-8 rows 1.1-1.2x, 16 ~1.07x).
//
// The inner product of a row of x with a row of W is a sum over K in native vectors, ended by
// one horizontal sum per (row of x, row of W). Rows of x go kRowBlock at a time (its
// kRowBlock x 4 accumulators and the 4 weight vectors must fit the register file); at one row,
// two sets of accumulators alternate over K so that eight chains of FMAs hide the FMA latency.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "f32_operands.h"
#include "team.h"
#include "vec_math.h"

namespace gemv {
namespace {

// Up to this many rows f32_linear takes the GEMV; above, a GEMM (`gemm` below).
// SmolLM2's 30 layers with cold weights, two threads: on an Intel Xeon (AVX2 and AVX-512) the
// GEMV was 1.1-1.5x the faster of oneDNN and MKL at 1-16 rows, 1.03-1.07x at 24, 0.95-0.98x at
// 32; on an AMD Zen 5, AVX2 alike (1.15x oneDNN at 24, level at 32), but with AVX-512 the
// GEMV is 1.12x oneDNN at 8 rows, level at 12 and 0.75x at 16 (oneDNN's AVX-512 GEMM runs
// twice its AVX2 rate there; this GEMV is bound by its two loads per FMA).
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 12;
#else
constexpr int64_t kMaxRows = 24;
#endif
constexpr int64_t kOuts = 4;          // weight rows (outputs) per group
constexpr int64_t kAhead = 256;       // floats a single pass prefetches ahead in each row
constexpr int64_t kGroupsPerTask = 8; // groups a thread takes at a time (32 outputs)
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRowBlock = 4;  // 32 vector registers: 16 accumulators + 4 weights + 1 x
#else
constexpr int kRowBlock = 2;  // 16 vector registers: 8 accumulators + 4 weights + 1 x
#endif

// What a pass prefetches while it computes: its own weight rows kAhead floats ahead (one
// pass: the rows stream once), or lines of the next group spread over its K loop (several
// passes: memory streams while every pass computes, not only the first).
struct Prefetch {
  bool rows_ahead;
  const float* from;
  int64_t lines;
};

// y[r, o] (+ bias[o]) for rows [0, R) of x and the O (<= kOuts) weight rows at w; K in whole
// vectors up to K_vec, the rest one float at a time.
template <int R, int O>
void group_rows(const float* x, int64_t K, const float* w, const float* bias, float* y,
                int64_t ldy, Prefetch ahead) {
  constexpr int S = R == 1 ? 2 : 1;  // accumulator sets alternating over K
  vfn acc[S][R][O];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; ++o) acc[s][r][o] = vfn{};
  constexpr int64_t kStep = S * kLanes;  // floats of a weight row per iteration
  const int64_t K_vec = K - K % kStep;
  const int64_t per_step = (ahead.lines * kStep + K_vec - 1) / std::max<int64_t>(K_vec, 1);
  int64_t line = 0;
  for (int64_t k = 0; k < K_vec; k += kStep) {
    if (ahead.rows_ahead && k % 16 == 0) {  // every 64-byte line once
      for (int o = 0; o < O; ++o)
        for (int64_t l = 0; l < kStep; l += 16) __builtin_prefetch(w + o * K + k + kAhead + l);
    }
    for (const int64_t end = std::min(ahead.lines, line + per_step); line < end; ++line)
      __builtin_prefetch(ahead.from + line * 16);
    for (int s = 0; s < S; ++s) {
      vfn wv[O];
      for (int o = 0; o < O; ++o) wv[o] = loadv(w + o * K + k + s * kLanes);
      for (int r = 0; r < R; ++r) {
        const vfn xv = loadv(x + r * K + k + s * kLanes);
        for (int o = 0; o < O; ++o) acc[s][r][o] += xv * wv[o];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) {
      vfn total = acc[0][r][o];
      for (int s = 1; s < S; ++s) total += acc[s][r][o];
      float sum = hsum(total) + (bias ? bias[o] : 0.f);
      for (int64_t k = K_vec; k < K; ++k) sum += x[r * K + k] * w[o * K + k];
      y[r * ldy + o] = sum;
    }
  }
}

// Every row of x through the O weight rows at w (one group), in passes of kRowBlock rows and
// one of the rest; with several passes, each prefetches its share of the next group (the next
// 4 x K floats of W, contiguous).
template <int O>
void group(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y,
           int64_t ldy) {
  const int64_t passes = M / kRowBlock + (M % kRowBlock != 0), lines = kOuts * K / 16;
  const float* next = w + O * K;
  auto share = [&](int64_t pass) {
    if (passes == 1) return Prefetch{true, next, 0};
    const int64_t first = lines * pass / passes;
    return Prefetch{false, next + first * 16, lines * (pass + 1) / passes - first};
  };
  int64_t r = 0, pass = 0;
  for (; r + kRowBlock <= M; r += kRowBlock, ++pass)
    group_rows<kRowBlock, O>(x + r * K, K, w, bias, y + r * ldy, ldy, share(pass));
  const int64_t rest = M - r;
  x += r * K;
  y += r * ldy;
  if (rest == 1) group_rows<1, O>(x, K, w, bias, y, ldy, share(pass));
  if constexpr (kRowBlock > 2) {
    if (rest == 2) group_rows<2, O>(x, K, w, bias, y, ldy, share(pass));
  }
  if constexpr (kRowBlock > 3) {
    if (rest == 3) group_rows<3, O>(x, K, w, bias, y, ldy, share(pass));
  }
}

}  // namespace

at::Tensor f32_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                    const std::optional<at::Tensor>& out) {
  const auto [M, K, N, has_bias] = check_f32_operands("f32_gemv", x, w, bias);
  at::Tensor y = f32_output("f32_gemv", out, x, M, N);
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = (N + kOuts - 1) / kOuts;
  team::parallel_for(0, groups, kGroupsPerTask, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * kOuts;
      const float* wg = wp + n * K;
      const float* bn = bp ? bp + n : nullptr;
      switch (std::min(kOuts, N - n)) {
        case 4: group<4>(xp, M, K, wg, bn, yp + n, N); break;
        case 3: group<3>(xp, M, K, wg, bn, yp + n, N); break;
        case 2: group<2>(xp, M, K, wg, bn, yp + n, N); break;
        default: group<1>(xp, M, K, wg, bn, yp + n, N); break;
      }
    }
  });
  return y;
}

// Many rows: oneDNN's GEMM on the plain weight (it packs a copy of the weight per call, ~7% of
// the product at 256 rows), where torch has oneDNN; else torch's own linear (MKL's sgemm).
// MKL runs its generic code on AMD CPUs: SmolLM2's linears at 256 rows on a Zen 5, two
// threads, reach 168 GFLOP/s in MKL on AVX2 and 164 on AVX-512, 215 and 378 in oneDNN (1.3-1.5x
// and 2.0-2.4x from 25 rows up); on Intel the two were level at 64-256 rows, oneDNN ahead below.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>);
  static const auto onednn = []() -> std::optional<c10::TypedOperatorHandle<Linear>> {
    const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!at::hasMKLDNN() || !op.has_value()) return std::nullopt;
    return op->typed<Linear>();
  }();
  if (!onednn.has_value() || x.dim() != 2) return at::linear(x, w, bias);
  // oneDNN reads a strided bias as if it were contiguous (torch 2.13): give it a dense one.
  const std::optional<at::Tensor> b = bias.has_value() ? std::optional(bias->contiguous()) : bias;
  // oneDNN builds (JIT-compiles) and caches a primitive per shape, up to 1024 of them: every
  // prefill length a server sees would add ~0.2 MB (a short soak's memory never levelled).
  // Rows are padded to a multiple of 8 (32 from 512 rows), so a model's linears need a few
  // hundred primitives at most; the padding costs at most 7 rows in 32, 31 in 512.
  const int64_t rows = x.size(0), step = rows < 512 ? 8 : 32;
  const int64_t padded = (rows + step - 1) / step * step;
  at::Tensor xp = x;
  if (padded != rows) {
    xp = at::zeros({padded, x.size(1)}, x.options());
    xp.narrow(0, 0, rows).copy_(x);
  }
  const at::Tensor y = onednn->call(xp, w, b, "none", c10::List<std::optional<at::Scalar>>(), "");
  return padded == rows ? y : y.narrow(0, 0, rows);
}

// The float32 linear layer of the CPU path, all on the same plain weight: this GEMV up to
// kMaxRows rows, csrc/gemm_cpu.cpp's GEMM up to f32gemm::kMaxRows (a decode batch, on the AVX2
// flavour), `gemm` above. Given `out` (the LM head's logits buffer), the GEMM takes every row
// count above the GEMV's on every flavour: it writes in place, where oneDNN's output would be
// fresh memory to copy from (SmolLM2's head at 256 rows, AVX-512: 35.3 ms against 46.3).
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& out) {
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const bool plain = w.is_contiguous() && (!b.defined() || b.is_contiguous());
  TORCH_CHECK(!out.has_value() || x.dim() == 2, "f32_linear: out needs a 2-D x");
  if (x.dim() == 2 && plain && x.size(0) <= kMaxRows) return f32_gemv(x.contiguous(), w, b, out);
  if (x.dim() == 2 && plain && (x.size(0) <= f32gemm::kMaxRows || out.has_value()))
    return f32gemm::f32_gemm(x.contiguous(), w, b, out);
  const at::Tensor y = gemm(x, w, bias);
  return out.has_value() ? f32_output("f32_linear", out, x, x.size(0), w.size(0)).copy_(y) : y;
}

}  // namespace gemv
