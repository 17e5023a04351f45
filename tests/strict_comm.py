"""Strict comm mode for a test module or package: PENTATRON_STRICT_COMM=1 while its tests run, set before
its module-scoped fixtures spawn ranks (which inherit it), so every `Comm` they build holds gloo to NCCL's
ordering and device rules (see distributed/comm.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pentatron.distributed.comm import STRICT_ENV


def strict_comm_fixture(scope: str = "module") -> Any:
    """An autouse fixture turning strict mode on for the tests of `scope` (module or package)."""

    @pytest.fixture(scope=scope, autouse=True)  # type: ignore[call-overload]
    def strict_comm() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(STRICT_ENV, "1")
            yield

    return strict_comm
