// Element access for the kernels' two storage types: float32 (float) and bfloat16 (uint16_t,
// the upper half of a float32). Arithmetic is always float32; stores round to nearest even, as
// torch does, so a kernel that rounds where torch rounds gives torch's bfloat16 results.
#pragma once
#include <stdint.h>
#include <string.h>

namespace dspark {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
    p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// x rounded to the storage type T and read back (identity for float32).
template <typename T>
inline float round_to(float x) {
  T v;
  store(&v, 0, x);
  return load(&v, 0);
}

}  // namespace dspark
