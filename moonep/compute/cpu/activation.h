// The SwiGLU element-wise passes of the CPU executor, written so that the compiler vectorizes
// them: exp is a branch-free Cephes-style polynomial (relative error ~2 ulp over the clamped
// range) instead of a libm call per element. Every element is computed on its own, so the result
// of an element does not depend on where a row or tile starts, nor on the thread count.
//   forward:  h = silu(a) * b,  silu(a) = a * sigmoid(a)
//   backward: given dh: h as above, da = dh * b * sigmoid(a) * (1 + a * (1 - sigmoid(a))),
//             db = dh * silu(a)
#pragma once

#include <cstdint>
#include <cstring>

namespace moonep::compute::cpu {

// Four lanes of fp32 (GCC/Clang vector extensions: one SSE register on baseline x86-64, one NEON
// register on AArch64). Lane-wise selects never branch or trap, so these loops are vector code
// without any fast-math flag.
typedef float Vec4 __attribute__((vector_size(16)));
typedef int32_t IVec4 __attribute__((vector_size(16)));
constexpr int kLanes = 4;

inline Vec4 Splat(float v) { return Vec4{v, v, v, v}; }

// exp(x) lane-wise, x clamped to [-87.3, 88.3] (so 0 and +inf are never produced; sigmoid then
// still rounds to 0 or 1 where it should, to within 4.5e-39). Relative error <= 1.5 ulp in range
// (Cephes polynomial). NaN in gives NaN out.
inline Vec4 FastExp(Vec4 x) {
  x = x > Splat(88.3f) ? Splat(88.3f) : x;
  x = x < Splat(-87.3f) ? Splat(-87.3f) : x;
  // n = round(x / ln 2) through the 1.5 * 2^23 trick, r = x - n ln 2 in two parts.
  const Vec4 shifter = Splat(12582912.0f);
  const Vec4 t = x * Splat(1.44269504088896341f) + shifter;
  const Vec4 n = t - shifter;
  Vec4 r = x - n * Splat(0.693359375f);
  r = r - n * Splat(-2.12194440e-4f);
  Vec4 p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  p = p * r * r + r + Splat(1.0f);
  // 2^n: n sits in the low mantissa bits of t = 1.5 * 2^23 + n.
  const IVec4 bits = ((IVec4)t - 0x4B400000 + 127) << 23;
  return p * (Vec4)bits;
}

inline Vec4 FastSigmoid(Vec4 v) { return Splat(1.0f) / (Splat(1.0f) + FastExp(-v)); }

inline Vec4 Load(const float* p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec4 v) { std::memcpy(p, &v, sizeof(v)); }
// The last n < 4 elements go through a zero-padded vector, so every element gets the same
// arithmetic wherever it sits.
inline Vec4 LoadTail(const float* p, int64_t n) {
  Vec4 v = Splat(0.0f);
  std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
  return v;
}
inline void StoreTail(float* p, Vec4 v, int64_t n) {
  std::memcpy(p, &v, static_cast<size_t>(n) * sizeof(float));
}

// Scalar entry points (tests, one-off use): the same lane arithmetic.
inline float FastExp(float x) { return FastExp(Splat(x))[0]; }
inline float FastSigmoid(float x) { return FastSigmoid(Splat(x))[0]; }

// h[i] = silu(a[i]) * b[i] for i < n.
inline void SwiGluForward(const float* a, const float* b, float* h, int64_t n) {
  auto lanes = [](Vec4 av, Vec4 bv) { return av * FastSigmoid(av) * bv; };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(h + i, lanes(Load(a + i), Load(b + i)));
  if (i < n) StoreTail(h + i, lanes(LoadTail(a + i, n - i), LoadTail(b + i, n - i)), n - i);
}

// h, da, db from a, b and dh, for i < n.
inline void SwiGluBackward(const float* a, const float* b, const float* dh, float* h, float* da,
                           float* db, int64_t n) {
  auto lanes = [](Vec4 av, Vec4 bv, Vec4 g, Vec4* hv, Vec4* dav, Vec4* dbv) {
    const Vec4 sg = FastSigmoid(av), silu = av * sg;
    *hv = silu * bv;
    *dav = g * bv * (sg + silu * (Splat(1.0f) - sg));
    *dbv = g * silu;
  };
  Vec4 hv, dav, dbv;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    lanes(Load(a + i), Load(b + i), Load(dh + i), &hv, &dav, &dbv);
    Store(h + i, hv);
    Store(da + i, dav);
    Store(db + i, dbv);
  }
  if (i < n) {
    const int64_t m = n - i;
    lanes(LoadTail(a + i, m), LoadTail(b + i, m), LoadTail(dh + i, m), &hv, &dav, &dbv);
    StoreTail(h + i, hv, m);
    StoreTail(da + i, dav, m);
    StoreTail(db + i, dbv, m);
  }
}

}  // namespace moonep::compute::cpu
