#!/usr/bin/env python3
"""How noisy are real checks? Runs rounds of K concurrent two-rank `faultline-probe allgather`
checks on loopback and judges each check as the pairing planner does (core/src/peer/pairing):
the check's time (the slower rank's median over the iterations, as the coordinator takes it)
over its round's reference (the lower median of the round's other checks), and slow when that
is above the ratio and 3 MADs of the others (MAD only with 3 or more others).

    check-noise.py PROBE K ROUNDS SIZE [--json OUT]

docs/benchmarks.md ("Check-time noise") has the figures and the load used. Each round's ports
move on so a probe winding down never holds the next round's port."""
import json, statistics, subprocess, sys

def lower_median(v):
    v = sorted(v)
    return v[(len(v) - 1) // 2]

def main():
    probe, k, rounds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    rows, base = [], 0
    for _ in range(rounds):
        procs = []
        for c in range(k):
            peers = f"127.0.0.1:{30000 + base + 2 * c},127.0.0.1:{30001 + base + 2 * c}"
            for rank in (0, 1):
                procs.append(subprocess.Popen(
                    [probe, "allgather", "--peers", peers, "--rank", str(rank), "--size", size,
                     "--iterations", "5", "--timeout", "20s"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
        base = (base + 2 * k) % 2000
        meds = []
        for p in procs:
            o, _ = p.communicate()
            meds.append(json.loads(o)["median_seconds"] if p.returncode == 0 else None)
        times = [max(meds[2 * c], meds[2 * c + 1]) for c in range(k)
                 if meds[2 * c] is not None and meds[2 * c + 1] is not None]
        rows.append(times)
    ratios, slow = [], {r: 0 for r in (1.5, 1.75, 2.0, 2.5, 3.0)}
    for times in rows:
        for i, t in enumerate(times):
            others = times[:i] + times[i + 1:]
            if not others:
                continue
            m = lower_median(others)
            mad = statistics.median([abs(x - statistics.median(others)) for x in others]) \
                if len(others) >= 3 else 0.0
            ratios.append(t / m)
            for r in slow:
                slow[r] += t > m * r and t > m + 3 * mad
    ratios.sort()
    q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]
    rm = sorted(statistics.median(t) for t in rows if t)
    n = len(ratios)
    print(f"size {size}, {k} checks at once, {rounds} rounds, {n} checks")
    print(f"round medians ms: min {rm[0]*1e3:.2f} median {statistics.median(rm)*1e3:.2f} "
          f"max {rm[-1]*1e3:.2f} (max/min {rm[-1]/rm[0]:.1f})")
    print(f"check / reference: p50 {q(.5):.2f} p90 {q(.9):.2f} p99 {q(.99):.2f} max {ratios[-1]:.2f}")
    print("slow by the rule: " + ", ".join(f"{r}: {s} ({100*s/n:.2f} %)" for r, s in slow.items()))
    if out:
        json.dump(rows, open(out, "w"))

if __name__ == "__main__":
    main()
