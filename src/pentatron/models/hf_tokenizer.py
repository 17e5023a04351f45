"""The tokenizer files of a Hugging Face model directory, so that `AutoTokenizer.from_pretrained(dir)`
loads the tokenizer a model was trained with: the run's `tokenizers` tokenizer.json as it is, a
tokenizer_config.json naming the fast tokenizer class and the end-of-document token, and
special_tokens_map.json. Written by `export_hf` (models/hf.py) beside the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = "special_tokens_map.json"


def end_of_document(tokenizer_json: Path, eos_id: int | None,
                    candidates: tuple[str, ...]) -> tuple[str | None, int | None]:
    """(token, id) of the end-of-document token: `eos_id`'s token when given, else the first of
    `candidates` the vocabulary has; (None, None) when neither."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    if eos_id is not None:
        return tok.id_to_token(eos_id), eos_id
    for name in candidates:
        found = tok.token_to_id(name)
        if found is not None:
            return name, found
    return None, None


def write_hf_tokenizer(out_dir: Path, tokenizer_json: Path, eos_token: str | None, max_length: int) -> list[str]:
    """Write the tokenizer files into `out_dir`; returns their names."""
    shutil.copyfile(tokenizer_json, out_dir / TOKENIZER_FILE)
    special: dict[str, Any] = {"eos_token": eos_token} if eos_token else {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **special}
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / SPECIAL_TOKENS).write_text(json.dumps(special, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS]
