"""Foreign weight layouts converted to timm's (= vitflow's) parameter names: Hugging Face ViT and
big_vision ``.npz`` (:mod:`.vit`), Hugging Face image backbones (:mod:`.hf`) and Swin
(:mod:`.hf_swin`), OpenCLIP / OpenAI CLIP towers (:mod:`.openclip`)."""
