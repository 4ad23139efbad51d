"""glmtune's version, written here and nowhere else in the package (pyproject.toml repeats it).

`glmtune.__version__` is this; modules below the package root (a data manifest, an adapter's
metadata, the code pin of preflight, eval and release) import it from here.
"""

__version__ = "0.1.0"
