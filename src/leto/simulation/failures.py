"""Published failure data: which failures happen, how often, whether the node survives them,
and how each shows itself (docs/simulation.md gives the reason for each row's treatment)."""

from __future__ import annotations

from dataclasses import dataclass

from leto.protocol.failures import Detection

DETECTION_CLASSES = tuple(Detection)
"""How a failure shows itself (`protocol.failures.Detection`), in the simulator's order."""


@dataclass(frozen=True)
class FailureClass:
    """One root-cause category of Llama 3 Table 5, with how the simulator treats it.

    Attributes:
        name: category as printed in the source.
        count: unexpected interruptions of this category in the 54-day snapshot.
        node_lost: True if the node must leave the job (replacement/repair); its host memory
            is then treated as lost too (conservative for Leto: tier-2 decode is needed).
        detection: one of `DETECTION_CLASSES`.
    """

    name: str
    count: int
    node_lost: bool
    detection: str


# Dubey et al. (2024), "The Llama 3 Herd of Models", Sec. 3.3.4, Table 5: root causes of the
# 419 unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384
# H100 GPUs. The counts sum to 419. The node_lost/detection columns are this simulator's
# classification; docs/simulation.md gives the reason for each row.
LLAMA3_FAILURES: tuple[FailureClass, ...] = (
    FailureClass("Faulty GPU", 148, True, "exit"),
    FailureClass("GPU HBM3 Memory", 72, True, "exit"),
    FailureClass("Software Bug", 54, False, "exit"),
    FailureClass("Network Switch/Cable", 35, False, "hang"),
    FailureClass("Host Maintenance", 32, True, "node"),
    FailureClass("GPU SRAM Memory", 19, True, "exit"),
    FailureClass("GPU System Processor", 17, True, "exit"),
    FailureClass("NIC", 7, True, "hang"),
    FailureClass("NCCL Watchdog Timeouts", 7, False, "hang"),
    FailureClass("Silent Data Corruption", 6, True, "hang"),
    FailureClass("GPU Thermal Interface + Sensor", 6, True, "exit"),
    FailureClass("SSD", 3, True, "node"),
    FailureClass("Power Supply", 3, True, "node"),
    FailureClass("Server Chassis", 2, True, "node"),
    FailureClass("IO Expansion Board", 2, True, "node"),
    FailureClass("Dependency", 2, False, "exit"),
    FailureClass("CPU", 2, True, "node"),
    FailureClass("System Memory", 2, True, "node"),
)
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_MTBF_GPU_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_UNEXPECTED
"""Per-GPU mean time between unexpected job interruptions: 54 d x 24 h x 16,384 / 419."""


def failure_mix(classes: tuple[FailureClass, ...] = LLAMA3_FAILURES) -> dict[str, float]:
    """Fractions of failures that lose the node and of each detection class."""
    total = sum(c.count for c in classes)
    mix = {"node_lost": sum(c.count for c in classes if c.node_lost) / total}
    for d in DETECTION_CLASSES:
        mix[d] = sum(c.count for c in classes if c.detection == d) / total
    return mix
