"""Installing cachefs as an operator would, without a network: pip takes every package
from the wheelhouse `make test-setup` builds (VENV/wheels), and the environment of an
installed command has none of this checkout on its Python path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = Path(sys.prefix) / "wheels"
INSTALL_TIMEOUT_S = 300


def offline_env(**extra: str) -> dict[str, str]:
    """The environment for an install and the installed commands: pip offline from the
    wheelhouse, no PYTHONPATH (the installed package must be the one that runs)."""
    if not any(WHEELHOUSE.glob("pyfuse3-*.whl")):
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: `make test-setup` builds it")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE),
               PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env
