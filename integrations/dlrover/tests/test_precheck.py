"""faultline's pre-check operator run by DLRover's own job-master code (dlrover 0.6.1) against
faultline's real programs.

Every test goes through DLRover's path: the operators come from the recipe's `--pre_check_ops`
parsed by `dlrover.python.master.args.parse_master_args`, DLRover loads them by name
(`Context.get_pre_check_operators`) and runs them in `DiagnosisMaster.pre_check`, which calls
`check`, reads `PreCheckResult.is_success`, and on failure enqueues `failed_actions` for the
master (harness.run_precheck). The operator asks the real `faultline` CLI; the records it reads
are written by real agents, into the Kubernetes API emulator or served by agents without
Kubernetes, and the peer checks are run by a real coordinator and probes.

Run (integrations/dlrover/README.md):
  FAULTLINE_BIN=target/debug/faultline python3 -m unittest discover -s integrations/dlrover/tests
(with dlrover[k8s]==0.6.1 installed; .ci/run makes the venv).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
from harness import wait_until, worker  # noqa: E402

from dlrover.python.common.constants import NodeType, PreCheckStatus  # noqa: E402
from dlrover.python.diagnosis.common.constants import (  # noqa: E402
    DiagnosisActionType,
    DiagnosisConstant,
)
from dlrover.python.diagnosis.common.diagnosis_action import (  # noqa: E402
    JobAbortionAction,
    NodeAction,
)
from dlrover.python.master.node.job_context import get_job_context  # noqa: E402
from dlrover.python.util.function_util import TimeoutException  # noqa: E402

from faultline_dlrover import precheck  # noqa: E402

OP = "FaultlinePreCheckOperator"


def only_faultline():
    """The recipe's faultline operator alone (DLRover's scheduling check would wait for an
    unplaced pod itself, and has nothing to say about the rest)."""
    return [o for o in harness.recipe_pre_check_ops() if o[1] == OP]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def kill_survivors(pids_file: Path):
    """SIGKILL to the stand-in CLI's processes still running after a failed test (each by the
    pid it wrote), so that they do not outlive the test run."""
    if pids_file.exists():
        for pid in map(int, pids_file.read_text().split()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


class Recipe(unittest.TestCase):
    """What the ElasticJob recipe gives DLRover's master."""

    def test_the_master_loads_faultline_after_dlrovers_scheduling_check_unbypassed(self):
        ops = harness.recipe_pre_check_ops()
        self.assertEqual(
            ops,
            [
                (
                    "dlrover.python.master.diagnosis.precheck_operator",
                    "SchedulingPreCheckOperator",
                    False,
                ),
                ("faultline_dlrover.precheck", OP, False),
            ],
        )
        from dlrover.python.common.global_context import Context

        ctx = Context.singleton_instance()
        with mock.patch.object(ctx, "pre_check_operators", ops):
            loaded = ctx.get_pre_check_operators()
            self.assertEqual(
                [type(o).__name__ for o in loaded], ["SchedulingPreCheckOperator", OP]
            )
            # DLRover matches the bypass flag by the operator's own module: a failure of
            # faultline's check is acted on, not ignored.
            self.assertFalse(ctx.is_pre_check_operator_bypass(loaded[1]))

    def test_the_master_gets_a_cli_that_runs_outside_the_faultline_image(self):
        """The master's faultline-cli init container, run as written in a root built like the
        image's (manifests/build-image.sh: the binary, the libraries ldd names, busybox as sh),
        leaves a `faultline` wrapper that runs from another root: here the test's own."""
        if os.geteuid() != 0 or not Path("/bin/busybox").is_file():
            if os.environ.get("CI"):
                self.fail("this test needs root (chroot) and /bin/busybox (busybox-static)")
            self.skipTest("needs root and /bin/busybox")
        bins = harness.binaries()
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "image"
            (root / "usr/local/bin").mkdir(parents=True)
            shutil.copy(bins["agent"], root / "usr/local/bin/faultline-agent")
            ldd = subprocess.run(["ldd", str(bins["agent"])], capture_output=True, text=True)
            for line in ldd.stdout.splitlines():
                parts = line.split()
                path = parts[2] if len(parts) > 2 and parts[1] == "=>" else parts[0]
                if path.startswith("/"):
                    dest = root / path.lstrip("/")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, dest)
            (root / "bin").mkdir()
            shutil.copy("/bin/busybox", root / "bin/busybox")
            for applet in ("sh", "cat", "mv", "sleep"):
                (root / "bin" / applet).symlink_to("busybox")
            (root / "opt/faultline").mkdir(parents=True)
            script = init_script("faultline-cli")
            run = subprocess.run(
                [shutil.which("chroot") or "chroot", str(root), "/bin/sh", "-c", script],
                capture_output=True,
                text=True,
                env={"PATH": "/usr/local/bin:/bin"},  # the image's (manifests/Dockerfile)
            )
            self.assertEqual(run.returncode, 0, run.stderr)
            wrapper = root / "opt/faultline/bin/faultline"
            out = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True)
            self.assertEqual(
                (out.returncode, out.stdout.strip()), (0, "faultline 0.1.0"), out.stderr
            )
            # And as the operator calls it: a command's JSON answer.
            out = subprocess.run(
                [str(wrapper), "get", "--file", "/nonexistent", "-o", "json"],
                capture_output=True,
                text=True,
            )
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn('"exitCode":2', out.stdout)


def init_script(container: str) -> str:
    """The `sh -c` script of the recipe's init container `container`, as the shell gets it."""
    lines = harness.RECIPE.read_text().splitlines()
    at = next(i for i, l in enumerate(lines) if l.strip() == f"- name: {container}")
    start = next(i for i in range(at, len(lines)) if lines[i].strip() == "- |") + 1
    indent = len(lines[start]) - len(lines[start].lstrip())
    out = []
    for l in lines[start:]:
        if l.strip() and len(l) - len(l.lstrip()) < indent:
            break
        out.append(l[indent:])
    return "\n".join(out) + "\n"


class OnKubernetes(unittest.TestCase):
    """Records published by real agents into the API emulator: gpu-a and gpu-d Healthy, gpu-b
    Unhealthy (an Xid 79 in its kernel log), gpu-c Healthy but its agent dead (killed; its pod
    not Ready) while its ConfigMap still says Healthy. No peer-check coordinator runs:
    `faultline check` exits 2."""

    @classmethod
    def setUpClass(cls):
        cls.bins = harness.binaries()
        cls.tmp = Path(tempfile.mkdtemp(prefix="faultline-dlrover-"))
        cls.procs = harness.Processes(cls.tmp)
        try:
            cls.emu = harness.Emulator(cls.procs, cls.bins["kube-emulator"], cls.tmp)
            agents = {}
            kmsgs = {"gpu-a": "", "gpu-b": harness.XID79, "gpu-c": "", "gpu-d": ""}
            for node, kmsg in kmsgs.items():
                cls.emu.gpu_node(node)
                cls.emu.agent_pod(node, ready=True)
                agents[node] = harness.start_agent(
                    cls.procs,
                    cls.bins["agent"],
                    cls.tmp / node,
                    node,
                    ["--kubeconfig", str(cls.emu.kubeconfig), "--settle", "0s"]
                    + ["--listen", "127.0.0.1:0"],
                    kmsg,
                )
            for node, kmsg in kmsgs.items():
                health = "Unhealthy" if kmsg else "Healthy"
                wait_until(
                    f"{node}'s record ({health})",
                    60,
                    lambda: (cls.emu.record(node) or {}).get("health") == health,
                )
            # gpu-c's agent dies; the kubelet marks its pod not Ready; its record stays.
            agents["gpu-c"].send_signal(signal.SIGKILL)
            agents["gpu-c"].wait()
            cls.emu.agent_pod("gpu-c", ready=False)
            cls.secret = cls.tmp / "requester-secret"
            cls.secret.write_text("0123456789abcdef0123456789abcdef\n")
        except BaseException:
            cls.procs.stop_all()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def env(self, **extra):
        e = {
            "FAULTLINE_BIN": str(self.bins["cli"]),
            "FAULTLINE_KUBECONFIG": str(self.emu.kubeconfig),
            "FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(self.secret),
            "FAULTLINE_DLROVER_CHECK_TIMEOUT": "3",
            "FAULTLINE_DLROVER_RETRY_SECONDS": "1",
        }
        e.update(extra)
        return mock.patch.dict(os.environ, e)

    def test_usable_nodes_pass_and_without_a_coordinator_the_job_starts(self):
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(),
                [worker(0, "gpu-a"), worker(1, "gpu-d"), worker(2, "gpu-d")],
            )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        self.assertEqual(out.actions, [])
        (result,) = out.results(OP)
        self.assertIn("result=0", result)
        self.assertIn("usable: gpu-a, gpu-d", result)
        # The peer check was asked for and could not run (no coordinator Lease: said at once,
        # not at its --timeout): no verdict, the job starts.
        self.assertIn(
            "no peer check (no peer check can run: there is no coordinator Lease "
            "faultline-system/faultline-peercheck",
            result,
        )

    def test_an_unhealthy_node_fails_the_check_and_its_worker_is_relaunched(self):
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-a"), worker(1, "gpu-b")]
            )
        self.assertNotEqual(out.status, PreCheckStatus.PASS)
        (action,) = out.actions
        self.assertIsInstance(action, NodeAction)
        self.assertEqual((action.node_type, action.node_id), (NodeType.WORKER, 1))
        self.assertEqual(action.action_type, DiagnosisActionType.MASTER_RELAUNCH_WORKER)
        self.assertEqual(action.instance, DiagnosisConstant.MASTER_INSTANCE)
        result = out.results(OP)[0]
        self.assertIn("result=1", result)
        self.assertIn(
            "FAULTLINE_NODE_UNUSABLE: gpu-b: the record says Unhealthy (SeparateNPU)", result
        )
        self.assertNotIn("gpu-a:", result)

    def test_a_dead_agents_record_is_refused(self):
        # The record itself still says Healthy: only the agent's liveness refuses it.
        self.assertEqual(self.emu.record("gpu-c")["health"], "Healthy")
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-a"), worker(1, "gpu-c")]
            )
        (action,) = out.actions
        self.assertIsInstance(action, NodeAction)
        self.assertEqual(action.node_id, 1)
        self.assertIn("gpu-c: its faultline agent pod is not Ready", out.results(OP)[0])

    def test_abort_instead_of_relaunch(self):
        with self.env(FAULTLINE_DLROVER_ON_FAILURE="abort"):
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-b"), worker(1, "gpu-c")]
            )
        (action,) = out.actions
        self.assertIsInstance(action, JobAbortionAction)
        self.assertEqual(action.reason, "FAULTLINE_NODE_UNUSABLE")
        self.assertIn("gpu-b: the record says Unhealthy", action.msg)
        self.assertIn("gpu-c: its faultline agent pod is not Ready", action.msg)

    def test_nodes_not_placed_yet_are_waited_for(self):
        # Only faultline's operator (DLRover's scheduling check would wait for the pod itself).
        ops = [o for o in harness.recipe_pre_check_ops() if o[1] == OP]
        placed = []

        def place(log):
            # Once the operator has said it waits, the pod is scheduled onto gpu-a.
            if not placed and any("FAULTLINE_NODES_NOT_PLACED" in l for l in log):
                get_job_context().update_job_node(worker(1, "gpu-a"))
                placed.append(True)

        with self.env():
            out = harness.run_precheck(ops, [worker(0, "gpu-a"), worker(1, None)], during=place)
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        self.assertEqual(out.actions, [])
        first, *rest = out.results(OP)
        self.assertIn("result=3", first)
        self.assertIn("not on a node yet: faultline-example-edljob-worker-1", first)
        self.assertIn("result=0", rest[-1])

    def test_records_that_cannot_be_read_are_no_verdict(self):
        # A namespace without records: `faultline hosts` exits 2, as without the right to list.
        with self.env(FAULTLINE_DLROVER_NAMESPACE="nowhere"):
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-b")]
            )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        self.assertIn(
            "records not read (no fault records in namespace nowhere", out.results(OP)[0]
        )


    def test_a_job_node_without_any_record_is_refused(self):
        # gpu-z has no Node, no agent pod and no fault ConfigMap: `hosts` does not mention it.
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-a"), worker(1, "gpu-z")]
            )
        (action,) = out.actions
        self.assertIsInstance(action, NodeAction)
        self.assertEqual(action.node_id, 1)
        result = out.results(OP)[0]
        self.assertIn("result=1", result)
        self.assertIn(
            "FAULTLINE_NODE_UNUSABLE: gpu-z: no fault record for the node (no faultline agent?)",
            result,
        )

    # Each invalid setting: the variable, its value, and what the message must say it accepts.
    INVALID = [
        ("FAULTLINE_DLROVER_ON_FAILURE", "kill", "relaunch or abort"),
        ("FAULTLINE_DLROVER_CHECK_TIMEOUT", "5m", "a whole number of seconds, 1 to 3600"),
        # The CLI refuses a --timeout this long with exit 2, which was read as no verdict.
        (
            "FAULTLINE_DLROVER_CHECK_TIMEOUT",
            "99999999999999999999",
            "a whole number of seconds, 1 to 3600",
        ),
        ("FAULTLINE_DLROVER_RETRY_SECONDS", "x", "a whole number of seconds, 1 to 600"),
        # Past DLRover's pre-check timeout (which passes the job), and past what its
        # `time.sleep` takes (OverflowError, which it counted as a pass).
        ("FAULTLINE_DLROVER_RETRY_SECONDS", "601", "a whole number of seconds, 1 to 600"),
        ("FAULTLINE_DLROVER_RETRY_SECONDS", "10000000000", "a whole number of seconds, 1 to 600"),
        ("FAULTLINE_DLROVER_HOSTS_TIMEOUT", "0", "a whole number of seconds, 1 to 3600"),
        ("FAULTLINE_DLROVER_HOSTS_TIMEOUT", "3601", "a whole number of seconds, 1 to 3600"),
        (
            "FAULTLINE_DLROVER_ACCEPT",
            "restart",
            "healthy, degraded, or a handling level (NotHandleFault, SubHealthFault,",
        ),
        ("FAULTLINE_DLROVER_PEER_CHECK", "enabled", "on or off"),
        (
            "FAULTLINE_DLROVER_NODE_TYPES",
            "Worker",
            "DLRover node types, comma separated, each one of worker, ps, chief, master, "
            "evaluator (lower case)",
        ),
        ("FAULTLINE_DLROVER_NAMESPACE", "Faultline_System", "a Kubernetes namespace name"),
        ("FAULTLINE_DLROVER_MEMBERS", "/nonexistent/members", "no readable file there"),
        ("FAULTLINE_DLROVER_AGENT_PORT", "20260", "set without FAULTLINE_DLROVER_MEMBERS"),
        ("FAULTLINE_BIN", "/nonexistent/faultline", "no executable file there"),
    ]

    def test_an_invalid_setting_fails_the_check_and_aborts_the_job(self):
        """Every one of these passed the job before: an exception from `check` (which DLRover
        counts as a pass), a CLI refusing its flags (no verdict), a peer check switched off, a
        node type matching nothing, no CLI at all."""
        for var, value, accepted in self.INVALID:
            with self.subTest(var=var, value=value), self.env(**{var: value}):
                out = harness.run_precheck(
                    harness.recipe_pre_check_ops(), [worker(0, "gpu-a"), worker(1, "gpu-d")]
                )
                self.assertNotEqual(out.status, PreCheckStatus.PASS, out.log)
                (action,) = out.actions
                self.assertIsInstance(action, JobAbortionAction)
                self.assertEqual(action.reason, "FAULTLINE_CONFIG_INVALID")
                self.assertIn(f"{var}={value!r}: {accepted}", action.msg)
                self.assertIn("result=4", out.results(OP)[0])

    def test_every_invalid_setting_is_named_at_once(self):
        with self.env(FAULTLINE_DLROVER_ON_FAILURE="Abort!", FAULTLINE_DLROVER_PEER_CHECK="y"):
            out = harness.run_precheck(only_faultline(), [worker(0, "gpu-a")])
        (action,) = out.actions
        self.assertIn("FAULTLINE_DLROVER_ON_FAILURE='Abort!'", action.msg)
        self.assertIn("FAULTLINE_DLROVER_PEER_CHECK='y'", action.msg)

    def test_node_types_matching_none_of_the_jobs_nodes_are_a_configuration_error(self):
        # A valid DLRover type the job has no node of: nothing would be checked.
        with self.env(FAULTLINE_DLROVER_NODE_TYPES="chief"):
            out = harness.run_precheck(only_faultline(), [worker(0, "gpu-a")])
        (action,) = out.actions
        self.assertIsInstance(action, JobAbortionAction)
        self.assertEqual(action.reason, "FAULTLINE_CONFIG_INVALID")
        self.assertIn(
            "FAULTLINE_DLROVER_NODE_TYPES='chief': the job has no node of that type; its "
            "nodes are worker",
            action.msg,
        )

    def test_valid_settings_other_than_the_defaults_are_taken(self):
        # A handling level in any case (the CLI's own rule), a switch word, two node types.
        with self.env(
            FAULTLINE_DLROVER_ACCEPT="restartbusiness",
            FAULTLINE_DLROVER_PEER_CHECK="OFF",
            FAULTLINE_DLROVER_NODE_TYPES="worker, ps",
            FAULTLINE_DLROVER_ON_FAILURE="Abort",
            FAULTLINE_DLROVER_RETRY_SECONDS="600",
            FAULTLINE_DLROVER_CHECK_TIMEOUT="3600",
        ):
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "gpu-a"), worker(1, "gpu-d")]
            )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        (result,) = out.results(OP)
        self.assertIn("usable: gpu-a, gpu-d; peer check off", result)

    def test_the_operators_handling_levels_are_the_clis(self):
        out = subprocess.run(
            [str(self.bins["cli"]), "hosts", "-o", "json", "--max-handling", "none-such"],
            capture_output=True,
            text=True,
        )
        error = json.loads(out.stdout)["error"]
        listed = re.search(r"one of (.*)$", error).group(1).split(", ")
        self.assertEqual(tuple(listed), precheck.HANDLING_LEVELS)

    def test_a_cli_that_is_not_a_program_fails_closed(self):
        # The file exists and is executable, but exec refuses it (no interpreter line).
        not_a_program = self.tmp / "not-a-program"
        not_a_program.write_bytes(b"\x00\x01\x02 not an executable\n")
        not_a_program.chmod(0o755)
        with self.env(FAULTLINE_BIN=str(not_a_program)):
            out = harness.run_precheck(only_faultline(), [worker(0, "gpu-a")])
        (action,) = out.actions
        self.assertIsInstance(action, JobAbortionAction)
        self.assertEqual(action.reason, "FAULTLINE_CONFIG_INVALID")
        self.assertIn(f"FAULTLINE_BIN={str(not_a_program)!r}: cannot run", action.msg)
        self.assertIn("Exec format error", action.msg)


class WithoutKubernetes(unittest.TestCase):
    """Peer checks without Kubernetes: a coordinator from a members file at 127.0.0.9, agents
    n1, n2, n3 at 127.0.0.1-3 with their node keys; n3's probe cannot run, so a check with it
    finds it faulty. Records come from each agent (`faultline hosts --members`)."""

    NODES = ("n1", "n2", "n3")

    @classmethod
    def setUpClass(cls):
        cls.bins = harness.binaries()
        cls.tmp = Path(tempfile.mkdtemp(prefix="faultline-dlrover-bm-"))
        cls.procs = harness.Processes(cls.tmp)
        try:
            cls._start()
        except BaseException:
            cls.procs.stop_all()
            raise

    @classmethod
    def _start(cls):
        t, cli = cls.tmp, str(cls.bins["cli"])
        ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

        def keys(*args):
            out = subprocess.run([cli, "keys", *args], capture_output=True, text=True, check=True)
            return out.stdout.strip()

        public = keys("coordinator", "--out", str(t / "coordinator.key"))
        keys("master", "--out", str(t / "master"))
        cls.http_port = harness.free_port(ips)
        peer_port = harness.free_port(ips)
        probe_base = harness.free_range(ips, 32)
        (t / "members").write_text(
            "".join(f"{n} {ip}:{peer_port}\n" for n, ip in zip(cls.NODES, ips))
        )
        policy = t / "policy.yaml"
        policy.write_text(
            "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n"
        )
        cls.secret = t / "requester-secret"
        cls.secret.write_text("bare-metal-requester-secret-0123456789\n")
        coord_port = harness.free_port(["127.0.0.9"])
        cls.coordinator = f"127.0.0.9:{coord_port}"
        cls.procs.start(
            "coordinator",
            [
                str(cls.bins["coordinator"]),
                "--name", "coordinator",
                "--members", str(t / "members"),
                "--key-file", str(t / "coordinator.key"),
                "--node-key-master-file", str(t / "master"),
                "--requester-secret-file", str(cls.secret),
                "--policy", str(policy),
                "--state-dir", str(t / "coordinator"),
                "--peer-listen", cls.coordinator,
                "--listen", "127.0.0.1:0",
                "--probe-port-base", str(probe_base),
            ],
        )
        for n, ip in zip(cls.NODES, ips):
            keys("node", "--master", str(t / "master"), "--node", n, "--out", str(t / f"{n}.key"))
            probe = "/nonexistent/faultline-probe" if n == "n3" else str(cls.bins["probe"])
            harness.start_agent(
                cls.procs,
                cls.bins["agent"],
                t / n,
                n,
                [
                    "--policy", str(policy),
                    "--listen", f"{ip}:{cls.http_port}",
                    "--peer-node-key-file", str(t / f"{n}.key"),
                    "--peer-coordinator-key", public,
                    "--peer-listen", f"{ip}:{peer_port}",
                    "--probe-bin", probe,
                    "--probe-port-base", str(probe_base),
                ],
            )
        wait_until("the coordinator", 30, lambda: harness.listening("127.0.0.9", coord_port))
        for n, ip in zip(cls.NODES, ips):
            wait_until(f"{n}'s record", 30, lambda: (t / n / "state" / "faults.json").exists())
            wait_until(f"{n}'s peer port", 30, lambda: harness.listening(ip, peer_port))

    @classmethod
    def tearDownClass(cls):
        cls.procs.stop_all()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def env(self, **extra):
        e = {
            "FAULTLINE_BIN": str(self.bins["cli"]),
            "FAULTLINE_DLROVER_MEMBERS": str(self.tmp / "members"),
            "FAULTLINE_DLROVER_AGENT_PORT": str(self.http_port),
            "FAULTLINE_COORDINATOR": self.coordinator,
            "FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(self.secret),
            "FAULTLINE_DLROVER_CHECK_TIMEOUT": "60",
            "FAULTLINE_DLROVER_RETRY_SECONDS": "1",
        }
        e.update(extra)
        return mock.patch.dict(os.environ, e)

    def members_file(self, name: str, lines: str) -> str:
        """Another members file for `hosts` (the coordinator keeps its own)."""
        path = self.tmp / name
        path.write_text(lines)
        return str(path)

    def test_a_passing_peer_check_passes(self):
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(),
                [worker(0, "n1"), worker(1, "n2"), worker(2, "n2")],
            )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        (result,) = out.results(OP)
        self.assertIn("usable: n1, n2", result)
        self.assertRegex(result, r"peer check run \S+: nothing found")

    def test_a_node_the_peer_check_names_is_relaunched(self):
        with self.env():
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(),
                [worker(0, "n1"), worker(1, "n2"), worker(2, "n3")],
            )
        self.assertNotEqual(out.status, PreCheckStatus.PASS)
        (action,) = out.actions
        self.assertIsInstance(action, NodeAction)
        self.assertEqual((action.node_type, action.node_id), (NodeType.WORKER, 2))
        self.assertEqual(action.action_type, DiagnosisActionType.MASTER_RELAUNCH_WORKER)
        result = out.results(OP)[0]
        self.assertIn("result=2", result)
        self.assertRegex(result, r"FAULTLINE_PEER_CHECK_FAILED: run \S+: faulty_node n3 ")


    def test_nodes_a_peer_check_cannot_judge_do_not_hold_the_job(self):
        # n1 and n3 alone: n3's probe cannot run, and with no third node to compare with
        # neither can be judged (`check` exits 3). A peer check that found n3 faulty leaves its
        # record Degraded with PreSeparateNPU: accepted here, so that only the check decides.
        with self.env(FAULTLINE_DLROVER_ACCEPT="PreSeparateNPU"):
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "n1"), worker(1, "n3")]
            )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        self.assertEqual(out.actions, [])
        (result,) = out.results(OP)
        self.assertIn("usable: n1, n3", result)
        self.assertRegex(
            result,
            r"peer check run \S+: not judged: unknown n1: no node passed a check to compare "
            r"with .*; unknown n3: ",
        )

    def test_one_silent_agent_refuses_its_node(self):
        # n4's address has no agent; n1's and n2's answer.
        members = self.members_file(
            "members-n4",
            (self.tmp / "members").read_text() + f"n4 127.0.0.4:{self.http_port}\n",
        )
        with self.env(FAULTLINE_DLROVER_MEMBERS=members):
            out = harness.run_precheck(
                harness.recipe_pre_check_ops(), [worker(0, "n1"), worker(1, "n4")]
            )
        (action,) = out.actions
        self.assertIsInstance(action, NodeAction)
        self.assertEqual(action.node_id, 1)
        self.assertIn(
            f"FAULTLINE_NODE_UNUSABLE: n4: its agent at 127.0.0.4:{self.http_port}: ",
            out.results(OP)[0],
        )

    def test_no_agent_answering_fails_closed_and_aborts_the_job(self):
        """`hosts --members` exits 2 when no member's agent answers; that passed the job as
        "records not read" before. A wrong port, and a members file of the job's nodes whose
        agents are all silent (none listens at 127.0.0.5 and .6)."""
        port = harness.free_port(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
        silent = self.members_file(
            "members-silent", f"n1 127.0.0.5:{port}\nn2 127.0.0.6:{port}\n"
        )
        for name, extra in [
            ("wrong port", {"FAULTLINE_DLROVER_AGENT_PORT": str(port)}),
            ("silent agents", {"FAULTLINE_DLROVER_MEMBERS": silent}),
        ]:
            with self.subTest(name), self.env(**extra):
                out = harness.run_precheck(
                    harness.recipe_pre_check_ops(), [worker(0, "n1"), worker(1, "n2")]
                )
                self.assertNotEqual(out.status, PreCheckStatus.PASS, out.log)
                (action,) = out.actions
                self.assertIsInstance(action, JobAbortionAction)
                self.assertEqual(action.reason, "FAULTLINE_NO_AGENT_ANSWERS")
                self.assertIn("no member's agent answered on port", action.msg)
                self.assertIn("result=5", out.results(OP)[0])

    def test_the_peer_checks_own_settings_are_required(self):
        """Without Kubernetes the CLI cannot find a coordinator or a secret by itself; it said
        so with exit 2, which passed the job as "no peer check" (its own answer to an
        infrastructure it cannot reach)."""
        for name, extra, said in [
            (
                "no coordinator",
                {"FAULTLINE_COORDINATOR": ""},
                "FAULTLINE_COORDINATOR unset: with FAULTLINE_DLROVER_MEMBERS (no Kubernetes) "
                "the peer check needs the coordinator's address",
            ),
            (
                "no secret",
                {"FAULTLINE_PEER_REQUESTER_SECRET_FILE": "/nonexistent/requester-secret"},
                "FAULTLINE_PEER_REQUESTER_SECRET_FILE='/nonexistent/requester-secret': no "
                "readable file there",
            ),
        ]:
            with self.subTest(name), self.env(**extra):
                out = harness.run_precheck(
                    harness.recipe_pre_check_ops(), [worker(0, "n1"), worker(1, "n2")]
                )
                self.assertNotEqual(out.status, PreCheckStatus.PASS, out.log)
                (action,) = out.actions
                self.assertIsInstance(action, JobAbortionAction)
                self.assertEqual(action.reason, "FAULTLINE_CONFIG_INVALID")
                self.assertIn(said, action.msg)
                self.assertIn("result=4", out.results(OP)[0])

class StubbedCli(unittest.TestCase):
    """The operator's reading of answers the real programs on loopback cannot be made to give
    (link and straggler verdicts, a verdict kind the CLI has no name for, a hang): the CLI is
    tests/fake_faultline.py (harness.FakeCli); DLRover's side is as everywhere else. Every
    node is usable by `hosts` unless a test says otherwise."""

    HOSTS = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="faultline-dlrover-stub-"))

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fake(self, check=None, hosts=None) -> harness.FakeCli:
        hosts = hosts or {
            "code": 0,
            "doc": {"hosts": [{"host": h, "slots": 8} for h in self.HOSTS], "leftOut": []},
        }
        scenario = {"hosts": hosts}
        if check is not None:
            scenario["check"] = check
        return harness.FakeCli(self.tmp, scenario)

    @staticmethod
    def failed(*verdicts):
        """`faultline check`'s exit 1 with these verdicts."""
        return {"code": 1, "doc": {"run_id": "r1", "rounds": 2, "verdicts": list(verdicts)}}

    def run_with(self, cli: harness.FakeCli, nodes, **extra):
        env = {
            **cli.env(),
            "FAULTLINE_DLROVER_CHECK_TIMEOUT": "3",
            "FAULTLINE_DLROVER_RETRY_SECONDS": "1",
            **extra,
        }
        with mock.patch.dict(os.environ, env):
            return harness.run_precheck(only_faultline(), nodes, limit=20)

    def workers(self, n):
        return [worker(i, self.HOSTS[i]) for i in range(n)]

    def mode_env(self, mode: str) -> dict:
        """The operator's settings for `mode`: `kubernetes` (the defaults), or `members`: a
        members file, the coordinator's address and the requesters' secret (the CLI here is
        the stand-in: nothing listens there)."""
        if mode == "kubernetes":
            return {}
        members = self.tmp / "members"
        members.write_text("".join(f"{h} 127.0.0.1:1\n" for h in self.HOSTS))
        secret = self.tmp / "requester-secret"
        secret.write_text("0123456789abcdef0123456789abcdef\n")
        return {
            "FAULTLINE_DLROVER_MEMBERS": str(members),
            "FAULTLINE_COORDINATOR": "127.0.0.1:1",
            "FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(secret),
        }

    def assert_aborted_as_config(self, out, said: str):
        self.assertNotEqual(out.status, PreCheckStatus.PASS, out.log)
        (action,) = out.actions
        self.assertIsInstance(action, JobAbortionAction)
        self.assertEqual(action.reason, "FAULTLINE_CONFIG_INVALID")
        self.assertIn(said, action.msg)
        self.assertIn("result=4", out.results(OP)[0])

    def relaunched(self, out):
        self.assertTrue(out.actions, out.log)
        for a in out.actions:
            self.assertIsInstance(a, NodeAction)
            self.assertEqual(a.action_type, DiagnosisActionType.MASTER_RELAUNCH_WORKER)
        return sorted(a.node_id for a in out.actions)

    def test_settings_reach_the_cli_as_its_flags(self):
        cli = self.fake(check={"code": 0, "doc": {"run_id": "r1", "rounds": 1, "verdicts": []}})
        out = self.run_with(
            cli,
            self.workers(2),
            FAULTLINE_DLROVER_ACCEPT="restartnpu",
            FAULTLINE_DLROVER_CHECK_TIMEOUT="7",
            FAULTLINE_DLROVER_NAMESPACE="ns1",
        )
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        self.assertEqual(
            cli.calls(),
            [
                ["hosts", "-o", "json", "--max-handling", "RestartNPU", "--namespace", "ns1"],
                ["check", "--nodes", "gpu-a,gpu-b", "--timeout", "7s", "--namespace", "ns1",
                 "-o", "json"],
            ],
        )

    def test_a_broken_link_relaunches_both_its_nodes(self):
        cli = self.fake(check=self.failed({"kind": "broken_link", "nodes": ["gpu-a", "gpu-b"]}))
        out = self.run_with(cli, self.workers(3))
        self.assertEqual(self.relaunched(out), [0, 1])
        self.assertIn(
            "FAULTLINE_PEER_CHECK_FAILED: run r1: broken_link gpu-a<->gpu-b (", out.results(OP)[0]
        )

    def test_a_degraded_link_and_a_straggler_relaunch_the_nodes_they_name(self):
        cli = self.fake(
            check=self.failed(
                {"kind": "degraded_link", "nodes": ["gpu-b", "gpu-c"], "slowdown": 2.5},
                {"kind": "straggler", "nodes": ["gpu-d"], "slowdown": 4.0},
                {"kind": "unknown", "nodes": ["gpu-a"], "reason": "accelerators busy"},
            )
        )
        out = self.run_with(cli, self.workers(4))
        # gpu-a was not judged, which names nothing.
        self.assertEqual(self.relaunched(out), [1, 2, 3])
        self.assertIn(
            "run r1: degraded_link gpu-b<->gpu-c (2.50x); straggler gpu-d (4.00x); "
            "unknown gpu-a: accelerators busy (",
            out.results(OP)[0],
        )

    def test_a_verdict_of_a_kind_the_cli_cannot_name_is_a_finding(self):
        # `unspecified`: the CLI exits 1 for it; before, the operator ignored it.
        cli = self.fake(check=self.failed({"kind": "unspecified", "nodes": ["gpu-b"]}))
        out = self.run_with(cli, self.workers(2))
        self.assertEqual(self.relaunched(out), [1])

    def test_a_failed_peer_check_naming_no_job_node_aborts_the_job(self):
        """Before, the check failed with no abnormal node and `NoAction`, every retry
        interval, until DLRover's pre-check timeout passed the job."""
        for name, verdict, text in [
            ("no node", {"kind": "unspecified", "nodes": []}, "unspecified (no node)"),
            ("not the job's", {"kind": "faulty_node", "nodes": ["gpu-z"]}, "faulty_node gpu-z"),
        ]:
            for mode in ("relaunch", "abort"):
                with self.subTest(name, mode=mode):
                    cli = self.fake(check=self.failed(verdict))
                    out = self.run_with(
                        cli, self.workers(2), FAULTLINE_DLROVER_ON_FAILURE=mode
                    )
                    (action,) = out.actions
                    self.assertIsInstance(action, JobAbortionAction)
                    self.assertEqual(action.reason, "FAULTLINE_PEER_CHECK_FAILED")
                    self.assertEqual(
                        action.msg,
                        "FAULTLINE_PEER_CHECK_FAILED: run r1: it failed and names no node of "
                        f"the job (gpu-a, gpu-b): {text}",
                    )
                    self.assertIn("result=2", out.results(OP)[0])

    def test_a_hanging_cli_is_killed_with_its_children_and_is_no_verdict(self):
        cli = self.fake(
            hosts={"hang": True},
            check={"code": 0, "doc": {"run_id": "r1", "rounds": 1, "verdicts": []}},
        )
        out = self.run_with(cli, self.workers(2), FAULTLINE_DLROVER_HOSTS_TIMEOUT="2")
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
        (result,) = out.results(OP)
        self.assertIn(
            "records not read (faultline hosts did not answer within 2 s (killed)); "
            "peer check run r1: nothing found",
            result,
        )
        pids = [int(p) for p in cli.pids.read_text().split()]
        self.assertEqual(len(pids), 2)
        for pid in pids:
            wait_until(f"process {pid} killed", 5, lambda: not alive(pid))

    def test_a_cli_that_cannot_run_through_its_wrapper_fails_closed(self):
        """The recipe's wrapper (manifests/examples/elasticjob.yaml) execs the image's loader:
        missing, sh exits 127; not executable, 126. Both passed the job ("cannot answer"),
        and with a members file were called "no agent answers"."""
        loader = self.tmp / "ld-linux-x86-64.so.2"
        loader.write_text("not executable\n")
        loader.chmod(0o644)
        for code, path in [(127, self.tmp / "missing" / loader.name), (126, loader)]:
            wrapper = self.tmp / f"faultline-{code}"
            wrapper.write_text(
                f'#!/bin/sh\nexec "{path}" --argv0 faultline /x/faultline-agent "$@"\n'
            )
            wrapper.chmod(0o755)
            for mode in ("kubernetes", "members"):
                with self.subTest(exit=code, mode=mode):
                    out = self.run_with(
                        self.fake(),
                        self.workers(2),
                        **self.mode_env(mode),
                        FAULTLINE_BIN=str(wrapper),
                    )
                    self.assert_aborted_as_config(
                        out,
                        f"FAULTLINE_BIN={str(wrapper)!r}: faultline hosts could not run "
                        f"(exit {code}, no JSON answer: ",
                    )

    # What a CLI that runs but does not answer prints, and how the message describes it.
    CRASHES = [
        (
            "a panic after junk",
            {
                "code": 101,
                "stdout": "junk {\n",
                "stderr": "thread 'main' panicked at agent/src/cli/check.rs:1:1:\nboom\n",
            },
            "exit 101, no JSON answer: boom",
        ),
        ("killed by a signal", {"signal": "SIGKILL"}, "killed by SIGKILL, no JSON answer"),
        (
            "exit 2 from something else",
            {"code": 2, "stderr": "/opt/faultline/bin/faultline: line 2: syntax error\n"},
            "exit 2, no JSON answer: /opt/faultline/bin/faultline: line 2: syntax error",
        ),
        (
            "exit 2 with JSON that is not the error document",
            {"code": 2, "doc": {"hosts": []}},
            "exit 2 without its JSON error document",
        ),
        ("exit 0 without JSON", {"code": 0, "stdout": "ok\n"}, "exit 0, no JSON answer: ok"),
    ]

    def test_a_cli_that_crashes_fails_closed(self):
        """Only the CLI's own "no run" (exit 2 with its JSON error document) or a hang is no
        verdict; each of these passed the job before (with a members file, `hosts` was
        called "no agent answers")."""
        ok_check = {"code": 0, "doc": {"run_id": "r1", "rounds": 1, "verdicts": []}}
        runs = [("hosts", c, mode) for c in self.CRASHES for mode in ("kubernetes", "members")]
        # `check`'s answer is read the same way in both modes: each crash in one of them.
        runs += [
            ("check", c, ("kubernetes", "members")[i % 2]) for i, c in enumerate(self.CRASHES)
        ]
        for command, (name, crash, said), mode in runs:
            with self.subTest(command, crash=name, mode=mode):
                cli = (
                    self.fake(hosts=crash, check=ok_check)
                    if command == "hosts"
                    else self.fake(check=crash)
                )
                out = self.run_with(cli, self.workers(2), **self.mode_env(mode))
                self.assert_aborted_as_config(
                    out,
                    f"FAULTLINE_BIN={str(cli.bin)!r}: faultline {command} could not "
                    f"run ({said}",
                )
                self.assertEqual(
                    [c[0] for c in cli.calls()],
                    ["hosts"] if command == "hosts" else ["hosts", "check"],
                )

    def test_the_clis_own_no_run_answer_to_the_peer_check_is_no_verdict_in_both_modes(self):
        """docs/dlrover.md, "The decision on cannot run": exit 2 with the CLI's JSON error
        document (a coordinator that does not answer, its --timeout), with the operator's
        own settings valid, lets the job start."""
        no_run = {
            "code": 2,
            "doc": {"error": "no peer check can run: coordinator down", "exitCode": 2},
        }
        for mode in ("kubernetes", "members"):
            with self.subTest(mode=mode):
                out = self.run_with(
                    self.fake(check=no_run), self.workers(2), **self.mode_env(mode)
                )
                self.assertEqual(out.status, PreCheckStatus.PASS, out.log)
                self.assertEqual(out.actions, [])
                (result,) = out.results(OP)
                self.assertIn(
                    "usable: gpu-a, gpu-b; no peer check (no peer check can run: "
                    "coordinator down)",
                    result,
                )

    def test_without_kubernetes_the_peer_checks_settings_are_required(self):
        """The CLI's exit 2 for each of these passed the job as "no peer check"; the stand-in
        answers `check` as the real CLI does without a coordinator address."""
        no_coordinator = {
            "code": 2,
            "doc": {
                "error": "no --coordinator and no Kubernetes to find it in: no kubeconfig",
                "exitCode": 2,
            },
        }
        short = self.tmp / "short-secret"
        short.write_text("12345\n")
        token = self.tmp / "token"
        token.write_text("a-token\n")
        cases = [
            (
                {"FAULTLINE_COORDINATOR": ""},
                "FAULTLINE_COORDINATOR unset: with FAULTLINE_DLROVER_MEMBERS (no Kubernetes) "
                "the peer check needs the coordinator's address, host:port (or "
                "FAULTLINE_DLROVER_PEER_CHECK=off)",
            ),
            (
                {"FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(self.tmp / "none")},
                f"FAULTLINE_PEER_REQUESTER_SECRET_FILE={str(self.tmp / 'none')!r}: no readable "
                "file there (No such file or directory)",
            ),
            (
                {"FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(short)},
                f"FAULTLINE_PEER_REQUESTER_SECRET_FILE={str(short)!r}: the requesters' secret "
                "is 5 bytes, the CLI takes at least 16",
            ),
            (
                {"FAULTLINE_PEER_TOKEN_FILE": str(token)},
                f"FAULTLINE_PEER_TOKEN_FILE={str(token)!r}: a service-account token, which a "
                "coordinator without Kubernetes does not take",
            ),
        ]
        if not Path(precheck.DEFAULT_SECRET_FILE).exists():
            cases.append(
                (
                    {"FAULTLINE_PEER_REQUESTER_SECRET_FILE": ""},
                    "FAULTLINE_PEER_REQUESTER_SECRET_FILE unset, its default "
                    "'/etc/faultline/peer/requester-secret': no readable file there",
                )
            )
        for extra, said in cases:
            with self.subTest(**extra):
                cli = self.fake(check=no_coordinator)
                env = {**self.mode_env("members"), **extra}
                out = self.run_with(cli, self.workers(2), **env)
                self.assert_aborted_as_config(out, said)
                # Settings are judged before the CLI is run.
                self.assertEqual(cli.calls(), [])
        # With the peer check off they are not needed.
        env = {
            **self.mode_env("members"),
            "FAULTLINE_COORDINATOR": "",
            "FAULTLINE_DLROVER_PEER_CHECK": "off",
        }
        out = self.run_with(self.fake(), self.workers(2), **env)
        self.assertEqual(out.status, PreCheckStatus.PASS, out.log)

    def test_dlrovers_pre_check_timeout_is_left_to_dlrover_and_the_cli_is_killed(self):
        """DLRover's pre-check timeout raises `TimeoutException` (a SIGALRM) in whatever runs,
        here the operator waiting for a hanging `hosts`. Before, `check` turned it into
        FAULTLINE_OPERATOR_ERROR and aborted the job, and the CLI and its child ran on."""
        cli = self.fake(hosts={"hang": True})
        env = {
            **cli.env(),
            "FAULTLINE_DLROVER_HOSTS_TIMEOUT": "60",
            "FAULTLINE_DLROVER_RETRY_SECONDS": "1",
        }
        self.addCleanup(kill_survivors, cli.pids)
        with mock.patch.dict(os.environ, env):
            with self.assertRaises(TimeoutException):
                harness.run_precheck(only_faultline(), self.workers(2), pre_check_timeout=2)
        pids = [int(p) for p in cli.pids.read_text().split()]
        self.assertEqual(len(pids), 2)
        # The CLI was reaped before `check` returned; its child (reparented) is dead too.
        self.assertFalse(alive(pids[0]))
        for pid in pids:
            wait_until(f"process {pid} killed", 2, lambda: not alive(pid))

    def test_an_error_in_the_operator_fails_the_check(self):
        """DLRover counts an exception from `check` as a pass."""
        cli = self.fake()
        with mock.patch.object(precheck, "job_nodes", side_effect=RuntimeError("boom")):
            out = self.run_with(cli, self.workers(2))
        (action,) = out.actions
        self.assertIsInstance(action, JobAbortionAction)
        self.assertEqual(action.reason, "FAULTLINE_OPERATOR_ERROR")
        self.assertEqual(action.msg, "FAULTLINE_OPERATOR_ERROR: RuntimeError: boom")


if __name__ == "__main__":
    unittest.main()
