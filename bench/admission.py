"""Admission benchmark: cost per call of resolve + render + splice at turn 64 vs turn 4.

Rollouts of a guess-the-number style conversation are staged turn by turn through the real
``StagingWriter`` on local disk; each call's admission resolves the parent's exact tokens through
``ChainPrefixCache`` (only the newest delta is read from staging), renders the chat and splices
with ``ChatPromptBuilder``. Every measured prompt is checked against the full-render definition
of docs/architecture.md §6 (``splice_chat_prompt``), outside the timed region.

    python bench/admission.py [--rollouts 40] [--turns 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks import ids
from tasks.capture.prefix_cache import Admission, ChainPrefixCache, resolve_admission
from tasks.capture.splice import ChatPromptBuilder, splice_chat_prompt
from tasks.models.bundled import load_bundled_tokenizer
from tasks.records.ledger import StagedDelta
from tasks.storage.objects import ObjectStore
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates, StagingWriter

TARGET_RATIO = 1.5
EARLY_TURN = 4


def reply_ids(tokenizer, turn: int, rollout: int) -> tuple[str, list[int]]:
    """A sampled reply whose ids are NOT what re-encoding its text gives (split into pieces)."""
    text = f"I guess {(turn * 37 + rollout * 11) % 100 + 1}."
    pieces = [text[:3], text[3:8], text[8:]]
    sampled = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
    return text, [*sampled, tokenizer.eos_token_id]


def run(rollouts: int, turns: int, *, write_through: bool) -> bool:
    tokenizer = load_bundled_tokenizer()
    builder = ChatPromptBuilder(tokenizer)
    costs: dict[int, list[float]] = {EARLY_TURN: [], turns: []}
    checked = 0
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        store = ObjectStore(tmp)
        coordinates: dict[str, CommitCoordinates] = {}
        reader = StagedReader(store)
        cache = ChainPrefixCache()
        cache.set_source("bench", lambda keys: reader.fetch_token_ids([(k, coordinates[k]) for k in keys]))
        with StagingWriter(store, shard=0, attempt=0, max_delay_ms=1.0) as writer:
            for r in range(rollouts):
                rollout = ids.rollout_id(r, 0)
                messages = [
                    {"role": "system", "content": "We are playing a guessing game. Reply with one number."},
                    {"role": "user", "content": "Guess my number (1 to 100)."},
                ]
                parent: StagedDelta | None = None
                chain: tuple[str, ...] = ()
                for turn in range(1, turns + 1):
                    call = ids.call_id(rollout, 0, turn - 1)
                    admission = Admission(
                        call_id=call,
                        parent_call_id=parent.call_id if parent else None,
                        prev_len=parent.cum_len if parent else 0,
                        staging_chain=chain,
                        parent_chain_hash=parent.chain_hash if parent else None,
                    )
                    start = time.perf_counter()
                    parent_tokens = resolve_admission(admission, cache)
                    prompt = builder.prompt(messages, parent_tokens)
                    elapsed = time.perf_counter() - start
                    if turn in costs:
                        costs[turn].append(elapsed)
                        expected = splice_chat_prompt(tokenizer, messages, parent_tokens)
                        if prompt.tolist() != expected:
                            raise AssertionError(f"{call}: the builder differs from the full-render definition")
                        checked += 1
                    text, sampled = reply_ids(tokenizer, turn, r)
                    delta = StagedDelta.build(
                        batch_id="bench",
                        rollout_id=rollout,
                        call_id=call,
                        parent_call_id=admission.parent_call_id,
                        parent_chain_hash=admission.parent_chain_hash,
                        prefix_token_ids=parent_tokens,
                        prompt_token_ids=prompt,
                        generated_token_ids=sampled,
                        generated_logprobs=np.full(len(sampled), -0.5, np.float32),
                        weight_version=0,
                        finish_reason="stop",
                        temperature=1.0,
                        top_p=1.0,
                        top_k=-1,
                    )
                    coordinates[delta.staging_key] = writer.submit(delta).result()
                    if write_through:
                        cache.remember(delta.staging_key, np.concatenate([parent_tokens, delta.token_ids_delta]))
                    parent, chain = delta, (*chain, delta.staging_key)
                    messages = [
                        *messages,
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": "Higher. My number is greater than that."},
                    ]
    early, late = statistics.median(costs[EARLY_TURN]), statistics.median(costs[turns])
    ratio = late / early
    ok = ratio <= TARGET_RATIO
    mode = "write-through prefix cache (as call capture runs)" if write_through else "every parent read from staging"
    print(f"{rollouts} rollouts x {turns} turns, {mode}; {checked} prompts checked against the full-render definition")
    print(
        f"admission per call (resolve + render + splice), median: turn {EARLY_TURN} {early * 1e6:.0f} us, "
        f"turn {turns} {late * 1e6:.0f} us"
    )
    print(f"turn {turns} / turn {EARLY_TURN} = {ratio:.2f}  (target <= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--turns", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = [run(args.rollouts, args.turns, write_through=mode) for mode in (True, False)]
    return 0 if results[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
