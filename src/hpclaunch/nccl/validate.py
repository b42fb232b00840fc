"""Validation of NCCL and torch-distributed variables: removed names, unknown values, contradictions.

NCCL silently ignores values it does not understand (``NCCL_NET_GDR_LEVEL=PBH``) and still reads
nothing from variables it removed years ago (``NCCL_TREE_THRESHOLD``), so hpclaunch checks them
itself. The table of known names was taken from the strings of libnccl 2.32.3 and torch 2.13's
ProcessGroupNCCL/FlightRecorder headers.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class NcclIssue:
    """One finding about one variable. Errors are certainly wrong; warnings are doubtful."""

    name: str
    severity: Severity
    message: str
    replacement: str | None = None

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


Kind = Literal[
    "any", "int", "bool", "torch_bool", "enum", "level", "debug", "subsys", "algo", "proto", "path"
]


@dataclass(frozen=True)
class VarSpec:
    kind: Kind = "any"
    values: tuple[str, ...] = ()  # for enum
    lo: int | None = None
    hi: int | None = None
    case_sensitive: bool = False
    note: str = field(default="", compare=False)


# Names present in libnccl.so 2.32.3 (strings; enum labels and macros removed). A name missing here
# is either misspelled (close to a known one: an error) or newer than this table (a warning).
_NCCL_NAMES = """
ALGO ALLGATHERV_ENABLE ALLOC_P2P_NET_LL_BUFFERS BUFFSIZE CE_CHUNK_SIZE CE_COLL_AG_MULTICAST_THRESHOLD
CE_INTRA_GPU_MEMCPY_ENABLE CFT_ENABLE CFT_MULTIMEM CGA_CLUSTER_SIZE CHECK_MODE CHECK_POINTERS CHUNK_SIZE
COLLNET_ENABLE COLLNET_NODE_THRESHOLD COMM_BLOCKING COMM_ID COMM_SHRINK_SHARE_RESOURCES
COMM_SPLIT_SHARE_RESOURCES CONF_FILE CONNECT_ROUND_MAX_PEERS CROSS_NIC CTA_POLICY CUMEM_ENABLE
CUMEM_HOST_ENABLE DEBUG DEBUG_FILE DEBUG_LEVELS DEBUG_SUBSYS DEBUG_TIMESTAMP_FORMAT DEBUG_TIMESTAMP_LEVELS
DEV_API_JIT DIAGNOSTICS_ECC_THRESHOLD DIAGNOSTICS_IB_BW_TIMEOUT DISABLE_MEM_MANAGER DMABUF_ENABLE
ELASTIC_BUFFER_REGISTER ENABLE_VERSION_CHECK ENQUEUE_REARCH_ENABLE ENV_PLUGIN GDAKI_FORCE_MCST
GDAKI_USE_RELIABLE_DB GDRCOPY_ENABLE GDRCOPY_FIFO_ENABLE GDRCOPY_FLUSH_ENABLE GDRCOPY_SYNC_ENABLE
GDRCOPY_USE_INTERNAL_DMABUF GDR_FLUSH_DISABLE GIN_ENABLE GIN_ERROR_QUERY_SEC GIN_GDAKI_GPU_CONTEXT_MAX_SIZE
GIN_GDAKI_GPU_CONTEXT_VERSION GIN_GDAKI_LAG_AWARE_DISABLE GIN_GDAKI_MAX_DEST_RD_ATOMIC
GIN_GDAKI_MAX_QP_RD_ATOMIC GIN_GDAKI_NIC_HANDLER GIN_GDAKI_QP_DEPTH GIN_IB_ALLGATHER_TAG GIN_IB_ALLTOALL_TAG
GIN_IB_OOO_OPT GIN_IB_TC GIN_NCONNECTIONS GIN_PLUGIN GIN_PROXY_GPU_CONTEXT_MAX_SIZE
GIN_PROXY_GPU_CONTEXT_VERSION GIN_PROXY_NTHREADS GIN_PROXY_POLL_BATCH GIN_PROXY_QUEUE_SIZE GIN_TYPE
GRAPH_DUMP_FILE GRAPH_DUMP_FILE_RANK GRAPH_FILE GRAPH_HELPER_DISABLE GRAPH_MIXING_SUPPORT GRAPH_REGISTER
GRAPH_STREAM_ORDERING GROUP_CUDA_STREAM HIER_CE_COLL_AG_RAIL_RING_ENABLE HIER_CE_COLL_NUM_CTX HOSTID
IBVERBS_LIB IB_ADAPTIVE_ROUTING IB_ADDR_FAMILY IB_ADDR_RANGE IB_AR_THRESHOLD IB_DATA_DIRECT
IB_DEVICE_PCI_ORDER IB_DISABLE IB_ECE_ENABLE IB_EVENT_BASED_LB IB_EVENT_BASED_LB_REMOTE IB_FIFO_TC
IB_GID_INDEX IB_HCA IB_MERGE_NICS IB_MERGE_VFS IB_MLX_VENDOR_ID IB_MQP_RETRY_ALL IB_MQP_RETRY_CNT
IB_MQP_RETRY_SLEEP_MSEC IB_OOO_RQ IB_PCI_RELAXED_ORDERING IB_PKEY IB_PKEY_VALUE
IB_PREPOST_RECEIVE_WORK_REQUESTS IB_QPS_PER_CONNECTION IB_QUERY_PORT_SPEED IB_RAIL_POLICY
IB_RECEIVER_SIDE_MATCHING_SCHEME IB_RESILIENCY_PORT_FAILOVER IB_RESILIENCY_PORT_FAILOVER_MAX_ATTEMPTS
IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY IB_RESILIENCY_PORT_RECOVERY IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_INTERVAL IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_SIZE
IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_SEQUENCE_SIZE IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_TIMEOUT
IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX IB_RESILIENCY_PORT_RECOVERY_START_DELAY IB_RETRY_CNT
IB_RETURN_ASYNC_EVENTS IB_ROCE_VERSION_NUM IB_ROUTABLE_FLID_GID_INDEX IB_SL IB_SORT_MERGE_NICS
IB_SPLIT_DATA_ON_QPS IB_SUBNET_AWARE_ROUTING IB_SUBNET_PREFIX_LEN IB_TC IB_TIMEOUT IB_USE_INLINE
IB_VR_RAILS_PER_SOCKET IB_VR_SOCKET_COUNT IB_WARN_RAIL_LOCAL IB_WQE_LATENCY_REPORT
IB_WQE_LATENCY_THRESHOLD_NS IGNORE_COLLNET_MISMATCH IGNORE_CPU_AFFINITY IGNORE_DISABLED_P2P
IGNORE_NET_MISMATCH IPC_COLLECTIVE IPC_SENDRECV L1_SHARED_MEMORY_CARVEOUT LAUNCH_MODE
LAUNCH_ORDER_IMPLICIT LAUNCH_RACE_FATAL LEGACY_CUDA_REGISTER LL128_BUFFSIZE LL128_C2C LL128_NTHREADS
LL_BUFFSIZE LOCAL_REGISTER LSA_TEAM_SIZE MAX_CTAS MAX_NCHANNELS MAX_NRINGS MAX_P2P_NCHANNELS
MEM_SYNC_DOMAIN MIN_CTAS MIN_NCHANNELS MIN_NRINGS MIN_P2P_NCHANNELS MNNVL_CLIQUE_ID MNNVL_CROSS_CLIQUE
MNNVL_ENABLE MNNVL_RAIL_PER_HOST MNNVL_SCATTER_NETS_ENABLE MNNVL_UUID MULTI_RANK_GPU_ENABLE
MULTI_SEGMENT_REGISTER NCHANNELS_PER_NET_PEER NET NETDEVS_POLICY NET_DISABLE_INTRA NET_FORCE_FLUSH
NET_FORCE_MERGE NET_GDR_C2C NET_GDR_LEVEL NET_GDR_READ NET_MERGE_LEVEL NET_MERGE_POLICY
NET_OPTIONAL_RECV_COMPLETION NET_OVERHEAD NET_PLUGIN NET_SHARED_BUFFERS NET_SHARED_COMMS NO_CACHE
NSOCKS_PERTHREAD NTHREADS NUM_RMA_CTX NUM_RMA_INT_CTX NVB_DISABLE NVB_PRECONNECT
NVLINK_UTIL_CENTRIC_SCHED_ENABLE NVLSTREE_MAX_CHUNKSIZE NVLS_CHUNKSIZE NVLS_ENABLE NVLS_NCHANNELS
NVLS_UB_SIZE NVTX_DISABLE OOB_NET_ENABLE OOB_NET_IFNAME P2P_DIRECT_DISABLE P2P_DISABLE P2P_EPOCH_ENABLE
P2P_LEVEL P2P_LL_THRESHOLD P2P_MAX_PEERS P2P_NET_CHUNKSIZE P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE
P2P_PER_CHANNEL_NET_BW P2P_PER_CHANNEL_REG_NET_BW P2P_PXN_LEVEL P2P_READ_ENABLE P2P_SCHEDULE_GROUP_SIZE
P2P_USE_CUDA_MEMCPY PARAM_DUMP_ALL PAT_ENABLE PAT_NDIMS PROFILER_PLUGIN PROGRESS_APPENDOP_FREQ
PROGRESS_COUNTERS PROGRESS_COUNTER_MONITOR_POLL_MS PROGRESS_COUNTER_MONITOR_STALE_MS
PROGRESS_COUNTER_MONITOR_STALE_WARN_SEC PROTO PROXY_APPEND_BATCH_SIZE PROXY_CPUSET PROXY_DUMP_SIGNAL
PXN_C2C PXN_DISABLE RAS_ADDR RAS_ENABLE RAS_TIMEOUT_FACTOR REPORT_CONNECT_PROGRESS RMA_DISABLE
RMA_EAGER_INIT RMA_IB_WR_BATCHSIZE RMA_MULTI_CTX_THRESHOLD RMA_PLUGIN RMA_PROXY_DUMP_SIGNAL
RMA_PROXY_QUEUE_SIZE RUNTIME_CONNECT RUN_DIAGNOSTICS RUN_RAS_DIAGNOSTICS SET_CPU_STACK_SIZE
SET_STACK_SIZE SET_THREAD_NAME SHADOW_MEMPOOL_MAX_SIZE SHM_DISABLE SHM_LOCALITY
SINGLE_PROC_MEM_REG_ENABLE SOCKET_FAMILY SOCKET_IFNAME SOCKET_INLINE SOCKET_MIN_TASKSIZE SOCKET_NTHREADS
SOCKET_POLL_TIMEOUT_MSEC SOCKET_RCVBUF SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC SOCKET_SNDBUF
SYM_CE_THRESHOLD SYM_CTAS SYM_GIN_KERNELS_ENABLE SYM_KERNEL SYM_NOWIN_ENABLE SYM_REUSE_SYSMEM_HANDLES
SYM_RS_GIN_CHUNK_SIZE SYM_TMA_ENABLE THREAD_THRESHOLDS TOPO_DUMP_FILE TOPO_DUMP_FILE_RANK TOPO_FILE
TOPO_SPLIT_MLOPART TUNER_PLUGIN UID_STAGGER_RATE UID_STAGGER_THRESHOLD UNPACK_DOUBLE_NCHANNELS
WARN_ENABLE_DEBUG_INFO WIN_ENABLE WIN_STRIDE WORK_ARGS_BYTES WORK_FIFO_BYTES
"""

# torch 2.13 (ProcessGroupNCCL.hpp, FlightRecorder.hpp, distributed_c10d.py).
_TORCH_BOOLS = """
TORCH_NCCL_BLOCKING_WAIT TORCH_NCCL_DESYNC_DEBUG TORCH_NCCL_ENABLE_TIMING TORCH_NCCL_DUMP_ON_TIMEOUT
TORCH_NCCL_ENABLE_MONITORING TORCH_NCCL_PROPAGATE_ERROR TORCH_NCCL_AVOID_RECORD_STREAMS
TORCH_NCCL_NAN_CHECK TORCH_NCCL_HIGH_PRIORITY TORCH_NCCL_BCAST_UNIQUEID TORCH_NCCL_CUDA_EVENT_CACHE
TORCH_NCCL_RETHROW_CUDA_ERRORS TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN TORCH_NCCL_EXTRA_DUMP_ON_EXEC
TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK
TORCH_FR_CPP_STACK TORCH_FR_DUMP_DYNAMIC_FILE_NAME
"""
_TORCH_INTS = """
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC TORCH_NCCL_COORD_CHECK_MILSEC
TORCH_NCCL_RANKS_PER_ROOT TORCH_FR_BUFFER_SIZE
"""
_TORCH_PATHS = "TORCH_FR_DUMP_TEMP_FILE TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def _words(text: str) -> list[str]:
    return text.split()


_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "ABORT", "TRACE", "NONE", "ATTN")
_SUBSYSTEMS = (
    "INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "ALLOC_HOST", "CALL",
    "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "DESTROY", "ALL",
)  # fmt: skip
_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
_PROTOS = ("LL", "LL128", "Simple")
_FUNCS = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "SendRecv", "AllToAll")

_BOOL = VarSpec("bool")
_INT = VarSpec("int")
_NONNEG = VarSpec("int", lo=0)
_POS = VarSpec("int", lo=1)

_SPECS: dict[str, VarSpec] = {
    # switches NCCL reads as integers (0 = off)
    **{
        f"NCCL_{n}": _BOOL
        for n in _words(
            "IB_DISABLE P2P_DISABLE SHM_DISABLE P2P_DIRECT_DISABLE NVB_DISABLE PXN_DISABLE "
            "IGNORE_CPU_AFFINITY CUMEM_ENABLE CUMEM_HOST_ENABLE DMABUF_ENABLE GDRCOPY_ENABLE NET_GDR_READ "
            "NET_SHARED_BUFFERS NET_SHARED_COMMS IB_ADAPTIVE_ROUTING IB_ECE_ENABLE IB_SPLIT_DATA_ON_QPS "
            "IB_RETURN_ASYNC_EVENTS IB_MERGE_VFS IB_MERGE_NICS OOB_NET_ENABLE COLLNET_ENABLE COMM_BLOCKING "
            "CHECK_POINTERS RUNTIME_CONNECT GRAPH_REGISTER LOCAL_REGISTER LEGACY_CUDA_REGISTER "
            "SET_THREAD_NAME SET_STACK_SIZE RAS_ENABLE NVTX_DISABLE WIN_ENABLE PAT_ENABLE NET_GDR_C2C "
            "PXN_C2C NET_DISABLE_INTRA NET_FORCE_FLUSH GRAPH_MIXING_SUPPORT"
        )
    },
    # 0 off / 1 on / 2 auto
    **{
        f"NCCL_{n}": VarSpec("enum", ("0", "1", "2"))
        for n in _words("NVLS_ENABLE CROSS_NIC IB_PCI_RELAXED_ORDERING P2P_PXN_LEVEL MNNVL_ENABLE")
    },
    **{
        f"NCCL_{n}": _POS
        for n in _words(
            "BUFFSIZE NSOCKS_PERTHREAD IB_QPS_PER_CONNECTION MAX_NCHANNELS MIN_NCHANNELS MAX_CTAS "
            "MIN_CTAS NCHANNELS_PER_NET_PEER MAX_P2P_NCHANNELS MIN_P2P_NCHANNELS NVLS_CHUNKSIZE "
            "P2P_NET_CHUNKSIZE P2P_NVL_CHUNKSIZE P2P_PCI_CHUNKSIZE WORK_FIFO_BYTES MAX_NRINGS MIN_NRINGS"
        )
    },
    **{
        f"NCCL_{n}": _NONNEG
        for n in _words(
            "SOCKET_RETRY_CNT SOCKET_RETRY_SLEEP_MSEC COLLNET_NODE_THRESHOLD P2P_LL_THRESHOLD "
            "IB_AR_THRESHOLD UID_STAGGER_THRESHOLD UID_STAGGER_RATE RAS_TIMEOUT_FACTOR "
            "SOCKET_POLL_TIMEOUT_MSEC CGA_CLUSTER_SIZE MEM_SYNC_DOMAIN PROGRESS_APPENDOP_FREQ"
        )
    },
    "NCCL_NTHREADS": VarSpec("enum", ("64", "128", "256", "512"), note="threads per CTA"),
    "NCCL_SOCKET_NTHREADS": VarSpec("int", lo=1, hi=16),
    # IB verbs fields: the timeout is 5 bits (4.096 us * 2^t), the retry count 3 bits.
    "NCCL_IB_TIMEOUT": VarSpec("int", lo=1, hi=31, note="4.096 us * 2^value; default 20"),
    "NCCL_IB_RETRY_CNT": VarSpec("int", lo=0, hi=7),
    "NCCL_IB_GID_INDEX": VarSpec("int", lo=-1, hi=255, note="-1 = auto (RoCEv2 preferred) since 2.21.5"),
    "NCCL_IB_SL": VarSpec("int", lo=0, hi=15),
    "NCCL_IB_TC": VarSpec("int", lo=0, hi=255),
    "NCCL_IB_FIFO_TC": VarSpec("int", lo=0, hi=255),
    "NCCL_IB_ROCE_VERSION_NUM": VarSpec("enum", ("1", "2")),
    "NCCL_SOCKET_FAMILY": VarSpec("enum", ("AF_INET", "AF_INET6"), case_sensitive=True),
    "NCCL_IB_ADDR_FAMILY": VarSpec("enum", ("AF_INET", "AF_INET6"), case_sensitive=True),
    "NCCL_LAUNCH_MODE": VarSpec("enum", ("PARALLEL", "GROUP")),
    "NCCL_P2P_LEVEL": VarSpec("level"),
    "NCCL_NET_GDR_LEVEL": VarSpec("level"),
    "NCCL_DEBUG": VarSpec("debug"),
    "NCCL_DEBUG_SUBSYS": VarSpec("subsys"),
    "NCCL_ALGO": VarSpec("algo"),
    "NCCL_PROTO": VarSpec("proto"),
    "NCCL_DEBUG_FILE": VarSpec("path"),
    "NCCL_TOPO_FILE": VarSpec("path"),
    "NCCL_TOPO_DUMP_FILE": VarSpec("path"),
    "NCCL_GRAPH_FILE": VarSpec("path"),
    "NCCL_GRAPH_DUMP_FILE": VarSpec("path"),
    "NCCL_CONF_FILE": VarSpec("path"),
    # torch
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": VarSpec(
        "enum", ("0", "1", "2", "3"), note="0 none, 1 abort+teardown, 2 abort only, 3 teardown (default)"
    ),
    "TORCH_DISTRIBUTED_DEBUG": VarSpec("enum", ("OFF", "INFO", "DETAIL")),
    **{n: VarSpec("torch_bool") for n in _words(_TORCH_BOOLS)},
    **{n: _NONNEG for n in _words(_TORCH_INTS)},
    **{n: VarSpec("path") for n in _words(_TORCH_PATHS)},
}

KNOWN_VARIABLES: dict[str, VarSpec] = {
    **{f"NCCL_{n}": VarSpec() for n in _words(_NCCL_NAMES)},
    **_SPECS,
}

# Old names still read (by torch or NCCL) under a new one: warning + the name to use.
DEPRECATED: dict[str, str] = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_CPP_STACK": "TORCH_FR_CPP_STACK",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
    "NCCL_MAX_NRINGS": "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_NRINGS": "NCCL_MIN_NCHANNELS",
}

# Names no current NCCL reads at all (error: setting them changes nothing). name -> (why, use instead)
REMOVED: dict[str, tuple[str, str | None]] = {
    "NCCL_TREE_THRESHOLD": ("was removed in NCCL 2.5.6 (2019) and does nothing", "NCCL_ALGO"),
    "NCCL_LL_THRESHOLD": ("was removed in NCCL 2.5.6 (2019) and does nothing", "NCCL_PROTO"),
    "NCCL_SINGLE_RING_THRESHOLD": ("was removed from NCCL long ago and does nothing", "NCCL_ALGO"),
    "NCCL_IB_CUDA_SUPPORT": ("was removed in NCCL 2.4 and does nothing", "NCCL_NET_GDR_LEVEL"),
    "NCCL_CHECKS_DISABLE": ("was removed from NCCL and does nothing", "NCCL_CHECK_POINTERS"),
    "NCCL_RINGS": ("was removed in NCCL 2.4 (topology search) and does nothing", "NCCL_GRAPH_FILE"),
    "NCCL_TIMEOUT": (
        "does not exist: collective timeouts come from init_process_group(timeout=...) "
        "(NCCL_IB_TIMEOUT is the InfiniBand transport retry timeout, a different thing)",
        None,
    ),
}

# Other families that legitimately ride along with NCCL settings (libfabric, aws-ofi-nccl, UCX, gloo).
_PASS_THROUGH_PREFIXES = ("FI_", "OFI_NCCL_", "UCX_", "GLOO_", "CUDA_", "NVSHMEM_", "OMPI_", "PMIX_")
_OURS = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISTRIBUTED_")

_INT_RE = re.compile(r"^[+-]?(?:0[xX][0-9a-fA-F]+|\d+)$")
_TORCH_TRUE = ("y", "yes", "1", "t", "true")
_TORCH_FALSE = ("n", "no", "0", "f", "false")


def validate_nccl_env(env: Mapping[str, str]) -> list[NcclIssue]:
    """Issues with the NCCL / torch-distributed variables in ``env`` (errors first, then warnings)."""
    issues: list[NcclIssue] = []
    for name, value in env.items():
        issues.extend(_check_one(name, str(value)))
    issues.extend(_check_combinations(env))
    return sorted(issues, key=lambda i: i.severity != "error")


def _check_one(name: str, value: str) -> list[NcclIssue]:
    if name in REMOVED:
        why, use = REMOVED[name]
        msg = why + (f"; use {use}" if use else "")
        return [NcclIssue(name, "error", msg, use)]
    if name in DEPRECATED:
        new = DEPRECATED[name]
        issue = NcclIssue(name, "warning", f"is a deprecated alias; rename it to {new}", new)
        return [issue, *(_check_value(name, value, KNOWN_VARIABLES[new]) if new in KNOWN_VARIABLES else [])]
    spec = KNOWN_VARIABLES.get(name)
    if spec is not None:
        return _check_value(name, value, spec)
    if name == "RDMAV_FORK_SAFE":
        return [
            NcclIssue(
                name, "warning", "aws-ofi-nccl advises never to set it (EFA is fork-safe by itself)", None
            )
        ]
    if name.startswith(_OURS):
        close = _close_name(name)
        if close:
            return [
                NcclIssue(
                    name, "error", f"is not a variable NCCL or torch reads (did you mean {close}?)", close
                )
            ]
        return [
            NcclIssue(
                name,
                "warning",
                "is not known to NCCL 2.32 / torch 2.13 (newer, or misspelled?); unknown names are ignored",
                None,
            )
        ]
    if name.startswith(_PASS_THROUGH_PREFIXES):
        return []
    return [
        NcclIssue(
            name,
            "warning",
            "is not an NCCL/torch-distributed variable; general variables go in launch.env",
            None,
        )
    ]


def _close_name(name: str) -> str | None:
    known = [*KNOWN_VARIABLES, *DEPRECATED]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
    return close[0] if close else None


def _check_value(name: str, value: str, spec: VarSpec) -> list[NcclIssue]:
    def err(msg: str, replacement: str | None = None) -> list[NcclIssue]:
        return [NcclIssue(name, "error", msg, replacement)]

    def warn(msg: str, replacement: str | None = None) -> list[NcclIssue]:
        return [NcclIssue(name, "warning", msg, replacement)]

    v = value.strip()
    if v == "":
        return warn("is empty; NCCL/torch treat it as unset or as 0")
    if spec.kind == "int":
        n = _parse_int(v)
        if n is None:
            return err(f"{value!r} is not an integer; NCCL ignores it and keeps its default")
        if (spec.lo is not None and n < spec.lo) or (spec.hi is not None and n > spec.hi):
            rng = f"{spec.lo if spec.lo is not None else '-inf'}..{spec.hi if spec.hi is not None else 'inf'}"
            return err(f"{n} is outside {rng}" + (f" ({spec.note})" if spec.note else ""))
        return []
    if spec.kind == "bool":
        n = _parse_int(v)
        if n is not None:
            return [] if n in (0, 1) else warn(f"{value!r}: use 0 or 1 (any non-zero reads as 1)")
        if v.upper() in ("T", "TRUE", "F", "FALSE"):
            one = "1" if v.upper().startswith("T") else "0"
            return warn(
                f"{value!r} is read by recent NCCL (2.32) only; older releases ignore it: write {one}", one
            )
        return err(f"{value!r} is not 0 or 1; NCCL ignores it and keeps its default")
    if spec.kind == "torch_bool":
        if v.lower() in _TORCH_TRUE or v.lower() in _TORCH_FALSE:
            return []
        return err(f"{value!r} is not a boolean torch accepts (0/1, true/false, yes/no); torch refuses it")
    if spec.kind == "enum":
        return _check_enum(name, v, spec)
    if spec.kind == "level":
        return _check_level(name, v)
    if spec.kind == "debug":
        if v.upper() in _DEBUG_LEVELS:
            return []
        close = _suggest(v.upper(), _DEBUG_LEVELS)
        return err(
            f"{value!r} is not a level ({'/'.join(_DEBUG_LEVELS[:5])})"
            + (f" (did you mean {close}?)" if close else "")
            + "; NCCL ignores it and logs nothing",
            close,
        )
    if spec.kind == "subsys":
        items = [t.strip() for t in v.lstrip("^").split(",")]
        bad = [t for t in items if t.upper() not in _SUBSYSTEMS]
        if bad:
            close = _suggest(bad[0].upper(), _SUBSYSTEMS)
            return err(
                f"unknown subsystem(s) {', '.join(bad)}"
                + (f" (did you mean {close}?)" if close else "")
                + f"; known: {', '.join(_SUBSYSTEMS)}"
            )
        return []
    if spec.kind in ("algo", "proto"):
        return _check_algo_list(name, v, _ALGOS if spec.kind == "algo" else _PROTOS)
    if spec.kind == "path":
        if v.startswith("~"):
            return warn(f"{value!r}: '~' is not expanded here; use an absolute path")
        return []
    return []


def _check_enum(name: str, v: str, spec: VarSpec) -> list[NcclIssue]:
    allowed = spec.values
    if v in allowed or (not spec.case_sensitive and v.upper() in (a.upper() for a in allowed)):
        return []
    close = _suggest(v.upper(), allowed)
    extra = f" ({spec.note})" if spec.note else ""
    return [
        NcclIssue(
            name,
            "error",
            f"{v!r} is not one of {', '.join(allowed)}"
            + (f" (did you mean {close}?)" if close else "")
            + extra,
            close,
        )
    ]


def _check_level(name: str, v: str) -> list[NcclIssue]:
    if v in _LEVELS:
        return []
    if v[:1].isdigit():
        n = _parse_int(v)
        if n is not None and n <= 5:
            return []
        return [
            NcclIssue(
                name, "warning", f"{v!r}: legacy numeric levels are 0..5 (larger reads as SYS); use a name"
            )
        ]
    close = _suggest(v.upper(), _LEVELS)
    if v.upper() in _LEVELS:
        why = "NCCL compares level names case-sensitively"
    else:
        why = f"levels are {' '.join(_LEVELS)}"
    return [
        NcclIssue(
            name,
            "error",
            f"{v!r} is not a level NCCL knows"
            + (f" (did you mean {close}?)" if close else "")
            + f"; {why}, and NCCL silently ignores anything else",
            close,
        )
    ]


def _check_algo_list(name: str, v: str, names: tuple[str, ...]) -> list[NcclIssue]:
    """``Ring,Tree`` / ``^Tree`` / (NCCL >= 2.24) ``allreduce:tree,ring;broadcast:ring``."""
    lower = {n.lower(): n for n in names}
    funcs = {f.lower() for f in _FUNCS}
    bad: list[str] = []
    for part in filter(None, (p.strip() for p in v.split(";"))):
        func, sep, items = part.rpartition(":")
        if sep and func.strip().lower() not in funcs:
            bad.append(func.strip())
        for tok in items.lstrip("^").split(","):
            tok = tok.strip()
            if tok and tok.lower() not in lower:
                bad.append(tok)
    if not bad:
        return []
    close = _suggest(bad[0], names)
    return [
        NcclIssue(
            name,
            "error",
            f"unknown name(s) {', '.join(repr(b) for b in bad)}"
            + (f" (did you mean {close}?)" if close else "")
            + f"; allowed: {', '.join(names)} (optionally per collective, e.g. allreduce:ring,tree)",
            close,
        )
    ]


def _parse_int(v: str) -> int | None:
    """An integer as C's strtoll(base 0) reads it whole (0x1f hex, 017 octal), else None."""
    if not _INT_RE.match(v):
        return None
    sign, digits = (v[0], v[1:]) if v[0] in "+-" else ("", v)
    try:
        if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xX":
            return int(sign + digits, 8)
        return int(sign + digits, 0)
    except ValueError:
        return None


def _suggest(word: str, allowed: tuple[str, ...]) -> str | None:
    """Case-insensitive match, then a transposition (PBH -> PHB), then difflib."""
    for a in allowed:
        if a.upper() == word.upper():
            return a
    for a in allowed:
        if len(a) == len(word) and sorted(a.upper()) == sorted(word.upper()):
            return a
    close = difflib.get_close_matches(word.upper(), [a.upper() for a in allowed], n=1, cutoff=0.6)
    if close:
        return next(a for a in allowed if a.upper() == close[0])
    return None


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "y", "yes", "t", "true")


def _check_combinations(env: Mapping[str, str]) -> list[NcclIssue]:
    out: list[NcclIssue] = []
    for old, new in DEPRECATED.items():
        if old in env and new in env:
            out.append(NcclIssue(old, "warning", f"is ignored because {new} is also set; remove it", new))
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1" and "NCCL_P2P_LEVEL" in env:
        out.append(
            NcclIssue("NCCL_P2P_LEVEL", "warning", "has no effect: NCCL_P2P_DISABLE=1 forces LOC", None)
        )
    if env.get("NCCL_IB_DISABLE", "").strip() == "1":
        ib = sorted(k for k in env if k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE")
        if ib:
            out.append(
                NcclIssue(ib[0], "warning", f"{', '.join(ib)} have no effect with NCCL_IB_DISABLE=1", None)
            )
    buf = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if _truthy(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT")) and buf is not None and buf.strip() == "0":
        out.append(
            NcclIssue(
                "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "warning",
                "dumps nothing with TORCH_FR_BUFFER_SIZE=0 (the flight recorder is off)",
                None,
            )
        )
    if _truthy(env.get("TORCH_NCCL_DESYNC_DEBUG")) and env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        out.append(
            NcclIssue(
                "TORCH_NCCL_DESYNC_DEBUG",
                "warning",
                "needs TORCH_NCCL_ASYNC_ERROR_HANDLING != 0 to report anything",
                None,
            )
        )
    return out
