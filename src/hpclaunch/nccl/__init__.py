"""NCCL environment: named presets (``presets``), what a node's fabric shows (``fabric``) and
validation of NCCL / torch-distributed variables (``validate``). Torch-free; imported by the config
(validation at load), the login side (static presets in scripts), the node agent (``auto`` on each
node) and preflight."""

from .fabric import IbPort, NetInterface, infiniband_ports, match_socket_ifname, net_interfaces
from .presets import (
    PRESET_NAMES,
    PRESETS,
    Preset,
    ResolvedPreset,
    detect_fabric,
    flight_recorder_env,
    nccl_environment,
    resolve_preset,
    static_preset_env,
)
from .validate import NcclIssue, validate_nccl_env

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "IbPort",
    "NcclIssue",
    "NetInterface",
    "Preset",
    "ResolvedPreset",
    "detect_fabric",
    "flight_recorder_env",
    "infiniband_ports",
    "match_socket_ifname",
    "nccl_environment",
    "net_interfaces",
    "resolve_preset",
    "static_preset_env",
    "validate_nccl_env",
]
