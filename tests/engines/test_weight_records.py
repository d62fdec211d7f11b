"""A load's two hashes (:mod:`tasks.engines.weight_records`) and what ``rollout-ledger refit`` says of them.

A refit's load keeps the sha256 the refit announced and the server's own; it is verified only when
both name the same folder and sha256. Records of servers that did not hash their refits (a load of
three keys) are still read: a refit's as announced only, declared.
"""

from __future__ import annotations

import pytest

from tasks.engines.vllm_server.refit import Refit
from tasks.engines.weight_records import (
    FAILED_LOAD,
    LOADED_AT_START,
    LOADED_BY_REFIT,
    UNANNOUNCED_LOAD,
    Announcement,
    Load,
    RecordsFormatError,
    WeightRecords,
)

SHA, OTHER = "ab" * 32, "cd" * 32
FOLDER = "/models/step-42"
ANNOUNCED = Announcement(SHA, FOLDER)


@pytest.mark.parametrize(
    ("load", "verified"),
    [
        (Load(LOADED_AT_START, SHA, FOLDER), SHA),
        (Load(LOADED_AT_START, None, "org/model"), None),
        (Load(LOADED_BY_REFIT, SHA, FOLDER, ANNOUNCED), SHA),
        (Load(LOADED_BY_REFIT, OTHER, FOLDER, ANNOUNCED), None),  # forged, or the folder changed
        (Load(LOADED_BY_REFIT, None, FOLDER, ANNOUNCED), None),  # the server could not hash it
        (Load(LOADED_BY_REFIT, SHA, "/models/elsewhere", ANNOUNCED), None),  # the same weights under another name
        (Load(LOADED_BY_REFIT, None, None, ANNOUNCED), None),  # a load that names no folder
        (Load(LOADED_BY_REFIT, None, FOLDER, Announcement(None, FOLDER)), None),  # hashed by nobody
        (Load(UNANNOUNCED_LOAD, folder=FOLDER), None),
        (Load(FAILED_LOAD, folder=FOLDER), None),
    ],
)
def test_a_load_is_verified_only_where_the_server_hashed_it_and_a_refits_two_hashes_agree(load, verified) -> None:
    assert load.verified_sha256 == verified
    assert Load.from_json(load.to_json()) == load
    assert WeightRecords({3: (load,)}, 3, load, False).sha256_of(3) == verified


def test_the_three_key_shape_reads_on_and_a_refit_in_it_reads_as_announced_only() -> None:
    start_up = {"loaded_by": LOADED_AT_START, "weights_sha256": SHA, "folder": FOLDER}
    assert Load.from_json(start_up) == Load(LOADED_AT_START, SHA, FOLDER) and Load(**start_up).to_json() == start_up
    old_refit = Load.from_json({"loaded_by": LOADED_BY_REFIT, "weights_sha256": SHA, "folder": FOLDER})
    assert old_refit == Load(LOADED_BY_REFIT, None, FOLDER, ANNOUNCED) and old_refit.verified_sha256 is None
    refit = Load(LOADED_BY_REFIT, SHA, FOLDER, ANNOUNCED).to_json()
    assert refit["announced"] == {"weights_sha256": SHA, "folder": FOLDER} and refit["weights_sha256"] == SHA


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"loaded_by": LOADED_BY_REFIT, "weights_sha256": SHA, "folder": FOLDER, "announced": None}, "announcement"),
        ({"loaded_by": UNANNOUNCED_LOAD, "weights_sha256": None, "folder": None, "announced": ANNOUNCED.to_json()},
         "keeps its announcement"),
        ({"loaded_by": LOADED_BY_REFIT, "weights_sha256": SHA, "folder": FOLDER, "by": "me"}, "expected loaded_by"),
        ({"loaded_by": LOADED_BY_REFIT, "weights_sha256": SHA, "folder": FOLDER,
          "announced": {"weights_sha256": "ABC", "folder": FOLDER}}, "not a lowercase hex sha256"),
        ({"loaded_by": LOADED_BY_REFIT, "weights_sha256": SHA, "folder": FOLDER,
          "announced": {"weights_sha256": SHA, "folder": ""}}, "folder '' is not a path"),
    ],
)  # fmt: skip
def test_a_malformed_load_is_refused_naming_what_is_wrong(value, named) -> None:
    with pytest.raises(RecordsFormatError, match=named):
        Load.from_json(value)


@pytest.mark.parametrize(
    ("load", "says"),
    [
        (Load(LOADED_BY_REFIT, SHA, FOLDER, ANNOUNCED), "verified: the server hashed the folder it loaded"),
        (None, "declared, not verified: it keeps no weight records"),
        (Load(LOADED_BY_REFIT, OTHER, FOLDER, ANNOUNCED), f"the server hashed the folder it loaded to sha256 {OTHER}"),
        (Load(LOADED_BY_REFIT, None, FOLDER, ANNOUNCED), f"the server could not hash {FOLDER} where it runs"),
        (Load(LOADED_BY_REFIT, SHA, "/elsewhere", ANNOUNCED), f"the server loaded /elsewhere, not {FOLDER}"),
        (Load(UNANNOUNCED_LOAD), "not this refit's load (the server recorded: unannounced load)"),
    ],
)
def test_refit_says_what_each_server_recorded_of_its_load(load, says) -> None:
    (verdict,) = Refit(FOLDER, 42, ANNOUNCED, {"http://replica": load}).verdicts()
    assert verdict.startswith("http://replica: ") and says in verdict
    assert ("declared, not verified" in verdict) is (load is None or load.verified_sha256 is None)
