"""The long fuzz run: the properties of tests/test_fuzz.py with many random cases.

    python benchmarks/fuzz_long.py                 # 5000 cases per property (a few minutes on 2 cores)
    python benchmarks/fuzz_long.py --cases 500     # quicker
    python benchmarks/fuzz_long.py --seed 7        # reproducible

Every input must end in success or one `UserError` sentence, and accepted inputs must agree with
an independent reader (see tests/test_fuzz.py). Prints, per property, the cases run, the
distinct findings (exception type and the line that raised it, with a count and one input)
and the time taken.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASE_SECONDS = 5
HUGE = False
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_fuzz as fz  # noqa: E402  (the strategies and checks live with the tests)


def properties(workdir: Path):
    """name -> (strategy of one case, check(case))."""
    counter = iter(range(10**9))

    def fresh() -> Path:
        d = workdir / str(next(counter))
        d.mkdir()
        return d

    def yaml_text(case):
        data, edits = case
        return fz.corrupt(fz.yaml.safe_dump(data, allow_unicode=True), edits), edits.draw(fz.overrides)

    def header_case(data):
        raw, header = fz.honest_file(data)
        return fz.lie_about(raw, header, data) if data.draw(st.booleans()) else raw

    def write_header(raw):
        path = fresh() / "x.safetensors"
        path.write_bytes(raw)
        fz.check_header_file(path)

    def checkpoint_case(case):
        config, index, mangle, data = case
        config_text = json.dumps(config).encode()
        if mangle:
            config_text = config_text[: data.draw(st.integers(0, len(config_text)))] + data.draw(st.binary(max_size=4))
        index_text = None if index is None else json.dumps(index).encode()
        fz.check_checkpoint_dir(fresh(), config_text, index_text)

    def config_case(data):
        fz.check_config(fresh(), fz.mutated_config(data, fz.config_junk | fz.huge_sizes if HUGE else fz.config_junk))

    return {
        "model config.json (inspect)": (st.data(), config_case),
        "recipe dict + overrides": (st.tuples(fz.recipes, fz.overrides), lambda c: fz.check_recipe_dict(*c)),
        "recipe YAML text (edited)": (
            st.tuples(fz.recipes, st.data()),
            lambda c: fz.check_recipe_text(fresh(), *yaml_text(c)),
        ),
        "recipe arbitrary bytes": (
            st.binary(max_size=400) | st.text(max_size=400).map(str.encode),
            lambda raw: fz.check_recipe_text(fresh(), raw),
        ),
        "safetensors header (honest / lying)": (st.data(), lambda d: write_header(header_case(d))),
        "safetensors arbitrary bytes": (st.binary(max_size=300), write_header),
        "checkpoint dir (config + index)": (
            st.tuples(fz.configs, st.none() | fz.index_docs, st.booleans(), st.data()),
            checkpoint_case,
        ),
    }


def counted(check, tally, findings: dict):
    """Run one case; anything but success or a UserError (which the checks swallow) is a finding,
    recorded by exception type and the line that raised it, and the run goes on."""

    def one(case):
        tally["cases"] += 1
        signal.alarm(CASE_SECONDS)  # a case that runs longer is a hang: a finding, not a stall
        try:
            check(case)
        except Exception as error:
            where = traceback.extract_tb(error.__traceback__)[-1]
            key = f"{type(error).__name__} at {Path(where.filename).name}:{where.lineno}"
            entry = findings.setdefault(key, {"count": 0, "message": str(error)[:300], "case": repr(case)[:300]})
            entry["count"] += 1
        finally:
            signal.alarm(0)

    return one


class Hang(Exception):
    pass


def _hang(*_):
    raise Hang(f"one case ran longer than {CASE_SECONDS} s")


def run(cases: int, seed: int | None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="moequant-fuzz-") as tmp:
        for name, (strategy, check) in properties(Path(tmp)).items():
            tally, findings = {"cases": 0}, {}
            one = counted(check, tally, findings)
            test = settings(
                max_examples=cases,
                deadline=None,
                database=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
            )(given(strategy)(one))
            if seed is not None:
                from hypothesis import seed as hseed

                test = hseed(seed)(test)
            t0 = time.perf_counter()
            test()
            rows.append(
                {"property": name, **tally, "findings": findings, "seconds": round(time.perf_counter() - t0, 1)}
            )
            hits = sum(f["count"] for f in findings.values())
            print(
                f"{name:<36} {tally['cases']:>7} cases  {len(findings):>3} distinct findings in {hits:>5} cases"
                f"  {rows[-1]['seconds']:>7.1f} s",
                flush=True,
            )
            for key, f in sorted(findings.items(), key=lambda kv: -kv[1]["count"]):
                print(f"    {f['count']:>5} x {key}: {f['message'][:150]!r}")
    return rows


def main() -> None:
    import resource

    # a reader that believes a config's sizes must fail, not swap: 4 GB of address space at most
    resource.setrlimit(resource.RLIMIT_AS, (4 * 1024**3, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _hang)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=5000, help="examples per property")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--huge-configs",
        action="store_true",
        help="also give configs sizes like 2**40 layers (today: the adapters exhaust memory; slow)",
    )
    args = parser.parse_args()
    global HUGE
    HUGE = args.huge_configs
    rows = run(args.cases, args.seed)
    total = sum(r["cases"] for r in rows)
    found = sum(len(r["findings"]) for r in rows)
    print(f"total: {total} cases, {found} distinct findings")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
