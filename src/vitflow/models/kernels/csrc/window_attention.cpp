// Fused window attention for the CPU: softmax(scale * Q K^T + bias) V for many short sequences
// (Swin's windows), one (window, head) at a time in the cache, read straight from the packed qkv
// projection and written straight into the merged-head layout; the backward reads the
// probabilities the forward saved and writes dq, dk, dv straight into the qkv gradient's layout.
//
// Shapes: qkv (BW, N, 3*H*d) float32 or bfloat16, contiguous; bias (NB, H, N, N) float32 or an
// empty tensor, window w using bias[w % NB]; out (BW, N, H*d) and probs (BW, H, N, N) in qkv's
// dtype; the backward also returns the bias gradient (NB, H, N, N) and the column sums of the qkv
// gradient (3*H*d,), the projection's bias gradient, both float32. All arithmetic is float32. Built
// by vitflow.models.kernels.cpp on first use.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace vitflow_vec;

// C[r, v*kNative : (v+1)*kNative] = sum_k A[r, k] B[k, same columns] for r < R, v < NV native vectors: the
// accumulators stay in registers (native vectors: vec.h).
template <int R, int NV>
inline void micro_kernel(const float* a, int64_t sr, int64_t sk, const float* b, int64_t ldb, int64_t depth, float* c,
                         int64_t ldc) {
  vn acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = vn{};
  for (int64_t k = 0; k < depth; ++k) {
    vn bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = loadn(b + k * ldb + v * kNative);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = a[r * sr + k * sk];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) storen(c + r * ldc + v * kNative, acc[r][v]);
}

// C (m x n, n a multiple of 16) = A (m x depth; A[r, k] at a[r * sr + k * sk]: sr = row stride, sk = 1 for
// row-major A, the other way round for a transposed one) @ B (depth x n, row stride ldb). With AVX-512, row
// blocks of 4 (8 where the width is at most 32) over up to 64 columns keep up to 16 accumulators in its 32
// registers; with AVX2 (16 registers), blocks of 6 rows over 16 columns keep 12.
void small_gemm(const float* a, int64_t sr, int64_t sk, const float* b, int64_t ldb, int64_t m, int64_t n,
                int64_t depth, float* c, int64_t ldc) {
#define VITFLOW_BLOCK(R, NV) \
  for (; i + R <= m; i += R) micro_kernel<R, NV>(a + i * sr, sr, sk, bb, ldb, depth, cc + i * ldc, ldc); \
  for (; i < m; ++i) micro_kernel<1, NV>(a + i * sr, sr, sk, bb, ldb, depth, cc + i * ldc, ldc);
#ifdef __AVX512F__
  for (int64_t c0 = 0; c0 < n; c0 += 4 * kLanes) {
    const int64_t nv = std::min<int64_t>(4, (n - c0) / kLanes);
    const float* bb = b + c0;
    float* cc = c + c0;
    int64_t i = 0;
    switch (nv) {
      case 1: VITFLOW_BLOCK(8, 1) break;
      case 2: VITFLOW_BLOCK(8, 2) break;
      case 3: VITFLOW_BLOCK(4, 3) break;
      default: VITFLOW_BLOCK(4, 4) break;
    }
  }
#else
  for (int64_t c0 = 0; c0 < n; c0 += kLanes) {
    const float* bb = b + c0;
    float* cc = c + c0;
    int64_t i = 0;
    VITFLOW_BLOCK(6, kLanes / kNative)
  }
#endif
#undef VITFLOW_BLOCK
}

struct Geometry {
  int64_t bw, n, heads, d, c, np, dp, nb;
  vi tail;  // the valid lanes of a row's last 16 keys (-1) and its padding (0)
};

// The working set of one (window, head): np x dp (q, k, v, dout, and results; rows past n zero),
// dp x np (k and v transposed), n x np (scores or probabilities and their gradient), all float32.
struct Tiles {
  std::vector<float> mem;
  float *q, *k, *v, *dout, *kt, *vt, *s, *ds, *out, *inv;
  explicit Tiles(const Geometry& g) : mem(7 * g.np * g.dp + 2 * g.n * g.np + g.np, 0.0f) {
    float* p = mem.data();
    inv = p;
    p += g.np;
    for (float** x : {&q, &k, &v, &dout, &out, &kt, &vt}) { *x = p; p += g.np * g.dp; }
    for (float** x : {&s, &ds}) { *x = p; p += g.n * g.np; }
  }
};

// dst (cols x rows, row stride lds) = src (rows x cols, row stride lss)^T; rows and cols multiples of 16.
inline void transpose(const float* src, int64_t lss, int64_t rows, int64_t cols, float* dst, int64_t lds) {
#ifdef __AVX512F__
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes)
    for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {  // 16 x 16 in registers: 4 rounds of shuffles
      __m512 a[16], b[16];
      for (int r = 0; r < 16; ++r) a[r] = _mm512_loadu_ps(src + (r0 + r) * lss + c0);
      for (int r = 0; r < 16; r += 2) {
        b[r] = _mm512_unpacklo_ps(a[r], a[r + 1]);
        b[r + 1] = _mm512_unpackhi_ps(a[r], a[r + 1]);
      }
      for (int r = 0; r < 16; r += 4) {
        a[r] = _mm512_shuffle_ps(b[r], b[r + 2], 0x44);
        a[r + 1] = _mm512_shuffle_ps(b[r], b[r + 2], 0xEE);
        a[r + 2] = _mm512_shuffle_ps(b[r + 1], b[r + 3], 0x44);
        a[r + 3] = _mm512_shuffle_ps(b[r + 1], b[r + 3], 0xEE);
      }
      for (int r = 0; r < 16; r += 8)
        for (int q = 0; q < 4; ++q) {
          b[r + q] = _mm512_shuffle_f32x4(a[r + q], a[r + q + 4], 0x88);
          b[r + q + 4] = _mm512_shuffle_f32x4(a[r + q], a[r + q + 4], 0xDD);
        }
      for (int q = 0; q < 8; ++q) {
        a[q] = _mm512_shuffle_f32x4(b[q], b[q + 8], 0x88);
        a[q + 8] = _mm512_shuffle_f32x4(b[q], b[q + 8], 0xDD);
      }
      for (int q = 0; q < 16; ++q) _mm512_storeu_ps(dst + (c0 + q) * lds + r0, a[q]);  // a[q]: column q
    }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * lds + r] = src[r * lss + c];
#endif
}

// q (times scale), k, v of window w, head h into the tiles (n x dp, rows past n stay zero); k transposed
// into kt for the forward's scores, v into vt for the backward's dP = dO V^T.
template <typename T>
void load_qkv(const T* qkv, const Geometry& g, int64_t w, int64_t h, float scale, Tiles& x, bool backward) {
  const T* base = qkv + w * g.n * 3 * g.c + h * g.d;
  for (int64_t i = 0; i < g.n; ++i) {
    const T* row = base + i * 3 * g.c;
    copy_row(row, x.q + i * g.dp, g.d, scale);
    copy_row(row + g.c, x.k + i * g.dp, g.d, 1.0f);
    copy_row(row + 2 * g.c, x.v + i * g.dp, g.d, 1.0f);
  }
  if (backward)
    transpose(x.v, g.dp, g.np, g.dp, x.vt, g.np);
  else
    transpose(x.k, g.dp, g.np, g.dp, x.kt, g.np);
}

// A score row (np wide, keys past n padding) plus its bias row (n wide).
inline void add_bias_row(float* s, const float* bias_row, int64_t n) {
  if (!bias_row) return;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store(s + j, load(s + j) + load(bias_row + j));
  for (; j < n; ++j) s[j] += bias_row[j];
}

// The largest of a row's n valid scores (the padding left out).
inline float row_max(const float* s, const Geometry& g) {
  const int64_t last = g.np - kLanes;
  vf m = load(s + last);
  m = g.tail ? m : splat(-3.0e38f);
  for (int64_t j = 0; j < last; j += kLanes) {
    const vf x = load(s + j);
    m = x > m ? x : m;
  }
  return reduce_max(m);
}

// exp(s - shift) over the n valid keys of a row, zeros in the padding; returns the sum.
inline float exp_row(float* s, float shift, const Geometry& g) {
  const int64_t last = g.np - kLanes;
  vf sum = {};
  for (int64_t j = 0; j < last; j += kLanes) {
    const vf e = exp_nonpositive(load(s + j) - shift);
    store(s + j, e);
    sum += e;
  }
  vf e = exp_nonpositive(load(s + last) - shift);
  e = g.tail ? e : vf{};
  store(s + last, e);
  return reduce_add(sum + e);
}

// Ask for [p, p + bytes) to be brought into the cache (the next window's rows while this one is computed:
// a window's heads are interleaved in its rows, which the hardware prefetcher alone follows poorly).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

template <typename T>
void forward_kernel(const T* qkv, const float* bias, const Geometry& g, float scale, T* out, T* probs) {
  at::parallel_for(0, g.bw * g.heads, 1, [&](int64_t begin, int64_t end) {
    Tiles x(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t w = item / g.heads, h = item % g.heads;
      if (h == 0 && item + g.heads < end) prefetch(qkv + (w + 1) * g.n * 3 * g.c, g.n * 3 * g.c * sizeof(T));
      load_qkv(qkv, g, w, h, scale, x, false);
      small_gemm(x.q, g.dp, 1, x.kt, g.np, g.n, g.np, g.d, x.s, g.np);
      const float* bias_wh = bias ? bias + ((w % g.nb) * g.heads + h) * g.n * g.n : nullptr;
      for (int64_t i = 0; i < g.n; ++i) {  // unnormalised probabilities; 1 / row sum applied to the output rows
        float* si = x.s + i * g.np;
        add_bias_row(si, bias_wh ? bias_wh + i * g.n : nullptr, g.n);
        const float m = row_max(si, g);
        const float sum = exp_row(si, m, g);
        x.inv[i] = 1.0f / sum;
        if (probs) copy_row(si, probs + ((w * g.heads + h) * g.n + i) * g.n, g.n, x.inv[i]);
      }
      small_gemm(x.s, g.np, 1, x.v, g.dp, g.n, g.dp, g.n, x.out, g.dp);
      for (int64_t i = 0; i < g.n; ++i)
        copy_row(x.out + i * g.dp, out + (w * g.n + i) * g.c + h * g.d, g.d, x.inv[i]);
    }
  });
}

// One head's dq, dk or dv (n x d, times factor) into the qkv gradient's rows; their column sums added
// to sums (d floats: the projection's bias gradient, summed before the rounding to T).
template <typename T>
void store_grad(T* dst, const float* src, const Geometry& g, float factor, float* sums) {
  for (int64_t i = 0; i < g.n; ++i) {
    const float* row = src + i * g.dp;
    copy_row(row, dst + i * 3 * g.c, g.d, factor);
    int64_t e = 0;
    for (; e + kLanes <= g.d; e += kLanes) store(sums + e, load(sums + e) + load(row + e) * factor);
    for (; e < g.d; ++e) sums[e] += row[e] * factor;
  }
}

template <typename T>
void backward_kernel(const T* qkv, const T* probs, const T* grad, const Geometry& g, float scale,
                     T* dqkv, float* dbias_parts, float* colsum_parts, int64_t chunks) {
  const int64_t items = g.bw * g.heads, per = (items + chunks - 1) / chunks, nn = g.n * g.n;
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    Tiles x(g);
    for (int64_t chunk = cbegin; chunk < cend; ++chunk) {
      float* dbias = dbias_parts ? dbias_parts + chunk * g.nb * g.heads * nn : nullptr;
      float* colsum = colsum_parts + chunk * 3 * g.c;
      for (int64_t item = chunk * per; item < std::min(items, (chunk + 1) * per); ++item) {
        const int64_t w = item / g.heads, h = item % g.heads, slot = (w % g.nb) * g.heads + h;
        if (h == 0 && w + 1 < g.bw) {
          prefetch(qkv + (w + 1) * g.n * 3 * g.c, g.n * 3 * g.c * sizeof(T));
          prefetch(grad + (w + 1) * g.n * g.c, g.n * g.c * sizeof(T));
          prefetch(probs + (w + 1) * g.heads * nn, g.heads * nn * sizeof(T));
        }
        load_qkv(qkv, g, w, h, scale, x, true);
        for (int64_t i = 0; i < g.n; ++i) copy_row(grad + (w * g.n + i) * g.c + h * g.d, x.dout + i * g.dp, g.d, 1.0f);
        small_gemm(x.dout, g.dp, 1, x.vt, g.np, g.n, g.np, g.d, x.ds, g.np);  // dP = dO V^T
        const T* probs_wh = probs + (w * g.heads + h) * nn;
        for (int64_t i = 0; i < g.n; ++i) {
          float *pi = x.s + i * g.np, *dsi = x.ds + i * g.np;
          copy_row(probs_wh + i * g.n, pi, g.n, 1.0f);  // P as the forward saved it (the padding stays 0)
          vn dot = {};
          for (int64_t j = 0; j < g.np; j += kNative) dot += loadn(pi + j) * loadn(dsi + j);
          const float dsum = reduce_add(dot);
          for (int64_t j = 0; j < g.np; j += kLanes) store(dsi + j, load(pi + j) * (load(dsi + j) - dsum));
          if (dbias) add_bias_row(dbias + slot * nn + i * g.n, dsi, g.n);  // (the same row-wise add)
        }
        T* base = dqkv + w * g.n * 3 * g.c + h * g.d;
        small_gemm(x.ds, g.np, 1, x.k, g.dp, g.n, g.dp, g.n, x.out, g.dp);  // dQ / scale = dS K
        store_grad(base, x.out, g, scale, colsum + h * g.d);
        small_gemm(x.ds, 1, g.np, x.q, g.dp, g.n, g.dp, g.n, x.out, g.dp);  // dK = dS^T (scale Q)
        store_grad(base + g.c, x.out, g, 1.0f, colsum + g.c + h * g.d);
        small_gemm(x.s, 1, g.np, x.dout, g.dp, g.n, g.dp, g.n, x.out, g.dp);  // dV = P^T dO
        store_grad(base + 2 * g.c, x.out, g, 1.0f, colsum + 2 * g.c + h * g.d);
      }
    }
  });
}

Geometry geometry(const at::Tensor& qkv, const at::Tensor& bias, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.device().is_cpu(),
              "window attention: qkv must be a contiguous CPU tensor (windows, tokens, 3*heads*d)");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "window attention: qkv must be float32 or bfloat16");
  Geometry g{qkv.size(0), qkv.size(1), heads, 0, 0, padded(qkv.size(1)), 0, 1, vi{}};
  TORCH_CHECK(heads > 0 && qkv.size(2) % (3 * heads) == 0, "window attention: qkv width is not 3*heads*d");
  g.c = qkv.size(2) / 3;
  g.d = g.c / heads;
  g.dp = padded(g.d);
  for (int l = 0; l < kLanes; ++l) g.tail[l] = g.np - kLanes + l < g.n ? -1 : 0;
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.dim() == 4 &&
                    bias.size(1) == heads && bias.size(2) == g.n && bias.size(3) == g.n && g.bw % bias.size(0) == 0,
                "window attention: bias must be contiguous float32 (nb, heads, N, N) with nb dividing the windows");
    g.nb = bias.size(0);
  }
  return g;
}

std::vector<at::Tensor> window_attention_forward(const at::Tensor& qkv, const at::Tensor& bias, int64_t heads,
                                                 double scale, bool keep_probs) {
  const Geometry g = geometry(qkv, bias, heads);
  const bool has_bias = bias.defined() && bias.numel();
  at::Tensor out = at::empty({g.bw, g.n, g.c}, qkv.options());
  at::Tensor probs = at::empty({keep_probs ? g.bw : 0, g.heads, g.n, g.n}, qkv.options());
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (qkv.scalar_type() == at::kFloat)
    forward_kernel(qkv.data_ptr<float>(), b, g, static_cast<float>(scale), out.data_ptr<float>(),
                   keep_probs ? probs.data_ptr<float>() : nullptr);
  else
    forward_kernel(qkv.data_ptr<c10::BFloat16>(), b, g, static_cast<float>(scale), out.data_ptr<c10::BFloat16>(),
                   keep_probs ? probs.data_ptr<c10::BFloat16>() : nullptr);
  return {out, probs};
}

std::vector<at::Tensor> window_attention_backward(const at::Tensor& grad, const at::Tensor& qkv, const at::Tensor& bias,
                                                  const at::Tensor& probs, int64_t heads, double scale,
                                                  bool bias_grad) {
  const Geometry g = geometry(qkv, bias, heads);
  TORCH_CHECK(grad.is_contiguous() && grad.scalar_type() == qkv.scalar_type() && grad.numel() == g.bw * g.n * g.c,
              "window attention: grad must be contiguous (windows, tokens, heads*d) in qkv's dtype");
  TORCH_CHECK(probs.is_contiguous() && probs.scalar_type() == qkv.scalar_type() &&
                  probs.numel() == g.bw * g.heads * g.n * g.n,
              "window attention: probs must be the forward's (windows, heads, N, N) in qkv's dtype");
  at::Tensor dqkv = at::empty_like(qkv);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), g.bw * g.heads));
  const bool want_db = bias.defined() && bias.numel() && bias_grad;
  at::Tensor parts = want_db ? at::zeros({chunks, g.nb, g.heads, g.n, g.n}, bias.options()) : at::Tensor();
  float* db = want_db ? parts.data_ptr<float>() : nullptr;
  at::Tensor colsums = at::zeros({chunks, 3 * g.c}, qkv.options().dtype(at::kFloat));
  float* cs = colsums.data_ptr<float>();
  if (qkv.scalar_type() == at::kFloat)
    backward_kernel(qkv.data_ptr<float>(), probs.data_ptr<float>(), grad.data_ptr<float>(), g,
                    static_cast<float>(scale), dqkv.data_ptr<float>(), db, cs, chunks);
  else
    backward_kernel(qkv.data_ptr<c10::BFloat16>(), probs.data_ptr<c10::BFloat16>(), grad.data_ptr<c10::BFloat16>(),
                    g, static_cast<float>(scale), dqkv.data_ptr<c10::BFloat16>(), db, cs, chunks);
  return {dqkv, want_db ? parts.sum(0) : at::empty({0}, qkv.options().dtype(at::kFloat)), colsums.sum(0)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitflow, m) {
  m.def("window_attention_forward(Tensor qkv, Tensor bias, int heads, float scale, bool keep_probs) -> Tensor[]");
  m.def("window_attention_backward(Tensor grad, Tensor qkv, Tensor bias, Tensor probs, int heads, float scale, bool bias_grad) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vitflow, CPU, m) {
  m.impl("window_attention_forward", &window_attention_forward);
  m.impl("window_attention_backward", &window_attention_backward);
}
