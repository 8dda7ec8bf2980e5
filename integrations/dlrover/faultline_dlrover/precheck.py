"""faultline as a DLRover pre-check operator: the job master asks faultline about the job's
own nodes before training starts.

DLRover's job master (dlrover 0.6.1) runs the operators named by `--pre_check_ops` one after
the other before it lets the workers train (integrations/dlrover/README.md restates its rules).
`FaultlinePreCheckOperator.check` takes the job's nodes from the master's job context (the
Kubernetes node each pod was placed on) and asks the `faultline` CLI, faultline's interface
for job scripts, two questions:

1. `faultline hosts -o json`: is each node usable? Its record must pass the usability rule
   (docs/record.md, "Usable"), and its agent must be alive: on Kubernetes the agent pod is
   Ready (a fault record outlives its agent), without Kubernetes (`--members`) the agent
   answers with a fresh heartbeat. A node the CLI leaves out is abnormal, with its reason.
2. `faultline check --nodes ... -o json`: a peer check of the job's nodes against each other.
   The nodes named by a verdict (faulty node, broken or degraded link, straggler) are abnormal.

Abnormal nodes fail the check with DLRover's `PreCheckResult`; `failed_actions` then asks the
master to relaunch those workers (as DLRover's own ConnectionPreCheckOperator does), or to
abort the job (`FAULTLINE_DLROVER_ON_FAILURE=abort`). A question faultline cannot answer
(exit 2: no coordinator, no permission, no records; or no CLI at all) is no verdict: the check
passes and says why, as the PyTorchJob example's pre-flight lets the Master start.

Configuration is read from the environment at every check (DLRover builds the operator with no
arguments): see `Settings`. The CLI reads its own variables (`FAULTLINE_KUBECONFIG`,
`FAULTLINE_COORDINATOR`, `FAULTLINE_PEER_REQUESTER_SECRET_FILE`, ...) from the same environment.
"""

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dlrover.python.common.constants import NodeStatus
from dlrover.python.common.log import default_logger as logger
from dlrover.python.common.node import Node
from dlrover.python.diagnosis.common.constants import (
    DiagnosisActionType,
    DiagnosisConstant,
    DiagnosisErrorConstant,
)
from dlrover.python.diagnosis.common.diagnosis_action import (
    DiagnosisAction,
    JobAbortionAction,
    NoAction,
    NodeAction,
)
from dlrover.python.master.diagnosis.precheck_operator import (
    PreCheckOperator,
    PreCheckResult,
)
from dlrover.python.master.node.job_context import get_job_context

# Result codes (DLRover leaves every code above 0 to the operator) and the first word of the
# message, which is all `failed_actions` is given besides the abnormal nodes.
UNUSABLE = 1
UNUSABLE_MSG = "FAULTLINE_NODE_UNUSABLE"
PEER_CHECK_FAILED = 2
PEER_CHECK_FAILED_MSG = "FAULTLINE_PEER_CHECK_FAILED"
NOT_PLACED = 3
NOT_PLACED_MSG = "FAULTLINE_NODES_NOT_PLACED"

# Verdict kinds of `faultline check -o json` that name what the job must not use; `unknown`
# (a node that could not be judged) is not one of them.
BAD_VERDICTS = ("faulty_node", "broken_link", "degraded_link", "straggler")


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Settings:
    """What the operator does, from `FAULTLINE_*` variables of the master's environment."""

    # The faultline CLI (FAULTLINE_BIN): a path, or a name on PATH.
    bin: str = "faultline"
    # The agents' namespace (FAULTLINE_DLROVER_NAMESPACE): fault ConfigMaps, agent pods and the
    # coordinator's Lease.
    namespace: str = "faultline-system"
    # Without Kubernetes (FAULTLINE_DLROVER_MEMBERS): the peer checks' members file; each
    # member's agent answers for its record on FAULTLINE_DLROVER_AGENT_PORT.
    members: Optional[str] = None
    agent_port: Optional[str] = None
    # Which records pass (FAULTLINE_DLROVER_ACCEPT): `degraded` (the default, as the examples'
    # init containers: Degraded with faults that need at most a restart of the job), `healthy`,
    # or a handling level (`--max-handling`).
    accept: str = "degraded"
    # FAULTLINE_DLROVER_PEER_CHECK: `off` skips the peer check.
    peer_check: bool = True
    # FAULTLINE_DLROVER_CHECK_TIMEOUT: seconds `faultline check` may take (its --timeout).
    check_timeout: int = 300
    # FAULTLINE_DLROVER_NODE_TYPES: the DLRover node types checked (comma separated).
    node_types: Tuple[str, ...] = ("worker",)
    # FAULTLINE_DLROVER_ON_FAILURE: `relaunch` the abnormal nodes' pods, or `abort` the job.
    on_failure: str = "relaunch"
    # FAULTLINE_DLROVER_RETRY_SECONDS: how long the master waits after a failed check before
    # it runs every operator again.
    retry_seconds: int = 60
    # Seconds `faultline hosts` may take (it lists the records, Nodes and agent pods).
    hosts_timeout: int = 60
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        e = os.environ if env is None else env
        s = cls(env=e)
        s.bin = e.get("FAULTLINE_BIN", s.bin) or s.bin
        s.namespace = e.get("FAULTLINE_DLROVER_NAMESPACE", s.namespace) or s.namespace
        s.members = e.get("FAULTLINE_DLROVER_MEMBERS") or None
        s.agent_port = e.get("FAULTLINE_DLROVER_AGENT_PORT") or None
        s.accept = (e.get("FAULTLINE_DLROVER_ACCEPT") or s.accept).strip()
        s.peer_check = _flag(e.get("FAULTLINE_DLROVER_PEER_CHECK", "on"))
        s.check_timeout = int(e.get("FAULTLINE_DLROVER_CHECK_TIMEOUT") or s.check_timeout)
        types = e.get("FAULTLINE_DLROVER_NODE_TYPES")
        if types:
            s.node_types = tuple(t.strip() for t in types.split(",") if t.strip())
        s.on_failure = (e.get("FAULTLINE_DLROVER_ON_FAILURE") or s.on_failure).strip().lower()
        if s.on_failure not in ("relaunch", "abort"):
            raise ValueError(
                f"FAULTLINE_DLROVER_ON_FAILURE={s.on_failure!r}: relaunch or abort"
            )
        s.retry_seconds = int(e.get("FAULTLINE_DLROVER_RETRY_SECONDS") or s.retry_seconds)
        return s

    def accept_flags(self) -> List[str]:
        a = self.accept.lower()
        if a == "healthy":
            return []
        if a == "degraded":
            return ["--allow-degraded"]
        return ["--max-handling", self.accept]

    def hosts_args(self) -> List[str]:
        args = ["hosts", "-o", "json"] + self.accept_flags()
        if self.members:
            # Without Kubernetes the CLI asks each member's agent; slots are not used here.
            args += ["--members", self.members, "--slots", "1"]
            if self.agent_port:
                args += ["--agent-port", self.agent_port]
        else:
            args += ["--namespace", self.namespace]
        return args

    def check_args(self, hosts: Sequence[str]) -> List[str]:
        return [
            "check",
            "--nodes",
            ",".join(hosts),
            "--timeout",
            f"{self.check_timeout}s",
            "--namespace",
            self.namespace,
            "-o",
            "json",
        ]


@dataclass
class Answer:
    """One run of the CLI: its exit status and its JSON document, or why there is none."""

    code: Optional[int]
    doc: Optional[object]
    error: str = ""

    def why(self) -> str:
        """The CLI's own reason (`{"error": ...}`), else what went wrong running it."""
        if isinstance(self.doc, dict) and isinstance(self.doc.get("error"), str):
            return self.doc["error"]
        return self.error or f"exit {self.code}"


def run_cli(s: Settings, args: List[str], timeout: float) -> Answer:
    """Runs `faultline ARGS` (every command here asks for `-o json`: one document on stdout,
    errors included). A CLI that cannot be run, hangs past `timeout` or prints no JSON is an
    answer without a document."""
    try:
        p = subprocess.run(
            [s.bin] + args,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(s.env) if s.env else None,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return Answer(None, None, f"cannot run {s.bin}: {e}")
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
        return Answer(p.returncode, None, f"exit {p.returncode}, no JSON: {tail[0]}")
    return Answer(p.returncode, doc)


def job_nodes(node_types: Sequence[str]) -> Tuple[List[Node], List[Node]]:
    """The job's live nodes of these types from the master's job context: those placed on a
    Kubernetes node (`host_name`, the pod's spec.nodeName) and those not placed yet. Released
    nodes and nodes in a final state are not the job's any more."""
    placed: List[Node] = []
    waiting: List[Node] = []
    for node_type, nodes in get_job_context().dup_job_nodes().items():
        if node_type not in node_types:
            continue
        for node in nodes.values():
            if node is None or node.is_released:
                continue
            if NodeStatus.is_terminal_status(node.status):
                continue
            (placed if node.host_name else waiting).append(node)
    key = lambda n: (n.type, n.id)  # noqa: E731
    return sorted(placed, key=key), sorted(waiting, key=key)


def _names(nodes: Sequence[Node]) -> str:
    return ", ".join(f"{n.name or n.type + '-' + str(n.id)} on {n.host_name}" for n in nodes)


class FaultlinePreCheckOperator(PreCheckOperator):
    """A DLRover pre-check operator backed by faultline (module docstring)."""

    @classmethod
    def get_retry_interval_secs(cls) -> int:
        return Settings.from_env().retry_seconds

    def check(self, *args, **kwargs) -> PreCheckResult:
        s = Settings.from_env()
        placed, waiting = job_nodes(s.node_types)
        if waiting:
            # A node not placed yet cannot be asked about; the master runs the check again.
            names = ", ".join(n.name or f"{n.type}-{n.id}" for n in waiting)
            return PreCheckResult(
                result=NOT_PLACED,
                result_msg=f"{NOT_PLACED_MSG}: not on a node yet: {names}",
            )
        if not placed:
            return PreCheckResult(
                result_msg=f"faultline: no {'/'.join(s.node_types)} node to check"
            )
        hosts = sorted({n.host_name for n in placed})
        notes: List[str] = []

        # 1. Records and agents.
        answer = run_cli(s, s.hosts_args(), s.hosts_timeout)
        if answer.code == 0 and isinstance(answer.doc, dict):
            usable = {h.get("host") for h in answer.doc.get("hosts", [])}
            left: Dict[str, str] = {
                x.get("node"): x.get("why", "") for x in answer.doc.get("leftOut", [])
            }
            why_of: Dict[str, str] = {}
            for h in hosts:
                if h in usable:
                    continue
                why_of[h] = left.get(h) or "no fault record for the node (no faultline agent?)"
            if why_of:
                bad = [n for n in placed if n.host_name in why_of]
                reasons = "; ".join(f"{h}: {w}" for h, w in sorted(why_of.items()))
                return PreCheckResult(
                    result=UNUSABLE,
                    result_msg=f"{UNUSABLE_MSG}: {reasons} ({_names(bad)})",
                    abnormal_nodes=bad,
                )
            notes.append(f"usable: {', '.join(hosts)}")
        else:
            # No verdict (no permission, no records in the namespace, no CLI): say so, and go
            # on; each worker's own init container still waits for a usable record.
            logger.warning(f"faultline: records not read ({answer.why()}); not judged")
            notes.append(f"records not read ({answer.why()})")

        # 2. The peer check of the job's own nodes.
        if not s.peer_check:
            notes.append("peer check off")
        elif len(hosts) < 2:
            notes.append("no peer check (one node)")
        else:
            answer = run_cli(s, s.check_args(hosts), s.check_timeout + 30)
            doc = answer.doc if isinstance(answer.doc, dict) else {}
            verdicts = [v for v in doc.get("verdicts", []) if isinstance(v, dict)]
            run = doc.get("run_id", "?")
            if answer.code == 0:
                notes.append(f"peer check run {run}: nothing found")
            elif answer.code == 1:
                named: Dict[str, List[str]] = {}
                lines = []
                for v in verdicts:
                    if v.get("kind") not in BAD_VERDICTS:
                        continue
                    vnodes = [str(x) for x in v.get("nodes", [])]
                    lines.append(f"{v.get('kind')} {'<->'.join(vnodes)}")
                    for h in vnodes:
                        named.setdefault(h, []).append(str(v.get("kind")))
                bad = [n for n in placed if n.host_name in named]
                return PreCheckResult(
                    result=PEER_CHECK_FAILED,
                    result_msg=(
                        f"{PEER_CHECK_FAILED_MSG}: run {run}: {'; '.join(lines)} "
                        f"({_names(bad)})"
                    ),
                    abnormal_nodes=bad,
                )
            elif answer.code == 3:
                unknown = [
                    f"{','.join(map(str, v.get('nodes', [])))}: {v.get('reason', '')}"
                    for v in verdicts
                ]
                logger.warning(f"faultline: peer check run {run} left nodes unjudged: {unknown}")
                notes.append(f"peer check run {run}: not judged: {'; '.join(unknown)}")
            else:
                # Exit 2 (no coordinator, no credential, timeout) or no answer: no verdict,
                # the job starts (the PyTorchJob example's pre-flight does the same).
                logger.warning(f"faultline: no peer check ({answer.why()}); starting")
                notes.append(f"no peer check ({answer.why()})")
        return PreCheckResult(result_msg="faultline: " + "; ".join(notes))

    def failed_actions(self, *args, **kwargs) -> List[DiagnosisAction]:
        result_msg = str(kwargs.get("result_msg") or "")
        abnormal = kwargs.get("abnormal_nodes") or []
        kind = result_msg.split(":", 1)[0]
        if kind == NOT_PLACED_MSG or not abnormal:
            # Nothing to act on: the master waits and checks again.
            return [NoAction()]
        if Settings.from_env().on_failure == "abort":
            return [JobAbortionAction(reason=kind, msg=result_msg)]
        return [
            NodeAction(
                node_id=n.id,
                node_type=n.type,
                node_status=DiagnosisErrorConstant.PRE_CHECK_FAILED,
                reason=kind,
                instance=DiagnosisConstant.MASTER_INSTANCE,
                action_type=DiagnosisActionType.MASTER_RELAUNCH_WORKER,
            )
            for n in abnormal
        ]
