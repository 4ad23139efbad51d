"""The licence: the LICENSE file holds the Apache License 2.0 as the Apache Software Foundation
publishes it (LICENSE-2.0.txt, byte for byte), and pyproject.toml declares the same licence."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (md5 3b83ef96387f14655fc854ddc3c6bd57)
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_apache_2_0_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256


def test_pyproject_declares_the_same_licence():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639); setuptools ships LICENSE with it
