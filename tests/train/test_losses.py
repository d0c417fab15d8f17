"""Losses: label smoothing with soft targets, distillation losses, DeiT's distilled ViT and its teacher."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import digits_config
from vitflow import checkpoint as ckpt
from vitflow import create_model
from vitflow.config import build_config
from vitflow.data.augment import MixupCutmix
from vitflow.train import Trainer
from vitflow.train.distill import DistillationLoss
from vitflow.train.losses import classification_loss, hard_distillation_loss, soft_distillation_loss


def test_soft_target_ce_applies_label_smoothing_once():
    torch.manual_seed(0)
    logits, y, eps, c = torch.randn(6, 5), torch.randint(0, 5, (6,)), 0.1, 5
    x = torch.randn(6, 3, 4, 4)
    _, soft = MixupCutmix(c, mixup_alpha=0.8, cutmix_alpha=0.0)(x, y, np.random.default_rng(1))
    assert torch.allclose(soft.sum(1), torch.ones(6)) and (soft.max(1).values < 1).any()  # mixed, unsmoothed
    manual = -(((1 - eps) * soft + eps / c) * logits.log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(classification_loss(logits, soft, eps), manual)
    one_hot = F.one_hot(y, c).float()  # a one-hot soft target equals the hard label, smoothing included
    torch.testing.assert_close(classification_loss(logits, one_hot, eps), classification_loss(logits, y, eps))


def test_distillation_losses_match_their_definitions():
    torch.manual_seed(0)
    s, t, tau = torch.randn(4, 6), torch.randn(4, 6), 2.0
    p_t = (t / tau).softmax(1)
    kl = (p_t * (p_t.log() - (s / tau).log_softmax(1))).sum(1).mean() * tau**2
    torch.testing.assert_close(soft_distillation_loss(s, t, tau), kl)
    assert soft_distillation_loss(t, t, tau) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(hard_distillation_loss(s, t), F.cross_entropy(s, t.argmax(1)))
    cls, dist, y = torch.randn(4, 6), torch.randn(4, 6), torch.randint(0, 6, (4,))
    loss = DistillationLoss(lambda x: t, "hard", alpha=0.3, label_smoothing=0.1)((cls, dist), y, None)
    torch.testing.assert_close(loss, 0.7 * F.cross_entropy(cls, y, label_smoothing=0.1)
                               + 0.3 * F.cross_entropy(dist, t.argmax(1)))


def test_distilled_vit_matches_timm_and_averages_heads():
    pytest.importorskip("timm")
    from timm.models.deit import VisionTransformerDistilled as TimmDistilled

    ours = create_model("vit_digits_patch2_8", num_classes=10, global_pool="token", distilled=True).eval()
    theirs = TimmDistilled(img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0,
                           num_classes=10).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)  # same names and shapes
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    tokens = ours.forward_features(x)
    torch.testing.assert_close(ours(x), (ours.head(tokens[:, 0]) + ours.head_dist(tokens[:, 1])) / 2)
    ours.distilled_training = True
    cls, dist = ours.train()(x)
    assert cls.shape == dist.shape == (3, 10)
    assert "dist_token" in ours.no_weight_decay() and create_model("deit_tiny_distilled_patch16_224").dist_token.numel()


def test_distillation_token_model_learns_digits_from_a_teacher(digits_run, tmp_path):
    """A distilled ViT trained with hard DeiT distillation from the default run's checkpoint:
    both heads learn, and the averaged prediction is what eval reports."""
    _, teacher, _ = digits_run
    cfg = digits_config(tmp_path / "student", "model.distilled=true", "model.global_pool=token",
                 f"distill.teacher={teacher['checkpoint']}", "distill.kind=hard", "train.total_steps=300",
                 "train.log_every=50")
    tr = Trainer(cfg)
    r = tr.fit()
    assert r["test_top1"] >= 0.7, r  # chance is 0.10; 300 steps (the teacher had 400: 0.86); measured 0.79
    state = ckpt.load_checkpoint(r["checkpoint"])
    assert state["model_args"]["distilled"] and "head_dist.weight" in state["model"]
    model = ckpt.model_from_checkpoint(state)
    x = tr.data.test.load_batch(torch.arange(len(tr.data.test)).numpy()).float()
    x = (x / 255 - 0.5) / 0.5
    tokens = model.forward_features(x)
    y = torch.from_numpy(tr.data.test.labels)
    acc_cls = (model.head(tokens[:, 0]).argmax(1) == y).float().mean()
    acc_dist = (model.head_dist(tokens[:, 1]).argmax(1) == y).float().mean()
    assert acc_cls > 0.6 and acc_dist > 0.6, (acc_cls, acc_dist)


def test_teacher_with_other_classes_is_refused(digits_run, tmp_path):
    from helpers import make_folder

    _, teacher, _ = digits_run
    data = make_folder(tmp_path / "data", per_class=4)
    cfg = build_config(overrides=[f"data.path={data}", "data.source=folder", "data.train_split=train[:50%]",
                                  "data.test_split=train[50%:]", f"distill.teacher={teacher['checkpoint']}",
                                  f"train.run_dir={tmp_path / 'run'}", "train.batch_size=4"])
    with pytest.raises(ValueError, match="teacher was trained on classes"):
        Trainer(cfg)
