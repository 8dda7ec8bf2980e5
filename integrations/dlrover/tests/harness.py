"""What the tests of the DLRover operator run: faultline's real programs on loopback, and
DLRover's own pre-check loop.

faultline's side: the binaries cargo builds (`FAULTLINE_BIN` names the CLI, target/debug/faultline;
`faultline-agent`, `faultline-coordinator`, `faultline-kube-emulator` and `faultline-probe` are
taken from the same directory). On Kubernetes, agents write their fault ConfigMaps into the API
emulator (tests/kube-emulator, its binary and control endpoints); without Kubernetes, a
coordinator from a members file and agents with peer-check keys (docs/peer-checks.md,
"Bare metal").

DLRover's side: `run_precheck` runs `DiagnosisMaster.pre_check`, the loop DLRover's job master
runs before training, over a job context holding the given nodes.

`FakeCli` stands in for the CLI where the real programs cannot be made to answer as a test
needs (tests/fake_faultline.py).
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, List, Optional

from dlrover.python.common.constants import (
    DistributionStrategy,
    JobStage,
    NodeStatus,
    NodeType,
    PreCheckStatus,
)
from dlrover.python.common.global_context import Context
from dlrover.python.common.node import Node
from dlrover.python.diagnosis.common.constants import DiagnosisConstant
from dlrover.python.diagnosis.common.diagnosis_action import (
    JobAbortionAction,
    NodeAction,
)
from dlrover.python.master.args import parse_master_args
from dlrover.python.master.diagnosis.diagnosis_master import DiagnosisMaster
from dlrover.python.master.node.job_context import get_job_context
from dlrover.python.scheduler.kubernetes import K8sJobArgs
from dlrover.python.util.function_util import timeout

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "manifests" / "examples" / "elasticjob.yaml"
# DLRover's logger (dlrover/python/common/log.py): the pre-check loop logs each result on it.
DLROVER_LOGGER = "dlrover.logger"
# A kernel log record of an Xid 79 ("fallen off the bus"): an Unhealthy node.
XID79 = "4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, GPU has fallen off the bus.\n"


def binaries() -> Dict[str, Path]:
    """faultline's programs, next to the CLI that FAULTLINE_BIN names; a missing one is an
    error, never a skipped test."""
    cli = os.environ.get("FAULTLINE_BIN")
    if not cli:
        raise RuntimeError(
            "set FAULTLINE_BIN to the faultline CLI cargo built (target/debug/faultline, after "
            "cargo build -p faultline -p faultline-kube-emulator -p faultline-probe)"
        )
    d = Path(cli).absolute().parent
    found = {"cli": Path(cli).absolute()}
    for name in ("agent", "coordinator", "kube-emulator", "probe"):
        found[name] = d / f"faultline-{name}"
    missing = [str(p) for p in found.values() if not p.is_file()]
    if missing:
        raise RuntimeError(f"not built: {', '.join(missing)}")
    return found


def wait_until(what: str, limit: float, f: Callable[[], object]) -> object:
    """Polls `f` until it returns something true; fails after `limit` seconds."""
    end = time.monotonic() + limit
    while True:
        v = f()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def free_port(ips: List[str]) -> int:
    """A TCP port free on every one of these loopback addresses."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        if all(port_free(ip, port) for ip in ips[1:]):
            return port
    raise AssertionError(f"no port free on all of {ips}")


def free_range(ips: List[str], n: int) -> int:
    """The first of `n` consecutive ports free on all these addresses (the probes' ports)."""
    for _ in range(100):
        base = free_port(ips[:1])
        if base + n < 65000 and all(port_free(ip, base + i) for ip in ips for i in range(n)):
            return base
    raise AssertionError(f"no {n} consecutive ports free")


def port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


def listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0


class Processes:
    """Child processes, each killed (by its own pid) when the fixture ends."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: List[subprocess.Popen] = []

    def start(self, name: str, argv: List[str], env: Optional[Dict[str, str]] = None):
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "RUST_LOG": "info", **(env or {})},
        )
        log.close()
        self.children.append(p)
        return p

    def stop_all(self):
        for p in self.children:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        self.children.clear()

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Emulator:
    """The Kubernetes API emulator's binary on a loopback port, driven through its control
    endpoint (`POST /_emulator/objects`) and its API."""

    def __init__(self, procs: Processes, binary: Path, tmp: Path):
        self.port = free_port(["127.0.0.1"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = tmp / "kubeconfig"
        procs.start(
            "emulator",
            [
                str(binary),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--kubeconfig",
                str(self.kubeconfig),
                "--namespace",
                "faultline-system",
            ],
        )
        wait_until("the emulator", 30, lambda: self.kubeconfig.exists() and self.get("/version"))

    def put(self, obj: dict):
        req = urllib.request.Request(
            f"{self.url}/_emulator/objects",
            data=json.dumps(obj).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def get(self, path: str) -> Optional[dict]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def record(self, node: str) -> Optional[dict]:
        """Node `node`'s record as its agent published it (its fault ConfigMap)."""
        cm = self.get(f"/api/v1/namespaces/faultline-system/configmaps/faultline-{node}")
        text = (cm or {}).get("data", {}).get("faults.json")
        return json.loads(text) if text else None

    def gpu_node(self, name: str):
        """A Ready Node offering 8 GPUs."""
        self.put(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name},
                "status": {
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "allocatable": {"nvidia.com/gpu": "8"},
                },
            }
        )

    def agent_pod(self, node: str, ready: bool):
        """The DaemonSet's pod on `node`, Ready or not (what the kubelet reports: a pod whose
        agent died is not Ready)."""
        self.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"faultline-{node}",
                    "namespace": "faultline-system",
                    "labels": {
                        "app.kubernetes.io/name": "faultline",
                        "app.kubernetes.io/component": "agent",
                    },
                },
                "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
                "status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                },
            }
        )


def start_agent(procs: Processes, binary: Path, dir: Path, node: str, args: List[str], kmsg=""):
    """A real agent for `node`, its kernel log the file `dir/kmsg` (with `kmsg` in it)."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "kmsg").write_text(kmsg)
    (dir / "boot_id").write_text("boot-1\n")
    return procs.start(
        f"agent-{node}",
        [
            str(binary),
            "--node-name",
            node,
            "--kmsg-path",
            str(dir / "kmsg"),
            "--state-dir",
            str(dir / "state"),
            "--data-dir",
            str(dir / "data"),
            "--boot-id-path",
            str(dir / "boot_id"),
            "--no-nvml",
            "--no-ascend",
        ]
        + args,
    )


def worker(i: int, host: Optional[str]) -> Node:
    """A worker as DLRover's pod watcher records it (dlrover/python/master/watcher/
    k8s_watcher.py, `_convert_pod_event_to_node_event`): `host_name` is the pod's
    spec.nodeName, unset while the pod is not placed."""
    n = Node(
        NodeType.WORKER,
        i,
        name=f"faultline-example-edljob-worker-{i}",
        status=NodeStatus.RUNNING if host else NodeStatus.PENDING,
        rank_index=i,
        host_name=host,
    )
    n.create_time = datetime.now()
    return n


def recipe_master_argv(namespace="dlrover", job="faultline-example") -> List[str]:
    """The job master's arguments as manifests/examples/elasticjob.yaml writes them (its
    dlrover-master container's command after `python -m dlrover.python.master.main`), with
    the `$(VAR)` references Kubernetes expands from the container's env."""
    lines = RECIPE.read_text().splitlines()
    at = next(i for i, l in enumerate(lines) if l.strip() == "- dlrover.python.master.main")
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())] + "- "
    start = at
    while lines[start - 1].startswith(indent):
        start -= 1
    items = []
    i = start
    while i < len(lines) and lines[i].startswith(indent):
        v = lines[i][len(indent):]
        # A double-quoted YAML scalar without escapes reads as a JSON string.
        items.append(json.loads(v) if v.startswith('"') else v)
        i += 1
    assert items[:3] == ["python", "-m", "dlrover.python.master.main"], items
    expand = {"$(JOB_NAMESPACE)": namespace, "$(JOB_NAME)": job}
    out = []
    for a in items[3:]:
        for k, v in expand.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def recipe_pre_check_ops() -> list:
    """The operators the recipe configures, parsed by DLRover's own master argument parser
    (dlrover/python/master/args.py, `parse_master_args`)."""
    return parse_master_args(recipe_master_argv()).pre_check_ops


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@dataclass
class Outcome:
    """How DLRover's pre-check ended."""

    status: str
    # The actions the operators' failures enqueued for the master, in order.
    actions: list = field(default_factory=list)
    # DLRover's log lines.
    log: List[str] = field(default_factory=list)

    def results(self, op: str) -> List[str]:
        """DLRover's `<op>(<index>) done checking, ..., result: ...` lines for operator `op`."""
        return [l for l in self.log if l.startswith(f"{op}(") and " done checking" in l]


def run_precheck(
    ops: list,
    nodes: List[Node],
    limit: float = 120.0,
    during=None,
    pre_check_timeout: Optional[int] = None,
) -> Outcome:
    """Runs DLRover's own pre-check loop as the job master does: `DistributedJobMaster.
    pre_check` calls `DiagnosisMaster.pre_check` (dlrover/python/master/dist_master.py), which
    loads the operators named in `Context.pre_check_operators` by module and class name
    (`Context.get_pre_check_operators`, dlrover/python/common/global_context.py), calls each
    one's `check(job_args=...)`, and on a failure enqueues its `failed_actions`, sleeps its
    `get_retry_interval_secs()` and starts again, until every operator passes or the job is
    stopped.

    The master's main loop takes those actions (`DistributedJobMaster._diagnose_job`): a
    `JobAbortionAction` stops the job, a `NodeAction` relaunches the node. A thread here takes
    them the same way (`JobContext.next_action` for the master's instance) and stops the job at
    the first failure's actions (all of them), which ends the pre-check; those actions are what
    the master would have done.
    `during(log)` is called by that thread every 0.1 s with DLRover's log lines so far (a test
    moves the job on with it).

    `pre_check_timeout` (seconds) replaces the length of DLRover's pre-check timeout, which
    its `timeout` decorator on `DiagnosisMaster.pre_check` fixes when the module is imported
    (900 + 600 s): the same decorator (dlrover/python/util/function_util.py, `timeout`: a
    SIGALRM raising `TimeoutException`) is applied again, with this length, to the undecorated
    method. When it fires, `TimeoutException` leaves this function as it leaves
    `DiagnosisMaster.pre_check` for `DistributedJobMaster.pre_check`, which marks the pre-check
    passed (that module needs protobuf, which the venv does not have, so it is not called here).
    """
    ctx = Context.singleton_instance()
    # dlrover/python/master/main.py, `run`: the parsed --pre_check_ops go into the context.
    ctx.pre_check_operators = ops
    job_ctx = get_job_context()
    job_ctx.clear_job_nodes()
    job_ctx.clear_actions()
    job_ctx.update_job_stage(JobStage.JOB_INIT)
    job_ctx.set_pre_check_status(PreCheckStatus.CHECKING)
    for n in nodes:
        job_ctx.update_job_node(n)
    actions: list = []
    done = threading.Event()
    started = time.monotonic()
    collect = _Collect()

    def master_loop():
        while not done.is_set():
            a = job_ctx.next_action(instance=DiagnosisConstant.MASTER_INSTANCE)
            if isinstance(a, (NodeAction, JobAbortionAction)):
                # The rest of what the same failure enqueued (one relaunch per node).
                time.sleep(0.2)
                while isinstance(a, (NodeAction, JobAbortionAction)):
                    actions.append(a)
                    a = job_ctx.next_action(instance=DiagnosisConstant.MASTER_INSTANCE)
                job_ctx.request_stop()
                return
            if time.monotonic() - started > limit:
                actions.append("timed out")
                job_ctx.request_stop()
                return
            if during:
                during(list(collect.lines))
            time.sleep(0.1)

    logger = logging.getLogger(DLROVER_LOGGER)
    logger.addHandler(collect)
    t = threading.Thread(target=master_loop, daemon=True)
    t.start()
    try:
        job_args = K8sJobArgs("pyk8s", "dlrover", "faultline-example")
        # What K8sJobArgs.initilize reads from the ElasticJob (distributionStrategy
        # AllreduceStrategy); the scheduling operator checks the workers of such a job.
        job_args.distribution_strategy = DistributionStrategy.ALLREDUCE
        master = DiagnosisMaster(job_args)
        if pre_check_timeout is None:
            master.pre_check()
        else:
            # `functools.wraps` in DLRover's decorator keeps the method it wrapped.
            undecorated = DiagnosisMaster.pre_check.__wrapped__
            timeout(secs=pre_check_timeout)(undecorated)(master)
    finally:
        done.set()
        t.join()
        logger.removeHandler(collect)
    return Outcome(job_ctx.get_pre_check_status(), actions, collect.lines)


class FakeCli:
    """tests/fake_faultline.py as the operator's `FAULTLINE_BIN`, answering `hosts` and `check`
    as `scenario` says (that file's docstring); `calls()` are the argument lists it was run
    with."""

    def __init__(self, tmp: Path, scenario: dict):
        tmp.mkdir(parents=True, exist_ok=True)
        self.bin = tmp / "faultline"
        self.bin.write_text(
            "#!/bin/sh\n"
            f'exec "{sys.executable}" "{Path(__file__).with_name("fake_faultline.py")}" "$@"\n'
        )
        self.bin.chmod(0o755)
        self.scenario = tmp / "scenario.json"
        self.scenario.write_text(json.dumps(scenario))
        self.calls_file = tmp / "calls"
        self.calls_file.write_text("")
        self.pids = tmp / "pids"

    def env(self) -> Dict[str, str]:
        return {
            "FAULTLINE_BIN": str(self.bin),
            "FAULTLINE_FAKE_SCENARIO": str(self.scenario),
            "FAULTLINE_FAKE_CALLS": str(self.calls_file),
            "FAULTLINE_FAKE_PIDS": str(self.pids),
        }

    def calls(self) -> List[List[str]]:
        return [json.loads(l) for l in self.calls_file.read_text().splitlines()]
