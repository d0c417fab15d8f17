"""An MViTv2 through vitflow's pipeline: a few training steps of the 32x32 variant (shrunk) on the
embedded digits with the Trainer (stochastic depth, a checkpointed block; depths 1-1-2 from
the MViT section's model.depths), its checkpoint rebuilt;
one ONNX export checked at batch 1 and 7; INT8 (ONNX Runtime and PyTorch) of the trained
checkpoint; LoRA and linear-probe fine-tuning; attention figure; bench infer against timm;
pruning refused."""

import pytest
import torch

from helpers import check_run_checkpoint, digits_config, stage_attention_figures
from vitflow import checkpoint as ckpt
from vitflow.infer.export.formats import export_onnx, verify
from vitflow.infer.prune import prune_checkpoint
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel

SHRUNK = ("model.name=mvitv2_cifar_32", "model.img_size=16", "model.embed_dim=16", "model.depths=1,1,2",
          "train.batch_size=4",
          "data.train_split=train[:64]", "data.val_split=none", "data.test_split=train[64:96]", "train.eval_every=0",
          "train.log_every=2", "optim.warmup_steps=1", "train.precision=fp32")


@pytest.fixture(scope="module")
def mvit_run(tmp_path_factory):
    from vitflow.training.loop import Trainer

    run = tmp_path_factory.mktemp("mvit") / "run"
    trainer = Trainer(digits_config(run, *SHRUNK, "model.drop_path_rate=0.1", "model.grad_checkpointing=1",
                                    "train.total_steps=3"))
    return trainer, trainer.fit()


def test_variant_trains_and_its_checkpoint_rebuilds(mvit_run):
    trainer, summary = mvit_run
    assert trainer.model.blocks[1].grad_checkpointing and trainer.model.blocks[1].attn.rel_pos_h.grad is None
    check_run_checkpoint(trainer, summary, "mvitv2_cifar_32", "stages.1.blocks.0.attn.pool_q.weight")


def test_onnx_batch_1_and_7_from_one_export_and_int8(mvit_run, tmp_path):
    """The trained checkpoint exported once (PyTorch's convolution and explicit attention while
    tracing) verifies at batch 1 and 7 within 1e-4; its dynamic-INT8 graph quantises every linear
    layer and stays within 0.1 of the float logits; PyTorch's INT8 model runs the plain residual
    adds (quantized linears take no residual)."""
    from vitflow.infer.quantize.dynamic import quantize_onnx, quantize_torch

    _, summary = mvit_run
    state = ckpt.load_checkpoint(summary["checkpoint"])
    model = ckpt.model_from_checkpoint(state)
    path = export_onnx(model, tmp_path / "mvit.onnx", ModelInfo.from_checkpoint(state))
    x = torch.randn(7, 3, 16, 16)
    check = verify(model, OnnxModel(path), x, batch_sizes=(1, 7), tolerance=1e-4)
    assert check.ok and set(check.max_abs_diff) == {1, 7}, check.summary()
    ops = quantize_onnx(path, tmp_path / "mvit.int8.onnx")
    assert ops.get("MatMulInteger", 0) + ops.get("DynamicQuantizeMatMul", 0) >= 4 * len(model.blocks)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(torch.as_tensor(OnnxModel(tmp_path / "mvit.int8.onnx")(x)), want, atol=0.1,
                                   rtol=0)
        torch.testing.assert_close(quantize_torch(model)(x), want, atol=0.1, rtol=0)


def test_lora_and_linear_probe_finetune_the_checkpoint(mvit_run, tmp_path):
    """Fine-tuning the run's checkpoint: LoRA adapters land on every block's attn.qkv / attn.proj
    and only they and the head change; a linear probe changes only the head."""
    from vitflow.models.lora import LoRALinear
    from vitflow.training.loop import Trainer

    _, summary = mvit_run
    for mode, trained in (("lora", ("lora_A", "lora_B", "head.fc.")), ("linear_probe", ("head.fc.",))):
        tr = Trainer(digits_config(tmp_path / mode, *SHRUNK, f"model.pretrained={summary['checkpoint']}",
                                   f"finetune.mode={mode}", "train.total_steps=2"))
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        tr.fit()
        changed = {k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed and all(any(t in k for t in trained) for k in changed), (mode, changed)
        if mode == "lora":
            adapted = [n for n, m in tr.model.named_modules() if isinstance(m, LoRALinear)]
            assert len(adapted) == 2 * len(tr.model.blocks) and "stages.2.blocks.1.attn.qkv" in adapted


def test_attention_figure_bench_infer_and_pruning_refused(mvit_run, tmp_path):
    from vitflow.infer.bench.infer import bench_infer

    _, summary = mvit_run
    last, first = stage_attention_figures(summary["checkpoint"], tmp_path, layer=0)
    assert last["grid"] == [2, 2] and last["heads"] == 4  # 16 px / stride 2 -> 8x8, 4x4, 2x2
    assert first["grid"] == [8, 8] and first["heads"] == 1
    r = bench_infer(summary["checkpoint"], paths=("timm_eager_fp32", "eager_fp32"), batch_size=2, repeats=1,
                    latency_calls=1, min_time=0.0, log=lambda s: None)
    assert set(r["results"]) == {"timm_eager_fp32", "eager_fp32"} and "MultiScaleVit" in r["notes"]["timm_eager_fp32"]
    with pytest.raises(ValueError, match="mvitv2_cifar_32 cannot be pruned"):
        prune_checkpoint(summary["checkpoint"], tmp_path / "pruned.pt")
