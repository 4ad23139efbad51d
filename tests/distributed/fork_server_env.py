"""The environment of the gloo fork server, set before its preload imports transformers.

The first module of tests/distributed/gloo_helpers.py's PRELOAD: the fork server imports it in its
own process (the test process's environment is left alone) before transformers, whose hub settings
are read once, at import (huggingface_hub.constants.HF_HUB_OFFLINE): every forked process is then as
offline as a `glmtune train` subprocess started with tests/train/run_helpers.py's `env()`, and as
the forked processes were when they imported transformers themselves after setting it.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
