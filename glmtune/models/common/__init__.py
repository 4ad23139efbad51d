"""Model-agnostic model pieces, and the interfaces a model family implements for distributed/.

Above kernels/ only: a module here imports kernels/ and models/common/, never a model
family, so both the families and distributed/ build on it.

  aux_loss          auxiliary losses carried by the main loss's backward (`attach`)
  document_masks    block-causal masks of packed rows, longest document, one-document rows
  family            `ModelFamily`, what a family answers without torch (presets, config.json,
                    overrides, dims, stage costs, parameter count), and `ModelDims`
  hf_config         an HF checkpoint's config.json, read with the same refusals everywhere
  loss              the chunked causal-LM cross-entropy
  microbatch        `MicroBatch`, one micro-batch of packed rows as the trainer builds it (tokens,
                    positions, documents, targets, host facts, loss weights), and the pipeline
                    microbatch a stage reads (`StageMicrobatch`)
  model_spec        `ModelSpec`, the front door every model family implements
  rmsnorm           RMSNorm
  rope              rotary position embedding (interleaved, over the rope slice)
  sequence_shard    a context-parallel rank's queries (`SequenceShard`; the model's
                    `sequence_shard` attribute)
  step_runner       `StepRunner`, how a micro-batch runs through a built model, and `PlainRunner`
  step_runner_pipelined  `PipelinedRunner`: a pipeline's stages run it
  token_dispatch    MoE token dispatch (`TokenDispatcher`, `LocalTokenDispatcher`) and the
                    routed-experts layer contract (`expert_layers`)
"""
