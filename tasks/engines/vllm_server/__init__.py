"""Engine ``vllm_server``: the engine contract over HTTP to running vLLM servers (docs/servers.md)."""
