"""The `hf` family: any causal LM transformers implements (Llama, Qwen3, Qwen3-MoE, GLM-4, ...),
built from transformers' own classes and trained through glmtune's loss and parallelization.

args.py (`HfArgs`, torch-free: config.json's shapes), shapes.py (parameter and FLOP counts from
the shapes, torch-free), family.py (`HF_FAMILY`), model.py (build, the packed forward, the loss),
weights.py (a directory's weights against its config), parallelize.py (FSDP2, activation
checkpointing, compile), state_dict_adapter.py (identity on HF names), spec.py (`HF`, the front door).
"""
