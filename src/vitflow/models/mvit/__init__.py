"""MViTv2 (Li et al. 2022) with timm's names: the model (:mod:`.model`), its blocks (:mod:`.block`),
the pooling attention module (:mod:`.pooling`), the stage layout and ``grad_checkpointing=auto``
(:mod:`.plan`), and the family (:mod:`.variants`);
weights fitted to another input size in :mod:`vitflow.models.pretrained.mvit_fit`. The attention kernels are in :mod:`vitflow.models.attention.pooling`."""
