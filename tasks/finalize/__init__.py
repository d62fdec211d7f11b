"""The finalize stage: verify every receipt's lineage, linearize it, and publish GRPO datasets."""
