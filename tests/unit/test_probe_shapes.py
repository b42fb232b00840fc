"""The probe's JSON has one shape on both sides of the process boundary: the trainer's scripts
(``probe_main.py``, ``step_probe.py``) write it, preflight (``preflight/probe.py``, which never
imports the trainer) reads it. Each side types it; this keeps the two in step."""

from __future__ import annotations

import typing

import pytest

from hpclaunch.preflight import probe as reader
from hpclaunch.trainer import probe_main, step_probe

pytestmark = pytest.mark.fast

PAIRS = [
    (reader.TorchDevice, probe_main.TorchDevice),
    (reader.TorchInfo, probe_main.TorchInfo),
    (reader.PackageInfo, probe_main.PackageInfo),
    (reader.ModelInfo, probe_main.ModelInfo),
    (reader.ProbeAnswer, probe_main.ProbeAnswer),
    (reader.StepMeasure, step_probe.StepMeasure),
    (reader.StepRequest, step_probe.StepRequest),
]


@pytest.mark.parametrize(("read", "written"), PAIRS, ids=[r.__name__ for r, _ in PAIRS])
def test_reader_and_writer_agree(read: typing.Any, written: typing.Any) -> None:
    assert read.__required_keys__ == written.__required_keys__
    assert read.__optional_keys__ == written.__optional_keys__
    assert _spelled(read) == _spelled(written)


def _spelled(shape: typing.Any) -> dict[str, str]:
    """Each key's type as written in the source (the annotations are strings: the two modules'
    names for the same type, e.g. JSONObject, are compared by name)."""
    return {k: getattr(v, "__forward_arg__", str(v)) for k, v in shape.__annotations__.items()}
