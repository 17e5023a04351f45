"""(f) A rank that skips an all-reduce, on 2 real gloo ranks: check mode names both sides at once;
without it the sums are silently wrong and the hang watchdog names the rank at the end."""

from __future__ import annotations

import re
import time
from pathlib import Path

from pentatron.lab.common import Verdict, save_plot
from pentatron.lab.hang_scenarios import STEPS, skip_allreduce
from pentatron.lab.ranks import RankGroup
from pentatron.observe.watchdog import HANG_EXIT_CODE


def collective_mismatch(out: Path, quick: bool) -> Verdict:
    timeout_s = 2.0 if quick else 5.0
    results = {}
    for mode, check in (("check", True), ("watchdog", False)):
        run_dir = out / f"lab_collective_{mode}"
        start = time.monotonic()
        group = RankGroup(skip_allreduce, 2, run_dir, args=(str(run_dir), timeout_s, check, 1, 2))
        codes = group.wait(timeout_s=120 + 10 * timeout_s)
        results[mode] = {"codes": codes, "seconds": time.monotonic() - start, "logs": [group.log(0), group.log(1)],
                         "diagnosis": (run_dir / "flight" / "diagnosis.txt").read_text()
                         if (run_dir / "flight" / "diagnosis.txt").exists() else ""}
    chk, dog = results["check"], results["watchdog"]
    mismatch = next((m.group(0) for m in re.finditer(r"collective mismatch.*?(?=\n[^ ])", chk["logs"][0], re.S)), "")
    sums = re.findall(r"rank (\d): loss sums per step (\[.*?\])", dog["logs"][0] + dog["logs"][1])
    named = re.search(r"stuck ranks?: ([\d, ]+|unknown)", dog["diagnosis"])
    stuck = named.group(1).strip() if named else "none"
    reproduced = (chk["codes"] == [1, 1] and "rank 1 calls dp all_reduce #3" in mismatch
                  and dog["codes"] == [HANG_EXIT_CODE] * 2 and stuck == "1")
    plot = save_plot(out / "lab_collective.png", "a skipped all-reduce on 2 gloo ranks", [
        {"kind": "bar", "title": "time to a named failure", "ylabel": "seconds (wall, incl. start-up)",
         "categories": ["check mode", "hang watchdog"], "series": {"wall time": [chk["seconds"], dog["seconds"]]},
         "lines": {f"watchdog timeout ({timeout_s:g} s)": timeout_s}}])
    text = (f"rank 1 skips its gradient all-reduce at step 2 of {STEPS}. Check mode: both ranks stop at once "
            f"(exit codes {chk['codes']}, {chk['seconds']:.1f} s incl. start-up):\n{mismatch}\n"
            f"Without check mode the run goes on with wrong sums ({'; '.join(f'rank {r}: {s}' for r, s in sums)}) "
            f"until rank 0 waits in an all-reduce rank 1 never enters; the watchdog (timeout {timeout_s:g} s) "
            f"ends it after {dog['seconds']:.1f} s (exit codes {dog['codes']}) with:\n{dog['diagnosis']}")
    return Verdict("collective", reproduced, text,
                   {"check_codes": chk["codes"], "watchdog_codes": dog["codes"], "stuck": stuck,
                    "check_seconds": chk["seconds"], "watchdog_seconds": dog["seconds"], "timeout_s": timeout_s},
                   plot)
