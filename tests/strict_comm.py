"""Strict comm mode for a test module or package: PENTATRON_STRICT_COMM=1 while its tests run, set before
its module-scoped fixtures spawn ranks (which inherit it), so every `Comm` they build holds gloo to NCCL's
contract (see distributed/nccl_contract.py). `tests.multiprocess.run_ranks` gives its ranks strict mode by
default; this also covers the test's own process and the trainer subprocesses it starts."""

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
