"""The kept sets megatron's sampler drew from, per request: staged on the GPU each step, filed on the host by request.

The Megatron engine's sampler (:class:`tasks.engines.megatron.model.VllmConventionSampling`) draws
each truncating row (top-k, top-p) from a filtered logits tensor in which every id it dropped is
``-inf``. The boolean mask ``filtered != -inf`` of that very tensor is what the row kept: the
sampler hands it to :class:`KeptRecorder` (:meth:`KeptRecorder.stage`) with the megatron request
id of each row, and :meth:`KeptRecorder.record` moves only the kept ids to the host, as CSR (one
count per row, then the ids, ascending within a row: one device-to-host copy per step), and files
them under the requests the engine said it expects sets of (:meth:`KeptRecorder.expect`); the engine
takes a request's sets when it has finished (:meth:`KeptRecorder.take`), one per sampled token in
sampling order.

Invariants: a step's masks are recorded before the step's finished requests are handed back
(the sampler records them after its log-probs, the step backend after every step), so a finished
request's sets are complete when the engine takes them; each request's sets are in the order its
tokens were sampled; only expected requests' sets are kept, and a request's are taken at most once,
after which nothing more is filed for it (a call whose caller stopped waiting leaves nothing behind).

Only the step thread stages and records; the engine's loop takes. Imports PyTorch and numpy, not
megatron-core.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch


class KeptRecorder:
    """Per megatron request id, the kept ids (int32, ascending) of each token sampled for it so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, list[np.ndarray]] = {}  # guarded by _lock: the expected requests' sets so far
        self._staged: list[tuple[list[int], torch.Tensor]] = []  # the step thread's own

    def expect(self, request_id: int) -> None:
        """File the kept sets of ``request_id`` from now on, until :meth:`take`."""
        with self._lock:
            self._sets.setdefault(request_id, [])

    def stage(self, request_ids: Sequence[int], kept: torch.Tensor) -> None:
        """Hold one bucket's masks (bool ``[len(request_ids), vocab]``, any device) until :meth:`record`."""
        if kept.dtype != torch.bool or kept.ndim != 2 or kept.shape[0] != len(request_ids):
            raise ValueError(f"kept masks of shape {tuple(kept.shape)} ({kept.dtype}) for {len(request_ids)} rows")
        self._staged.append((list(request_ids), kept))

    @property
    def staged(self) -> bool:
        """Whether masks wait to be recorded."""
        return bool(self._staged)

    def record(self) -> None:
        """Copy the staged masks' kept ids to the host (counts, then ids: one transfer) and file them by request."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        request_ids = [rid for ids, _ in staged for rid in ids]
        counts = [kept.sum(dim=1, dtype=torch.int32) for _, kept in staged]
        ids = [kept.nonzero()[:, 1].to(torch.int32) for _, kept in staged]  # row-major: each row's ids ascending
        packed = torch.cat([*counts, *ids]).cpu().numpy()
        rows = len(request_ids)
        sets = np.split(packed[rows:], np.cumsum(packed[:rows])[:-1])
        with self._lock:
            for request_id, kept_ids in zip(request_ids, sets, strict=True):
                filed = self._sets.get(request_id)
                if filed is not None:
                    filed.append(kept_ids)

    def take(self, request_id: int) -> list[np.ndarray] | None:
        """The request's kept sets in sampling order, forgotten here (none filed after); None if not expected."""
        with self._lock:
            return self._sets.pop(request_id, None)

    def __len__(self) -> int:
        """Requests expected and not yet taken."""
        with self._lock:
            return len(self._sets)
