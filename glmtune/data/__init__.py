"""Data pipeline: chat rows (SFT) or preference rows (DPO) in, packed token rows out.

  sources.py        read JSONL / Parquet / `datasets` directories, rows keep file:line
  contract.py       the data contract (validate_rows, check_or_raise) and normalization
  preferences.py    preference rows (prompt/chosen/rejected): kind, contract, pair tokenization
  pii.py            secrets / PII lint
  dedup.py          exact and normalized-text dedup
  split.py          group-aware deterministic train/validation/test split
  prepare.py        `glmtune data prepare`: versioned split files + manifest
  chat_template.py  GLM-5 chat template rendering and assistant-only loss labels
  tokenizer.py      load a model's tokenizer or the bundled tiny one; GLM-5 special tokens
  token_cache.py    on-disk tokenization cache
  packing.py        first-fit-decreasing packing with per-document positions (samples or pairs)
  synthetic.py      the bundled support-ticket task (`glmtune data synth`)
  synthetic_preferences.py  the same task as preference pairs (`data synth --kind support_preferences`)

Modules are imported directly (`from glmtune.data.packing import pack_samples`);
this package imports nothing so that `import glmtune.data` stays free.
"""
