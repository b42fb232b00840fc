"""Metrics: device-side window means, skipped steps, strict JSON lines, plain console lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpclaunch.trainer.reporting.metrics_window import FIELDS, MetricsLog, MetricsWindow

pytestmark = pytest.mark.fast


def t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_window_means_skip_bad_steps_and_reset() -> None:
    w = MetricsWindow(torch.device("cpu"))
    w.add(t(4.0), t(3.0), t(1.0), t(2.0), ok=True, step_time_s=0.1)
    w.add(t(float("nan")), t(float("nan")), t(1.0), t(float("inf")), ok=False, step_time_s=0.3)
    w.add(t(2.0), t(1.0), t(1.0), t(4.0), ok=True, step_time_s=0.2)
    out = w.collect()
    assert out == pytest.approx(
        {"loss": 3.0, "text_loss": 2.0, "latent_loss": 1.0, "grad_norm": 3.0, "step_time_s": 0.2}
    )
    w.add(t(float("nan")), t(0.0), t(0.0), t(float("nan")), ok=False, step_time_s=0.5)
    out = w.collect()
    assert out["loss"] is None and out["grad_norm"] is None and out["step_time_s"] == 0.5


def test_window_reduces_over_ranks() -> None:
    w = MetricsWindow(torch.device("cpu"))
    w.add(t(2.0), t(1.0), t(1.0), t(3.0), ok=True, step_time_s=0.1)

    def fake_all_reduce(x: torch.Tensor) -> None:  # another rank with loss 4, same grad norm
        x += torch.tensor([4.0, 3.0, 1.0, 3.0, 1.0], dtype=x.dtype)

    out = w.collect(fake_all_reduce, world_size=2)
    assert out["loss"] == 3.0 and out["text_loss"] == 2.0 and out["grad_norm"] == 3.0


def test_log_writes_strict_json_lines_and_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=10, start_step=0, tty=False)
    log.write({"step": 1, "loss": float("nan"), "text_loss": 1.5, "lr": 1e-3, "skipped": 1, "extra": 5})
    log.write({"step": 2, "loss": 2.0, "text_loss": 1.0, "latent_loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "samples_per_s": 10.0, "skipped": 1})  # fmt: skip
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [list(x) for x in lines] == [list(FIELDS)] * 2
    assert lines[0]["loss"] is None and lines[0]["text_loss"] == 1.5
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("step 2/10 loss 2.0000 (text 1.0000, latent 1.0000) gnorm 0.500")
    assert "skipped 1" in printed[1]


def test_quiet_log_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=10, start_step=0, echo=False)
    log.write({"step": 1})
    assert capsys.readouterr().out == ""
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1


def test_every_line_carries_its_time_and_attempt(tmp_path: Path) -> None:
    import time

    before = time.time()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=10, start_step=0, echo=False, attempt="7.1")
    log.write({"step": 1, "ts": 0.0, "attempt": "spoofed"})  # the writer's stamp wins
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert line["attempt"] == "7.1"
    assert before - 0.01 <= line["ts"] <= time.time() + 0.01


def test_a_gpu_line_shows_tflops_and_mfu_and_a_cpu_line_does_not() -> None:
    from hpclaunch.trainer.reporting.metrics_window import describe

    gpu = {"loss": 1.0, "samples_per_s": 50.0, "tflops_per_gpu": 405.3, "mfu": 0.4098}
    assert "405 TFLOP/s/GPU (MFU 41.0%)" in describe(gpu)
    assert "MFU" not in describe({"loss": 1.0, "samples_per_s": 50.0, "tflops_per_gpu": None, "mfu": None})


def test_model_flops_know_the_peak_of_known_gpus_only() -> None:
    from hpclaunch.modelmath import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") is None
