"""Sampling masks through the shard runner (fake scripted engine, real tokenizer, real storage).

A batch sampled with top-p / top-k stages each sampled token's kept set with its call and names their digest in
the call's extras (so its chain covers the mask); an engine that answers a truncating call without kept sets
fails that call, named; an untruncated batch stages none. The real engines' kept sets are proven against an fp32
recompute in tests/engines/test_vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tasks.batch import Batch
from tasks.generate import generate_shard
from tasks.plan import plan_batch
from tasks.records.sampling_mask import KEPT_DIGEST_KEY, KEPT_NOTE
from tasks.sampling import SamplingSettings
from tasks.storage.ledger_reader import LedgerReader

from .chains import verified_sequences
from .configs import fake_model_config
from .fakes import FakeScriptedEngine, scripted_kept_sets

TRUNCATED = SamplingSettings(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16)


def _generate(root: str, sampling: SamplingSettings, engine: FakeScriptedEngine, batch_id: str) -> Batch:
    batch = Batch.open(root, batch_id)
    plan_batch(batch, fake_model_config(batch_id=batch_id, shards=1, sampling=sampling))
    generate_shard(batch, 0, engine=engine, run=asyncio.run, progress=False)
    return batch


def test_a_truncated_batch_stages_each_sampled_tokens_kept_set_under_its_call_digest(tmp_path, tokenizer):
    engine = FakeScriptedEngine(tokenizer, masks=True)
    batch = _generate(str(tmp_path), TRUNCATED, engine, "b-masks")
    chains = verified_sequences(batch.store, 0)
    deltas = [delta for chain in chains.values() for delta in chain]
    assert len(chains) == 8 and len(deltas) == len(engine.requests)
    for delta in deltas:
        sampled = np.asarray(delta.token_ids_delta)[np.asarray(delta.token_mask_delta) == 1]
        expected = scripted_kept_sets(sampled.tolist())
        assert [s.tolist() for s in delta.kept.sets()] == [s.tolist() for s in expected.sets()]
        assert json.loads(delta.extras_json)[KEPT_NOTE] == {KEPT_DIGEST_KEY: expected.digest()}
    assert {r.status for r in LedgerReader(batch.store, 0).receipts} == {"ok"}


def test_an_engine_that_answers_a_truncated_call_without_kept_sets_fails_it_named(tmp_path, tokenizer):
    batch = _generate(str(tmp_path), TRUNCATED, FakeScriptedEngine(tokenizer), "b-no-masks")
    ledger = LedgerReader(batch.store, 0)
    assert {f.reason for f in ledger.failures} == {"sampling_mask_missing"}
    assert {(r.status, r.failure_reason) for r in ledger.receipts} == {("poisoned", "sampling_mask_missing")}
    assert ledger.calls == ()  # nothing of a call that cannot be proven is staged as proven


def test_an_untruncated_batch_stages_no_kept_sets(tmp_path, tokenizer):
    engine = FakeScriptedEngine(tokenizer, masks=True)
    batch = _generate(str(tmp_path), SamplingSettings(temperature=1.0, max_tokens=16), engine, "b-plain")
    for chain in verified_sequences(batch.store, 0).values():
        for delta in chain:
            assert not delta.kept and KEPT_NOTE not in (json.loads(delta.extras_json) or {})
