"""The autotune sweep and the trace's cost of benches/RESULTS.md: `gpufeed bench
--json` over one workload with each setting in turn within a round, round after round; prints
each setting's median steady and whole-run rate, auto's ratios to the best fixed count and to
the default (medians), the trace's on/off ratio per round, and the reasons auto gave.

    python3 crates/bench/scripts/autotune_sweep.py records|rows|jpegs ROUNDS
    python3 crates/bench/scripts/autotune_sweep.py NAME ROUNDS --settings w4,w8,w16,default,auto \\
        [--unit bytes|samples|tokens] [--jsonl FILE] -- BENCH FLAGS...

The presets (records, rows, jpegs) are the 2-core VM's workloads: --workers 1 to 4, the
default and auto. A setting is `wN` (--workers N), `default` (no flag), `auto` (--workers
auto), `trace` (the default workers with --trace FILE) or `wN+trace`; --abba runs every other
round in reverse order (for two settings whose order within a round might matter). GPUFEED: the binary
(default target/release/gpufeed); JPEGS: the ImageFolder of the jpegs preset.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

G = os.environ.get("GPUFEED", "target/release/gpufeed")
PRESETS = {
    "records": (["--epochs", "4", "--no-baseline"], "bytes"),
    "rows": (["--epochs", "4", "--no-baseline", "--record-bytes", "4096", "--records", "131072"], "bytes"),
    "jpegs": (["--epochs", "3", "--images", os.environ.get("JPEGS", "jpegs"), "--batch-size", "64"], "samples"),
}
VM_SETTINGS = "w1,w2,w3,w4,default,auto"


def flags_of(setting: str, trace_file: str) -> list:
    flags = []
    for part in setting.split("+"):
        if part == "default":
            continue
        if part == "auto":
            flags += ["--workers", "auto"]
        elif part == "trace":
            flags += ["--trace", trace_file]
        elif part.startswith("w") and part[1:].isdigit():
            flags += ["--workers", part[1:]]
        else:
            raise SystemExit(f"--settings: {part!r} is not wN, default, auto or trace")
    return flags


def rates(d: dict, unit: str) -> tuple:
    if unit == "tokens":
        return d["steady_tokens_per_s"], d["tokens_per_s"]
    return d[f"steady_{unit}_per_sec"], d[f"{unit}_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("rounds", type=int)
    p.add_argument("--settings")
    p.add_argument("--unit", choices=["bytes", "samples", "tokens"])
    p.add_argument("--jsonl", help="append every run's report here, one line each")
    p.add_argument("--abba", action="store_true", help="every other round in reverse order")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.bench = argv[cut + 1 :]
    preset_flags, preset_unit = PRESETS.get(a.name, ([], "bytes"))
    bench = a.bench or preset_flags
    unit = a.unit or preset_unit
    settings = (a.settings or VM_SETTINGS).split(",")
    trace_file = os.path.join(tempfile.mkdtemp(), "trace.json")
    results = {s: [] for s in settings}
    reasons = []
    for r in range(a.rounds):
        for s in settings[::-1] if a.abba and r % 2 else settings:
            out = subprocess.run(
                [G, "bench", "--json", *bench, *flags_of(s, trace_file)],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"{s}: gpufeed bench failed: {out.stderr.strip()}")
            d = json.loads(out.stdout)
            steady, whole = rates(d, unit)
            results[s].append((steady, whole, d.get("workers")))
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps({"name": a.name, "round": r, "setting": s, "report": d}) + "\n")
            if s == "auto" and d.get("tuning"):
                t = d["tuning"]
                reasons.append(f"{t['reason']} (took {t['seconds']:.3f} s)")
    med = {}
    for s, runs in results.items():
        med[s] = statistics.median(x[0] for x in runs)
        whole = statistics.median(x[1] for x in runs)
        print(
            f"{a.name} {s:12s} steady median {med[s]:,.0f}  whole median {whole:,.0f}  "
            f"workers {[x[2] for x in runs]}  steady {[round(x[0]) for x in runs]}"
        )
    fixed = [s for s in settings if s.startswith("w") and "+" not in s]
    if "auto" in med and fixed:
        best = max(fixed, key=lambda s: med[s])
        print(f"{a.name} auto / best fixed ({best}): {med['auto'] / med[best]:.3f}")
        if "default" in med:
            print(f"{a.name} auto / default: {med['auto'] / med['default']:.3f}")
    for on in [s for s in settings if "trace" in s]:
        off = on.replace("+trace", "") if "+" in on else "default"
        if off in results:
            per_round = [x[0] / y[0] for x, y in zip(results[on], results[off])]
            print(
                f"{a.name} {on} / {off} per round {[round(x, 3) for x in per_round]}  "
                f"median {statistics.median(per_round):.3f}"
            )
    for reason in reasons:
        print("auto:", reason)


if __name__ == "__main__":
    main()
