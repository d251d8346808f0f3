"""Offline model resolution: folders, cache aliases, and clear errors for missing models."""
import pathlib

import pytest

from services.common import model_store


def test_missing_model_error_says_how_to_provide(tmp_path, monkeypatch):
    monkeypatch.setenv("RLYARD_HOME", str(tmp_path))
    with pytest.raises(model_store.ModelNotFound, match="make install"):
        model_store.resolve_model("SmolLM2-135M-Instruct")
    with pytest.raises(model_store.ModelNotFound, match="never downloads"):
        model_store.resolve_model("some-org/not-here")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(model_store.ModelNotFound, match="config.json"):
        model_store.resolve_model(str(tmp_path))


def test_alias_and_folder_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("RLYARD_HOME", str(tmp_path))
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert model_store.resolve_model("tiny") == folder
    assert model_store.resolve_model(str(folder)) == folder.resolve()


def test_default_model_is_provisioned():
    """`make install` converted the packaged GGUF into a loadable HF folder."""
    path = model_store.resolve_model()
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    assert any(path.glob("*.safetensors"))
    assert model_store.find_gguf().name.endswith(".gguf")
