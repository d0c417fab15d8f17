"""The ViT family (Dosovitskiy et al. 2021) and the families in its layout: the model
(:mod:`.model`, its argument checks in :mod:`.checks`), DeiT's distilled ViT (:mod:`.distilled`),
the named variants (:mod:`.variants`) and the pretrained backbones with timm's names: DeiT III,
DINOv2, CLIP / OpenCLIP, SigLIP (:mod:`.pretrained`)."""
