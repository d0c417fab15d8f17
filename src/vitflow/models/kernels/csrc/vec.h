// Shared by vitflow's CPU kernels: 16-float vectors (GCC / Clang vector extensions, lowered to
// one AVX-512 register or to narrower ones), loads and stores of float32 / bfloat16, exp, reductions.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace vitflow_vec {

typedef float vf __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }
inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }
inline vf splat(float x) { return vf{} + x; }

typedef uint16_t vh_unaligned __attribute__((vector_size(32), aligned(2)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load16(const float* p) { return load(p); }
inline vf load16(const c10::BFloat16* p) {  // bfloat16 -> float32: the 16 bits on top
  const vu u = __builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(p), vu) << 16;
  return reinterpret_cast<const vf&>(u);
}
inline void store16(float* p, vf x) { store(p, x); }
inline void store16(c10::BFloat16* p, vf x) {  // float32 -> bfloat16, round to nearest even, NaN kept
  const vu u = reinterpret_cast<const vu&>(x);
  const vu nan = (vu)(x != x);
  const vu r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (0x7fc0u & nan);
  *reinterpret_cast<vh_unaligned*>(p) = __builtin_convertvector(r, vh);
}
// The CPU's own register width: 8 floats with AVX2, 16 with AVX-512. An accumulator that lives across a
// loop of unknown trip count must be this type: GCC keeps a wider generic vector (vf on AVX2) in memory
// and reassembles it through general registers at every iteration (measured: MViTv2's pooling ran at
// ~5 GFLOP/s on 2 AVX2 cores with vf accumulators).
#ifdef __AVX512F__
constexpr int64_t kNative = 16;
#else
constexpr int64_t kNative = 8;
#endif
typedef float vn __attribute__((vector_size(kNative * 4)));
typedef float vn_unaligned __attribute__((vector_size(kNative * 4), aligned(4)));
typedef uint16_t vnh __attribute__((vector_size(kNative * 2)));
typedef uint16_t vnh_unaligned __attribute__((vector_size(kNative * 2), aligned(2)));
typedef uint32_t vnu __attribute__((vector_size(kNative * 4)));

inline vn loadn(const float* p) { return *reinterpret_cast<const vn_unaligned*>(p); }
inline vn loadn(const c10::BFloat16* p) {
  const vnu u = __builtin_convertvector(*reinterpret_cast<const vnh_unaligned*>(p), vnu) << 16;
  return reinterpret_cast<const vn&>(u);
}
inline void storen(float* p, vn x) { *reinterpret_cast<vn_unaligned*>(p) = x; }
inline void storen(c10::BFloat16* p, vn x) {  // round to nearest even, NaN kept (as store16)
  const vnu u = reinterpret_cast<const vnu&>(x);
  const vnu nan = (vnu)(x != x);
  const vnu r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (0x7fc0u & nan);
  *reinterpret_cast<vnh_unaligned*>(p) = __builtin_convertvector(r, vnh);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// dst[0:n] = factor * src[0:n] across dtypes, 16 lanes at a time.
template <typename S, typename D>
inline void copy_row(const S* src, D* dst, int64_t n, float factor) {
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) store16(dst + e, load16(src + e) * factor);
  for (; e < n; ++e) dst[e] = static_cast<D>(factor * to_float(src[e]));
}

// exp(x) for x <= 0, lane-wise (Cephes' expf polynomial, ~1 ulp); 0 below -87, where exp(x) < 1.7e-38 would
// be (or lead to) a subnormal number, which the CPU handles ~100x slower.
inline vf exp_nonpositive(vf x) {
  const vf lo = splat(-87.0f);
  const vi under = x < lo;
  x = under ? lo : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf e = p * reinterpret_cast<const vf&>(bits);
  return under ? vf{} : e;
}

inline float reduce_max(vf x) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512&>(x));
#else
  float m = x[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, x[l]);
  return m;
#endif
}

inline float reduce_add(vf x) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(x));
#else
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += x[l];
  return s;
#endif
}

#ifndef __AVX512F__  // (with AVX-512, vn is vf)
inline float reduce_add(vn x) {
  float s = 0.0f;
  for (int l = 0; l < kNative; ++l) s += x[l];
  return s;
}
#endif

}  // namespace vitflow_vec
