"""A stand-in for the `faultline` CLI, for the operator's answers to what the real programs on
loopback cannot be made to print (link and straggler verdicts, a verdict kind the CLI has no
name for) or to do (hang, crash, die by a signal).

Run as `python3 fake_faultline.py SUBCOMMAND ...`; `FAULTLINE_FAKE_SCENARIO` names a JSON
file mapping a subcommand (`hosts`, `check`) to what to do for it:
`{"code": N, "doc": {...}}` prints the document as the real CLI's `-o json` does and exits N;
`{"code": N, "stdout": "...", "stderr": "..."}` prints those texts as they are (a crash's
output) and exits N; `{"signal": "SIGKILL"}` kills itself with that signal; `{"hang": true}`
starts a child that sleeps and then sleeps itself, after writing both pids to
`FAULTLINE_FAKE_PIDS`.
Each call's arguments are appended, one JSON list a line, to `FAULTLINE_FAKE_CALLS`.
"""

import json
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    with open(os.environ["FAULTLINE_FAKE_CALLS"], "a") as f:
        f.write(json.dumps(args) + "\n")
    scenario = json.loads(open(os.environ["FAULTLINE_FAKE_SCENARIO"]).read())
    step = scenario.get(args[0] if args else "")
    if step is None:
        print(json.dumps({"error": f"no scenario for {args[:1]}", "exitCode": 2}))
        return 2
    if step.get("hang"):
        child = subprocess.Popen(["sleep", "300"])
        with open(os.environ["FAULTLINE_FAKE_PIDS"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(300)
        return 0
    if "signal" in step:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.Signals[step["signal"]])
        time.sleep(10)
        return 0
    if "doc" not in step:
        sys.stdout.write(step.get("stdout", ""))
        sys.stderr.write(step.get("stderr", ""))
        return int(step["code"])
    print(json.dumps(step["doc"]))
    return int(step["code"])


if __name__ == "__main__":
    sys.exit(main())
