// A pre-norm block's residual add and the LayerNorm after it (Ba et al. 2016), in one pass over each
// row, for bf16 autocast on the CPU: s = x + branch in float32 (the residual stream), then
// LayerNorm(s) rounded to bfloat16 (what the next linear layer reads). PyTorch runs this as three
// passes (the add, the float32 LayerNorm, the cast to bfloat16), each over the whole activation, and
// its backward as three or four (the cast's, the LayerNorm's, the sum of the two gradients of s, the
// branch's cast).
//
// Forward: x (M, C) float32, contiguous; branch (M, C) float32 or bfloat16, contiguous, or an empty
// tensor (no add: s is x); weight, bias (C,) float32. Returns [s (M, C) float32 (x itself without a
// branch), y (M, C) bfloat16, mean (M,), rstd (M,) float32]. Statistics in float32, two passes over each
// row held in cache (mean, then the mean squared deviation), the variance biased, as LayerNorm's.
//
// Backward: gy (M, C) bfloat16 or float32, gs (M, C) float32 or empty (the gradient reaching s from
// its other uses), s, mean, rstd, weight as the forward's; branch_bf16: whether to also return the
// gradient rounded to bfloat16 (the branch's dtype). Returns [gx (M, C) float32 = gs + LayerNorm's input
// gradient, gbranch (bfloat16, or empty), dweight, dbias (C,) float32].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace vitflow_vec;

template <typename B>
void kernel(const float* x, const B* branch, const float* weight, const float* bias, float eps, int64_t rows,
            int64_t cols, float* s, c10::BFloat16* y, float* mean_out, float* rstd_out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * cols;
      float* sr = s + r * cols;
      c10::BFloat16* yr = y + r * cols;
      vn acc = {};
      int64_t c = 0;
      for (; c + kNative <= cols; c += kNative) {
        vn v = loadn(xr + c);
        if (branch) {
          v += loadn(branch + r * cols + c);
          storen(sr + c, v);
        }
        acc += v;
      }
      float total = reduce_add(acc);
      for (; c < cols; ++c) {
        const float v = branch ? xr[c] + to_float(branch[r * cols + c]) : xr[c];
        if (branch) sr[c] = v;
        total += v;
      }
      const float* row = branch ? sr : xr;
      const float mean = total / cols;
      vn dev = {};
      for (c = 0; c + kNative <= cols; c += kNative) {
        const vn d = loadn(row + c) - mean;
        dev += d * d;
      }
      float sq = reduce_add(dev);
      for (; c < cols; ++c) sq += (row[c] - mean) * (row[c] - mean);
      const float rstd = 1.0f / std::sqrt(sq / cols + eps);
      mean_out[r] = mean;
      rstd_out[r] = rstd;
      for (c = 0; c + kNative <= cols; c += kNative)
        storen(yr + c, (loadn(row + c) - mean) * rstd * loadn(weight + c) + loadn(bias + c));
      for (; c < cols; ++c) yr[c] = static_cast<c10::BFloat16>((row[c] - mean) * rstd * weight[c] + bias[c]);
    }
  });
}

std::vector<at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                                       const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "add_layer_norm: x must be a contiguous float32 CPU tensor");
  const bool add = branch.defined() && branch.numel();
  TORCH_CHECK(!add || (branch.sizes() == x.sizes() && branch.is_contiguous() &&
                       (branch.scalar_type() == at::kFloat || branch.scalar_type() == at::kBFloat16)),
              "add_layer_norm: branch must be a contiguous float32 or bfloat16 tensor of x's shape");
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  bias.is_contiguous() && weight.numel() == cols && bias.numel() == cols,
              "add_layer_norm: weight and bias must be float32 (C,)");
  at::Tensor s = add ? at::empty_like(x) : x;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  at::Tensor mean = at::empty({rows}, x.options()), rstd = at::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const float e = static_cast<float>(eps);
  if (!add)
    kernel<float>(xp, nullptr, wp, bp, e, rows, cols, sp, yp, mp, rp);
  else if (branch.scalar_type() == at::kFloat)
    kernel(xp, branch.data_ptr<float>(), wp, bp, e, rows, cols, sp, yp, mp, rp);
  else
    kernel(xp, branch.data_ptr<c10::BFloat16>(), wp, bp, e, rows, cols, sp, yp, mp, rp);
  return {s, y, mean, rstd};
}

template <typename G>
void backward_kernel(const G* gy, const float* gs, const float* s, const float* mean, const float* rstd,
                     const float* weight, int64_t rows, int64_t cols, float* gx, c10::BFloat16* gb, float* parts,
                     int64_t chunks) {
  const int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    std::vector<float> buf(2 * padded(cols), 0.0f);
    float *xhat = buf.data(), *a = xhat + padded(cols);  // one row: normalised s, gy * weight
    for (int64_t chunk = cbegin; chunk < cend; ++chunk) {
      float *dw = parts + chunk * 2 * cols, *db = dw + cols;
      for (int64_t r = chunk * per; r < std::min(rows, (chunk + 1) * per); ++r) {
        const float mu = mean[r], rs = rstd[r];
        const G* g = gy + r * cols;
        const float* sr = s + r * cols;
        float s1 = 0.0f, s2 = 0.0f;
        vn v1 = {}, v2 = {};
        int64_t c = 0;
        for (; c + kNative <= cols; c += kNative) {
          const vn h = (loadn(sr + c) - mu) * rs, gv = loadn(g + c), av = gv * loadn(weight + c);
          storen(xhat + c, h);
          storen(a + c, av);
          storen(dw + c, loadn(dw + c) + gv * h);
          storen(db + c, loadn(db + c) + gv);
          v1 += av;
          v2 += av * h;
        }
        for (; c < cols; ++c) {
          const float h = (sr[c] - mu) * rs, gv = to_float(g[c]), av = gv * weight[c];
          xhat[c] = h;
          a[c] = av;
          dw[c] += gv * h;
          db[c] += gv;
          s1 += av;
          s2 += av * h;
        }
        const float m1 = (reduce_add(v1) + s1) / cols, m2 = (reduce_add(v2) + s2) / cols;
        float* gxr = gx + r * cols;
        const float* gsr = gs ? gs + r * cols : nullptr;
        for (c = 0; c + kNative <= cols; c += kNative) {
          vn d = (loadn(a + c) - m1 - loadn(xhat + c) * m2) * rs;
          if (gsr) d += loadn(gsr + c);
          storen(gxr + c, d);
          if (gb) storen(gb + r * cols + c, d);
        }
        for (; c < cols; ++c) {
          float d = (a[c] - m1 - xhat[c] * m2) * rs;
          if (gsr) d += gsr[c];
          gxr[c] = d;
          if (gb) gb[r * cols + c] = static_cast<c10::BFloat16>(d);
        }
      }
    }
  });
}

std::vector<at::Tensor> add_layer_norm_backward(const at::Tensor& gy, const at::Tensor& gs, const at::Tensor& s,
                                                const at::Tensor& mean, const at::Tensor& rstd,
                                                const at::Tensor& weight, bool branch_bf16) {
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous(),
              "add_layer_norm_backward: s must be the forward's contiguous float32 sum");
  TORCH_CHECK(gy.sizes() == s.sizes() && gy.is_contiguous() &&
                  (gy.scalar_type() == at::kFloat || gy.scalar_type() == at::kBFloat16),
              "add_layer_norm_backward: gy must be a contiguous float32 or bfloat16 tensor of s's shape");
  const bool has_gs = gs.defined() && gs.numel();
  TORCH_CHECK(!has_gs || (gs.sizes() == s.sizes() && gs.is_contiguous() && gs.scalar_type() == at::kFloat),
              "add_layer_norm_backward: gs must be a contiguous float32 tensor of s's shape");
  const int64_t cols = s.size(-1), rows = cols ? s.numel() / cols : 0;
  TORCH_CHECK(mean.numel() == rows && rstd.numel() == rows && weight.numel() == cols &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "add_layer_norm_backward: mean, rstd (M,) and weight (C,) must be the forward's");
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  at::Tensor gx = at::empty_like(s);
  at::Tensor gb = branch_bf16 ? at::empty(s.sizes(), s.options().dtype(at::kBFloat16)) : at::Tensor();
  at::Tensor parts = at::zeros({chunks, 2, cols}, s.options());
  const float* gsp = has_gs ? gs.data_ptr<float>() : nullptr;
  c10::BFloat16* gbp = branch_bf16 ? gb.data_ptr<c10::BFloat16>() : nullptr;
  if (gy.scalar_type() == at::kFloat)
    backward_kernel(gy.data_ptr<float>(), gsp, s.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                    weight.data_ptr<float>(), rows, cols, gx.data_ptr<float>(), gbp, parts.data_ptr<float>(), chunks);
  else
    backward_kernel(gy.data_ptr<c10::BFloat16>(), gsp, s.data_ptr<float>(), mean.data_ptr<float>(),
                    rstd.data_ptr<float>(), weight.data_ptr<float>(), rows, cols, gx.data_ptr<float>(), gbp,
                    parts.data_ptr<float>(), chunks);
  at::Tensor sums = parts.sum(0);
  return {gx, branch_bf16 ? gb : at::empty({0}, s.options()), sums[0], sums[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitflow, m) {
  m.def("add_layer_norm(Tensor x, Tensor branch, Tensor weight, Tensor bias, float eps) -> Tensor[]");
  m.def("add_layer_norm_backward(Tensor gy, Tensor gs, Tensor s, Tensor mean, Tensor rstd, Tensor weight, "
        "bool branch_bf16) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vitflow, CPU, m) {
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("add_layer_norm_backward", &add_layer_norm_backward);
}
