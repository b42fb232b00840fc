"""The ``gpu`` check: enough healthy GPUs on this node (count, memory in use, compute capability, ECC).

Health comes from ``nvidia-smi --query-gpu`` and ``--query-remapped-rows`` (machine CSV, not the
human table), the count from torch in the probe (it honours ``CUDA_VISIBLE_DEVICES``) or, without
it, from nvidia-smi. Uncorrected volatile ECC errors, pending page retirement, pending row remapping
(needs a GPU reset) and a failed remapping (needs an RMA) fail the node: they are what gets nodes
drained by admins (mechanics.md E).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

from .check_context import CheckContext, Findings, Outcome, skip

GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "memory.used",
    "compute_cap",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
)
# Drivers before 510 do not know compute_cap; ask again without it.
GPU_FIELDS_OLD = tuple(f for f in GPU_FIELDS if f != "compute_cap")
REMAP_FIELDS = ("gpu_uuid", "remapped_rows.pending", "remapped_rows.failure")
BUSY_FRACTION = 0.10  # memory in use by someone else before we start


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    compute_cap: tuple[int, int] | None
    ecc_uncorrected: int | None
    retired_pending: bool | None


@dataclass(frozen=True)
class RemapInfo:
    uuid: str
    pending: bool | None
    failure: bool | None


def _value(text: str) -> str | None:
    text = text.strip()
    if not text or text.strip("[]") in (
        "N/A",
        "Not Supported",
        "Unknown Error",
        "Requested functionality has been deprecated",
    ):
        return None
    return text


def _int(text: str) -> int | None:
    v = _value(text)
    if v is None:
        return None
    try:
        return int(float(v.split()[0]))
    except ValueError:
        return None


def _yes(text: str) -> bool | None:
    v = _value(text)
    if v is None:
        return None
    return v.lower() in ("yes", "1", "true", "pending")


def _rows(text: str) -> list[list[str]]:
    return [row for row in csv.reader(text.splitlines(), skipinitialspace=True) if row and row[0].strip()]


def parse_gpu_query(text: str, fields: tuple[str, ...] = GPU_FIELDS) -> list[GpuInfo]:
    """``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` -> one GpuInfo per line."""
    gpus = []
    for row in _rows(text):
        if len(row) != len(fields):
            raise ValueError(f"expected {len(fields)} fields, got {len(row)}: {','.join(row)!r}")
        r = dict(zip(fields, row, strict=True))
        cap = _value(r.get("compute_cap", ""))
        major, _, minor = (cap or "").partition(".")
        gpus.append(
            GpuInfo(
                index=int(r["index"]),
                name=r["name"].strip(),
                uuid=r["uuid"].strip(),
                memory_total_mib=_int(r["memory.total"]),
                memory_used_mib=_int(r["memory.used"]),
                compute_cap=(int(major), int(minor or 0)) if cap and major.isdigit() else None,
                ecc_uncorrected=_int(r["ecc.errors.uncorrected.volatile.total"]),
                retired_pending=_yes(r["retired_pages.pending"]),
            )
        )
    return gpus


def parse_remapped_rows(text: str) -> list[RemapInfo]:
    """``nvidia-smi --query-remapped-rows=gpu_uuid,remapped_rows.pending,remapped_rows.failure
    --format=csv,noheader`` (Ampere and newer; older GPUs answer [N/A] or nothing)."""
    out = []
    for row in _rows(text):
        if len(row) != len(REMAP_FIELDS):
            continue
        out.append(RemapInfo(row[0].strip(), _yes(row[1]), _yes(row[2])))
    return out


def query_gpus(ctx: CheckContext) -> tuple[list[GpuInfo] | None, str | None]:
    """(GPUs, None) or (None, why not) from nvidia-smi."""
    for fields in (GPU_FIELDS, GPU_FIELDS_OLD):
        res = ctx.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], 20)
        if res is None:
            return None, "nvidia-smi not found"
        if res.ok:
            try:
                return parse_gpu_query(res.stdout, fields), None
            except ValueError as e:
                return None, f"cannot read nvidia-smi output ({e})"
        if "compute_cap" not in res.error_line():
            return None, f"nvidia-smi failed: {res.error_line()}"
    return None, "nvidia-smi failed"


def query_remapped_rows(ctx: CheckContext) -> list[RemapInfo]:
    res = ctx.run(
        ["nvidia-smi", f"--query-remapped-rows={','.join(REMAP_FIELDS)}", "--format=csv,noheader"], 20
    )
    if res is None or not res.ok:
        return []
    return parse_remapped_rows(res.stdout)


def check_gpu(ctx: CheckContext) -> Outcome:
    """GPU count vs gpus_per_node, memory already in use, compute capability, ECC / row-remap health."""
    cfg = ctx.cfg
    want = cfg.scheduler.gpus_per_node
    if want == 0:
        return skip("CPU run (gpus_per_node 0)")
    if not ctx.sees_compute_hardware:
        return skip("GPUs are checked on each allocated node before launch")
    f = Findings()
    gpus, why = query_gpus(ctx)
    torch = (ctx.probe_result() or {}).get("torch") or {}
    visible = torch.get("device_count") if torch.get("cuda_available") else None
    if visible is None and gpus is not None:
        visible = len(_visible(gpus, ctx.environ.get("CUDA_VISIBLE_DEVICES")))
    if visible is None:
        f.fail(
            f"no GPU visible ({why}; torch sees no CUDA device)", "check the driver and the job's GPU request"
        )
        return f.outcome()
    if visible < want:
        f.fail(
            f"{visible} GPU(s) visible, the run needs gpus_per_node={want}",
            "request the GPUs from the scheduler (gres/ngpus) or lower scheduler.gpus_per_node",
        )
    for g in _visible(gpus or [], ctx.environ.get("CUDA_VISIBLE_DEVICES")):
        _health(g, f, cfg.train.precision)
    for r in query_remapped_rows(ctx) if gpus else []:
        if r.failure:
            f.fail(f"GPU {r.uuid}: row remapping failed (the GPU needs replacing)", "drain this node: RMA")
        elif r.pending:
            f.fail(
                f"GPU {r.uuid}: remapped rows pending (a GPU reset is needed)",
                "reset the GPU or drain this node",
            )
    names = sorted({g.name for g in gpus or []})
    f.ok(f"{visible} GPU(s) visible" + (f" ({', '.join(names)})" if names else "") + f", {want} needed")
    if why and gpus is None:
        f.skip(f"health not checked: {why}")
    return f.outcome()


def _visible(gpus: list[GpuInfo], cvd: str | None) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible (indices or UUIDs); all when unset."""
    if cvd is None or cvd.strip() == "":
        return gpus
    picked = []
    for tok in (t.strip() for t in cvd.split(",")):
        for g in gpus:
            if tok == str(g.index) or (tok.startswith("GPU-") and g.uuid.startswith(tok)):
                picked.append(g)
    return picked


def _health(g: GpuInfo, f: Findings, precision: str) -> None:
    label = f"GPU {g.index} ({g.name})"
    if g.ecc_uncorrected:
        f.fail(
            f"{label}: {g.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded",
            "drain this node",
        )
    if g.retired_pending:
        f.fail(f"{label}: retired pages pending (a GPU reset is needed)", "reset the GPU or drain this node")
    if (
        g.memory_total_mib
        and g.memory_used_mib is not None
        and g.memory_used_mib > BUSY_FRACTION * g.memory_total_mib
    ):
        f.warn(
            f"{label}: {g.memory_used_mib} of {g.memory_total_mib} MiB already in use by another process",
            "is another job sharing this node? (nvidia-smi --query-compute-apps=pid,used_memory --format=csv)",
        )
    if g.compute_cap and g.compute_cap < (8, 0):
        msg = f"{label}: compute capability {g.compute_cap[0]}.{g.compute_cap[1]} has no bf16"
        if precision == "bf16":
            f.fail(msg, "use train.precision auto or fp32, or newer GPUs (sm_80+)")
        elif precision == "auto":
            f.warn(
                msg + " (auto precision would pick bf16 on CUDA)", "set train.precision: fp32 on these GPUs"
            )
