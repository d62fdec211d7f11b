"""What one vLLM server says it serves: the value :mod:`~tasks.engines.vllm_server.claims` reads and checks and
:mod:`~tasks.engines.vllm_server.weights` judges the weights of.

It sits below both, so the dependency between them runs one way (``claims`` uses ``weights``):
it imports no other module of the package, and a claim is a frozen value, never changed once read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerClaim:
    """What one server says it serves."""

    url: str
    model: str  # the served model name (``--served-model-name``, by default the folder)
    root: str  # the folder or hub id it loaded
    max_model_len: int
    weight_version: int
    logprobs_mode: str
    paused: bool = False
    identity: str = ""  # the server process's start (:func:`~tasks.engines.vllm_server.replica.start_identity`)

    def same_model(self, other: ServerClaim) -> bool:
        return (self.model, self.root, self.max_model_len) == (other.model, other.root, other.max_model_len)
