"""The built-in default corpus: the Python standard library's own source, so a first run needs no download.

Every Python installation ships these files, they are real text with real structure (code, comments,
docstrings), and selecting them is deterministic for a given interpreter build.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from pentatron.data.errors import DataError

DEFAULT_CORPUS_BYTES = 6_000_000
"""About 1.8M tokens at vocab 4096: trains the tokenizer and tokenizes in a few seconds on 2 cores."""

# Test suites are mostly fixtures and deliberately odd code (and some are not UTF-8); third-party
# packages differ from one environment to the next, which would break determinism.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the eligible `*.py` files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (often far larger than the stdlib).
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        for name in filenames:
            # _sysconfigdata* is generated at build time and machine-specific.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append((rel / name).as_posix())
    return sorted(found)


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The stdlib `*.py` files, sorted by relative path, each taken if it still fits in `max_bytes`.

    Files that would overflow the budget are skipped (not a stop), so small budgets still fill up.
    """
    if max_bytes <= 0:
        raise DataError(f"the default corpus byte budget must be positive, got max_bytes={max_bytes}")
    root = stdlib_dir()
    if not root.is_dir():
        raise DataError(f"the default corpus needs the Python standard library sources at {root}, "
                        "which do not exist in this installation; pass input files to tokenize instead")
    chosen: list[Path] = []
    used = 0
    for rel in _source_files(root):
        path = root / rel
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0 or used + size > max_bytes:
            continue
        chosen.append(path)
        used += size
    if not chosen:
        raise DataError(f"no standard-library source file fits in max_bytes={max_bytes} (stdlib at {root}); "
                        "raise the budget")
    return chosen
