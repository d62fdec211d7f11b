"""The server side of engine ``vllm_server``: what ``rollout-ledger serve`` runs (docs/servers.md).

:mod:`.launch` starts vLLM's own API server with this project's flags and the vLLM engine's
options, and stops it with the process that launched it; :mod:`.keys` makes its API key.
:mod:`.auth` (the key guard) and :mod:`.records` (the weight records) run inside the server's
process, loaded by vLLM's ``--middleware`` hook. The client side (the rest of
:mod:`tasks.engines.vllm_server`) talks to such a server over HTTP only.
"""
