"""The sandbox fleet: one Ray actor per node runs that node's sandboxes behind admission control."""

from sandboxes.fleet.admission import AdmissionConfig, AdmissionController, AdmissionRejected
from sandboxes.fleet.heartbeat import HostHeartbeat, QueueMetrics, SandboxStatus

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionRejected",
    "HostHeartbeat",
    "QueueMetrics",
    "SandboxStatus",
]
