"""Swin Transformer (Liu et al. 2021) and Swin V2 (Liu et al. 2022) with timm's names: the model
(:mod:`.model`), its blocks and patch merging (:mod:`.block`), ``grad_checkpointing=auto``
(:mod:`.plan`) and the family (:mod:`.variants`). Window attention itself is in
:mod:`vitflow.models.attention.window`; fitting Swin weights to another window or input size in
:mod:`vitflow.models.pretrained.swin_fit`."""
