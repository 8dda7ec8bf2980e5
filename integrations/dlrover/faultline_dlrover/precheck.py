"""faultline as a DLRover pre-check operator: the job master asks faultline about the job's
own nodes before training starts.

DLRover's job master (dlrover 0.6.1) runs the operators named by `--pre_check_ops` one after
the other before it lets the workers train (docs/dlrover.md restates its rules).
`FaultlinePreCheckOperator.check` takes the job's nodes from the master's job context (the
Kubernetes node each pod was placed on) and asks the `faultline` CLI, faultline's interface
for job scripts, two questions:

1. `faultline hosts -o json`: is each node usable? Its record must pass the usability rule
   (docs/record.md, "Usable"), and its agent must be alive: on Kubernetes the agent pod is
   Ready (a fault record outlives its agent), without Kubernetes (`--members`) the agent
   answers with a fresh heartbeat. A node the CLI leaves out is abnormal, with its reason.
2. `faultline check --nodes ... -o json`: a peer check of the job's nodes against each other.
   The nodes named by a verdict other than `unknown` (faulty node, broken or degraded link,
   straggler, or a kind this CLI cannot name) are abnormal.

Abnormal nodes fail the check with DLRover's `PreCheckResult`; `failed_actions` then asks the
master to relaunch those workers (as DLRover's own ConnectionPreCheckOperator does), or to
abort the job (`FAULTLINE_DLROVER_ON_FAILURE=abort`). A failure that no relaunch can mend
aborts the job in either mode, since the same check would fail again at every round: an
invalid setting of the operator's own, a CLI that cannot be run, no agent answering from the
members file, a peer check that failed without naming a job node.

The check fails closed, with one exception (docs/dlrover.md, "The decision on cannot run"):
faultline's own "no run" answer, exit 2 with its JSON error document, or a CLI that hangs past
its time, is no verdict from faultline's infrastructure: the check passes and says why, as the
PyTorchJob example's pre-flight lets the Master start. That holds for `check` in both modes
and for `hosts` on Kubernetes; without Kubernetes `hosts` giving no answer aborts the job. Any
other exit status, a signal, or an exit 2 without that document is a CLI that could not run
(the wrapper's loader missing, a panic, an OOM kill): a failure that aborts the job.

DLRover counts an exception from `check` as a pass, so `check` turns every exception into a
failing result, except DLRover's own pre-check timeout (`TimeoutException`, raised by its
SIGALRM), which it lets through for DLRover to pass the job at its timeout as documented; the
CLI's processes are killed whenever `run_cli` returns or raises.

Configuration is read from the environment at every check (DLRover builds the operator with no
arguments) and validated strictly: see `Settings`. The CLI reads its own variables
(`FAULTLINE_KUBECONFIG`, `FAULTLINE_COORDINATOR`, `FAULTLINE_PEER_REQUESTER_SECRET_FILE`, ...)
from the same environment.
"""

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from dlrover.python.common.constants import NodeStatus, NodeType
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
from dlrover.python.util.function_util import TimeoutException

# Result codes (DLRover leaves every code above 0 to the operator) and the first word of the
# message, which is all `failed_actions` is given besides the abnormal nodes.
UNUSABLE = 1
UNUSABLE_MSG = "FAULTLINE_NODE_UNUSABLE"
PEER_CHECK_FAILED = 2
PEER_CHECK_FAILED_MSG = "FAULTLINE_PEER_CHECK_FAILED"
NOT_PLACED = 3
NOT_PLACED_MSG = "FAULTLINE_NODES_NOT_PLACED"
CONFIG_INVALID = 4
CONFIG_INVALID_MSG = "FAULTLINE_CONFIG_INVALID"
NO_AGENT_ANSWERS = 5
NO_AGENT_ANSWERS_MSG = "FAULTLINE_NO_AGENT_ANSWERS"
OPERATOR_ERROR = 6
OPERATOR_ERROR_MSG = "FAULTLINE_OPERATOR_ERROR"
# Failures that abort the job whatever FAULTLINE_DLROVER_ON_FAILURE says: no node to relaunch,
# and the master's environment (where the cause lies) does not change between rounds.
ABORTS = (CONFIG_INVALID_MSG, NO_AGENT_ANSWERS_MSG, OPERATOR_ERROR_MSG)

# The verdict kind of `faultline check -o json` for a node that could not be judged. Every
# other kind, `unspecified` (a kind this CLI has no name for) included, makes the CLI exit 1
# (agent/src/cli/check.rs, `check_report`), and the nodes it names are abnormal.
NOT_JUDGED = "unknown"

# The handling levels `--max-handling` takes, least severe first (core/src/record.rs,
# `Handling::ALL`); the CLI matches them without regard to case.
HANDLING_LEVELS = (
    "NotHandleFault",
    "SubHealthFault",
    "RestartRequest",
    "RestartBusiness",
    "FreeRestartNPU",
    "RestartNPU",
    "PreSeparateNPU",
    "SeparateNPU",
    "ManuallySeparateNPU",
)
# DLRover's node types a job's pods can have (`NodeType`; the job master itself is not one of
# the job's nodes). DLRover compares them as written: lower case.
NODE_TYPES = (
    NodeType.WORKER,
    NodeType.PS,
    NodeType.CHIEF,
    NodeType.MASTER,
    NodeType.EVALUATOR,
)
SWITCH = {"on": True, "true": True, "yes": True, "1": True}
SWITCH.update({"off": False, "false": False, "no": False, "0": False})
# A Kubernetes namespace name (an RFC 1123 label).
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DIGITS = re.compile(r"[0-9]+")
# The longest wait between two rounds of the pre-check (FAULTLINE_DLROVER_RETRY_SECONDS): well
# inside DLRover's own pre-check timeout (900 + 600 s by default), which passes the job, and
# small enough for DLRover's `time.sleep` to take.
MAX_RETRY_SECONDS = 600
# The longest a CLI command may take (FAULTLINE_DLROVER_CHECK_TIMEOUT, _HOSTS_TIMEOUT): above
# DLRover's whole default pre-check timeout, and a duration the CLI's `--timeout` accepts.
MAX_CLI_SECONDS = 3600
# Where `faultline check` reads the requesters' secret when FAULTLINE_PEER_REQUESTER_SECRET_FILE
# is unset (faultline/src/bin/faultline.rs, the `check` command's `secret_file`), and the
# shortest secret it accepts (proto/src/auth.rs, `MIN_SECRET_BYTES`; agent/src/peer/wire.rs,
# `load_key`, trims trailing white space first).
DEFAULT_SECRET_FILE = "/etc/faultline/peer/requester-secret"
MIN_SECRET_BYTES = 16


@dataclass
class Settings:
    """What the operator does, from `FAULTLINE_*` variables of the master's environment. An
    unset or empty variable takes its default; any other value must be one the variable
    accepts (`load` lists what is wrong), never silently read as the default."""

    # The faultline CLI (FAULTLINE_BIN): a path, or a name on PATH; an executable file.
    bin: str = "faultline"
    # The agents' namespace (FAULTLINE_DLROVER_NAMESPACE): fault ConfigMaps, agent pods and the
    # coordinator's Lease.
    namespace: str = "faultline-system"
    # Without Kubernetes (FAULTLINE_DLROVER_MEMBERS): the peer checks' members file, a readable
    # file; each member's agent answers for its record on FAULTLINE_DLROVER_AGENT_PORT (1-65535,
    # only with a members file).
    members: Optional[str] = None
    agent_port: Optional[int] = None
    # Which records pass (FAULTLINE_DLROVER_ACCEPT): `degraded` (the default, as the examples'
    # init containers: Degraded with faults that need at most a restart of the job), `healthy`,
    # or a handling level of HANDLING_LEVELS (`--max-handling`).
    accept: str = "degraded"
    # FAULTLINE_DLROVER_PEER_CHECK: on or off (SWITCH).
    peer_check: bool = True
    # FAULTLINE_DLROVER_CHECK_TIMEOUT: seconds `faultline check` may take (its --timeout),
    # 1 to MAX_CLI_SECONDS.
    check_timeout: int = 300
    # FAULTLINE_DLROVER_NODE_TYPES: the DLRover node types checked (comma separated, of
    # NODE_TYPES).
    node_types: Tuple[str, ...] = (NodeType.WORKER,)
    # FAULTLINE_DLROVER_ON_FAILURE: `relaunch` the abnormal nodes' pods, or `abort` the job.
    on_failure: str = "relaunch"
    # FAULTLINE_DLROVER_RETRY_SECONDS: how long the master waits after a failed check before
    # it runs every operator again, 1 to MAX_RETRY_SECONDS.
    retry_seconds: int = 60
    # FAULTLINE_DLROVER_HOSTS_TIMEOUT: seconds `faultline hosts` may take (it lists the
    # records, Nodes and agent pods, or asks each member's agent), 1 to MAX_CLI_SECONDS.
    hosts_timeout: int = 60
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, env: Optional[Mapping[str, str]] = None) -> Tuple["Settings", List[str]]:
        """The settings, and one line per invalid variable naming it, its value and what it
        accepts (empty when all are valid). Never raises: an invalid value leaves its
        default in the settings, which the caller must not act on."""
        e = os.environ if env is None else env
        s = cls(env=e)
        errors: List[str] = []

        def get(name: str) -> Optional[str]:
            v = e.get(name)
            return v.strip() if v is not None and v.strip() else None

        def seconds(name: str, default: int, most: int) -> int:
            v = get(name)
            if v is None:
                return default
            if DIGITS.fullmatch(v) and 1 <= int(v) <= most:
                return int(v)
            errors.append(f"{name}={v!r}: a whole number of seconds, 1 to {most}, no unit")
            return default

        v = get("FAULTLINE_BIN")
        if v is not None:
            s.bin = v
        if _executable(s.bin, e.get("PATH")) is None:
            errors.append(
                f"FAULTLINE_BIN={s.bin!r}: no executable file there (a path, or a name on PATH)"
            )

        v = get("FAULTLINE_DLROVER_NAMESPACE")
        if v is not None:
            if NAMESPACE.fullmatch(v):
                s.namespace = v
            else:
                errors.append(
                    f"FAULTLINE_DLROVER_NAMESPACE={v!r}: a Kubernetes namespace name "
                    "(lower-case letters, digits and '-', at most 63)"
                )

        s.members = get("FAULTLINE_DLROVER_MEMBERS")
        if s.members is not None and not (
            os.path.isfile(s.members) and os.access(s.members, os.R_OK)
        ):
            errors.append(
                f"FAULTLINE_DLROVER_MEMBERS={s.members!r}: no readable file there "
                "(the peer checks' members file)"
            )
        v = get("FAULTLINE_DLROVER_AGENT_PORT")
        if v is not None:
            if not (DIGITS.fullmatch(v) and 1 <= int(v) <= 65535):
                errors.append(f"FAULTLINE_DLROVER_AGENT_PORT={v!r}: a port, 1 to 65535")
            elif s.members is None:
                errors.append(
                    f"FAULTLINE_DLROVER_AGENT_PORT={v!r}: set without "
                    "FAULTLINE_DLROVER_MEMBERS, which it belongs to"
                )
            else:
                s.agent_port = int(v)

        v = get("FAULTLINE_DLROVER_ACCEPT")
        if v is not None:
            level = next((h for h in HANDLING_LEVELS if h.lower() == v.lower()), None)
            if v.lower() in ("healthy", "degraded"):
                s.accept = v.lower()
            elif level is not None:
                s.accept = level
            else:
                errors.append(
                    f"FAULTLINE_DLROVER_ACCEPT={v!r}: healthy, degraded, or a handling level "
                    f"({', '.join(HANDLING_LEVELS)})"
                )

        v = get("FAULTLINE_DLROVER_PEER_CHECK")
        if v is not None:
            if v.lower() in SWITCH:
                s.peer_check = SWITCH[v.lower()]
            else:
                errors.append(
                    f"FAULTLINE_DLROVER_PEER_CHECK={v!r}: on or off "
                    "(or true/false, yes/no, 1/0)"
                )

        s.check_timeout = seconds(
            "FAULTLINE_DLROVER_CHECK_TIMEOUT", s.check_timeout, MAX_CLI_SECONDS
        )

        v = get("FAULTLINE_DLROVER_NODE_TYPES")
        if v is not None:
            types = [t.strip() for t in v.split(",") if t.strip()]
            unknown = [t for t in types if t not in NODE_TYPES]
            if not types or unknown:
                errors.append(
                    f"FAULTLINE_DLROVER_NODE_TYPES={v!r}: DLRover node types, comma "
                    f"separated, each one of {', '.join(NODE_TYPES)} (lower case)"
                )
            else:
                s.node_types = tuple(dict.fromkeys(types))

        v = get("FAULTLINE_DLROVER_ON_FAILURE")
        if v is not None:
            if v.lower() in ("relaunch", "abort"):
                s.on_failure = v.lower()
            else:
                errors.append(f"FAULTLINE_DLROVER_ON_FAILURE={v!r}: relaunch or abort")

        s.retry_seconds = seconds(
            "FAULTLINE_DLROVER_RETRY_SECONDS", s.retry_seconds, MAX_RETRY_SECONDS
        )
        s.hosts_timeout = seconds(
            "FAULTLINE_DLROVER_HOSTS_TIMEOUT", s.hosts_timeout, MAX_CLI_SECONDS
        )

        if s.members is not None and s.peer_check:
            # Without Kubernetes the CLI finds no coordinator by itself and signs with the
            # requesters' secret: both are the master's settings, checked here so that their
            # absence is not mistaken for the CLI's "no peer check can run".
            errors.extend(_peer_settings(get))
        return s, errors

    def accept_flags(self) -> List[str]:
        if self.accept == "healthy":
            return []
        if self.accept == "degraded":
            return ["--allow-degraded"]
        return ["--max-handling", self.accept]

    def hosts_args(self) -> List[str]:
        args = ["hosts", "-o", "json"] + self.accept_flags()
        if self.members:
            # Without Kubernetes the CLI asks each member's agent; slots are not used here.
            args += ["--members", self.members, "--slots", "1"]
            if self.agent_port is not None:
                args += ["--agent-port", str(self.agent_port)]
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


def _peer_settings(get) -> List[str]:
    """What is wrong with the settings `faultline check` needs without Kubernetes: the
    coordinator's address (FAULTLINE_COORDINATOR) and the requesters' secret, readable and
    long enough (FAULTLINE_PEER_REQUESTER_SECRET_FILE, or the CLI's default path). A
    coordinator from a members file takes no service-account token, so
    FAULTLINE_PEER_TOKEN_FILE, which the CLI would send instead of signing, is refused."""
    errors: List[str] = []
    if get("FAULTLINE_COORDINATOR") is None:
        errors.append(
            "FAULTLINE_COORDINATOR unset: with FAULTLINE_DLROVER_MEMBERS (no Kubernetes) the "
            "peer check needs the coordinator's address, host:port (or "
            "FAULTLINE_DLROVER_PEER_CHECK=off)"
        )
    token = get("FAULTLINE_PEER_TOKEN_FILE")
    if token is not None:
        errors.append(
            f"FAULTLINE_PEER_TOKEN_FILE={token!r}: a service-account token, which a coordinator "
            "without Kubernetes does not take; unset it and give the requesters' secret"
        )
    name = "FAULTLINE_PEER_REQUESTER_SECRET_FILE"
    secret = get(name)
    if secret is not None:
        shown = f"{name}={secret!r}"
    else:
        shown = f"{name} unset, its default {DEFAULT_SECRET_FILE!r}"
    try:
        with open(secret or DEFAULT_SECRET_FILE, "rb") as f:
            # ASCII white space as Rust's `trim_ascii_end` takes it (no vertical tab).
            length = len(f.read().rstrip(b" \t\n\r\x0c"))
    except OSError as e:
        errors.append(
            f"{shown}: no readable file there ({e.strerror}); the peer check signs its "
            "request with the requesters' secret"
        )
    else:
        if length < MIN_SECRET_BYTES:
            errors.append(
                f"{shown}: the requesters' secret is {length} bytes, the CLI takes at "
                f"least {MIN_SECRET_BYTES}"
            )
    return errors


def _executable(name: str, path: Optional[str]) -> Optional[str]:
    """The executable file `name` stands for (a path, or a name looked up on `path`), as
    the CLI's run would find it; None when there is none."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name, path=path)


@dataclass
class Answer:
    """One run of the CLI: how it ended, and its JSON document when stdout held one."""

    # The exit status; negative: killed by that signal (subprocess's convention); None when it
    # did not end by itself (hung) or did not start.
    code: Optional[int]
    doc: Optional[object]
    # The last line of its stderr (else of its stdout), or why it could not be started.
    error: str = ""
    # The CLI could not be started at all (no such file, not executable, wrong format).
    cannot_run: bool = False
    # It did not answer within its time and was killed.
    hung: bool = False

    def no_run(self) -> bool:
        """Whether this is the CLI's own "cannot answer": exit 2 with the JSON error document
        every command prints under `-o json` (`{"error": "...", "exitCode": 2}`,
        agent/src/cli/mod.rs, `render`). An exit 2 without it is not the CLI speaking (a
        wrapper, a shell, a loader)."""
        d = self.doc
        return (
            self.code == 2
            and isinstance(d, dict)
            and isinstance(d.get("error"), str)
            and d.get("exitCode") == 2
        )

    def why(self) -> str:
        """The CLI's own reason (`{"error": ...}`), else what went wrong running it."""
        if isinstance(self.doc, dict) and isinstance(self.doc.get("error"), str):
            return self.doc["error"]
        return self.error or self.status()

    def status(self) -> str:
        if self.code is None:
            return "no exit status"
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"killed by {name}"
        return f"exit {self.code}"

    def broken(self) -> str:
        """How a run that is neither an answer nor "cannot answer" ended, for the message."""
        if self.code == 2 and self.doc is not None:
            what = "exit 2 without its JSON error document"
        elif self.doc is None:
            what = f"{self.status()}, no JSON answer"
        else:
            what = f"{self.status()}, not the answer this command gives"
        return f"{what}: {self.error}" if self.error else what


def _last_line(*texts: Optional[str]) -> str:
    """The last non-empty line of the first text that has one, at most 300 characters."""
    for t in texts:
        lines = [l.strip() for l in (t or "").splitlines() if l.strip()]
        if lines:
            return lines[-1][:300]
    return ""


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL to the CLI's process group (it leads its own session): the CLI, and what a
    wrapper or the CLI started. Then its pipes are read to their end, or closed when something
    outside the group still holds them, and the CLI is reaped."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # The group is empty (everything in it has ended and been reaped).
        pass
    try:
        p.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        # Still held (or already closed, after an interrupted read): stop reading them.
        for pipe in (p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()
        p.wait()


def run_cli(s: Settings, args: List[str], timeout: float) -> Answer:
    """Runs `faultline ARGS` (every command here asks for `-o json`: one document on stdout,
    errors included). A CLI that cannot be started is `cannot_run`; one that hangs past
    `timeout` is `hung`, without a document. However the call ends (an answer, a hang, or an
    exception raised in it, such as DLRover's pre-check timeout from its SIGALRM), the CLI's
    process group is killed before it returns: the recipe's CLI is a wrapper script, and no
    process the call started outlives it."""
    try:
        p = subprocess.Popen(
            [s.bin] + args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(s.env) if s.env else None,
            start_new_session=True,
        )
    except OSError as e:
        return Answer(None, None, f"cannot run {s.bin}: {e}", cannot_run=True)
    try:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return Answer(
                None,
                None,
                f"faultline {args[0]} did not answer within {timeout:g} s (killed)",
                hung=True,
            )
    finally:
        _kill_group(p)
    try:
        doc = json.loads(out)
    except ValueError:
        doc = None
    return Answer(p.returncode, doc, _last_line(err, out))


@dataclass
class JobNodes:
    """The job's nodes as the check sees them."""

    # Live nodes of the checked types placed on a Kubernetes node (`host_name`, the pod's
    # spec.nodeName), and those not placed yet.
    placed: List[Node]
    waiting: List[Node]
    # Whether the job has any node of the checked types, live or not.
    of_types: bool
    # The types of the job's live nodes of other types.
    other_types: List[str]


def job_nodes(node_types: Sequence[str]) -> JobNodes:
    """The job's nodes from the master's job context. Released nodes and nodes in a final
    state are not the job's any more."""
    placed: List[Node] = []
    waiting: List[Node] = []
    of_types = False
    others: Set[str] = set()
    for node_type, nodes in get_job_context().dup_job_nodes().items():
        for node in nodes.values():
            if node is None:
                continue
            if node_type in node_types:
                of_types = True
            if node.is_released or NodeStatus.is_terminal_status(node.status):
                continue
            if node_type not in node_types:
                others.add(str(node_type))
                continue
            (placed if node.host_name else waiting).append(node)
    key = lambda n: (n.type, n.id)  # noqa: E731
    return JobNodes(
        sorted(placed, key=key), sorted(waiting, key=key), of_types, sorted(others)
    )


def _names(nodes: Sequence[Node]) -> str:
    return ", ".join(f"{n.name or n.type + '-' + str(n.id)} on {n.host_name}" for n in nodes)


def _hosts_doc(doc: object) -> Optional[Tuple[Set[str], Dict[str, str]]]:
    """The usable hosts and the left-out nodes with why from `faultline hosts -o json`'s
    document, or None when it does not have that shape."""
    if not isinstance(doc, dict):
        return None
    hosts, left = doc.get("hosts"), doc.get("leftOut", [])
    if not isinstance(hosts, list) or not isinstance(left, list):
        return None
    if not all(isinstance(x, dict) for x in hosts + left):
        return None
    usable = {str(h.get("host")) for h in hosts}
    return usable, {str(x.get("node")): str(x.get("why") or "") for x in left}


def _verdict(v: dict) -> str:
    """One verdict as a line of the result's message."""
    nodes = [str(x) for x in v.get("nodes") or []]
    text = f"{v.get('kind')} {'<->'.join(nodes) if nodes else '(no node)'}"
    slowdown = v.get("slowdown")
    if isinstance(slowdown, (int, float)) and slowdown > 0:
        text += f" ({slowdown:.2f}x)"
    if v.get("reason"):
        text += f": {v.get('reason')}"
    return text


def _config_invalid(errors: Sequence[str]) -> PreCheckResult:
    msg = f"{CONFIG_INVALID_MSG}: {'; '.join(errors)}"
    logger.error(f"faultline: the operator's settings are invalid: {msg}")
    return PreCheckResult(result=CONFIG_INVALID, result_msg=msg)


def _cli_broken(s: Settings, command: str, answer: Answer) -> PreCheckResult:
    """The CLI ran and gave neither an answer nor its own "cannot answer" (a wrapper whose
    loader is missing, a panic, a kill): the master's CLI is broken, as much a mistake in its
    pod as a missing one, and no retry mends it."""
    return _config_invalid(
        [f"FAULTLINE_BIN={s.bin!r}: faultline {command} could not run ({answer.broken()})"]
    )


class FaultlinePreCheckOperator(PreCheckOperator):
    """A DLRover pre-check operator backed by faultline (module docstring)."""

    @classmethod
    def get_retry_interval_secs(cls) -> int:
        s, errors = Settings.load()
        # With an invalid setting the check failed and aborted the job: the master's loop
        # only has to see the stop.
        return 1 if errors else s.retry_seconds

    def check(self, *args, **kwargs) -> PreCheckResult:
        try:
            return self._check()
        except TimeoutException:
            # DLRover's pre-check timeout (its SIGALRM, `timeout` in
            # dlrover/python/util/function_util.py): DLRover's to handle (it passes the job
            # at its timeout); `run_cli` has killed the CLI on the way out.
            raise
        except Exception as e:
            # DLRover would count the exception as a pass.
            logger.exception("faultline: the pre-check operator failed")
            return PreCheckResult(
                result=OPERATOR_ERROR,
                result_msg=f"{OPERATOR_ERROR_MSG}: {type(e).__name__}: {e}",
            )

    def _check(self) -> PreCheckResult:
        s, errors = Settings.load()
        if errors:
            return _config_invalid(errors)
        job = job_nodes(s.node_types)
        if not job.of_types and job.other_types:
            return _config_invalid(
                [
                    f"FAULTLINE_DLROVER_NODE_TYPES={','.join(s.node_types)!r}: the job has no "
                    f"node of that type; its nodes are {', '.join(job.other_types)}"
                ]
            )
        placed, waiting = job.placed, job.waiting
        if waiting:
            # A node not placed yet cannot be asked about; the master runs the check again.
            names = ", ".join(n.name or f"{n.type}-{n.id}" for n in waiting)
            return PreCheckResult(
                result=NOT_PLACED,
                result_msg=f"{NOT_PLACED_MSG}: not on a node yet: {names}",
            )
        if not placed:
            return PreCheckResult(
                result_msg=f"faultline: no live {'/'.join(s.node_types)} node to check"
            )
        hosts = sorted({n.host_name for n in placed})
        notes: List[str] = []

        # 1. Records and agents.
        answer = run_cli(s, s.hosts_args(), s.hosts_timeout)
        if answer.cannot_run:
            return _config_invalid([f"FAULTLINE_BIN={s.bin!r}: {answer.error}"])
        read = _hosts_doc(answer.doc) if answer.code == 0 else None
        if read is None and not (answer.hung or answer.no_run()):
            return _cli_broken(s, "hosts", answer)
        if read is not None:
            usable, left = read
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
        elif s.members:
            # The operator was told where the agents are and none gave an answer (the CLI
            # exits 2 when no member's agent answers, or it hung): no node is shown usable,
            # and relaunching cannot change that.
            return PreCheckResult(
                result=NO_AGENT_ANSWERS,
                result_msg=(
                    f"{NO_AGENT_ANSWERS_MSG}: faultline hosts --members {s.members}: "
                    f"{answer.why()} ({_names(placed)})"
                ),
                abnormal_nodes=placed,
            )
        else:
            # No verdict on Kubernetes (no permission, no records in the namespace, a CLI that
            # hangs): say so, and go on; each worker's own init container still waits for a
            # usable record.
            why = answer.why()
            logger.warning(f"faultline: records not read ({why}); not judged")
            notes.append(f"records not read ({why})")

        # 2. The peer check of the job's own nodes.
        if not s.peer_check:
            notes.append("peer check off")
        elif len(hosts) < 2:
            notes.append("no peer check (one node)")
        else:
            answer = run_cli(s, s.check_args(hosts), s.check_timeout + 30)
            if answer.cannot_run:
                return _config_invalid([f"FAULTLINE_BIN={s.bin!r}: {answer.error}"])
            if answer.hung or answer.no_run():
                # No coordinator, no credential, its --timeout, or a hang: no verdict, the job
                # starts (the PyTorchJob example's pre-flight does the same).
                logger.warning(f"faultline: no peer check ({answer.why()}); starting")
                notes.append(f"no peer check ({answer.why()})")
                return PreCheckResult(result_msg="faultline: " + "; ".join(notes))
            if answer.code not in (0, 1, 3) or not isinstance(answer.doc, dict):
                return _cli_broken(s, "check", answer)
            doc = answer.doc
            verdicts = [v for v in doc.get("verdicts") or [] if isinstance(v, dict)]
            run = doc.get("run_id", "?")
            found = [v for v in verdicts if v.get("kind") != NOT_JUDGED]
            unjudged = [v for v in verdicts if v.get("kind") == NOT_JUDGED]
            if answer.code == 0:
                notes.append(f"peer check run {run}: nothing found")
            elif answer.code == 1:
                named = {str(h) for v in found for h in v.get("nodes") or []}
                bad = [n for n in placed if n.host_name in named]
                # The findings first, then the nodes it could not judge.
                lines = "; ".join(map(_verdict, found + unjudged)) or "no verdict in its answer"
                if bad:
                    msg = f"{PEER_CHECK_FAILED_MSG}: run {run}: {lines} ({_names(bad)})"
                else:
                    # Nothing of the job's to relaunch (`failed_actions` aborts): a verdict
                    # of a kind without nodes, or about nodes that are not the job's.
                    msg = (
                        f"{PEER_CHECK_FAILED_MSG}: run {run}: it failed and names no node "
                        f"of the job ({', '.join(hosts)}): {lines}"
                    )
                return PreCheckResult(
                    result=PEER_CHECK_FAILED, result_msg=msg, abnormal_nodes=bad
                )
            else:
                lines = "; ".join(map(_verdict, unjudged))
                logger.warning(f"faultline: peer check run {run} left nodes unjudged: {lines}")
                notes.append(f"peer check run {run}: not judged: {lines}")
        return PreCheckResult(result_msg="faultline: " + "; ".join(notes))

    def failed_actions(self, *args, **kwargs) -> List[DiagnosisAction]:
        result_msg = str(kwargs.get("result_msg") or "")
        abnormal = kwargs.get("abnormal_nodes") or []
        kind = result_msg.split(":", 1)[0]
        if kind == NOT_PLACED_MSG:
            # Nothing to act on yet: the master waits and checks again.
            return [NoAction()]
        s, errors = Settings.load()
        # A failure naming no node of the job has nothing to relaunch and would fail the same
        # way at every round until DLRover's pre-check timeout passes the job: abort instead.
        if kind in ABORTS or not abnormal or errors or s.on_failure == "abort":
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
