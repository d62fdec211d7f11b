"""The exactly-once trial's trainer process: train each dataset given, in order, one step each, from the latest
checkpoint (``python -m tests.trainer.step_trial ROOT URL...``). Prints ``ready`` once its imports (torch,
transformers) are done, then ``done``. The test kills it with SIGKILL at random moments and starts it again until
it says ``done``."""

from __future__ import annotations

import logging
import sys

from tasks.trainer.step import StepSettings, train_step

TRIAL_SETTINGS = StepSettings(lr=1e-3, threads=1)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    root, urls = argv[0], argv[1:]
    # The heavy imports happen before "ready" (transformers imports a model's code lazily, on first load), so the
    # kills land in the step's own work.
    import torch  # noqa: F401
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401

    print("ready", flush=True)
    for url in urls:
        train_step(root, [url], TRIAL_SETTINGS)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
