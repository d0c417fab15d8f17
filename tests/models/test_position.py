import math

import numpy as np
import pytest
import torch

import vitflow
from vitflow.models.position import (
    RelativePositionBias,
    relative_position_index,
    resample_pos_embed,
    resample_relative_table,
    sincos_2d,
)


def test_sincos_2d_matches_big_vision_formula():
    """big_vision's posemb_sincos_2d, re-derived in numpy: [sin(x w), cos(x w), sin(y w), cos(y w)],
    w = 1 / 10000 ** (arange(dim/4) / (dim/4 - 1))."""
    h, w, dim = 3, 5, 16
    y, x = np.mgrid[:h, :w]
    omega = 1.0 / 10000 ** (np.arange(dim // 4) / (dim // 4 - 1))
    xo, yo = np.einsum("m,d->md", x.flatten(), omega), np.einsum("m,d->md", y.flatten(), omega)
    expected = np.concatenate([np.sin(xo), np.cos(xo), np.sin(yo), np.cos(yo)], axis=1)
    pe = sincos_2d((h, w), dim, num_prefix_tokens=1)
    assert pe.shape == (1, 1 + h * w, dim)
    assert torch.equal(pe[0, 0], torch.zeros(dim))
    np.testing.assert_allclose(pe[0, 1:].numpy(), expected, atol=1e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d((2, 2), 6)


def test_relative_position_index_encodes_2d_offsets():
    h, w = 3, 4
    idx = relative_position_index((h, w), num_prefix_tokens=1)
    n_off = (2 * h - 1) * (2 * w - 1)
    assert idx.shape == (13, 13)
    assert idx[0, 0] == n_off + 2 and (idx[0, 1:] == n_off).all() and (idx[1:, 0] == n_off + 1).all()
    coords = [(r, c) for r in range(h) for c in range(w)]
    seen = {}
    for i, (ri, ci) in enumerate(coords):
        for j, (rj, cj) in enumerate(coords):
            seen.setdefault((ri - rj, ci - cj), set()).add(int(idx[1 + i, 1 + j]))
    assert all(len(v) == 1 for v in seen.values())  # same offset, same entry
    assert len({next(iter(v)) for v in seen.values()}) == n_off  # all offsets distinct
    assert relative_position_index((h, w), 0).max() == n_off - 1


def test_relative_bias_resamples_to_another_grid():
    torch.manual_seed(0)
    rpb = RelativePositionBias(num_heads=2, grid=(4, 4), num_prefix_tokens=1)
    bias = rpb()
    assert bias.shape == (2, 17, 17)
    # the table entry of offset (0, 0) is on the diagonal of every head
    center = (4 - 1) * 7 + (4 - 1)
    torch.testing.assert_close(bias[:, 5, 5], rpb.relative_position_bias_table[center])
    big = rpb((6, 6))
    assert big.shape == (2, 37, 37)
    assert torch.equal(big[:, 0, 1:], rpb.relative_position_bias_table[-3, :, None].expand(2, 36))
    table = rpb.relative_position_bias_table.detach()
    assert resample_relative_table(table, (4, 4), (4, 4)) is table
    # a table that is constant over offsets stays constant
    const = torch.cat([torch.full((49, 2), 0.3), torch.zeros(3, 2)])
    torch.testing.assert_close(resample_relative_table(const, (4, 4), (7, 7))[:169], torch.full((169, 2), 0.3))


def test_learned_pos_embed_run_time_equals_load_time_resampling(tmp_path):
    """An image of another size is embedded with the same bicubic resampling that loading the
    weights into a model built for that size applies."""
    from vitflow.models.pretrained.weights import save_safetensors

    torch.manual_seed(0)
    m32 = vitflow.create_model("vit_cifar_patch4_32", num_classes=10).eval()
    path = tmp_path / "w.safetensors"
    save_safetensors(m32, path)
    m48 = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, img_size=48, pretrained=path).eval()
    torch.testing.assert_close(m48.pos_embed, resample_pos_embed(m32.pos_embed, (12, 12)))
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(m32(x), m48(x), atol=1e-5, rtol=1e-5)


def test_sincos_model_runs_at_any_size_without_parameters():
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, pos_embed="sincos2d").eval()
    assert "pos_embed" not in m.state_dict() and not any("pos_embed" in n for n, _ in m.named_parameters())
    with torch.no_grad():
        assert m(torch.randn(1, 3, 40, 56)).shape == (1, 10)  # a 10x14 grid
    torch.testing.assert_close(m.pos_embed, sincos_2d((8, 8), 192))


def test_relative_model_layer_scale_and_weight_decay_names():
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, pos_embed="relative", layer_scale_init=1e-5)
    assert m.pos_embed is None
    names = dict(m.named_parameters())
    assert "blocks.0.attn.rel_pos.relative_position_bias_table" in names
    assert torch.equal(names["blocks.3.ls2.gamma"], torch.full((192,), 1e-5))
    assert "blocks.0.attn.rel_pos.relative_position_bias_table" in m.no_weight_decay()
    with torch.no_grad():
        assert torch.isfinite(m(torch.randn(1, 3, 48, 48))).all()


def test_layer_scale_matches_timm():
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    torch.manual_seed(0)
    ref = TimmViT(img_size=32, patch_size=4, embed_dim=192, depth=3, num_heads=3, mlp_ratio=2.0, num_classes=10,
                  init_values=0.1).eval()
    ours = vitflow.VisionTransformer(img_size=32, patch_size=4, embed_dim=192, depth=3, num_heads=3, mlp_ratio=2.0,
                                     num_classes=10, layer_scale_init=0.1).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_224_model_runs_at_384_with_resampled_pos_embed():
    """A 224-px ViT fed 384-px images: the 14x14 position grid is resampled to 24x24 at run time;
    outputs are finite, and the prediction for an upsampled image stays close to the 224 one."""
    torch.manual_seed(0)
    m = vitflow.create_model("vit_tiny_patch16_224", num_classes=10).eval()
    # a smooth, structured image (not noise): upsampling it barely changes its content
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 224), torch.linspace(-1, 1, 224), indexing="ij")
    img = torch.stack([torch.sin(3 * xx), torch.cos(2 * yy), xx * yy])[None].repeat(2, 1, 1, 1)
    img[1] = img[1].flip(-1)
    big = torch.nn.functional.interpolate(img, size=(384, 384), mode="bicubic", align_corners=False)
    with torch.no_grad():
        p224, p384 = m(img).softmax(-1), m(big).softmax(-1)
        tokens = m.forward_features(big)
    assert tokens.shape == (2, 1 + 24 * 24, 192)
    assert torch.isfinite(p384).all()
    torch.testing.assert_close(p384.sum(-1), torch.ones(2))
    assert (p384 - p224).abs().max() < 0.1 * p224.max()
    assert math.isclose(float(torch.corrcoef(torch.stack([p224.flatten(), p384.flatten()]))[0, 1]), 1.0, abs_tol=0.1)


def test_digits_model_keeps_accuracy_at_a_larger_grid(digits_run):
    """The trained default model (8 px, 4x4 grid) evaluated on the digits upsampled to 14 px (7x7
    grid, the 224 -> 384 ratio): position embeddings resampled at run time."""
    from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
    from vitflow.data import model_input, open_split

    run, summary, _ = digits_run
    state = load_checkpoint(run)
    model = model_from_checkpoint(state)
    test = open_split(None, "train[80%:]", "digits")
    images = torch.stack([test.load(i) for i in range(len(test))])
    labels = torch.as_tensor(test.labels)
    pp = state["preprocess"]
    accs = {}
    with torch.no_grad():
        for size in (8, 14):
            x = torch.nn.functional.interpolate(images.float(), size=(size, size), mode="nearest").to(torch.uint8)
            logits = model(model_input(x, pp["mean"], pp["std"]))
            assert torch.isfinite(logits).all()
            accs[size] = float((logits.argmax(1) == labels).float().mean())
    assert accs[8] == pytest.approx(summary["test_top1"], abs=0.02)
    assert accs[14] >= 0.5, accs
