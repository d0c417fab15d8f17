"""A Swin through vitflow's pipeline: a few training steps of the 32x32 variant (shrunk) on the
embedded digits with the Trainer, its checkpoint rebuilt; one ONNX export checked at batch 1
and 7; pruning refused."""

import pytest
import torch

from helpers import check_run_checkpoint, digits_config, stage_attention_figures
from vitflow.infer.export.formats import export_onnx, verify
from vitflow.infer.prune import prune_checkpoint
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel
from vitflow.models import create_model


@pytest.fixture(scope="module")
def swin_run(tmp_path_factory):
    from vitflow.training.loop import Trainer

    run = tmp_path_factory.mktemp("swin") / "run"
    cfg = digits_config(run, "model.name=swin_cifar_patch2_window4_32", "model.img_size=16", "model.embed_dim=24",
                        "model.drop_path_rate=0.1", "model.grad_checkpointing=1", "train.total_steps=3",
                        "train.batch_size=4", "data.train_split=train[:64]", "data.val_split=none",
                        "data.test_split=train[64:96]", "train.eval_every=0", "train.log_every=2", "optim.warmup_steps=1")
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def test_variant_trains_and_its_checkpoint_rebuilds(swin_run):
    trainer, summary = swin_run
    assert trainer.model.blocks[1].grad_checkpointing and any(trainer.model.blocks[1].shift)
    check_run_checkpoint(trainer, summary, "swin_cifar_patch2_window4_32", "layers.0.blocks.1.attn.relative_position_bias_table")


def test_onnx_export_batch_1_and_7_from_one_export(tmp_path):
    torch.manual_seed(0)
    model = create_model("swin_cifar_patch2_window4_32", num_classes=10, img_size=16, embed_dim=16,
                         depths=(2,), num_heads=(2,))  # one stage, a shifted block.eval()
    from vitflow.data.transforms import Preprocess

    info = ModelInfo([str(i) for i in range(10)], Preprocess(16, 1.0), {"name": "swin_cifar_patch2_window4_32",
                                                                          "num_classes": 10})
    path = export_onnx(model, tmp_path / "swin.onnx", info)
    x = torch.randn(7, 3, 16, 16)
    check = verify(model, OnnxModel(path), x, batch_sizes=(1, 7), tolerance=1e-4)
    assert check.ok and set(check.max_abs_diff) == {1, 7}, check.summary()


def test_pruning_is_refused(swin_run, tmp_path):
    _, summary = swin_run
    with pytest.raises(ValueError, match="swin_cifar_patch2_window4_32 cannot be pruned"):
        prune_checkpoint(summary["checkpoint"], tmp_path / "pruned.pt")


def test_attention_figure_on_a_stage_grid(swin_run, tmp_path):
    """`vitflow attention` on a Swin: the requested block's stage grid, rollout within that stage."""
    _, summary = swin_run
    last, first = stage_attention_figures(summary["checkpoint"], tmp_path, layer=1)
    assert last["grid"] == [2, 2] and last["heads"] == 12  # 16 px / patch 2 -> 8x8, 4x4, 2x2
    assert first["grid"] == [8, 8] and first["heads"] == 3
