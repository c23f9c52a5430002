"""Every environment variable pagedserve reads, in one place (listed in the README)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the default model is built: ``PAGEDSERVE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"
