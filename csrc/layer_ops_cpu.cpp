// The small operations of a decoder layer, fused, for float32 on CPU. In torch each of them
// is 5-20 separate kernels and as many passes over memory; at batch 1 the launch cost of
// those dominates the step once the weights are 4-bit.
//
//   rms_norm(out, x, w, eps)           out = w * (x * rsqrt(mean(x^2) + eps)), per row
//   add_rms_norm(x, residual, w, eps)  residual += x; x = rms_norm(residual), both in place
//   head_rms_norm(out, x, w, eps)      rms_norm of each head of x [T, H, D] (rows may be
//                                      strided views of a fused qkv); out may be x
//   rotary(positions, q, k, cos, sin)  rotate-half RoPE on q [T, H, D] and k [T, KVH, D] in
//                                      place (rows may be strided views of a fused qkv);
//                                      cos/sin [max_len, R], each half repeated: the first
//                                      R <= D dims rotate (partial rotary), the rest stay
//   silu_and_mul(out, x)               out = silu(x[:, :I]) * x[:, I:] for x [T, 2I]
//   gelu_tanh_and_mul(out, x)          out = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU)
//
// The arithmetic follows transformers' order (normalize, then scale; x1*c - x2*s), so results
// match torch's to a rounding or two (the sum of squares is accumulated in another order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "team.h"
#include "vec_math.h"

namespace {

// Rows per thread below which splitting work across threads costs more than it saves.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

float sum_squares(const float* x, int64_t n) {
  vf16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf16 v = load16(x + i);
    acc += v * v;
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

void normalize_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, load16(w + i) * (load16(x + i) * inv));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "rms_norm: x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 &&
                  w.size(0) == x.size(-1),
              "rms_norm: weight must be float32 [hidden]");
}

}  // namespace

// rows x n floats: out = w * normalize(x); out may be x.
void rms_norm_rows(float* out, const float* x, const float* w, int64_t rows, int64_t n,
                   float eps) {
  team::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(out + r * n, x + r * n, w, n, eps);
  });
}

// rows x n floats: residual += x, then x = w * normalize(residual).
void add_rms_norm_rows(float* x, float* residual, const float* w, int64_t rows, int64_t n,
                       float eps) {
  team::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * n;
      float* rr = residual + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      normalize_row(xr, rr, w, n, eps);
    }
  });
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == at::kFloat,
              "rms_norm: out must be like x");
  const int64_t n = x.size(-1);
  rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                x.numel() / n, n, static_cast<float>(eps));
}

void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                  double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == at::kFloat,
              "add_rms_norm: residual must be like x");
  const int64_t n = x.size(-1);
  add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                    x.numel() / n, n, static_cast<float>(eps));
}

void head_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && out.sizes() == x.sizes() &&
                  out.scalar_type() == at::kFloat && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "head_rms_norm: x and out must be float32 [T, H, D] with dense rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(2),
              "head_rms_norm: weight must be float32 [D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  team::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h)
        normalize_row(op + t * os + h * D, xp + t * xs + h * D, wp, D, static_cast<float>(eps));
  });
}

namespace {

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.stride(2) == 1 &&
                  t.stride(1) == t.size(2) && t.size(2) % 2 == 0,
              "rotary: ", name, " must be float32 [T, heads, D] with dense rows, D even");
}

// One head: x1' = x1 c - x2 s, x2' = x2 c + x1 s over the two halves.
void rotate(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

}  // namespace

void rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
            const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && positions.numel() == T &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary: positions [T] int64 and k [T, KVH, D] must match q");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) <= D && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && sin.scalar_type() == at::kFloat,
              "rotary: cos/sin must be float32 [max_len, R], R even and <= D");
  const int64_t R = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t len = cos.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < len, "rotary: position ", pos[t], " outside the table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t H = q.size(1), KVH = k.size(1);
  team::parallel_for(0, T, grain((H + KVH) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * R;
      const float* s = sp + pos[t] * R;
      for (int64_t h = 0; h < H; ++h) rotate(qp + t * q.stride(0) + h * D, c, s, R / 2);
      for (int64_t h = 0; h < KVH; ++h) rotate(kp + t * k.stride(0) + h * D, c, s, R / 2);
    }
  });
}

namespace {

// out = act(x[:, :I]) * x[:, I:] for x [T, 2I]; `Act` computes act(g) 16 lanes at a time
// (vf16) and one at a time (float).
template <typename Act>
void act_and_mul(const at::Tensor& out, const at::Tensor& x, const char* name, Act act) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) % 2 == 0,
              name, ": x must be contiguous float32 [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == T && out.size(1) == I,
              name, ": out must be contiguous float32 [T, I]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  team::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) store16(o + i, act(load16(g + i)) * load16(u + i));
      for (; i < I; ++i) o[i] = act(g[i]) * u[i];
    }
  });
}

struct Silu {
  vf16 operator()(vf16 g) const { return g / (1.f + vexp(-g)); }
  float operator()(float g) const { return g / (1.f + std::exp(-g)); }
};

// gelu(g) with the tanh approximation, as torch's approximate="tanh":
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (1 + exp(2y)).
struct GeluTanh {
  static constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  vf16 operator()(vf16 g) const {
    const vf16 y = kAlpha * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.f + (1.f - 2.f / (1.f + vexp(2.f * y))));
  }
  float operator()(float g) const {
    return 0.5f * g * (1.f + std::tanh(kAlpha * (g + 0.044715f * g * g * g)));
  }
};

}  // namespace

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  act_and_mul(out, x, "silu_and_mul", Silu{});
}

void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& x) {
  act_and_mul(out, x, "gelu_tanh_and_mul", GeluTanh{});
}
