"""The small layers of a transformer encoder: patch embedding, MLP and its activations, stochastic
depth, PatchDropout and LayerScale. Parameter names follow timm's (``patch_embed.proj``,
``mlp.fc1``, ``mlp.fc2``, ``ls1.gamma``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from vitflow.models.kernels import cpp
from vitflow.models.kernels.matmul import Linear
from vitflow.timing import tracing

LN_EPS = 1e-6  # the ViT / timm LayerNorm epsilon (CLIP towers use 1e-5)
ACT_LAYERS = ("gelu", "gelu_tanh", "quick_gelu")  # timm's act_layer names of the MLP activation


class _LayerNormFn(torch.autograd.Function):
    """LayerNorm over the last dimension: PyTorch's forward, vitflow's one-pass backward
    (``torch.ops.vitflow.layer_norm_backward``: the weight and bias gradients summed in float32 per
    thread; PyTorch's CPU kernel spends ~2/3 of its backward on those sums in separate passes, and
    for bf16 inputs its sums are far less exact: 0.6 off on values ~17 in a 300 x 96 test)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        x = x.contiguous()  # (native_layer_norm makes it so too)
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight = ctx.saved_tensors
        dx, dw, db = cpp.ops().layer_norm_backward(grad.to(x.dtype).contiguous(), x, mean.view(-1),
                                                           rstd.view(-1), weight)
        return dx, dw.to(weight.dtype), db.to(weight.dtype), None


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state-dict names) whose backward, on the CPU for a
    float32 / bfloat16 input normalised over its last dimension with float32 affine
    parameters, runs vitflow's one-pass kernel (:class:`_LayerNormFn`; where vitflow's CPU kernels
    are unavailable, or anywhere else, ``nn.LayerNorm``'s). ``(..., C) -> (..., C)``. The kernels are
    built (or found built) at construction, never inside a forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cpp.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and len(self.normalized_shape) == 1 and w is not None and b is not None
                and w.dtype == b.dtype == torch.float32 and type(x) is torch.Tensor and type(w) is nn.Parameter
                and type(b) is nn.Parameter and not tracing() and cpp.available()):
            return _LayerNormFn.apply(x, w, b, self.eps)
        return super().forward(x)


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation of OpenAI's CLIP (Radford et al. 2021;
    timm's ``quick_gelu``). Any shape, elementwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def make_act(name: str) -> nn.Module:
    """The MLP activation ``name`` of :data:`ACT_LAYERS`: ``gelu`` (exact, erf; Hendrycks & Gimpel
    2016), ``gelu_tanh`` (the tanh approximation, big_vision / SigLIP) or ``quick_gelu`` (CLIP).

    Raises:
        ValueError: another name.
    """
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "quick_gelu":
        return QuickGELU()
    raise ValueError(f"act_layer must be one of {', '.join(ACT_LAYERS)}, got {name!r}")


def classifier_head(embed_dim: int, num_classes: int, gemm: str = "auto") -> nn.Module:
    """A freshly initialised classifier ``Linear(embed_dim, num_classes)`` (weights truncated
    normal, std 0.02; zero bias, as timm's ``reset_classifier``) with the model's bf16 GEMM
    choice; ``nn.Identity()`` for ``num_classes == 0`` (features only)."""
    if num_classes <= 0:
        return nn.Identity()
    head = Linear(embed_dim, num_classes, gemm=gemm)
    nn.init.trunc_normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    return head


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding by a strided convolution.

    Input ``(B, C, H, W)`` float -> output ``(B, N, D)``, contiguous, with ``N = (H / p) * (W / p)``.

    With ``truncate`` a side that is not a multiple of the patch loses its last pixels (what
    timm's strided convolution does for SigLIP so400m/14 at 384 px: 27 patches cover 378 px).

    Raises:
        ValueError: H or W is not a multiple of the patch size (without ``truncate``).
    """

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True, truncate: bool = False):
        super().__init__()
        self.patch_size, self.truncate = patch_size, truncate
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if (h % self.patch_size or w % self.patch_size) and not self.truncate:
            raise ValueError(f"input size {h}x{w} is not a multiple of patch size {self.patch_size}")
        # contiguous tokens: left in the convolution's (B, D, N) order, every later add would keep that
        # order and every LayerNorm copy it (a model without a class token has no cat to fix it)
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class Mlp(nn.Module):
    """Two-layer MLP: ``fc1 -> act -> dropout -> fc2 -> dropout``; ``(B, N, D) -> (B, N, D)``
    (``(B, N, out_dim)`` with ``out_dim``: MViTv2's stage transitions); ``act_layer`` one of
    :data:`ACT_LAYERS` (default exact GELU).

    Without autograd (inference) a GELU (or QuickGELU) runs in place on fc1's output, which saves
    the largest activation allocation of the block. With ``residual`` (``(B, N, D)``) it returns
    ``residual + mlp(x)``, the add inside fc2's GEMM (:class:`~vitflow.models.kernels.matmul.Linear`)
    while dropout is inactive."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, act_layer: str = "gelu",
                 out_dim: int | None = None):
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim)
        self.act = make_act(act_layer)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = Linear(hidden_dim, out_dim or dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc1(x)
        if not torch.is_grad_enabled() and type(self.act) is nn.GELU:
            h = torch.ops.aten.gelu_(h, approximate=self.act.approximate)
        elif not torch.is_grad_enabled() and type(self.act) is QuickGELU:
            h = h.mul_(torch.sigmoid_(h * 1.702))
        else:
            h = self.act(h)
        h = self.drop1(h)
        if residual is not None and not active(self.drop2):
            return self.fc2(h, residual=residual)
        out = self.drop2(self.fc2(h))
        return out if residual is None else residual + out


class SwiGLUPacked(nn.Module):
    """SwiGLU MLP with the value and gate in one ``fc1`` (Shazeer 2020, "GLU Variants Improve
    Transformer"; timm's ``SwiGLUPacked``, DINOv2-giant): ``fc2(silu(a) * b)`` with ``a, b`` the
    first and second half of ``fc1(x)``. ``hidden_dim`` is fc1's width (twice the gated width).
    ``(B, N, D) -> (B, N, D)``; ``residual`` as :class:`Mlp`.

    Raises:
        ValueError: odd ``hidden_dim``.
    """

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        if hidden_dim % 2:
            raise ValueError(f"SwiGLU needs an even fc1 width, got {hidden_dim}")
        self.fc1 = Linear(dim, hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = Linear(hidden_dim // 2, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        a, b = self.fc1(x).chunk(2, dim=-1)
        h = self.drop1(self.act(a) * b)
        if residual is not None and not active(self.drop2):
            return self.fc2(h, residual=residual)
        out = self.drop2(self.fc2(h))
        return out if residual is None else residual + out


MLP_LAYERS = ("mlp", "swiglu_packed")


def make_mlp(kind: str, dim: int, hidden_dim: int, drop: float = 0.0, act_layer: str = "gelu") -> nn.Module:
    """:class:`Mlp` (``kind="mlp"``, with ``act_layer``) or :class:`SwiGLUPacked` (its SiLU gate is
    fixed). Raises ValueError for another kind."""
    if kind == "mlp":
        return Mlp(dim, hidden_dim, drop, act_layer)
    if kind == "swiglu_packed":
        return SwiGLUPacked(dim, hidden_dim, drop)
    raise ValueError(f"mlp_layer must be one of {', '.join(MLP_LAYERS)}, got {kind!r}")


def active(drop: nn.Module) -> bool:
    """True when a dropout-like module (``nn.Dropout``, :class:`DropPath`) changes its input now:
    training mode and ``p > 0``."""
    return drop.training and getattr(drop, "p", 0.0) > 0


class DropPath(nn.Module):
    """Stochastic depth per sample (Huang et al. 2016): drops the residual branch of a whole
    sample with probability ``p`` in training and rescales survivors by ``1 / (1 - p)``."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class PatchDropout(nn.Module):
    """PatchDropout (Liu et al. 2022; timm's ``patch_drop_rate``): in training, each sample keeps
    a random ``1 - p`` of its patch tokens (the prefix tokens always), so every block costs about
    ``1 - p`` as much; the identity in eval mode. ``(B, P + N, D) -> (B, P + K, D)``,
    ``K = max(1, int(N * (1 - p)))``; uses the global torch RNG."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        prefix, patches = x[:, :num_prefix_tokens], x[:, num_prefix_tokens:]
        b, n, d = patches.shape
        keep = torch.rand(b, n, device=x.device).argsort(dim=1)[:, :max(1, int(n * (1 - self.p)))]
        return torch.cat([prefix, patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, d))], dim=1)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch, initialised to a small constant
    (CaiT, Touvron et al. 2021). ``(..., D) -> (..., D)``; parameter ``gamma (D,)``."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``gamma * x``, or with ``residual`` ``residual + gamma * x`` in one pass (``addcmul``)."""
        return x * self.gamma if residual is None else torch.addcmul(residual, x, self.gamma)
