import pytest

# A small slice of the built-in corpus (Python's standard library): big enough for the loss to fall,
# small enough to tokenize in seconds on the 2-core CI machine.
SMALL_CORPUS_BYTES = 400_000


@pytest.fixture(scope="session")
def default_dataset(tmp_path_factory):
    from pentatron.data.tokenize import ensure_default_dataset

    return ensure_default_dataset(tmp_path_factory.mktemp("data-cache"), vocab_size=4096,
                                  max_bytes=SMALL_CORPUS_BYTES, progress=False)


@pytest.fixture
def unreadable(monkeypatch):
    """`deny(path)`: make a file unreadable (mode 000). Root ignores permission bits, so under root opening a
    denied file also raises EACCES here, at `open` (what pathlib, numpy and every reader call), as the kernel
    does for anyone else."""
    import builtins
    import errno
    import io
    import os

    denied: set[str] = set()

    def deny(path) -> None:
        os.chmod(path, 0)
        denied.add(os.path.abspath(path))

    if os.geteuid() == 0:
        real_open = builtins.open

        def guarded_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) in denied:
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(io, "open", guarded_open)
    yield deny
    for path in denied:
        os.chmod(path, 0o644)
