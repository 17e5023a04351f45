"""Every text file a user names — a training config, `plan --model-file`, `--batch`, `--hardware`, a Hugging Face
config.json — is read by `user_files.py`: random bytes, UTF-16 text or a file it may not read is one line
naming the file, exit code 2, where each used to be a UnicodeDecodeError or PermissionError traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pentatron.cli import main
from pentatron.user_files import UnreadableFile, read_json, read_toml

RANDOM = bytes(range(256)) * 2  # invalid UTF-8 from byte 0x80 on
UTF16 = "[train]\nsteps = 2\n".encode("utf-16")  # with its byte-order mark, as Windows editors write it


def _bad_file(tmp_path: Path, kind: str, deny, name: str = "f.toml", good: str = "") -> tuple[Path, str]:
    """A file of `kind` and the fragment its message must hold."""
    path = tmp_path / name
    if kind == "random bytes":
        path.write_bytes(RANDOM)
        return path, "is not UTF-8 text (byte 0x80 at offset 128); save it as UTF-8 text"
    if kind == "UTF-16":
        path.write_bytes(UTF16)
        return path, "is UTF-16 text; save it as UTF-8 text"
    path.write_text(good)
    deny(path)
    return path, "cannot be read: permission denied; make it readable"


KINDS = ["random bytes", "UTF-16", "mode 000"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_reader_says_what_is_wrong_in_one_line(tmp_path, unreadable, kind):
    path, fragment = _bad_file(tmp_path, kind, unreadable)
    for read in (read_toml, read_json):
        with pytest.raises(UnreadableFile) as e:
            read(path, "config file")
        assert str(e.value) == f"config file {str(path)!r} {fragment}" + (
            " (chmod u+r) or give another file" if kind == "mode 000" else "")


def test_a_byte_order_mark_is_read_and_bad_syntax_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes("\ufeff[train]\nsteps = 2\n".encode())
    assert read_toml(path, "config file") == {"train": {"steps": 2}}
    path.write_text("{")
    with pytest.raises(UnreadableFile, match="c.toml': not valid JSON"):
        read_json(path, "x")


def _one_error_line(capsys, prefix: str = "pentatron") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return err


@pytest.mark.parametrize("kind", KINDS)
def test_every_command_reading_a_user_file_exits_2(tmp_path, unreadable, capsys, kind):
    config, fragment = _bad_file(tmp_path, kind, unreadable, "c.toml", "[train]\nsteps = 2\n")
    assert main(["train", str(config)]) == 2
    assert fragment in _one_error_line(capsys)

    model, fragment = _bad_file(tmp_path, kind, unreadable, "model.toml", "[model]\nname = 'debug'\n")
    assert main(["plan", "--model-file", str(model), "--gpus", "2"]) == 2
    assert f"--model-file {str(model)!r} {fragment}" in _one_error_line(capsys)

    hardware, fragment = _bad_file(tmp_path, kind, unreadable, "gpu.toml", "name = 'x'\n")
    assert main(["plan", "--model", "debug", "--gpus", "2", "--hardware", str(hardware)]) == 2
    assert f"hardware file {str(hardware)!r} {fragment}" in _one_error_line(capsys)

    batch, fragment = _bad_file(tmp_path, kind, unreadable, "batch.toml", "[[layout]]\ndp = 2\n")
    assert main(["plan", "--model", "debug", "--gpus", "2", "--batch", str(batch)]) == 2
    assert f"--batch {str(batch)!r} {fragment}" in _one_error_line(capsys)

    hf = tmp_path / "hf"
    hf.mkdir()
    _, fragment = _bad_file(hf, kind, unreadable, "config.json", json.dumps({"model_type": "llama"}))
    assert main(["checkpoint", "import-hf", str(hf), str(tmp_path / "ck")]) == 2
    assert fragment in _one_error_line(capsys)
    assert not (tmp_path / "ck").exists()
