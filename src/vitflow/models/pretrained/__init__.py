"""Pretrained weights: reading and writing weight files safely (:mod:`.weights`), where they come
from (a file, a hub snapshot folder, ``hf-hub:``; :mod:`.hub`), fitting Swin weights to another
window or input size (:mod:`.swin_fit`) and MViTv2 weights to another input size (:mod:`.mvit_fit`), the run settings they imply (:mod:`.config`) and
constructor arguments between vitflow and timm (:mod:`.timm_args`)."""
