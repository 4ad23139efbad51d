"""Evaluation: `glmtune eval SUITE --base B --candidate C` scores two (or three) models on one suite
with the same prompt wrapper and decoding, gates a release on the scores, and writes a scorecard
(docs/eval.md)."""
