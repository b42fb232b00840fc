"""``hpclaunch data synth``: writes a valid dataset, one summary line; bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.config import load_config
from hpclaunch.shards import validate_dataset

pytestmark = pytest.mark.fast


def test_synth_writes_a_valid_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    code = main(["data", "synth", str(out), "--samples", "50", "--shard-size", "20", "--seed", "3", "--set", "model.text_len=12"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert text.count("\n") == 1
    assert "wrote 50 samples in 3 shards" in text and "[N, 12] int32" in text
    model = load_config(None, ["model.text_len=12"]).model
    info = validate_dataset(out / "tokens", out / "latents", model)
    assert info.num_samples == 50 and len(info.shards) == 3


def test_synth_takes_shapes_from_a_config(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  latent_len: 2\n  latent_dim: 3\n")
    assert main(["data", "synth", str(tmp_path / "d"), "--samples", "4", "--config", str(cfg)]) == 0
    model = load_config(cfg).model
    assert validate_dataset(tmp_path / "d" / "tokens", tmp_path / "d" / "latents", model).num_samples == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "0"], "--samples 0: need at least 1 sample"),
        (["--samples", "5", "--shard-size", "0"], "--shard-size 0: need at least 1"),
        (["--samples", "5", "--set", "train.lr=1"], "only model.* keys shape a dataset"),
        (["--samples", "5", "--set", "model.vocab_size=2"], "model.vocab_size"),
        (["--samples", "5", "--set", "model.nope=2"], "unknown key 'model.nope'"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["data", "synth", str(tmp_path / "d"), *args]) == 2
    assert message in capsys.readouterr().err


def test_refuses_to_mix_into_an_existing_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    assert main(["data", "synth", str(out), "--samples", "30", "--shard-size", "10"]) == 0
    assert main(["data", "synth", str(out), "--samples", "5"]) == 2
    assert "already holds 6 shard files" in capsys.readouterr().err
    assert main(["data", "synth", str(out), "--samples", "5", "--force"]) == 0
    assert len(list((out / "tokens").iterdir())) == 1
