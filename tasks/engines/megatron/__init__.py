"""The Megatron-core engine (docs/megatron.md).

Light at import: :mod:`.options` (what the registry imports anywhere), :mod:`.availability` (the
clear refusals), :mod:`.sampling` and :mod:`.tokenizer`. :mod:`.engine` (``MegatronEngine``),
:mod:`.results`, :mod:`.stepper`, :mod:`.step_backend`, :mod:`.runtime` and :mod:`.weights`
import numpy or PyTorch; :mod:`.model` imports megatron-core itself, only after
:func:`.availability.require_megatron` said it is there (:func:`.runtime.start_runtime` imports it).
"""
