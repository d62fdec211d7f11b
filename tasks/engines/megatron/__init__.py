"""The Megatron-core engine (docs/megatron.md).

:mod:`.options` is light (what the registry imports anywhere); :mod:`.engine` (``MegatronEngine``,
the clear refusals), :mod:`.stepper` and :mod:`.weights` import PyTorch; :mod:`.model` imports
megatron-core itself, only after :func:`.engine.require_megatron` said it is there.
"""
