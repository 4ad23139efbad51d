"""Release manifests: a finished, evaluated run recorded as one versioned, verifiable release.

    glmtune release RUN_DIR --eval EVAL_DIR --engine vllm==0.11.0   # writes RUN_DIR/release.json
    glmtune release verify release.json                             # re-hash every artifact: drift?
    glmtune release diff A.json B.json                              # what changed between releases

Modules: manifest (building and writing release.json), artifacts (hashing files and
directories, checking them again), base_model (the base's revision and identity),
eval_record (the eval directory and the candidate it scored), provenance (data, tokenizer,
versions), triggers (rollback thresholds), verify, diff. What is recorded and why:
docs/release.md.
"""

from glmtune.release.manifest import FORMAT, ReleaseRequest, create_release, load_release, release_id

__all__ = ["FORMAT", "ReleaseRequest", "create_release", "load_release", "release_id"]
