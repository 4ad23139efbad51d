"""Distillation (issue 48): teacher answers and their top-K log-probabilities (`generate`,
`topk_store`) for a student to learn from. docs/distill.md."""
