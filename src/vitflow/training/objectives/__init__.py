"""What a run minimises: :mod:`.losses` (classification and distillation losses), :mod:`.distill` (the
criterion: label loss and DeiT distillation) and :mod:`.class_weights` (imbalanced classes)."""
