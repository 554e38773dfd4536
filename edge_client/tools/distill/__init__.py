"""Distil the target into a small ONNX draft, resumably (``edgespec-distill``, see ``cli``).

One module per stage; each stage checkpoints, so it can be killed at any moment and rerun:

- ``magpie`` (``gen-prompts``): prompts that look like use, not templates: user turns the
  target writes itself after the chat template's user-turn start (Magpie, arXiv 2406.08464),
  multi-turn follow-ups, raw-text IME fragments, and requests started by an opener;
  deduplicated and kept apart from the realistic evaluation set
  (``edge_client.bench.eval_set``); ``gen-data --prompts-file`` continues them.
  ``--engine vllm`` samples them on vLLM (``magpie_vllm``).
- ``data`` (``gen-data``): the target continues the distillation prompts and records, for
  every generated token, the top-k ids and log-probabilities of its distribution p at
  temperature 1, one ``shard-NNNNN.npz`` (``shards``) per ``--shard-size`` prompts; with
  ``--draft-run`` a trained draft writes the continuations and the target labels them.
- ``corpus``: both at scale: chunk after chunk of ``gen-prompts`` then ``gen-data`` until
  ``--target-tokens``, bounded by ``--max-minutes`` and resumed by the same command, with a
  manifest (``corpus.json``) of each chunk's engine, dtype, host and counts.
- ``train``: a draft ``LlamaForCausalLM`` (``model``) against those sparse distributions,
  KL(p_topk || q) + w * TV(p_topk, q); per-token acceptance of speculative sampling is
  1 - TV(p, q), so TV is the quantity that matters, while KL gives the better gradients early.
- ``export``: checkpoint -> HF dir -> ONNX -> dynamic int8 (``quantize``), with a
  MODEL_CARD.md (``card``) holding the held-out acceptance of fp32 and int8.
- ``evaluate`` (``eval``): held-out acceptance of a checkpoint or of an ONNX draft directory.
- ``onnx_import`` (``import-onnx``): a shipped ONNX draft directory (int8 or fp32) back into a
  finished run directory, for ``train --init-from`` when the checkpoint is gone.
- ``expand``: a deeper draft from a finished run, new layers inserted with their output
  projections at zero (the same logits), for ``train --init-from``.
- ``head_model``, ``head_train`` (``train-head``), ``head_eval``, ``head_export``
  (``export-head``): a one-layer draft head conditioned on the target's final hidden state,
  run on the edge by ``edge_client.feature_draft`` (``docs/feature-draft.md``).
- ``head_context`` (``train-head --context``, ``prompt-features``), ``head_layers``
  (``layer-features``, ``--feature-layers``): context heads, which attend over the target's
  features of the whole text, optionally fused with some of its decoder layers' states; no
  edge runtime yet.
- ``prompts``: the distillation prompts (data files) and their fixed held-out split.

Notation as in ``cloud_verifier.verification``: p is the target, q the draft, K the draft
length.

Reduced vocabulary (``vocab``). A draft may keep only the ``--sub-vocab`` most frequent target
tokens (plus one <unk> slot for inputs outside them): its head is much cheaper, and this is
lossless because q is simply 0 elsewhere. ``vocab_map.npz`` beside the ONNX model
(``sub_to_full``, -1 for the <unk> slot, and ``full_vocab_size``) lets ``OnnxDraftModel`` keep
taking and returning full-vocabulary ids and logits.

Importing this package imports nothing else; none of its modules imports torch at module level.
"""
