"""Evaluation: a suite of scored test sets run on a base and candidate models, release gates, and the report."""
