"""Print the short tables of `python -m kvoffload.bench --json` runs: engine cases, metrics and stripe rows."""

import json
import sys

for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        print(path, "unreadable:", e)
        continue
    print(f"{path}: ok {d['ok']}, switch {d['config'].get('engine_switch_ms')} ms")
    for r in d.get("engine", []):
        print(f"  {r['path']:4} {r['direction']:5} {r['drives']} {r['share']:.2f} step {r['engine_step_ratio']:.3f} "
              f"(med {r['engine_step_ratio_median']:.3f} {r['engine_step_ratio_spread'][0]:.2f}-"
              f"{r['engine_step_ratio_spread'][1]:.2f}) bw {r['bandwidth_ratio']:.3f} (med {r['bandwidth_ratio_median']:.3f} "
              f"{r['bandwidth_ratio_spread'][0]:.2f}-{r['bandwidth_ratio_spread'][1]:.2f}) "
              f"{r['gib_s_busy']:.2f}/{r['gib_s_ref']:.2f} GiB/s x{r['repeats']}")
    for r in d.get("cases", []):
        if r["group"] in ("stripe", "metrics") or "cycling" in r["case"] or "4 dirs" in r["case"]:
            print(f"  {r['case']:<46} {r['gib_s_best']:7.2f} GiB/s  ratio {r.get('ratio')} to {r.get('ceiling')}")
