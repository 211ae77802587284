"""Draft head checkpoint files: folders, Hub ids, and weights read as data only."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from hf_speculators.heads.files import head_folder, read_json, read_weights


class Payload:
    """An object whose unpickling would run code: a checkpoint must never be able to do that."""

    def __reduce__(self):
        return (print, ("code ran",))


def test_the_first_present_weight_file_is_read(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "heads.pt")
    save_file({"b": torch.zeros(3)}, str(tmp_path / "heads.safetensors"))
    assert list(read_weights(tmp_path, ["missing.bin", "heads.safetensors", "heads.pt"])) == ["b"]
    assert torch.equal(read_weights(tmp_path, ["heads.pt"])["a"], torch.ones(2))


def test_a_pickle_with_code_is_refused_without_running_it(tmp_path, capsys):
    (tmp_path / "heads.pt").write_bytes(pickle.dumps({"a": Payload()}))
    with pytest.raises(ValueError, match="heads.pt: not a plain tensor checkpoint, refused without running its code"):
        read_weights(tmp_path, ["heads.pt"])
    assert "code ran" not in capsys.readouterr().out


def test_missing_weights_and_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds none of the weight files \['a.safetensors', 'a.pt'\]"):
        read_weights(tmp_path, ["a.safetensors", "a.pt"])
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        head_folder(str(tmp_path / "absent"))
    assert head_folder(str(tmp_path)) == tmp_path
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="expected a mapping of tensor names to tensors, got list"):
        read_weights(tmp_path, ["list.pt"])


def test_json_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json: malformed JSON"):
        read_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        read_json(tmp_path / "config.json")


def test_a_hub_id_downloads_json_and_weights_only(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("hf_speculators.heads.files.snapshot_download",
                        lambda repo, **kwargs: calls.append((repo, kwargs)) or str(tmp_path))
    assert head_folder("org/head", revision="v1", token="t") == tmp_path
    assert calls == [("org/head", {"revision": "v1", "token": "t",
                                   "allow_patterns": ["*.json", "*.safetensors", "*.bin", "*.pt"]})]
