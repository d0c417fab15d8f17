"""The BEiT / EVA-02 / DINOv3 encoder with timm's ``Beit`` / ``Eva`` names: the model
(:mod:`.model`), its block and attention (:mod:`.block`), gated MLPs (:mod:`.glu`), the EVA-02 and
DINOv3 families (:mod:`.variants`) and BEiT (:mod:`.beit`)."""
