"""Hand-offs from our GRPO rows to the trainers people run: one small module per trainer (docs/exporters.md).

Each exporter turns a published dataset's rows (a pyarrow table of dataset rows, a
:class:`~tasks.trainer.collate.PublishedDataset` or its items) into the fields that trainer's loss
reads, as plain torch tensors and lists (no trainer is imported):

* :mod:`.verl`: the rollout batch of verl's ``DataProto`` (``prompts``, ``responses``, ``response_mask``,
  ``rollout_log_probs``, ``advantages``, ...);
* :mod:`.nemo_rl`: NeMo RL's ``ClippedPGLossDataDict`` (``generation_logprobs``, ``token_mask``,
  ``sample_mask``, ``advantages``, ...);
* :mod:`.trl`: the output of TRL's ``rollout_func`` (``prompt_ids``, ``completion_ids``, ``logprobs``,
  ``env_mask``, ...);
* :mod:`.tinker`: Tinker ``Datum``\\ s (``model_input``, ``loss_fn_inputs``: ``target_tokens``, ``logprobs``,
  ``advantages``).

The invariant every one keeps: under the trainer settings its docstring names, that trainer's own loss over
the exported fields is :func:`tasks.trainer.loss.grpo_loss` over the rows (tests/trainer/test_exporters.py
reimplements each trainer's formula from its source and checks it to 1e-6). Carried tokens (the prompt, and
each later call's environment tokens inside a multi-turn row) are never trained: each exporter's mask is 0
on them, and a masked row (``sample_mask`` 0) contributes nothing.
"""
