"""Trainer side over published datasets (torch, imported where used): the collator (``collate``), the reference GRPO
loss (``loss``), policy checkpoints with their manifests (``checkpoint``) and the reference training step that reads
one checkpoint and writes the next, exactly once per dataset (``step``); docs/training.md."""
