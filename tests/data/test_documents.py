"""The loader's document boundaries (data/documents.py) on a tokenized stream: a document starts at each
sample's first token and at every input EOS, the same after a resume (a function of the tokens)."""

from __future__ import annotations

from pentatron.data.loader import TokenDataset, TokenLoader
from tests.documents_data import EOS, write_documents_dataset


def test_boundaries_follow_the_eos_tokens_and_survive_a_resume(tmp_path):
    dataset = TokenDataset(write_documents_dataset(tmp_path / "ds"))
    loader = TokenLoader(dataset, seq_len=32, micro_batch=4, global_batch=8, seed=3)
    loader.next_step()
    state = loader.state_dict()
    first = [(x, loader.documents(x)) for x, _ in loader.next_step()]
    for x, docs in first:
        for row, starts in zip(x.tolist(), docs.starts, strict=True):
            assert starts == (0, *(j for j, t in enumerate(row) if t == EOS and j > 0))
    assert any(len(s) > 3 for _, d in first for s in d.starts) and any(len(s) == 1 for _, d in first
                                                                       for s in d.starts)
    resumed = TokenLoader(dataset, seq_len=32, micro_batch=4, global_batch=8, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.documents(x).starts for x, _ in resumed.next_step()] == [d.starts for _, d in first]
