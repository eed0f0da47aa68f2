// 16-float vectors and the math the CPU kernels share on them.
//
// vf16 is 16 floats held as the CPU's native registers: one AVX-512 register, two AVX2 ones,
// four SSE2 or NEON ones. GCC's vector extensions would take a 64-byte vector type as it is
// on every CPU, but without AVX-512 GCC 12 lowers it through the stack (each store became
// four 16-byte moves and a spill), which made the AVX2 builds of every kernel 3-5x slower.
// A struct of native vectors, with operators that loop over its parts (unrolled at -O3),
// keeps the kernels written once for 16 lanes and every part in a register.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else  // SSE2, NEON
constexpr int kLanes = 4;
#endif
constexpr int kParts = 16 / kLanes;

typedef float vfn __attribute__((vector_size(kLanes * 4)));
typedef int32_t vin __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vun __attribute__((vector_size(kLanes * 4)));

// The name of the ISA flavour this translation unit is built for (pkv plugins prints it).
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
constexpr const char* kIsa = "avxvnni";
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
#elif defined(__aarch64__)
constexpr const char* kIsa = "generic (NEON)";
#else
constexpr const char* kIsa = "generic";
#endif

// Lane-wise operators of a struct of kParts native vectors of type V.
#define PKV_VEC16_OPS(T, V, S)                                                        \
  inline T operator+(T a, T b) { for (int i = 0; i < kParts; ++i) a.p[i] += b.p[i]; return a; } \
  inline T operator-(T a, T b) { for (int i = 0; i < kParts; ++i) a.p[i] -= b.p[i]; return a; } \
  inline T operator*(T a, T b) { for (int i = 0; i < kParts; ++i) a.p[i] *= b.p[i]; return a; } \
  inline T operator/(T a, T b) { for (int i = 0; i < kParts; ++i) a.p[i] /= b.p[i]; return a; } \
  inline T operator+(T a, S s) { for (int i = 0; i < kParts; ++i) a.p[i] += s; return a; }      \
  inline T operator-(T a, S s) { for (int i = 0; i < kParts; ++i) a.p[i] -= s; return a; }      \
  inline T operator*(T a, S s) { for (int i = 0; i < kParts; ++i) a.p[i] *= s; return a; }      \
  inline T operator+(S s, T a) { for (int i = 0; i < kParts; ++i) a.p[i] = s + a.p[i]; return a; } \
  inline T operator-(S s, T a) { for (int i = 0; i < kParts; ++i) a.p[i] = s - a.p[i]; return a; } \
  inline T operator*(S s, T a) { for (int i = 0; i < kParts; ++i) a.p[i] = s * a.p[i]; return a; } \
  inline T& operator+=(T& a, T b) { return a = a + b; }                                 \
  inline T& operator-=(T& a, T b) { return a = a - b; }                                 \
  inline T& operator*=(T& a, T b) { return a = a * b; }                                 \
  inline T& operator*=(T& a, S s) { return a = a * s; }

struct vf16 {
  vfn p[kParts];
};
PKV_VEC16_OPS(vf16, vfn, float)

inline vf16 operator-(vf16 a) { return 0.f - a; }
inline vf16 operator/(float s, vf16 a) {
  for (int i = 0; i < kParts; ++i) a.p[i] = s / a.p[i];
  return a;
}

// 16 unsigned 32-bit words (bit fields of packed weights).
struct vu16 {
  vun p[kParts];
};

inline vu16 operator|(vu16 a, vu16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] |= b.p[i];
  return a;
}
inline vu16 operator|(vu16 a, uint32_t s) {
  for (int i = 0; i < kParts; ++i) a.p[i] |= s;
  return a;
}
inline vu16 operator&(vu16 a, uint32_t s) {
  for (int i = 0; i < kParts; ++i) a.p[i] &= s;
  return a;
}
inline vu16 operator<<(vu16 a, int n) {
  for (int i = 0; i < kParts; ++i) a.p[i] <<= n;
  return a;
}
inline vu16 operator>>(vu16 a, int n) {
  for (int i = 0; i < kParts; ++i) a.p[i] >>= n;
  return a;
}

// Each word with its 16-bit halves swapped (a rotation by 16): one byte shuffle per native
// vector (vpshufb, vprold, rev32), where shifts and an or take three instructions on AVX2.
inline vu16 swap_halves(vu16 a) {
#if defined(__clang__)  // no __builtin_shuffle: the shifts, which clang may fold itself
  return (a << 16) | (a >> 16);
#else
  typedef uint16_t vhn __attribute__((vector_size(kLanes * 4)));
  typedef int16_t vhi __attribute__((vector_size(kLanes * 4)));
  vhi pairs;
  for (int i = 0; i < 2 * kLanes; ++i) pairs[i] = static_cast<int16_t>(i ^ 1);
  for (int i = 0; i < kParts; ++i)
    a.p[i] = reinterpret_cast<vun>(__builtin_shuffle(reinterpret_cast<vhn>(a.p[i]), pairs));
  return a;
#endif
}

// `a` unchanged, opaque to the optimizer: a value derived from it is computed from it, not
// re-derived from what `a` was made of (GCC turns ((r & m1) | e) & ~m2 back into two
// instructions on r, where one on the shared value was the point).
inline vu16 opaque(vu16 a) {
  for (int i = 0; i < kParts; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+x"(a.p[i]));
#elif defined(__aarch64__)
    asm("" : "+w"(a.p[i]));
#endif
  }
  return a;
}

// Every vector of an array of accumulators set to 0, in registers. `= {}` on an array this
// large became a call to memset and the accumulators' reloads, once per group of a GEMV's
// inputs (~3% of a batch-1 4-bit step).
template <size_t N>
inline void zero(vf16 (&a)[N]) {
  for (auto& v : a)
    for (int i = 0; i < kParts; ++i) v.p[i] = vfn{};
}

template <typename T, size_t N>
inline void zero(T (&a)[N]) {
  for (auto& inner : a) zero(inner);
}

// The same 64 bytes read as floats.
inline vf16 as_floats(vu16 bits) {
  vf16 f;
  for (int i = 0; i < kParts; ++i) f.p[i] = reinterpret_cast<vfn>(bits.p[i]);
  return f;
}

// One native vector from or to memory (unaligned).
inline vfn loadv(const float* p) {
  vfn v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vfn v) { std::memcpy(p, &v, sizeof(v)); }

// Loads and stores go part by part: a memcpy of the whole struct is copied through the stack.
inline vf16 load16(const float* p) {
  vf16 v;
  for (int i = 0; i < kParts; ++i) v.p[i] = loadv(p + i * kLanes);
  return v;
}

inline void store16(float* p, vf16 v) {
  for (int i = 0; i < kParts; ++i) storev(p + i * kLanes, v.p[i]);
}

inline vu16 load16u(const void* p) {
  vu16 v;
  for (int i = 0; i < kParts; ++i)
    std::memcpy(&v.p[i], static_cast<const char*>(p) + i * sizeof(vun), sizeof(vun));
  return v;
}

// 16 bytes widened to unsigned 32-bit lanes, and lanes to floats. Intrinsics on x86: GCC 12
// widened a vector of bytes through general registers, one byte at a time.
inline vu16 widen_u8(const uint8_t* p) {
  vu16 v;
#if defined(__AVX512F__)
  v.p[0] = (vun)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h)
    v.p[h] = (vun)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h)));
#else
  for (int i = 0; i < kParts; ++i)
    for (int j = 0; j < kLanes; ++j) v.p[i][j] = p[i * kLanes + j];
#endif
  return v;
}

// The same from 16 bytes in a register.
typedef uint8_t vb16 __attribute__((vector_size(16)));
inline vu16 widen_u8(vb16 bytes) {
  vu16 v;
#if defined(__AVX512F__)
  v.p[0] = (vun)_mm512_cvtepu8_epi32((__m128i)bytes);
#elif defined(__AVX2__)
  v.p[0] = (vun)_mm256_cvtepu8_epi32((__m128i)bytes);
  v.p[1] = (vun)_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)bytes, 8));
#else
  for (int i = 0; i < kParts; ++i)
    for (int j = 0; j < kLanes; ++j) v.p[i][j] = bytes[i * kLanes + j];
#endif
  return v;
}

inline vf16 to_floats(vu16 a) {
  vf16 f;
  for (int i = 0; i < kParts; ++i) f.p[i] = __builtin_convertvector((vin)a.p[i], vfn);
  return f;
}

inline float hsum(vfn v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float hsum(vf16 v) {
  vfn a = v.p[0];
  for (int i = 1; i < kParts; ++i) a += v.p[i];
  return hsum(a);
}

#if defined(__AVX2__)
// 8 floats summed as a tree: the two halves, then pairs (3 dependent adds, not 7).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// v's lanes summed as a tree where the ISA has one; hsum's loop elsewhere.
inline float hsum_tree(vfn v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX2__)
  return hsum8(reinterpret_cast<__m256>(v));
#else
  return hsum(v);
#endif
}

// exp(x) as in Cephes' expf (~1 ulp): x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n
// built in the exponent bits. x is clamped to [-87.3, 88.3]: ~0 below, finite above.
inline vfn vexp(vfn x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  vfn fx = x * 1.44269504088896341f + 0.5f;
  const vin ni = __builtin_convertvector(fx, vin);  // truncates toward zero
  vfn fn = __builtin_convertvector(ni, vfn);
  fn = fn > fx ? fn - 1.f : fn;  // floor
  x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vfn y = 1.9875691500E-4f * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * (x * x) + x + 1.f;
  const vin pow2 = (__builtin_convertvector(fn, vin) + 127) << 23;
  vfn scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  return y * scale;
}

// exp(x) for softmax terms, x <= 0 (-inf included): within 3 ulp above -20 and 5 below, 0
// below -87.3, where 2^n would leave the normal range, and NaN for NaN. Cheaper than vexp:
// n = round(x / ln2) is read off the mantissa of x / ln2 + 1.5 * 2^23 (no conversions),
// r = x - n ln2 takes one FMA, and exp(r) on |r| <= ln2 / 2 is a degree-5 polynomial fitted
// for relative error.
inline vfn vexp_neg(vfn x) {
  const vfn t = x * 1.44269504f + 12582912.f;  // 1.5 * 2^23: the mantissa's low bits hold n
  const vfn n = t - 12582912.f;
  const vfn r = x - n * 0.693147181f;
  vfn y = 8.31252523e-3f * r + 4.18901145e-2f;
  y = y * r + 1.66671142e-1f;
  y = y * r + 4.99992311e-1f;
  y = y * r + 1.f;
  y = y * r + 1.f;
  vun bits;  // unsigned: the shift wraps n's sign bits out, defined
  std::memcpy(&bits, &t, sizeof(bits));
  const vun pow2 = (bits << 23) + (127u << 23);  // (n + 127) << 23: the 1.5 * 2^23 shifts out
  vfn scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  const vin kept = reinterpret_cast<vin>(y * scale) & ~(x < -87.3f);  // NaN stays NaN
  vfn out;
  std::memcpy(&out, &kept, sizeof(out));
  return out;
}

inline vf16 vexp(vf16 x) {
  for (int i = 0; i < kParts; ++i) x.p[i] = vexp(x.p[i]);
  return x;
}

// f.template operator()<M>() with M = rows, 1 to 8 (8 for more): the GEMVs take their row count
// as a template parameter so that every row's accumulators stay in registers.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    case 7: return f.template operator()<7>();
    default: return f.template operator()<8>();
  }
}
