"""Whether this machine can run the Megatron engine: the clear refusals, said before anything starts.

Light (no PyTorch or megatron-core at import): the engine calls these first, and a machine without
the extra, a GPU or a new enough Python gets a message naming what is missing.
"""

from __future__ import annotations

import importlib.util
import sys

EXTRA = "megatron"


class MegatronUnavailableError(RuntimeError):
    """This machine cannot run the Megatron engine (the extra, a GPU or flash-attn is missing)."""


def require_megatron() -> None:
    """Raise :class:`MegatronUnavailableError` unless megatron-core can be imported here."""
    if sys.version_info < (3, 12):
        raise MegatronUnavailableError(
            f"the megatron engine needs Python >= 3.12 (megatron-core 0.19), this is "
            f"{sys.version_info.major}.{sys.version_info.minor}; use engine 'vllm' here"
        )
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise MegatronUnavailableError(
            f"megatron-core is not installed: pip install 'rollout-ledger[{EXTRA},model]' on a GPU machine"
        )


def require_gpu() -> None:
    """Raise :class:`MegatronUnavailableError` unless PyTorch sees a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise MegatronUnavailableError(
            "the megatron engine needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
            "run it on a GPU worker, or use engine 'vllm'"
        )
