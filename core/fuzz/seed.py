#!/usr/bin/env python3
"""Seeds the fuzz corpora from the project's fixtures (corpus/ is not committed)."""
import hashlib, os, re, sys

root = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(root, "..", "..", "tests", "fixtures")

def put(target, data):
    d = os.path.join(root, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()), "wb") as f:
        f.write(data)

# kernel-lines.yaml: every `- line: "..."` value (YAML double-quoted; good enough as seeds).
lines = []
for raw in open(os.path.join(fixtures, "kernel-lines.yaml"), encoding="utf-8"):
    m = re.match(r'^- line: "(.*)"\s*$', raw.rstrip("\n"))
    if m:
        lines.append(m.group(1).replace('\\"', '"').replace("\\\\", "\\").encode())
for i, l in enumerate(lines):
    put("kernel_message", l)
    put("pci_addr", l.split(b"(")[-1][:20])
    put("kmsg_record", b"4,%d,%d,-;" % (i + 1, i * 10) + l)
replay = open(os.path.join(fixtures, "replay", "mixed.kmsg"), "rb").read()
put("kmsg_reader", replay)
for l in replay.splitlines():
    put("kmsg_record", l)
put("policy", b"overrides:\n  Xid43: { handling: SeparateNPU }\nescalation:\n  - codes: [Xid13]\n    count: 3\n    window: 24h\n    handling: PreSeparateNPU\nrecovery:\n  - sources: [kmsg]\n    max_handling: RestartBusiness\n    clear_after: 1h\nnvml:\n  poll_interval: 10s\n")
put("policy", b'{"expected_gpus": 8, "node_actions": {"PreSeparateNPU": {"health": "Degraded", "condition": false}}}')
# tests/fixtures/ascend: every recorded npu-smi sample seeds ascend_npu_smi, every hccn_tool
# sample seeds ascend_hccn.
ascend = os.path.join(fixtures, "ascend")
for name in sorted(os.listdir(ascend)):
    if name.endswith(".txt"):
        data = open(os.path.join(ascend, name), "rb").read()
        put("ascend_npu_smi" if name.startswith("npu-smi") else "ascend_hccn", data)
# The built-in MindCluster tables seed ascend_tables.
catalog = os.path.join(root, "..", "catalog")
for name in ("ascend-faultCode.json", "ascend-faultCustomization.json"):
    put("ascend_tables", open(os.path.join(catalog, name), "rb").read())
print(f"seeded from {len(lines)} corpus lines", file=sys.stderr)
