"""Structured pruning of a trained ViT: whole blocks, attention heads and MLP hidden units are
removed, so the model has fewer layers and its ``qkv``/``proj`` and ``fc1``/``fc2`` matrices
physically shrink: it gets faster on any hardware (no sparse kernels needed), followed by an
optional short fine-tune with knowledge distillation from the unpruned model.

Blocks go first, by ablation: a block's importance is the rise of the calibration images' mean
cross-entropy when it is skipped (tokens passed on unchanged), as Michel et al. 2019 (sec. 3) ablate
heads; Gromov et al. 2024 and Men et al. 2024 ("ShortGPT") drop transformer blocks by similar
scores. The blocks with the smallest rise go at once (one pass, not greedy). Fewer blocks shorten
batch-1 latency, where a small model's time goes to the number of operations more than their size.

Heads and MLP units are then scored on the shallower model (first-order Taylor estimate of the
loss change when a unit is removed):

- head ``h`` of block ``l``: ``I = E_x |dL/d xi_h|`` where ``xi_h`` is a gate multiplying the
  head's output (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?", eq. 2);
- MLP hidden unit ``j``: ``I = E_x |dL/d g_j|`` for a gate on its activation (Molchanov et al.
  2017, "Pruning Convolutional Neural Networks for Resource Efficient Inference").

Scores are L2-normalised per block (Michel et al., sec. 4.2) and ranked globally, so blocks that
matter less lose more units; every block keeps at least one head and one hidden unit.

The pruned model is a regular :class:`vitflow.models.VisionTransformer` built with per-block
``block_heads`` / ``block_mlp_hidden`` (saved in the checkpoint's ``model_args``), so it loads,
evaluates, predicts, exports and quantises like any other.
"""

from vitflow.infer.prune.checkpoint import prune_checkpoint
from vitflow.infer.prune.scores import Importance, block_importance, importance_scores
from vitflow.infer.prune.surgery import prune_heads_, prune_mlp_, prune_model, remove_blocks, select_units

__all__ = ["Importance", "block_importance", "importance_scores", "prune_checkpoint", "prune_heads_", "prune_mlp_",
           "prune_model", "remove_blocks", "select_units"]
