// 16-float vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones) and
// the math the CPU kernels share on them.
#pragma once

#include <cstdint>
#include <cstring>

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

static inline float hsum(vf16 v) {
  typedef float vf8 __attribute__((vector_size(32)));
  typedef float vf4 __attribute__((vector_size(16)));
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) as in Cephes' expf (~1 ulp): x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n
// built in the exponent bits. x is clamped to [-87.3, 88.3]: ~0 below, finite above.
static inline vf16 vexp(vf16 x) {
  const vf16 lo = vf16{} - 87.3f, hi = vf16{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  vf16 fx = x * 1.44269504088896341f + 0.5f;
  const vi16 ni = __builtin_convertvector(fx, vi16);  // truncates toward zero
  vf16 fn = __builtin_convertvector(ni, vf16);
  fn = fn > fx ? fn - 1.f : fn;  // floor
  x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vf16 y = 1.9875691500E-4f * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * (x * x) + x + 1.f;
  const vi16 pow2 = (__builtin_convertvector(fn, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  return y * scale;
}
