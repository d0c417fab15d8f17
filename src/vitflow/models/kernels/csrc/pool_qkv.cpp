// MViTv2's conv pooling of q, k and v on the CPU: a depthwise k x k convolution (padding k / 2, one
// (d, k*k) kernel shared by the heads) of each third of the packed qkv projection, read in its token
// layout and written head-major, the layout attention's batched GEMMs read; class tokens copied. The
// backward writes the whole qkv gradient in one pass per third (each input pixel gathers the outputs
// that read it: no zero fill, no scatter) and sums the kernels' gradients per thread, along output rows
// in registers. Accumulators are native vectors (vec.h: kNative), four at a time where they fit.
//
// Shapes: qkv (B, P + H*W, 3*C) float32 or bfloat16, contiguous, C = heads * d; weights (d, k*k)
// float32; outputs (B, heads, P + h*w, d) in qkv's dtype with h = (H + 2*(k/2) - k) / s + 1. The
// backward takes the three outputs' gradients (in that layout and dtype) and returns the qkv
// gradient (qkv's shape and dtype) and the three kernels' gradients (d, k*k) float32. Arithmetic in
// float32. Built by vitflow.models.kernels.cpp on first use.
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

struct Grid {
  int64_t b, p, h, w, c, heads, d, k, s, ho, wo, ld;  // ld: the qkv row length (3 C)
  int64_t tokens_in() const { return p + h * w; }
  int64_t tokens_out() const { return p + ho * wo; }
};

// dst[0:n] += a[0:n] * b[0:n] (float32 accumulators, a and b in any of the two dtypes)
template <typename A, typename B>
inline void fma_row(float* dst, const A* a, const B* b, int64_t n) {
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) store(dst + e, load(dst + e) + load16(a + e) * load16(b + e));
  for (; e < n; ++e) dst[e] += to_float(a[e]) * to_float(b[e]);
}

// wt (k*k, C): tap-major kernels expanded over the heads, wt[t][c] = w[c % d][t]
std::vector<float> expand_weight(const at::Tensor& w, const Grid& g) {
  const int64_t kk = g.k * g.k;
  const float* wp = w.data_ptr<float>();
  std::vector<float> wt(kk * g.c);
  for (int64_t t = 0; t < kk; ++t)
    for (int64_t c = 0; c < g.c; ++c) wt[t * g.c + c] = wp[(c % g.d) * kk + t];
  return wt;
}

// the taps of a k x k window at (y0, x0) (the window's top-left, padding included) inside an h x w grid:
// their tap indices and source token offsets; returns how many
inline int window_taps(const Grid& g, int64_t y0, int64_t x0, int64_t* taps, int64_t* tokens) {
  int n = 0;
  for (int64_t ky = 0; ky < g.k; ++ky) {
    const int64_t iy = y0 + ky;
    if (iy < 0 || iy >= g.h) continue;
    for (int64_t kx = 0; kx < g.k; ++kx) {
      const int64_t ix = x0 + kx;
      if (ix < 0 || ix >= g.w) continue;
      taps[n] = ky * g.k + kx;
      tokens[n++] = iy * g.w + ix;
    }
  }
  return n;
}

// NV native vectors of one output's channels [c, c + NV * kNative), summed over its n taps and stored
// head-major (dst(v): where vector v goes). NV independent accumulators keep both FMA pipes busy.
template <int NV, typename T, typename Dst>
inline void pool_point(const T* xb, const float* wt, const int64_t* taps, const int64_t* tokens, int n,
                       const Grid& g, int64_t c, Dst dst) {
  vn a[NV] = {};
  for (int i = 0; i < n; ++i) {
    const T* xp = xb + tokens[i] * g.ld + c;
    const float* wp = wt + taps[i] * g.c + c;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[v] += loadn(xp + v * kNative) * loadn(wp + v * kNative);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) storen(dst(c + v * kNative), a[v]);
}

template <typename T>
void pool_forward(const T* x, const float* wt, const Grid& g, T* out) {
  const int64_t pad = g.k / 2, nin = g.tokens_in(), nout = g.tokens_out();
  const bool fast = g.d % kNative == 0;  // native vectors never straddle two heads
  constexpr int64_t kGroup = 4 * kNative;
  at::parallel_for(0, g.b * (g.ho + g.p), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(g.c);
    std::vector<int64_t> taps(g.k * g.k), tokens(g.k * g.k);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / (g.ho + g.p), r = job % (g.ho + g.p);
      if (r >= g.ho) {  // a class token: copied
        const int64_t t = r - g.ho;
        for (int64_t hd = 0; hd < g.heads; ++hd)
          copy_row(x + (b * nin + t) * g.ld + hd * g.d, out + ((b * g.heads + hd) * nout + t) * g.d, g.d, 1.0f);
        continue;
      }
      const T* xb = x + (b * nin + g.p) * g.ld;
      for (int64_t ox = 0; ox < g.wo; ++ox) {
        const int n = window_taps(g, r * g.s - pad, ox * g.s - pad, taps.data(), tokens.data());
        const int64_t o = g.p + r * g.wo + ox;
        if (fast) {
          T* ob = out + (b * g.heads * nout + o) * g.d;
          auto dst = [&](int64_t c) { return ob + (c / g.d) * nout * g.d + c % g.d; };
          int64_t c = 0;
          for (; c + kGroup <= g.c; c += kGroup) pool_point<4>(xb, wt, taps.data(), tokens.data(), n, g, c, dst);
          for (; c < g.c; c += kNative) pool_point<1>(xb, wt, taps.data(), tokens.data(), n, g, c, dst);
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int i = 0; i < n; ++i) fma_row(acc.data(), xb + tokens[i] * g.ld, wt + taps[i] * g.c, g.c);
        for (int64_t hd = 0; hd < g.heads; ++hd)
          copy_row(acc.data() + hd * g.d, out + ((b * g.heads + hd) * nout + o) * g.d, g.d, 1.0f);
      }
    }
  });
}

// the outputs that read input pixel (r, ix) and with which taps; returns how many
inline int reading_outputs(const Grid& g, int64_t r, int64_t ix, int64_t* taps, int64_t* outs) {
  const int64_t pad = g.k / 2;
  int n = 0;
  for (int64_t ky = 0; ky < g.k; ++ky) {
    const int64_t ny = r + pad - ky;  // = oy * s for the output that reads this pixel with tap ky
    if (ny < 0 || ny % g.s || ny / g.s >= g.ho) continue;
    for (int64_t kx = 0; kx < g.k; ++kx) {
      const int64_t nx = ix + pad - kx;
      if (nx < 0 || nx % g.s || nx / g.s >= g.wo) continue;
      taps[n] = ky * g.k + kx;
      outs[n++] = (ny / g.s) * g.wo + nx / g.s;
    }
  }
  return n;
}

// Where each native vector of an image's channels [c, c + NV * kNative) starts in the head-major gradient
// (B, heads, P + h*w, d) at output token 0 of the grid.
template <int NV, typename T>
inline void head_rows(const T* grad, const Grid& g, int64_t b, int64_t c, const T** rows) {
  const int64_t nout = g.tokens_out();
  for (int v = 0; v < NV; ++v) {
    const int64_t cv = c + v * kNative;
    rows[v] = grad + ((b * g.heads + cv / g.d) * nout + g.p) * g.d + cv % g.d;
  }
}

// One input pixel's gradient, channels [c, c + NV * kNative): the outputs that read it (outs, taps), gathered.
template <int NV, typename T>
inline void dx_point(const T* grad, const float* wt, const int64_t* taps, const int64_t* outs, int n, const Grid& g,
                     int64_t b, int64_t c, T* dst) {
  const T* rows[NV];
  head_rows<NV>(grad, g, b, c, rows);
  vn a[NV] = {};
  for (int i = 0; i < n; ++i) {
    const float* wp = wt + taps[i] * g.c + c;
    const int64_t o = outs[i] * g.d;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[v] += loadn(rows[v] + o) * loadn(wp + v * kNative);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) storen(dst + c + v * kNative, a[v]);
}

// Tap (ky, kx)'s kernel gradient from output row oy of image b, channels [c, c + NV * kNative): the sum over the
// row's outputs of their gradient times the input pixel the tap read, added into dw (k*k, C).
template <int NV, typename T>
inline void dw_row(const T* grad, const T* xb, const Grid& g, int64_t b, int64_t oy, int64_t iy, int64_t kx,
                   int64_t lo, int64_t hi, int64_t c, float* dw) {
  const T* rows[NV];
  head_rows<NV>(grad, g, b, c, rows);
  vn a[NV] = {};
  for (int64_t ox = lo; ox < hi; ++ox) {
    const T* xp = xb + (iy * g.w + ox * g.s - g.k / 2 + kx) * g.ld + c;
    const int64_t o = (oy * g.wo + ox) * g.d;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[v] += loadn(rows[v] + o) * loadn(xp + v * kNative);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) storen(dw + c + v * kNative, loadn(dw + c + v * kNative) + a[v]);
}

// The backward where native vectors never straddle two heads, one image per job in two passes over its data
// (in cache between them): every input pixel gathers its gradient from the outputs that read it, then every
// tap's kernel gradient is summed along each output row, in registers.
template <typename T>
void pool_backward_vec(const T* grad, const T* x, const float* wt, const Grid& g, T* dx, float* parts) {
  const int64_t nin = g.tokens_in(), nout = g.tokens_out(), kk = g.k * g.k, pad = g.k / 2;
  constexpr int64_t kGroup = 4 * kNative;
  at::parallel_for(0, g.b, 1, [&](int64_t begin, int64_t end) {
    float* dw = parts + at::get_thread_num() * kk * g.c;
    std::vector<int64_t> taps(kk), outs(kk);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t t = 0; t < g.p; ++t)  // class tokens' gradients: copied back
        for (int64_t hd = 0; hd < g.heads; ++hd)
          copy_row(grad + ((b * g.heads + hd) * nout + t) * g.d, dx + (b * nin + t) * g.ld + hd * g.d, g.d, 1.0f);
      for (int64_t r = 0; r < g.h; ++r)
        for (int64_t ix = 0; ix < g.w; ++ix) {
          const int n = reading_outputs(g, r, ix, taps.data(), outs.data());
          T* dst = dx + (b * nin + g.p + r * g.w + ix) * g.ld;
          int64_t c = 0;
          for (; c + kGroup <= g.c; c += kGroup) dx_point<4>(grad, wt, taps.data(), outs.data(), n, g, b, c, dst);
          for (; c < g.c; c += kNative) dx_point<1>(grad, wt, taps.data(), outs.data(), n, g, b, c, dst);
        }
      const T* xb = x + (b * nin + g.p) * g.ld;
      for (int64_t oy = 0; oy < g.ho; ++oy)
        for (int64_t ky = 0; ky < g.k; ++ky) {
          const int64_t iy = oy * g.s - pad + ky;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t kx = 0; kx < g.k; ++kx) {
            int64_t lo = 0, hi = g.wo;  // the outputs of the row whose tap kx lies inside the grid
            while (lo < hi && lo * g.s - pad + kx < 0) ++lo;
            while (hi > lo && (hi - 1) * g.s - pad + kx >= g.w) --hi;
            float* dwt = dw + (ky * g.k + kx) * g.c;
            int64_t c = 0;
            for (; c + kGroup <= g.c; c += kGroup) dw_row<4>(grad, xb, g, b, oy, iy, kx, lo, hi, c, dwt);
            for (; c < g.c; c += kNative) dw_row<1>(grad, xb, g, b, oy, iy, kx, lo, hi, c, dwt);
          }
        }
    }
  });
}

// dx (into the qkv gradient, row length g.ld) and the per-thread kernel gradients parts (threads, k*k, C)
template <typename T>
void pool_backward(const T* grad, const T* x, const float* wt, const Grid& g, T* dx, float* parts) {
  if (g.d % kNative == 0) return pool_backward_vec(grad, x, wt, g, dx, parts);
  const int64_t nin = g.tokens_in(), nout = g.tokens_out(), kk = g.k * g.k;
  at::parallel_for(0, g.b * (g.h + g.p), 1, [&](int64_t begin, int64_t end) {
    float* dw = parts + at::get_thread_num() * kk * g.c;
    std::vector<float> acc(g.c);
    std::vector<int64_t> taps(kk), outs(kk);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / (g.h + g.p), r = job % (g.h + g.p);
      if (r >= g.h) {  // a class token's gradient: copied back
        const int64_t t = r - g.h;
        for (int64_t hd = 0; hd < g.heads; ++hd)
          copy_row(grad + ((b * g.heads + hd) * nout + t) * g.d, dx + (b * nin + t) * g.ld + hd * g.d, g.d, 1.0f);
        continue;
      }
      for (int64_t ix = 0; ix < g.w; ++ix) {
        const int n = reading_outputs(g, r, ix, taps.data(), outs.data());
        const int64_t token = b * nin + g.p + r * g.w + ix;
        const T* xp = x + token * g.ld;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int i = 0; i < n; ++i) {
          for (int64_t hd = 0; hd < g.heads; ++hd) {
            const T* gp = grad + ((b * g.heads + hd) * nout + g.p + outs[i]) * g.d;
            fma_row(acc.data() + hd * g.d, gp, wt + taps[i] * g.c + hd * g.d, g.d);
            fma_row(dw + taps[i] * g.c + hd * g.d, gp, xp + hd * g.d, g.d);
          }
        }
        copy_row(acc.data(), dx + token * g.ld, g.c, 1.0f);
      }
    }
  });
}

Grid grid_of(const at::Tensor& qkv, int64_t prefix, int64_t h, int64_t w, int64_t heads, int64_t k, int64_t s) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.device().is_cpu() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "pool_qkv: qkv must be a contiguous float32 or bfloat16 CPU tensor (B, P + H*W, 3C)");
  TORCH_CHECK(qkv.size(1) == prefix + h * w && qkv.size(2) % (3 * heads) == 0 && k >= 1 && s >= 1,
              "pool_qkv: qkv of ", qkv.sizes(), " does not fit ", prefix, " + ", h, "x", w, " tokens of ", heads,
              " heads");
  const int64_t c = qkv.size(2) / 3, pad = k / 2;
  return Grid{qkv.size(0), prefix, h, w, c, heads, c / heads, k, s, (h + 2 * pad - k) / s + 1,
              (w + 2 * pad - k) / s + 1, 3 * c};
}

void check_weight(const at::Tensor& wgt, const Grid& g) {
  TORCH_CHECK(wgt.scalar_type() == at::kFloat && wgt.is_contiguous() && wgt.numel() == g.d * g.k * g.k,
              "pool_qkv: kernels must be float32 (d, k*k)");
}

std::vector<at::Tensor> pool_qkv_forward(const at::Tensor& qkv, const at::Tensor& wq, const at::Tensor& wk,
                                         const at::Tensor& wv, int64_t prefix, int64_t h, int64_t w, int64_t heads,
                                         int64_t kernel, int64_t stride_q, int64_t stride_kv) {
  std::vector<at::Tensor> outs;
  const at::Tensor* weights[3] = {&wq, &wk, &wv};
  for (int part = 0; part < 3; ++part) {
    const Grid g = grid_of(qkv, prefix, h, w, heads, kernel, part ? stride_kv : stride_q);
    check_weight(*weights[part], g);
    const std::vector<float> wt = expand_weight(*weights[part], g);
    at::Tensor out = at::empty({g.b, heads, g.tokens_out(), g.d}, qkv.options());
    if (qkv.scalar_type() == at::kFloat)
      pool_forward(qkv.data_ptr<float>() + part * g.c, wt.data(), g, out.data_ptr<float>());
    else
      pool_forward(qkv.data_ptr<c10::BFloat16>() + part * g.c, wt.data(), g, out.data_ptr<c10::BFloat16>());
    outs.push_back(out);
  }
  return outs;
}

std::vector<at::Tensor> pool_qkv_backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv,
                                          const at::Tensor& qkv, const at::Tensor& wq, const at::Tensor& wk,
                                          const at::Tensor& wv, int64_t prefix, int64_t h, int64_t w, int64_t heads,
                                          int64_t kernel, int64_t stride_q, int64_t stride_kv) {
  at::Tensor dqkv = at::empty_like(qkv);
  std::vector<at::Tensor> outs = {dqkv};
  const at::Tensor* grads[3] = {&gq, &gk, &gv};
  const at::Tensor* weights[3] = {&wq, &wk, &wv};
  const int64_t threads = at::get_num_threads();
  for (int part = 0; part < 3; ++part) {
    const Grid g = grid_of(qkv, prefix, h, w, heads, kernel, part ? stride_kv : stride_q);
    check_weight(*weights[part], g);
    const at::Tensor& grad = *grads[part];
    TORCH_CHECK(grad.is_contiguous() && grad.scalar_type() == qkv.scalar_type() && grad.size(0) == g.b &&
                    grad.size(1) == heads && grad.size(2) == g.tokens_out() && grad.size(3) == g.d,
                "pool_qkv_backward: gradient ", part, " must be contiguous (B, heads, P + h*w, d) in qkv's dtype");
    const std::vector<float> wt = expand_weight(*weights[part], g);
    at::Tensor parts = at::zeros({threads, g.k * g.k, g.c}, wq.options());
    if (qkv.scalar_type() == at::kFloat)
      pool_backward(grad.data_ptr<float>(), qkv.data_ptr<float>() + part * g.c, wt.data(), g,
                    dqkv.data_ptr<float>() + part * g.c, parts.data_ptr<float>());
    else
      pool_backward(grad.data_ptr<c10::BFloat16>(), qkv.data_ptr<c10::BFloat16>() + part * g.c, wt.data(), g,
                    dqkv.data_ptr<c10::BFloat16>() + part * g.c, parts.data_ptr<float>());
    // (threads, k*k, heads, d) -> (d, k*k): summed over threads and heads
    outs.push_back(parts.view({threads, g.k * g.k, heads, g.d}).sum({0, 2}).t().contiguous());
  }
  return outs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitflow, m) {
  m.def("pool_qkv_forward(Tensor qkv, Tensor wq, Tensor wk, Tensor wv, int prefix, int h, int w, int heads, "
        "int kernel, int stride_q, int stride_kv) -> Tensor[]");
  m.def("pool_qkv_backward(Tensor gq, Tensor gk, Tensor gv, Tensor qkv, Tensor wq, Tensor wk, Tensor wv, "
        "int prefix, int h, int w, int heads, int kernel, int stride_q, int stride_kv) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vitflow, CPU, m) {
  m.impl("pool_qkv_forward", &pool_qkv_forward);
  m.impl("pool_qkv_backward", &pool_qkv_backward);
}
