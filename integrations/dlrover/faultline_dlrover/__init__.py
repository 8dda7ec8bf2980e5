"""faultline for DLRover: a pre-check operator for DLRover's job master (`precheck`).

Name it to the master as `faultline_dlrover.precheck`, the module that defines the class:
DLRover matches an operator's bypass flag by the operator's own module (README.md).
"""

from faultline_dlrover.precheck import FaultlinePreCheckOperator, Settings

__all__ = ["FaultlinePreCheckOperator", "Settings"]
