// The operands of the float32 linear kernels (csrc/gemv_cpu.cpp's f32_gemv and f32_linear,
// csrc/gemm_cpu.cpp's f32_gemm): x [M, K] and w [N, K] contiguous float32, bias [N] or empty,
// and the output y [M, N], new or the caller's `out`.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

struct F32Operands {
  int64_t M, K, N;
  bool has_bias;
};

inline F32Operands check_f32_operands(const char* name, const at::Tensor& x, const at::Tensor& w,
                                      const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.size(1) == x.size(1),
              name, ": w must be contiguous float32 [N, K] with x's K");
  const int64_t N = w.size(0);
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                            bias.numel() == N),
              name, ": bias must be contiguous float32 [N]");
  return {x.size(0), x.size(1), N, has_bias};
}

// `out` when given (checked: contiguous float32 [M, N]), else a new tensor. A caller that
// produces a large output every step passes the same `out` each time: a fresh one of more
// than 32 MB is a new mmap from glibc, and its first touch page-faults (SmolLM2's 50 MB of
// logits at 256 rows: ~14 ms of a ~400 ms step).
inline at::Tensor f32_output(const char* name, const std::optional<at::Tensor>& out,
                             const at::Tensor& x, int64_t M, int64_t N) {
  if (!out.has_value()) return at::empty({M, N}, x.options());
  TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->dim() == 2 &&
                  out->size(0) == M && out->size(1) == N,
              name, ": out must be contiguous float32 [", M, ", ", N, "]");
  return *out;
}
