"""The vLLM engine: :mod:`.options` (light: what the registry imports) and :mod:`.engine` (imports vLLM's stack)."""
