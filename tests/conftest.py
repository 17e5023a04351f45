import pytest

# A small slice of the built-in corpus (Python's standard library): big enough for the loss to fall,
# small enough to tokenize in seconds on the 2-core CI machine.
SMALL_CORPUS_BYTES = 400_000


@pytest.fixture(scope="session")
def default_dataset(tmp_path_factory):
    from pentatron.data.tokenize import ensure_default_dataset

    return ensure_default_dataset(tmp_path_factory.mktemp("data-cache"), vocab_size=4096,
                                  max_bytes=SMALL_CORPUS_BYTES, progress=False)
