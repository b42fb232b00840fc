"""A config is read as it was written, or refused in one line (exit 2, no traceback, nothing
written): a file that is not UTF-8, a boolean where a number is wanted, an empty section, a key given
twice, a warmup the init template pinned, a memory below 1 MB, and YAML 1.1's other misreadings
(``yes``, ``2:00:00``, ``0022``, ``.inf``). Found by a new user."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, ValidationError

from hpclaunch.cli import main
from hpclaunch.cli.config_cmd import commented_example
from hpclaunch.config import RunConfig, load_config, read_yaml_mapping, validate_config
from hpclaunch.config.section_base import _section_model
from hpclaunch.errors import ConfigError

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    yield


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command that must exit 2 and write nothing."""
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err and len(lines) == 2 and lines[1].lstrip().startswith("hint: ")
    assert not Path("runs").exists()
    return lines[0].removeprefix("hpclaunch: error: ")


# ---- 1. not UTF-8 --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["config show", "render", "submit"])
def test_a_file_that_is_not_utf8_names_the_file_and_the_byte(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a UnicodeDecodeError traceback, exit 1."""
    binary = write(tmp_path / "bin.yaml", b"\xff\xfe bad")
    line = refused([*command.split(), str(binary)], capsys)
    assert line == f"{binary}: not UTF-8 text (byte 0xff at offset 0, line 1)"
    latin1 = write(tmp_path / "latin1.yaml", "name: x\ntrain:\n  lr: 1.0e-4  # café\n".encode("latin-1"))
    assert refused([*command.split(), str(latin1)], capsys) == (
        f"{latin1}: not UTF-8 text (byte 0xe9 at offset 34, line 3)"
    )


# ---- 2. booleans are not numbers -----------------------------------------------------------------


def _section_models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []

    def walk(model: type[BaseModel]) -> None:
        if model in found:
            return
        found.append(model)
        for field in model.model_fields.values():
            sub = _section_model(field.annotation)
            if sub is not None:
                walk(sub)

    walk(RunConfig)
    return found


def _wants_number(annotation: Any) -> bool:
    """``int``, ``float | None``, ``int | Literal["auto"]``: a key that takes a number, not a bool."""
    types = set(get_args(annotation)) or {annotation}
    return bool(types & {int, float}) and bool not in types


def test_every_number_key_of_every_section_refuses_a_boolean() -> None:
    """pydantic reads true as 1: `--set train.steps=true` ran one step, `model.depth=true` one block."""
    checked = []
    for model in _section_models():
        for name, field in model.model_fields.items():
            if not _wants_number(field.annotation):
                continue
            with pytest.raises(ValidationError) as e:
                model.model_validate({name: True})
            # (refused at the key itself; cpus_per_node's own check words it before the base's)
            assert [err for err in e.value.errors() if err["loc"] == (name,)], (model.__name__, name)
            checked.append(f"{model.__name__}.{name}")
    assert {"TrainConfig.steps", "ModelConfig.depth", "SchedulerConfig.mem_gb", "TrainConfig.lr"} <= set(
        checked
    )


@pytest.mark.parametrize(
    "item,expected",
    [
        ("train.steps=true", "--set: train.steps: true is a boolean, not a whole number"),
        ("model.depth=true", "--set: model.depth: true is a boolean, not a whole number"),
        ("train.lr=false", "--set: train.lr: false is a boolean, not a number"),
        ("train.micro_batch=true", "--set: train.micro_batch: true is a boolean, not a whole number"),
        ("train.betas=[true, 0.9]", "--set: train.betas: entry 0: true is a boolean, not a number"),
        ("testing.inject_nonfinite_at=[true]", "entry 0: true is a boolean, not a whole number"),
    ],
)
def test_a_boolean_given_for_a_number_is_refused(item: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    assert expected in e.value.one_line()


def test_yaml_booleans_and_number_strings_read_the_same_in_a_file_and_in_set(tmp_path: Path) -> None:
    """`steps: yes` was 1 (YAML 1.1's yes is true); now only true/false are booleans, and a quoted
    number stays accepted, in a file and in --set alike."""
    for text in ("true", "yes"):
        config = write(tmp_path / "run.yaml", f"train:\n  steps: {text}\n")
        with pytest.raises(ConfigError, match=r"train\.steps"):
            load_config(config)
        with pytest.raises(ConfigError, match=r"train\.steps"):
            load_config(None, [f"train.steps={text}"])
    config = write(tmp_path / "run.yaml", 'train:\n  steps: "30"\n  compile: yes\n  tensorboard: off\n')
    cfg = load_config(config)
    assert (cfg.train.steps, cfg.train.compile, cfg.train.tensorboard) == (30, True, False)
    assert load_config(None, ['train.steps="30"', "train.compile=yes"]).train.steps == 30


# ---- 3. an empty section -------------------------------------------------------------------------


def test_an_empty_section_is_every_default(tmp_path: Path) -> None:
    """The init template says to delete what is not changed: `train:` with nothing under it was
    refused ("train is a section, not a value (got None)")."""
    cfg = load_config(write(tmp_path / "run.yaml", "name: x\ntrain:\ncheckpoint:\n  memory:\n"))
    defaults = load_config(None)
    assert cfg.train == defaults.train and cfg.checkpoint == defaults.checkpoint
    # An optional section's null still means off, and an empty section in a later layer keeps the
    # earlier layer's keys (it changes nothing).
    assert load_config(write(tmp_path / "p.yaml", "train:\n  profile:\n")).train.profile is None
    base = write(tmp_path / "base.yaml", "train: {steps: 5}\n")
    assert load_config([base, write(tmp_path / "exp.yaml", "train:\nname: exp\n")]).train.steps == 5


# ---- 4. a key given twice ------------------------------------------------------------------------


def test_a_key_given_twice_is_refused_naming_the_key_and_its_second_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last one silently won."""
    config = write(tmp_path / "run.yaml", "name: x\ntrain:\n  steps: 5\n  lr: 1.0e-3\n  steps: 7\n")
    assert refused(["config", "show", str(config)], capsys) == (
        f"{config}:5:3: train.steps is given twice in one mapping (first on line 3); the last would "
        "silently win"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train={steps: 5, steps: 7}"])
    assert "train.steps is given twice" in e.value.one_line()
    # A merge key (<<) overriding what it merges is not a repetition.
    anchors = write(tmp_path / "a.yaml", "x-common: &c {steps: 5}\ntrain:\n  <<: *c\n  lr: 1.0e-3\n")
    assert read_yaml_mapping(anchors)["train"] == {"steps": 5, "lr": 1e-3}


# ---- 5. the warmup the init template pinned ------------------------------------------------------


def test_the_init_template_takes_any_number_of_steps(tmp_path: Path) -> None:
    """`hpclaunch init my-run.yaml` pinned warmup_steps: 10, and `--set train.steps=N` was refused
    for N from 2 to 10; the template leaves warmup out, so its rule applies."""
    config = write(tmp_path / "my-run.yaml", commented_example())
    for steps in range(1, 13):
        t = load_config(config, [f"train.steps={steps}"]).train
        assert t.warmup_steps == (10 if steps > 10 else steps // 10)
    assert load_config(config, ["train.steps=100", "train.lr_schedule_steps=5"]).train.warmup_steps == 0


def test_a_warmup_too_long_says_what_to_set_and_names_both_layers(tmp_path: Path) -> None:
    """steps=1 was accepted with warmup 10 while steps=2..10 were refused: every length is checked
    now, and the error names the file and --set, and says what to set."""
    config = write(tmp_path / "run.yaml", "name: x\ntrain:\n  warmup_steps: 10\n")
    for steps in (1, 10):
        with pytest.raises(ConfigError) as e:
            load_config(config, [f"train.steps={steps}"])
        assert e.value.one_line() == (
            f"{config} + --set: train.warmup_steps: 10 must be smaller than train.steps={steps} "
            f"(train.warmup_steps from {config}, train.steps from --set)"
        )
        assert e.value.hint == (
            f"set train.warmup_steps below {steps}, or leave it out (its default for this run: {steps // 10})"
        )
    # null is the default too: a --set can go back to it over a file's value.
    assert load_config(config, ["train.steps=5", "train.warmup_steps=null"]).train.warmup_steps == 0


# ---- 6. memory below 1 MB ------------------------------------------------------------------------


def test_memory_below_a_megabyte_is_refused_not_rendered_as_0MB(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mem_gb: 0.0001` rendered `#SBATCH --mem=0MB`: all of the node's memory to SLURM."""
    config = write(tmp_path / "run.yaml", "name: x\nscheduler: {kind: slurm}\n")
    line = refused(["render", str(config), "--set", "scheduler.mem_gb=0.0001"], capsys)
    assert line.startswith("--set: scheduler.mem_gb: 0.0001 GB is less than 1 MB")
    assert main(["render", str(config), "--set", "scheduler.mem_gb=0.001"]) == 0
    assert "#SBATCH --mem=1MB" in capsys.readouterr().out


# ---- the class: other ways a value was misread ---------------------------------------------------


def test_yaml_11_readings_a_config_never_means_are_text(tmp_path: Path) -> None:
    """`time_limit: 2:00:00` was the number 7200 ("did you mean '7200m'": five days), an env value
    `yes` was exported as true and `0022` as 18."""
    config = write(
        tmp_path / "run.yaml",
        "scheduler:\n  time_limit: 2:00:00\nlaunch:\n  env: {A: yes, UMASK: 0022, H: 0x1f, D: 2024-01-01}\n",
    )
    cfg = load_config(config)
    assert cfg.scheduler.time_limit_s == 7200
    assert cfg.launch.env == {"A": "yes", "UMASK": "0022", "H": "0x1f", "D": "2024-01-01"}


@pytest.mark.parametrize(
    "item", ["scheduler.mem_gb=.inf", "checkpoint.mtbf_hours=inf", "train.weight_decay=.nan"]
)
def test_an_infinite_or_nan_number_is_refused(item: str) -> None:
    """mem_gb: .inf crashed the render (OverflowError traceback); mtbf_hours: inf was accepted."""
    with pytest.raises(ConfigError, match="finite number"):
        load_config(None, [item])


def test_a_run_directorys_config_reads_back_as_written(tmp_path: Path) -> None:
    """What `to_yaml` writes (text that YAML 1.1 would misread is quoted) reads back the same."""
    cfg = load_config(
        None, ["name=no", "scheduler.time_limit=2:00:00", "launch.env={A: 'on', B: '010'}", "train.lr=1e-4"]
    )
    written = write(tmp_path / "config.yaml", cfg.to_yaml())
    raw: dict[str, Any] = read_yaml_mapping(written)
    assert validate_config(raw).to_dict() == cfg.to_dict()
