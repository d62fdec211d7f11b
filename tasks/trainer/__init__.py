"""Trainer-side tools over a published dataset: the torch collator and the logprob audit (both need torch)."""
