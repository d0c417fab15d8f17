// LayerNorm's backward over the last dimension (Ba et al. 2016) in one pass over each row, with the
// weight and bias gradients summed per thread: PyTorch's CPU kernel reduces those two over the rows
// in separate passes, 2/3 of its time on Swin's 100352 x 96 bf16 activations.
//
// Shapes: grad, x (M, C) float32 or bfloat16, contiguous, one dtype; mean, rstd (M,) float32 (the
// forward's, from native_layer_norm); weight (C,) float32 or an empty tensor. Returns dx (M, C) in
// x's dtype, dweight and dbias (C,) float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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

template <typename T>
void kernel(const T* grad, const T* x, const float* mean, const float* rstd, const float* weight, int64_t rows,
            int64_t cols, T* dx, float* parts, int64_t chunks) {
  const int64_t per = (rows + chunks - 1) / chunks, cp = padded(cols);
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    std::vector<float> buf(3 * cp, 0.0f);
    float *xhat = buf.data(), *a = xhat + cp, *gr = a + cp;  // one row: normalised x, grad * weight, grad
    for (int64_t chunk = cbegin; chunk < cend; ++chunk) {
      float *dw = parts + chunk * 2 * cols, *db = dw + cols;
      for (int64_t r = chunk * per; r < std::min(rows, (chunk + 1) * per); ++r) {
        const float mu = mean[r], rs = rstd[r];
        copy_row(x + r * cols, xhat, cols, 1.0f);
        copy_row(grad + r * cols, gr, cols, 1.0f);
        vn s1 = {}, s2 = {};  // native vectors: kept in registers across the loop (see vec.h)
        for (int64_t c = 0; c < cp; c += kNative) {  // padding lanes stay 0 in all three rows
          const vn h = (loadn(xhat + c) - mu) * rs, g = loadn(gr + c);
          const vn w = weight ? loadn(weight + c) : vn{} + 1.0f;
          const vn av = g * w;
          storen(xhat + c, h);
          storen(a + c, av);
          s1 += av;
          s2 += av * h;
        }
        for (int64_t c = cols; c < cp; ++c) xhat[c] = a[c] = 0.0f;
        const float m1 = reduce_add(s1) / cols, m2 = reduce_add(s2) / cols;
        int64_t c = 0;
        for (; c + kNative <= cols; c += kNative) {
          const vn h = loadn(xhat + c), g = loadn(gr + c);
          storen(dx + r * cols + c, (loadn(a + c) - m1 - h * m2) * rs);
          storen(dw + c, loadn(dw + c) + g * h);
          storen(db + c, loadn(db + c) + g);
        }
        for (; c < cols; ++c) {
          dx[r * cols + c] = static_cast<T>((a[c] - m1 - xhat[c] * m2) * rs);
          dw[c] += gr[c] * xhat[c];
          db[c] += gr[c];
        }
      }
    }
  });
}

std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const at::Tensor& weight) {
  TORCH_CHECK(grad.is_contiguous() && x.is_contiguous() && grad.sizes() == x.sizes() && x.dim() >= 1 &&
                  grad.scalar_type() == x.scalar_type() && x.device().is_cpu(),
              "layer_norm_backward: grad and x must be contiguous CPU tensors of one shape and dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "layer_norm_backward: float32 or bfloat16 only");
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == rows && rstd.numel() == rows,
              "layer_norm_backward: mean and rstd must be the forward's float32 statistics, one per row");
  const bool has_weight = weight.defined() && weight.numel();
  TORCH_CHECK(!has_weight || (weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == cols),
              "layer_norm_backward: weight must be float32 (C,)");
  // the weight read 16 lanes at a time: a padded copy
  at::Tensor w = has_weight ? at::zeros({padded(cols)}, weight.options()) : at::Tensor();
  if (has_weight) w.narrow(0, 0, cols).copy_(weight);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  at::Tensor dx = at::empty_like(x);
  at::Tensor parts = at::zeros({chunks, 2, cols}, mean.options());
  const float* wp = has_weight ? w.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    kernel(grad.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, rows, cols,
           dx.data_ptr<float>(), parts.data_ptr<float>(), chunks);
  else
    kernel(grad.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), mean.data_ptr<float>(),
           rstd.data_ptr<float>(), wp, rows, cols, dx.data_ptr<c10::BFloat16>(), parts.data_ptr<float>(), chunks);
  at::Tensor sums = parts.sum(0);
  return {dx, sums[0], sums[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitflow, m) {
  m.def("layer_norm_backward(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor weight) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(vitflow, CPU, m) {
  m.impl("layer_norm_backward", &layer_norm_backward);
}
