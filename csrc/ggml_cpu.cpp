// Linear layers on weights in ggml's block formats, as a GGUF file stores them, on CPU:
//
//   x      [M, K]   float32, contiguous
//   parts  [n_p, row_bytes] uint8 each: the output rows of one fused part (q, k, v), every
//          row K values in blocks of its type (a row stride above row_bytes is a column slice)
//   types  [P] int64: each part's ggml type id
//   y      [M, sum n_p] = x @ dequantize(parts)^T (+ bias)
//
// A block holds 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and F32/F16/BF16 read as blocks of
// 32) or 256 (the K-quants Q2_K..Q6_K) behind one or a few scales. Nothing is unpacked at
// load: the weights stay at the file's size, mapped from it. At few rows (decode) each thread
// walks its share of the weight rows once, dequantizing them in registers or 256 values at a
// time into a buffer in L1 and taking every row of x through them: the arithmetic is that of
// transformers on the dequantized weight, up to summation order. A decode batch (14-32 rows)
// takes x transposed against broadcast weights (ggml_broadcast_cpu.cpp). At more rows
// (prefill) the dequantizing costs nothing against the multiply: panels of rows are
// dequantized to float32 and multiplied by torch's GEMM.
//
// The block layouts and their formulas are ggml's (ggml-common.h, ggml-quants.c).
//
// One translation unit in parts, included below in this order:
//   ggml_blocks_cpu.cpp     each type's reader of one block, a layer's parts
//   ggml_float_cpu.cpp      float32 x: the GEMVs (weights decoded in registers) and the panels
//   ggml_q8_cpu.cpp         int8 x: x quantized per block, the K-quants' and Q8_0's GEMVs
//   ggml_groups_cpu.cpp     int8 x, 1 to a few rows: the 32-value types four blocks at a time
//   ggml_broadcast_cpu.cpp  float32 x, a decode batch: x transposed against decoded weights
//   ggml_tiles_cpu.cpp      int8 x, 5 rows or more: tiles of byte dot products
// and this file's ops (ggml_linear, ggml_rows, ggml_dequantize) choose between them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "team.h"
#include "vec_math.h"

namespace ggml {

enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

struct Format {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

// Values and bytes of one block of `type`; {0, 0} for a type the kernels do not read.
inline Format format(int64_t type) {
  switch (type) {
    case F32: return {32, 128};
    case F16: return {32, 64};
    case BF16: return {32, 64};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

// Rows of x the fused GEMV takes in one pass over the weight; up to kGemvPassRows rows take
// passes of it (with float32 x, from kBroadcastMinRows to kBroadcastMaxRows, the broadcast
// kernel instead), more take dequantized panels and the float32 GEMM (two AVX-512 threads: a
// Q8_0 LM head of 49152 x 576 took 23 ms for 32 rows in passes, 44 ms for 64, panels 27 ms
// for 65; 2048 x 2048 layers of every type alike). With int8 x the tiles
// (ggml_tiles_cpu.cpp) come first, taking the parts they read from 5 rows (the K-quants from
// 12), so the int8 GEMVs only see few rows.
constexpr int64_t kMaxRows = 16;
constexpr int64_t kGemvPassRows = 32;
constexpr int64_t kChunk = 256;  // values dequantized at a time: one K-block, 8 small ones

}  // namespace ggml

#include "ggml_blocks_cpu.cpp"
#include "ggml_float_cpu.cpp"
#include "ggml_q8_cpu.cpp"
#include "ggml_groups_cpu.cpp"
#include "ggml_broadcast_cpu.cpp"
#include "ggml_tiles_cpu.cpp"

namespace ggml {

// y = x @ W^T (+ bias), W the parts' rows one after another (module docstring above); with
// activation_bits 8, x in int8 where a kernel takes it: the tiles (ggml_tiles_cpu.cpp) the parts
// they take, from 5 rows; of the others, the int8 GEMVs (ggml_q8_cpu.cpp) the K-quants and the
// 32-value types at few rows (Q4_0, Q4_1, Q5_0: ggml_groups_cpu.cpp); the rest float32.
at::Tensor ggml_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                       const at::Tensor& types, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& out, int64_t activation_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "ggml_linear: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<Part> ps = check_parts(parts, types, K);
  int64_t N = 0;
  for (const Part& p : ps) N += p.rows;
  const bool has_bias = bias.has_value() && bias->defined() && bias->numel() > 0;
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->numel() == N),
              "ggml_linear: bias must be contiguous float32 [N]");
  at::Tensor y;
  if (out.has_value()) {
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->dim() == 2 &&
                    out->size(0) == M && out->size(1) == N,
                "ggml_linear: out must be contiguous float32 [", M, ", ", N, "]");
    y = *out;
  } else {
    y = at::empty({M, N}, x.options());
  }
  TORCH_CHECK(activation_bits == 32 || activation_bits == 8,
              "ggml_linear: activation_bits must be 32 or 8, got ", activation_bits);
  if (M == 0) return y;
  const float* bd = has_bias ? bias->data_ptr<float>() : nullptr;
#if defined(__AVX2__)
  // The caller's buffers, reused (no allocation on a decode step); named by a reference so
  // that the team's threads read this thread's, not their own thread_local ones.
  thread_local Q8Rows buffers256, buffers32;
  Q8Rows &x256 = buffers256, &x32 = buffers32;
  // The parts the tiles take, each on its own: a layer of types the tiles read and types they
  // do not (Q5_0 with AVX2's Q8_0: SmolLM2's or Qwen2.5-0.5B's Q4_K_M attention) keeps them
  // for the first. (No copies of the parts where none is tiled: a decode step's usual case.)
  const auto tiles = [&](const Part& p) {
    return activation_bits == 8 && int8_tile_part(p.type, M);
  };
  const bool any_tiled = std::any_of(ps.begin(), ps.end(), tiles);
  std::vector<Part> tiled, others;
  if (any_tiled) {
    for (const Part& p : ps) (tiles(p) ? tiled : others).push_back(p);
    quantize_q8(x.data_ptr<float>(), M, K, 32, x32);
    tile_linear(tiled, x32, M, K, bd, y.data_ptr<float>(), N);
    if (others.empty()) return y;
  }
  const std::vector<Part>& rest = any_tiled ? others : ps;
#else
  const std::vector<Part>& rest = ps;
#endif
  const auto takes_int8 = [&](const Part& p) {
    return activation_bits == 8 && (int8_kquant(p.type) || int8_block32(p.type, M));
  };
  const bool int8 = std::any_of(rest.begin(), rest.end(), takes_int8);
  if (!int8 && M >= kBroadcastMinRows && M <= kBroadcastMaxRows) {
    broadcast_linear(rest, x.data_ptr<float>(), M, K, bd, y.data_ptr<float>(), N);
    return y;
  }
  if (M > kGemvPassRows) {
    const bool fresh = !out.has_value() && rest.size() == ps.size();  // (no part tiled)
    gemm(rest, x, has_bias ? bias : std::nullopt, y, fresh);
    return y;
  }
#if defined(__AVX2__)
  const auto any = [&](auto takes) { return std::any_of(rest.begin(), rest.end(), takes); };
  if (any([&](const Part& p) { return takes_int8(p) && int8_kquant(p.type); }))
    quantize_q8(x.data_ptr<float>(), M, K, kQ8Block, x256);
  if (!any_tiled && any([&](const Part& p) { return takes_int8(p) && !int8_kquant(p.type); }))
    quantize_q8(x.data_ptr<float>(), M, K, 32, x32);
  thread_local Q8Groups buffer_groups;  // Q5_0, Q8_0 at few rows (ggml_groups_cpu.cpp)
  Q8Groups& groups = buffer_groups;
  const auto grouped = [&](const Part& p) {
    return activation_bits == 8 && int8_grouped(p.type, M);
  };
  if (any(grouped)) group_q8(x32, M, groups);
#endif
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // passes of up to kMaxRows rows of x
    const int64_t rows = std::min(kMaxRows, M - m0);
    const float* xd = x.data_ptr<float>() + m0 * K;
    float* yd = y.data_ptr<float>() + m0 * N;
    // One loop over every part's rows: a thread's share may span two parts.
    team::parallel_for(0, rows_of(rest), 16, [&](int64_t a, int64_t b) {
      int64_t first = 0;
      for (const Part& p : rest) {
        const int64_t lo = std::max(a, first) - first, hi = std::min(b, first + p.rows) - first;
        const float* bp = bd ? bd + p.col : nullptr;
        float* yp = yd + p.col;
#if defined(__AVX2__)
        if (lo < hi && grouped(p))
          groups_gemv(p, lo, hi, groups, rows, bp, yp, N);
        else if (lo < hi && int8 && takes_int8(p))
          q8_part(p, lo, hi, x256, x32, m0, rows, bp, yp, N);
        else
#endif
        if (lo < hi)
          gemv_part(p, p.type, lo, hi, xd, rows, K, bp, yp, N);
        first += p.rows;
      }
    });
  }
  return y;
}

// Whether the tiles (ggml_tiles_cpu.cpp) take every part of a layer of these ggml types at
// `rows` rows of int8 x.
bool ggml_int8_tiles(const at::Tensor& types, int64_t rows) {
  const at::Tensor t = types.to(at::kLong).contiguous();
  const int64_t* id = t.data_ptr<int64_t>();
  return std::all_of(id, id + t.numel(), [&](int64_t type) { return int8_tile_part(type, rows); });
}

// Rows `ids` of a table in ggml blocks ([V, row_bytes]) as float32 [T, K]: an embedding lookup.
at::Tensor ggml_rows(const at::Tensor& data, int64_t type, const at::Tensor& ids, int64_t K) {
  const Part p = check_part(data, type, K, "ggml_rows");
  const at::Tensor idx = ids.to(at::kLong).contiguous().view({-1});
  const int64_t T = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < p.rows, "ggml_rows: token id ", id[t],
                " is outside the table's ", p.rows, " rows");
  at::Tensor out = at::empty({T, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) dequantize_run(p, p.data + id[t] * p.stride, 0, K, o + t * K);
  });
  return out;
}

// The whole table as float32 [rows, K].
at::Tensor ggml_dequantize(const at::Tensor& data, int64_t type, int64_t K) {
  const Part p = check_part(data, type, K, "ggml_dequantize");
  at::Tensor out = at::empty({p.rows, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, p.rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) dequantize_run(p, p.data + r * p.stride, 0, K, o + r * K);
  });
  return out;
}

}  // namespace ggml
