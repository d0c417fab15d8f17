"""Pruning: physical head / MLP-unit removal equals masking, block removal equals skipping,
importance finds dead heads and blocks, pruned models rebuild from their model_args and export;
the CLI prunes, fine-tunes and measures."""

import json

import pytest
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.data import model_input
from vitflow.data.transforms import Preprocess
from vitflow.infer.export.formats import export_onnx, verify
from vitflow.infer.prune import (
    Importance,
    block_importance,
    importance_scores,
    prune_heads_,
    prune_mlp_,
    prune_model,
    remove_blocks,
    select_units,
)
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel
from vitflow.models import create_model


def _masked_forward(model, x, head_masks, mlp_masks):
    """Reference: the unpruned model with removed heads / units multiplied by 0."""
    hooks = []
    for blk, hm, mm in zip(model.blocks, head_masks, mlp_masks):
        d = blk.attn.head_dim
        hooks.append(blk.attn.proj.register_forward_pre_hook(lambda m, a, g=hm, d=d: (a[0] * g.repeat_interleave(d),)))
        hooks.append(blk.mlp.fc2.register_forward_pre_hook(lambda m, a, g=mm: (a[0] * g,)))
    try:
        with torch.no_grad():
            return model(x)
    finally:
        for h in hooks:
            h.remove()


def test_physical_removal_equals_masking():
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    x = torch.randn(5, 3, 32, 32)
    keep_heads = [[0, 2], [1], [0, 1, 2], [2], [0, 1], [1, 2], [0], [0, 2], [1]]
    keep_mlp = [sorted(torch.randperm(384)[:200].tolist()) for _ in range(9)]
    head_masks = [torch.zeros(3).index_fill_(0, torch.tensor(k), 1.0) for k in keep_heads]
    mlp_masks = [torch.zeros(384).index_fill_(0, torch.tensor(k), 1.0) for k in keep_mlp]
    ref = _masked_forward(model, x, head_masks, mlp_masks)
    pruned = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    pruned.load_state_dict(model.state_dict())
    for blk, kh, km in zip(pruned.blocks, keep_heads, keep_mlp):
        prune_heads_(blk.attn, kh)
        prune_mlp_(blk.mlp, km)
    with torch.no_grad():
        out = pruned(x)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert pruned.blocks[1].attn.qkv.weight.shape == (3 * 64, 192) and pruned.blocks[1].attn.proj.weight.shape == (192, 64)
    assert pruned.blocks[0].mlp.fc1.weight.shape == (200, 192)
    with torch.no_grad():
        assert not torch.allclose(model(x), ref, atol=1e-3)  # the removal did change the function


def test_pruned_model_rebuilds_from_model_args_and_exports(tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    scores = Importance([torch.rand(3) for _ in range(9)], [torch.rand(384) for _ in range(9)], 1)
    pruned, sizes = prune_model(model, scores, heads=0.25, mlp=0.25)
    assert sum(sizes["block_heads"]) == 27 - 7 and sum(sizes["block_mlp_hidden"]) == 9 * 384 - 864
    rebuilt = create_model("vit_cifar_patch4_32", num_classes=10, **sizes).eval()
    rebuilt.load_state_dict(pruned.state_dict())  # strict: shapes follow block_heads / block_mlp_hidden
    x = torch.randn(7, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), pruned(x))
    pp = Preprocess(32, 1.0)
    info = ModelInfo([str(i) for i in range(10)], pp, {"name": "vit_cifar_patch4_32", **sizes})
    path = export_onnx(rebuilt, tmp_path / "pruned.onnx", info)
    assert verify(rebuilt, OnnxModel(path), x, (1, 7), 1e-4).ok
    with pytest.raises(ValueError, match="block_heads"):
        create_model("vit_cifar_patch4_32", block_heads=[3, 3])


def test_importance_finds_a_dead_head_and_keeps_one_per_block():
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    with torch.no_grad():  # head 1 of block 4 contributes nothing: its proj columns are zero
        model.blocks[4].attn.proj.weight[:, 64:128] = 0
    batches = [{"images": torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8),
                "labels": torch.randint(0, 10, (16,))} for _ in range(2)]
    imp = importance_scores(model, batches, Preprocess(32, 1.0), max_images=32)
    assert imp.images == 32 and imp.heads[4][1] == 0
    others = [float(h[i]) for b, h in enumerate(imp.heads) for i in range(3) if (b, i) != (4, 1)]
    assert min(others) > 0
    keep = select_units(imp.heads, 1 / 27)
    assert keep[4] == [0, 2] and sum(map(len, keep)) == 26
    keep = select_units(imp.heads, 0.95)
    assert all(len(k) == 1 for k in keep)  # never an empty block
    with pytest.raises(ValueError):
        select_units(imp.heads, 1.0)


def _skipping(model, skipped):
    """Reference: the model with the ``skipped`` blocks' outputs replaced by their inputs."""
    return [model.blocks[i].register_forward_hook(lambda m, a, out: a[0]) for i in skipped]


def test_removing_blocks_equals_skipping_them_and_rebuilds():
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    rise = torch.tensor([0.5, 0.1, 0.4, -0.2, 0.3, 0.05, 0.6, 0.7, 0.2])
    shallow, removed = remove_blocks(model, rise, 3)
    assert removed == [1, 3, 5] and len(shallow.blocks) == 6 and len(model.blocks) == 9
    x = torch.randn(4, 3, 32, 32)
    hooks = _skipping(model, removed)
    with torch.no_grad():
        ref = model(x)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        torch.testing.assert_close(shallow(x), ref, atol=1e-6, rtol=0)
        assert not torch.allclose(model(x), ref, atol=1e-4)
    sizes = {"depth": 6, "block_heads": [3, 1, 2, 3, 3, 2], "block_mlp_hidden": [384, 100, 384, 384, 200, 384]}
    for blk, h, m in zip(shallow.blocks, sizes["block_heads"], sizes["block_mlp_hidden"]):
        prune_heads_(blk.attn, list(range(h)))
        prune_mlp_(blk.mlp, list(range(m)))
    rebuilt = create_model("vit_cifar_patch4_32", num_classes=10, **sizes).eval()
    rebuilt.load_state_dict(shallow.state_dict())  # strict: blocks.0 ... blocks.5 renumbered
    with torch.no_grad():
        assert torch.equal(rebuilt(x), shallow(x))
    for count in (9, -1):
        with pytest.raises(ValueError, match=r"blocks to remove must be in \[0, 9\)"):
            remove_blocks(model, rise, count)


def test_block_importance_is_the_loss_rise_of_skipping_and_finds_a_dead_block():
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10, depth=4).eval()
    with torch.no_grad():  # block 2 adds nothing to the residual stream: its two output layers are zero
        for lin in (model.blocks[2].attn.proj, model.blocks[2].mlp.fc2):
            lin.weight.zero_()
            lin.bias.zero_()
    batches = [{"images": torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8),
                "labels": torch.randint(0, 10, (16,))} for _ in range(3)]
    pp = Preprocess(32, 1.0)
    rise, n = block_importance(model, batches, pp, max_images=32)
    assert n == 32 and rise.shape == (4,) and abs(float(rise[2])) < 1e-7
    assert all(abs(float(rise[i])) > 1e-5 for i in (0, 1, 3))
    x = model_input(torch.cat([b["images"] for b in batches[:2]]), pp.mean, pp.std, "cpu")
    y = torch.cat([b["labels"] for b in batches[:2]])
    with torch.no_grad():  # the second implementation: each block physically removed
        intact = torch.nn.functional.cross_entropy(model(x), y)
        for i in range(4):
            shallow, _ = remove_blocks(model, torch.arange(4.0).roll(i), 1)
            assert abs(float(torch.nn.functional.cross_entropy(shallow(x), y) - intact) - float(rise[i])) < 1e-5
    assert remove_blocks(model, rise, 1)[1] == [int(rise.argmin())]


@pytest.mark.slow
def test_prune_cli_finetunes_and_measures(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    out = tmp_path / "pruned.pt"
    assert main(["prune", r["checkpoint"], "-o", str(out), "--heads", "0.25", "--mlp", "0.25",
                 "--finetune-steps", "40", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["heads_before"] == 8 and p["heads_after"] == 6 and p["params_after"] < p["params_before"]
    assert p["top1_after"] >= p["top1_before"] - 0.05  # the fine-tune recovers
    assert p["top1_after"] >= p["top1_pruned"] - 0.01
    assert p["speedup_throughput"] > 0 and p["timing"]["pruned"]["throughput_ips"] > 0
    state = load_checkpoint(out)
    assert state["model_args"]["block_heads"] == p["block_heads"] and "optimizer" not in state
    model_from_checkpoint(state)
    assert main(["eval", str(out), "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(e["test_top1"] - p["top1_after"]) < 0.02
    assert main(["predict", str(out), r["samples"], "--topk", "1"]) == 0
    capsys.readouterr()
    # against the model it came from: the reference's fp32 top-1 bounds the drop, even when its
    # path (timm_eager_fp32) is not among those timed
    assert main(["bench", "infer", str(out), "--reference", r["checkpoint"], "--data", "--paths", "eager_fp32",
                 "--repeats", "1", "--latency-calls", "2", "--min-time", "0.05"]) == 0
    bound = capsys.readouterr().out.strip().splitlines()[-1]
    assert bound.startswith("fastest paths chosen among those within 1 top-1 point(s) of fp32 (")
    assert abs(float(bound.rsplit("(", 1)[1].rstrip("%)")) / 100 - p["top1_before"]) < 0.005


def test_prune_cli_removes_a_block(digits_run, tmp_path, capsys):
    _, r, _ = digits_run
    out = tmp_path / "shallow.pt"
    assert main(["prune", r["checkpoint"], "-o", str(out), "--blocks", "1", "--json"]) == 0  # --heads: 0 with --blocks
    out_err = capsys.readouterr()
    p = json.loads(out_err.out.strip().splitlines()[-1])
    assert p["depth"] == 3 and len(p["blocks_removed"]) == 1 and p["block_heads"] == [2, 2, 2]
    assert "blocks 4 -> 3, heads 8 -> 6, parameters" in out_err.err  # --json: stdout holds the JSON alone
    assert "loss rise when each block is skipped" in out_err.err  # the progress lines
    # -q: no progress lines; the results on stdout, top-1 once
    assert main(["prune", r["checkpoint"], "-o", str(tmp_path / "quiet.pt"), "--blocks", "1", "-q"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and "blocks 4 -> 3" in quiet.out and "loss rise" not in quiet.out
    assert quiet.out.count("top-1") == 1 and "as given" in quiet.out
    state = load_checkpoint(out)
    assert state["model_args"]["depth"] == 3 and len(model_from_checkpoint(state).blocks) == 3
    assert main(["eval", str(out), "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(e["test_top1"] - p["top1_pruned"]) < 1e-9
    bad = {("--blocks", "4"): "blocks to remove must be in [0, 4) for a 4-block model, got 4",
           ("--temperature", "0", "--finetune-steps", "3"): "temperature must be > 0, got 0.0",
           ("--batch-size", "0", "--alpha", "2"): "batch_size must be >= 1, got 0; alpha must be in [0, 1], got 2.0",
           ("--finetune-steps", "-3"): "finetune_steps must be >= 0, got -3",
           ("--calib-images", "0", "--lr", "-1"): "calib_images must be >= 1, got 0; lr must be > 0, got -1.0"}
    for args, message in bad.items():
        assert main(["prune", r["checkpoint"], "-o", str(tmp_path / "none.pt"), *args]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"], args
    assert not (tmp_path / "none.pt").exists()


def test_prune_writes_a_checkpoint_only(digits_run, tmp_path, capsys):
    _, r, _ = digits_run
    out = tmp_path / "pruned.onnx"
    assert main(["prune", r["checkpoint"], "-o", str(out), "--no-eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output {out}: a pruned model is written as a checkpoint; name it *.pt (then vitflow "
                   "export or quantize it)"] and not out.exists()


def test_prune_says_when_fewer_heads_can_go(digits_run, tmp_path, capsys):
    """Every block keeps a head: 75% of the digits model's 8 heads (2 a block) cannot go, and the
    progress lines say how many did."""
    _, r, _ = digits_run
    assert main(["prune", r["checkpoint"], "-o", str(tmp_path / "p.pt"), "--heads", "0.75", "--no-eval"]) == 0
    got = capsys.readouterr()
    assert "--heads 0.75 asks for 6 of 8 removed; 4 were, as every block keeps at least one" in got.err
    assert "heads 8 -> 4," in got.out and "--mlp" not in got.err


@pytest.mark.slow
def test_openvino_yardstick_of_a_pruned_model_runs_the_reference_export(digits_run, tmp_path):
    """With a peer (the unpruned model of a pruned one), the ov_best_* paths run the peer's vitflow
    export, not the pruned model's: their logits are the unpruned model's but for INT8 rounding,
    and far from the pruned model's; without a peer they run the model's own."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from vitflow.infer.bench.infer import build_paths
    from vitflow.infer.calibration import calibration_images

    _, r, _ = digits_run
    state = load_checkpoint(r["checkpoint"])
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    scores = Importance([torch.arange(b.attn.num_heads, dtype=torch.float32) for b in model.blocks],
                        [torch.arange(b.mlp.fc1.out_features, dtype=torch.float32) for b in model.blocks], 0)
    pruned, sizes = prune_model(model, scores, heads=0.5, mlp=0.5)
    pruned_info = ModelInfo.from_checkpoint({**state, "model_args": {**state["model_args"], **sizes}})
    images = calibration_images(None, info.preprocess, info.classes, state, 64, split="test")
    paths = ("ov_best_latency", "openvino_int8_tuned")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with_peer, _ = build_paths(pruned, pruned_info, tmp_path / "a", paths, lambda: images, lambda m: None,
                               peer=(model, info))
    alone, _ = build_paths(pruned, pruned_info, tmp_path / "b", paths[:1], lambda: images, lambda m: None)
    with torch.no_grad():
        unpruned, small = model(images), pruned(images)
        yard, own, yard_alone = with_peer["ov_best_latency"](images), with_peer["openvino_int8_tuned"](images), \
            alone["ov_best_latency"](images)
    gap = (unpruned - small).abs().mean()
    assert gap > 0.1  # the pruned model computes something else
    assert (yard - unpruned).abs().mean() < 0.2 * gap and (own - small).abs().mean() < 0.2 * gap
    assert (yard_alone - small).abs().mean() < 0.2 * gap


def test_a_model_pruned_to_uneven_heads_takes_onnx_runtimes_fusions(tmp_path):
    """A block left with 5 of 6 heads (96 wide: 5 does not divide it) is exported and fused with
    the head counts read from the graph (given the first block's 5, ONNX Runtime's optimizer
    failed its check, as it did for a 25%-pruned ViT-S/16)."""
    pytest.importorskip("onnxruntime")
    from vitflow.infer.runtimes.onnx_fusion import fusion_sizes, optimize_onnx

    model = create_model("vit_cifar_patch4_32", num_classes=3, embed_dim=96, num_heads=6, depth=2).eval()
    assert fusion_sizes(model) == (6, 96)
    prune_heads_(model.blocks[0].attn, [0, 1, 2, 3, 4])
    assert fusion_sizes(model) == (0, 0)
    info = ModelInfo(["a", "b", "c"], Preprocess(image_size=32), {"name": "vit_cifar_patch4_32", "num_classes": 3,
                                                                  "embed_dim": 96, "num_heads": 6, "depth": 2})
    export_onnx(model, tmp_path / "m.onnx", info)
    fused = optimize_onnx(tmp_path / "m.onnx", tmp_path / "m.opt.onnx", "cpu", *fusion_sizes(model))
    assert fused.get("LayerNormalization", 0) >= 4
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(OnnxModel(tmp_path / "m.opt.onnx")(x), model(x), atol=1e-4, rtol=1e-4)
