"""An error about a value checked after loading (a data directory, ``train.init_from``) names the
file or flag that set it, as a config error does, and says what a relative path was relative to:
the working directory, not the config file's (issue 39, 9)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.config import load_config

pytestmark = pytest.mark.fast

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.fixture(autouse=True)
def _here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    yield


def test_a_config_knows_which_layer_set_a_key_and_how_a_path_was_given(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["train.init_from=runs/a"], base=tmp_path)
    assert cfg.origin("train.init_from") == "--set" and cfg.origin("data.token_dir") == str(TINY)
    assert cfg.origin("launch.python") == str(TINY)  # not set anywhere: the config as a whole
    said = cfg.path_said("data.token_dir", cfg.data.token_dir)
    assert (
        said
        == f"data/tiny/tokens (relative to the working directory {tmp_path}: {tmp_path}/data/tiny/tokens)"
    )


def test_init_from_that_does_not_exist_names_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["submit", str(TINY), "--set", "name=x1", "--set", "train.init_from=runs/nope"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"hpclaunch: error: --set: train.init_from: runs/nope (relative to the working directory {tmp_path}: "
        f"{tmp_path}/runs/nope) does not exist"
    ), err
    assert not (tmp_path / "runs").exists()


def test_a_missing_data_directory_is_one_line_naming_the_file_not_a_preflight_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "my-run.yaml"
    config.write_text(TINY.read_text().replace("data/tiny/tokens", "data/nope/tokens"))
    assert main(["submit", str(config), "--set", "name=x2"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1].lstrip().startswith("hint: "), err
    assert lines[0] == (
        f"hpclaunch: error: {config}: data.token_dir: data/nope/tokens (relative to the working directory "
        f"{tmp_path}: {tmp_path}/data/nope/tokens) does not exist"
    )
    assert not (tmp_path / "runs").exists()
