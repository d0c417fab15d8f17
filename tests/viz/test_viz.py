import json
import subprocess
import sys

import pytest
import torch

import vitflow
from vitflow.viz import attention_rollout, token_grid


def test_attention_maps_are_backend_independent_probabilities():
    torch.manual_seed(0)
    ref = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, attention="math").eval()
    other = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, attention="sdpa").eval()
    other.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        maps = ref.attention_maps(x, layers=[0, -1])
        same = other.attention_maps(x, layers=[8, 0])
    assert [m.shape for m in maps] == [(2, 3, 65, 65)] * 2
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 3, 65))
    torch.testing.assert_close(same[0], maps[1])  # layer 8 == layer -1
    torch.testing.assert_close(same[1], maps[0])
    # the maps are the softmax the block really computes: recompute block 0 by hand
    with torch.no_grad():
        tokens, grid = ref._embed(x)
        blk = ref.blocks[0]
        q, k, v = blk.attn.qkv(blk.norm1(tokens)).view(2, 65, 3, 3, 64).permute(2, 0, 3, 1, 4)
        expected = ((q @ k.transpose(-2, -1)) / 8.0).softmax(-1)
    torch.testing.assert_close(maps[0], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError):
        ref.attention_maps(x, layers=[9])


def test_attention_maps_follow_the_sparse_pattern():
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, attention="local", attn_window=1).eval()
    with torch.no_grad():
        (a,) = m.attention_maps(torch.randn(1, 3, 32, 32), layers=0)
    # patch (0, 0) = token 1 attends to the class token and its 2x2 corner window only
    allowed = {0, 1, 2, 9, 10}
    assert set(a[0, 0, 1].nonzero().flatten().tolist()) == allowed


def test_rollout_of_known_maps():
    n = 3
    eye = torch.eye(n).expand(1, 2, n, n)
    torch.testing.assert_close(attention_rollout([eye, eye]), torch.eye(n)[None])
    a = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    b = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.6, 0.2, 0.2], [0.0, 0.0, 1.0]])
    maps = [a.expand(1, 2, n, n), b.expand(1, 2, n, n)]
    ia, ib = 0.5 * torch.eye(n) + 0.5 * a, 0.5 * torch.eye(n) + 0.5 * b  # rows already sum to 1
    torch.testing.assert_close(attention_rollout(maps)[0], ib @ ia)
    # head fusion: max over heads differs from mean when heads differ
    two = torch.stack([a, b])[None]
    assert not torch.allclose(attention_rollout([two], "max"), attention_rollout([two], "mean"))
    grid = token_grid(attention_rollout(maps), 1, (1, 2))
    assert grid.shape == (1, 1, 2) and grid.max() == 1.0


def test_attention_command_writes_a_png(digits_run, tmp_path):
    run, _, _ = digits_run
    sample = sorted((run / "samples").glob("*.png"))[0]
    out = tmp_path / "maps.png"
    r = subprocess.run([sys.executable, "-m", "vitflow", "attention", str(run), str(sample), "-o", str(out),
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["heads"] == 2 and info["grid"] == [4, 4] and info["layer"] == 3
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    w, h = Image.open(out).size
    assert w > 500 and h > 200  # a grid of panels: image, 2 heads, rollout
    bad = subprocess.run([sys.executable, "-m", "vitflow", "attention", str(run), str(tmp_path / "nope.png")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "nope.png" in bad.stderr


def test_single_point_series_is_drawn(tmp_path):
    """One evaluation is one point: the accuracy panel must show it (a marker), not an empty axis."""
    import numpy as np
    from PIL import Image

    from vitflow.viz.curves import line_plot

    red = {"color": (1.0, 0.0, 0.0)}
    one = line_plot(tmp_path / "one.png", "acc", [("top-1", [100], [0.5], red)], "%")
    one = np.asarray(Image.open(one).convert("RGB"))
    is_red = (one[..., 0] > 200) & (one[..., 1] < 80) & (one[..., 2] < 80)
    assert is_red.sum() > 100  # legend line alone: ~50 red pixels; with the point marker (and its legend marker) ~170
    assert line_plot(tmp_path / "two.png", "acc", [("top-1", [100, 200], [0.5, 0.6], red)], "%").exists()
