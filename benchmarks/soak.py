"""Kill -9 soak: run the ci workflow, kill -9 a running job or Snakemake itself at random moments,
re-run as the README says after each kill, until the target is built; then compare every number with
an uninterrupted run on the same machine.

    uv run python benchmarks/soak.py --kills 20 --write-docs

Victims: a job process (Snakemake sees the job fail, removes its outputs and stops; the plain re-run
redoes it), or Snakemake's whole process group (what a lost node or a closed terminal does: the stale
lock needs `--unlock`, and the interrupted jobs' outputs are marked incomplete, which
`--rerun-incomplete` redoes). Job victims are chosen among the running rules killed least so far, so
the kills spread over every rule.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from docs_section import replace_section  # benchmarks/ is on sys.path when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]
TARGET = "results/tables/table4_ablation.csv"
SECTION = "## Kill -9 soak"


def snakemake_cmd(workdir: Path, config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2",
            TARGET, *extra, "--configfile", str(config)]


def job_rule(proc: psutil.Process) -> str | None:
    """The rule a process runs, from the script Snakemake wrote for it (.snakemake/scripts/tmpXXX.<rule>.py)."""
    try:
        for arg in proc.cmdline():
            if ".snakemake/scripts/tmp" in arg:
                return Path(arg).name.split(".", 1)[1].removesuffix(".py")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return None


def running_jobs(root: psutil.Process) -> dict[int, str]:
    jobs = {}
    try:
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return jobs
    for child in children:
        rule = job_rule(child)
        if rule:
            jobs[child.pid] = rule
    return jobs


def attempt(workdir: Path, config: Path, rng: random.Random, kills: Counter, cap: int, want_kill: bool, log,
            only: str | None = None) -> dict:
    """One Snakemake invocation; kill -9 once if `want_kill`, choosing a job of a rule killed fewer than
    `cap` times (fewest first) so that the run moves on and every rule gets its kills. Returns what happened."""
    extra = ["--forcerun", only] if only and want_kill else []   # make the one rule run again in a finished run
    proc = subprocess.Popen(snakemake_cmd(workdir, config, "--rerun-incomplete", *extra), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    root = psutil.Process(proc.pid)
    started = time.monotonic()
    event = {"victim": None, "rule": None, "at_s": None}
    kill_snakemake = rng.random() < 0.3
    chosen, chosen_at = None, None
    while want_kill and proc.poll() is None:
        now = time.monotonic()
        jobs = running_jobs(root)
        if chosen is None:
            eligible = {pid: r for pid, r in jobs.items() if kills[r] < cap and only in (None, r)}
            if eligible:
                least = min(kills[r] for r in eligible.values())
                chosen = rng.choice(sorted(pid for pid, r in eligible.items() if kills[r] == least))
                # A rule's first kill comes at once: some jobs (tables) last well under a second.
                chosen_at = now + (0.0 if least == 0 else rng.uniform(0.2, 2.5))
        elif now >= chosen_at:
            if chosen not in jobs or psutil.Process(chosen).status() == psutil.STATUS_ZOMBIE:
                chosen = None  # it finished first; pick again
                continue
            rule = jobs[chosen]
            kills[rule] += 1
            try:
                if kill_snakemake:
                    event.update(victim="snakemake", rule=",".join(sorted(set(jobs.values()))))
                    os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and every job it runs, as a lost node
                else:
                    event.update(victim="job", rule=rule)
                    psutil.Process(chosen).send_signal(signal.SIGKILL)
                event["at_s"] = round(now - started, 1)
            except (psutil.NoSuchProcess, ProcessLookupError):
                kills[rule] -= 1
                event.update(victim=None, rule=None)
                chosen = None
                continue
            break
        time.sleep(0.01)
    rc = proc.wait()
    event["returncode"] = rc
    event["seconds"] = round(time.monotonic() - started, 1)
    return event


def results_of(workdir: Path) -> dict[str, object]:
    """Every number the run reports: eval JSONs and the four tables."""
    out: dict[str, object] = {}
    for path in sorted((workdir / "results" / "eval").rglob("*.json")):
        if path.name.endswith(".predictions.json"):
            continue
        out[str(path.relative_to(workdir))] = json.loads(path.read_text())
    for path in sorted((workdir / "results" / "tables").glob("*.csv")):
        with open(path, newline="") as f:
            out[str(path.relative_to(workdir))] = list(csv.DictReader(f))
    return out


def differences(a: object, b: object, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        diffs = [f"{where}/{k}: only in one run" for k in sorted(set(a) ^ set(b))]
        for key in sorted(set(a) & set(b)):
            diffs += differences(a[key], b[key], f"{where}/{key}")
        return diffs
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=REPO / "config" / "ci.yaml")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vlbert-soak"))
    parser.add_argument("--max-attempts", type=int, default=200)
    parser.add_argument("--only", metavar="RULE", help="kill only jobs of RULE, re-run with --forcerun RULE in the "
                        "existing soaked directory (e.g. a rule the random soak did not catch)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace '{SECTION}' in docs/benchmarks.md")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    reference, soaked = args.workdir / "reference", args.workdir / "soaked"
    for d in (reference, soaked):
        d.mkdir(parents=True, exist_ok=True)
    log = open(args.workdir / "snakemake.log", "a")

    started = time.monotonic()
    reference_note = "the uninterrupted run reused from an earlier invocation"
    if not (reference / TARGET).is_file():
        subprocess.run(snakemake_cmd(reference, args.config), stdout=log, stderr=subprocess.STDOUT, check=True)
        reference_note = f"uninterrupted run {time.monotonic() - started:.0f} s"

    kills: Counter = Counter()   # per rule: kills of its jobs, alone or with Snakemake
    cap = 1                       # raised whenever the run gets past every rule killed `cap` times
    events, killed = [], 0
    soak_started = time.monotonic()
    for _ in range(args.max_attempts):
        event = attempt(soaked, args.config, rng, kills, cap if not args.only else args.kills,
                        want_kill=killed < args.kills, log=log, only=args.only)
        if event["victim"] == "snakemake":
            # the README's advice after Snakemake itself was killed: remove the stale lock, then re-run
            subprocess.run(snakemake_cmd(soaked, args.config, "--unlock"), stdout=log, stderr=subprocess.STDOUT, check=True)
        if event["victim"]:
            killed += 1
        events.append(event)
        print(json.dumps(event), flush=True)
        if event["victim"] is None and event["returncode"] == 0 and (soaked / TARGET).is_file():
            if killed >= args.kills or args.only:
                break
            # finished before enough kills: start over from nothing, allowing one more kill per rule
            cap += 1
            for path in ("results", "resources", "logs", ".snakemake"):
                shutil.rmtree(soaked / path, ignore_errors=True)
    soak_s = time.monotonic() - soak_started

    diffs = differences(results_of(reference), results_of(soaked))
    snakemake_kills = sum(e["victim"] == "snakemake" for e in events)
    job_kills = Counter(e["rule"] for e in events if e["victim"] == "job")
    with_snakemake = Counter(r for e in events if e["victim"] == "snakemake" for r in e["rule"].split(","))
    lines = [
        f"`uv run python benchmarks/soak.py --kills {args.kills} --seed {args.seed} --write-docs` "
        f"({time.strftime('%Y-%m-%d')}, config {args.config.name}, 2 cores shared with other work): "
        f"{reference_note}; soaked run {soak_s:.0f} s over {len(events)} Snakemake invocations.",
        "",
        f"- **{killed} kills**: {snakemake_kills} of Snakemake's whole process group (then `--unlock` and a re-run "
        f"with `--rerun-incomplete`), {sum(job_kills.values())} of single jobs (then a plain re-run).",
        "- Job kills by rule: " + ", ".join(f"{r} {n}" for r, n in sorted(job_kills.items())) + ".",
        "- Rules running when Snakemake was killed: " + (", ".join(
            f"{r} {n}" for r, n in sorted(with_snakemake.items())) or "none") + ".",
        f"- Rules killed at least once (alone or with Snakemake): {len(set(job_kills) | set(with_snakemake))}.",
        f"- Final numbers (every `results/eval/**/*.json` value and the four tables) vs the uninterrupted run: "
        + ("**identical**." if not diffs else f"**{len(diffs)} differences**: " + "; ".join(diffs[:10])),
        "",
        "| # | victim | rule(s) | killed at (s) | Snakemake exit |",
        "|---|---|---|---|---|",
    ]
    for i, e in enumerate((e for e in events if e["victim"]), 1):
        lines.append(f"| {i} | {e['victim']} | {e['rule']} | {e['at_s']} | {e['returncode']} |")
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        replace_section(SECTION, report)
    sys.exit(1 if diffs or killed < args.kills else 0)


if __name__ == "__main__":
    main()
