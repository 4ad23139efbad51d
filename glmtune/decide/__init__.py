"""The decision before training: `glmtune decide SUITE --base MODEL` scores the base model, the base
prompted with examples, the base with retrieved passages and the alternatives on one suite (eval's
machinery), applies written rules to the gates and says whether to fine-tune at all (docs/decide.md)."""
