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

import os
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

OP = "FaultlinePreCheckOperator"


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

    def env(self):
        return mock.patch.dict(
            os.environ,
            {
                "FAULTLINE_BIN": str(self.bins["cli"]),
                "FAULTLINE_DLROVER_MEMBERS": str(self.tmp / "members"),
                "FAULTLINE_DLROVER_AGENT_PORT": str(self.http_port),
                "FAULTLINE_COORDINATOR": self.coordinator,
                "FAULTLINE_PEER_REQUESTER_SECRET_FILE": str(self.secret),
                "FAULTLINE_DLROVER_CHECK_TIMEOUT": "60",
                "FAULTLINE_DLROVER_RETRY_SECONDS": "1",
            },
        )

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


if __name__ == "__main__":
    unittest.main()
