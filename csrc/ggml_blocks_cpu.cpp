// ggml's block formats one block at a time: each type's reader of one block into 32 or 256
// floats (the formulas of ggml-quants.c's dequantize_row_*), and a layer's parts (the rows of
// q, k, v, ... as the file stores them) checked against their types. Included by
// csrc/ggml_cpu.cpp after its types and formats.

namespace ggml {
namespace {

// Every float16 bit pattern's float, so that a block's scale is one load: converting a scalar
// (vpinsrw, vcvtph2ps, a broadcast) took ~5 vector instructions a block, a quarter of a Q5_0
// block's work in a one-row GEMV. Filled when the kernels load; read-only after.
struct HalfTable {
  float value[1 << 16];
  HalfTable() {
    for (uint32_t h = 0; h < (1u << 16); ++h)
      value[h] = c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(h));
  }
};
const HalfTable kHalfFloats;

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kHalfFloats.value[h];
}

inline uint32_t word(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

void q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((q[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(q[j] & 0xF) + m;
    y[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
  }
}

// Each byte value's 8 bits spread over 8 bytes as 0 or 0x10 (bit i -> byte i): Q5's fifth
// bits, read 8 at a time, in a form the value loops vectorize over.
struct FifthBits {
  uint64_t of[256];
  constexpr FifthBits() : of() {
    for (int v = 0; v < 256; ++v)
      for (int i = 0; i < 8; ++i)
        if (v & (1 << i)) of[v] |= uint64_t{0x10} << (8 * i);
  }
};
constexpr FifthBits kFifthBits;

// Q5_0 and Q5_1: the fifth bit of value j in bit j of qh.
void q5(const uint8_t* q, uint32_t qh, float d, float m, int offset, float* y) {
  uint8_t high[32];
  for (int i = 0; i < 4; ++i) {
    const uint64_t spread = kFifthBits.of[(qh >> (8 * i)) & 0xFF];
    std::memcpy(high + 8 * i, &spread, 8);
  }
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(((q[j] & 0xF) | high[j]) - offset) + m;
    y[j + 16] = d * static_cast<float>(((q[j] >> 4) | high[j + 16]) - offset) + m;
  }
}

void q5_0(const uint8_t* b, float* y) { q5(b + 6, word(b + 2), half(b), 0.0f, 16, y); }
void q5_1(const uint8_t* b, float* y) { q5(b + 8, word(b + 4), half(b), half(b + 2), 0, y); }

void q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]);
}

void f32(const uint8_t* b, float* y) { std::memcpy(y, b, 128); }

void f16(const uint8_t* b, float* y) {
#if defined(__F16C__)
  for (int j = 0; j < 32; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * j));
    _mm256_storeu_ps(y + j, _mm256_cvtph_ps(h));
  }
#else
  for (int j = 0; j < 32; ++j) y[j] = half(b + 2 * j);
#endif
}

// bfloat16 is float32's upper half: a shift, which the loop vectorizes.
void bf16(const uint8_t* b, float* y) {
  uint16_t h[32];
  uint32_t bits[32];
  std::memcpy(h, b, 64);
  for (int j = 0; j < 32; ++j) bits[j] = static_cast<uint32_t>(h[j]) << 16;
  std::memcpy(y, bits, 128);
}

// 16 x 2-bit values of a run of 16 at `shift`: y = dl * q - ml.
void q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half_run = 0; half_run < 2; ++half_run) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
        const uint8_t* qr = q + 16 * half_run;
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((qr[l] >> shift) & 3) - ml;
      }
    }
  }
}

// Q3_K's sixteen 6-bit scales, packed in 12 bytes, as signed values (minus 32).
void q3_k_scales(const uint8_t* packed, int8_t* scales) {
  uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  std::memcpy(scales, aux, 16);
}

void q3_k(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* q = b + 32;
  int8_t scales[16];
  q3_k_scales(b + 96, scales);
  const float d = half(b + 108);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
      for (int half_run = 0; half_run < 2; ++half_run) {
        const float dl = d * static_cast<float>(scales[is++] - 32);
        const uint8_t* qr = q + 16 * half_run;
        const uint8_t* hr = hmask + 16 * half_run;
        for (int l = 0; l < 16; ++l) {
          const int v = ((qr[l] >> shift) & 3) - ((hr[l] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
    }
  }
}

// Scale and min of sub-block j of Q4_K / Q5_K (6 bits each, packed in 12 bytes).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Runs j and j + 1 of a Q4_K / Q5_K block: each run's scale d * sc and min dmin * mn.
struct RunPair {
  float d1, m1, d2, m2;
};
inline RunPair run_pair(int j, const uint8_t* scales, float d, float dmin) {
  uint8_t sc, mn;
  scale_min_k4(j, scales, &sc, &mn);
  const float d1 = d * sc, m1 = dmin * mn;
  scale_min_k4(j + 1, scales, &sc, &mn);
  return {d1, m1, d * sc, dmin * mn};
}

void q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
    const auto [d1, m1, d2, m2] = run_pair(j, scales, d, dmin);
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 8; j += 2, q += 32, y += 64, u1 <<= 2, u2 <<= 2) {
    const auto [d1, m1, d2, m2] = run_pair(j, scales, d, dmin);
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>((q[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
      y[l + 32] = d2 * static_cast<float>((q[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
  }
}

// Runs of 16 values share a scale: four runs of 32 per 128 values, two scales each.
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int h = 0; h < 2; ++h) {
      const float s1 = d * sc[h], s2 = d * sc[h + 2], s3 = d * sc[h + 4], s4 = d * sc[h + 6];
      for (int l = 16 * h; l < 16 * h + 16; ++l) {
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * static_cast<float>(q1);
        y[l + 32] = s2 * static_cast<float>(q2);
        y[l + 64] = s3 * static_cast<float>(q3);
        y[l + 96] = s4 * static_cast<float>(q4);
      }
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(int64_t type) {
  switch (type) {
    case F32: return f32;
    case F16: return f16;
    case BF16: return bf16;
    case Q4_0: return q4_0;
    case Q4_1: return q4_1;
    case Q5_0: return q5_0;
    case Q5_1: return q5_1;
    case Q8_0: return q8_0;
    case Q2_K: return q2_k;
    case Q3_K: return q3_k;
    case Q4_K: return q4_k;
    case Q5_K: return q5_k;
    case Q6_K: return q6_k;
    default: return nullptr;
  }
}

// One part's rows as the kernels read them.
struct Part {
  const uint8_t* data;
  int64_t rows, stride;  // stride: bytes from one row to the next
  Format fmt;
  BlockFn fn;
  int64_t type;
  int64_t col = 0;  // its first column of the layer's output (its parts side by side)
};

// The rows of parts, together.
inline int64_t rows_of(const std::vector<Part>& ps) {
  int64_t n = 0;
  for (const Part& p : ps) n += p.rows;
  return n;
}

Part check_part(const at::Tensor& data, int64_t type, int64_t K, const char* name) {
  const Format fmt = format(type);
  const BlockFn fn = block_fn(type);
  TORCH_CHECK(fn != nullptr, name, ": ggml type ", type, " is not one the kernels read");
  TORCH_CHECK(K % fmt.values == 0, name, ": K=", K, " is not a whole number of blocks of ",
              fmt.values, " (ggml type ", type, ")");
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.stride(1) == 1 &&
                  data.size(1) == K / fmt.values * fmt.bytes,
              name, ": each part must be uint8 [rows, ", K / fmt.values * fmt.bytes,
              "] (K=", K, " in blocks of ggml type ", type, "), got ", data.sizes());
  return {data.data_ptr<uint8_t>(), data.size(0), data.stride(0), fmt, fn, type};
}

// Values [v0, v0 + count) of one row (v0 and count whole blocks) into out.
inline void dequantize_run(const Part& p, const uint8_t* row, int64_t v0, int64_t count,
                           float* out) {
  const uint8_t* b = row + v0 / p.fmt.values * p.fmt.bytes;
  for (int64_t v = 0; v < count; v += p.fmt.values, b += p.fmt.bytes) p.fn(b, out + v);
}

std::vector<Part> check_parts(const std::vector<at::Tensor>& parts, const at::Tensor& types,
                              int64_t K) {
  TORCH_CHECK(types.dim() == 1 && types.scalar_type() == at::kLong &&
                  types.numel() == static_cast<int64_t>(parts.size()) && !parts.empty(),
              "ggml_linear: one int64 type per part");
  std::vector<Part> out;
  const int64_t* t = types.data_ptr<int64_t>();
  int64_t col = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    out.push_back(check_part(parts[i], t[i], K, "ggml_linear"));
    out.back().col = col;
    col += out.back().rows;
  }
  return out;
}

}  // namespace
}  // namespace ggml
