"""Reading the committed per-seed tables a claims row rests on, and the page's spread rule.

Every table here is a file under results/ that a report wrote: a tuning protocol's `protocol.csv` (one row per
arm: `<metric>_min`, `_median`, `_max` over the fresh seeds) or, where the report wrote it beside, its per-seed
`protocol_runs.csv` (one row per fresh-seed run), which `arm` reads first; a BC grid's `<task>_dopr_vs_gp.csv` (one row per
GP x trajectory count), a report's own csv. Paths are relative to the repository's root."""
import csv
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PER_SEED = "protocol_runs.csv"   # beside a protocol.csv: the runs it aggregates (experiments/common/tuning.py)
#: not metrics: the per-seed table's other columns
RUN_FIELDS = ("arm", "setting", "seed", "fixed", "wall_time_s", "git_revision", "base")
#: the protocol tables `arm` read since the last `SOURCES.clear()`: {path: "per seed" | "aggregate"}
SOURCES: dict = {}


def rows(path: str) -> list:
    with open(ROOT / path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def arm(path: str, name: str) -> dict:
    """The row of arm `name` in a tuning protocol's table, numbers as floats where they parse: recomputed from
    the per-seed runs beside it (`PER_SEED`, its fixed seeds) where they are committed, else the aggregate row."""
    runs = str(Path(path).parent / PER_SEED)
    if (ROOT / runs).exists():
        SOURCES[runs] = "per seed"
        return arm_from_runs(rows(runs), name, runs)
    SOURCES[path] = "aggregate"
    for r in rows(path):
        if r["arm"] == name:
            return {k: _number(v) for k, v in r.items()}
    raise KeyError(f"{path} has no arm {name!r}")


def arm_from_runs(runs: list, name: str, where: str = "per-seed table") -> dict:
    """`<metric>_min`, `_median`, `_max`, `_mean` over arm `name`'s fixed-seed runs, as protocol.csv has them."""
    mine = [r for r in runs if r["arm"] == name and r.get("fixed", "True") in ("True", "true", "1", "")]
    if not mine:
        raise KeyError(f"{where} has no run of arm {name!r}")
    out = {"arm": name, "setting": mine[0]["setting"], "seeds": " ".join(r["seed"] for r in mine)}
    for metric in (k for k in mine[0] if k not in RUN_FIELDS):
        values = [float(r[metric]) for r in mine if r[metric] not in ("", None)]
        if values:
            out.update({f"{metric}_min": min(values), f"{metric}_median": statistics.median(values),
                        f"{metric}_max": max(values), f"{metric}_mean": statistics.fmean(values)})
    return out


def selection(path: str) -> dict:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def num(x: float) -> str:
    """A headline number, three significant digits, as the page prints them."""
    x = float(x)
    if x != 0 and abs(x) < 1e-4:
        m, e = f"{x:.2g}".split("e")
        return f"{m}e{int(e)}"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def num_range(cell: str) -> str:
    """A report's 'median [min, max]' cell, each number as `num` prints it, signed."""
    med, rest = cell.split(" [")
    lo, hi = rest.rstrip("]").split(", ")
    signed = lambda v: ("+" if float(v) > 0 else "") + num(v).replace("-", "−")
    return f"{signed(med)} [{signed(lo)}, {signed(hi)}]"


def rate(x: float) -> str:
    """A learning rate as the page prints it: 3e-3."""
    m, e = f"{float(x):.0e}".split("e")
    return f"{m}e{int(e)}"


def pct(x: float) -> str:
    return f"{100 * float(x):.2g}%"


def spread(r: dict, metric: str) -> str:
    """`median [min-max]` of one arm."""
    return f"{num(r[metric + '_median'])} [{num(r[metric + '_min'])}-{num(r[metric + '_max'])}]"


def compare(a: dict, b: dict, metric: str, mode: str) -> str:
    """Arm `a` against arm `b` by the page's rule: 'better' or 'worse' when the seeds' ranges do not overlap,
    else 'inconclusive'."""
    lo_a, hi_a, lo_b, hi_b = (a[metric + "_min"], a[metric + "_max"], b[metric + "_min"], b[metric + "_max"])
    if hi_a < lo_b or hi_b < lo_a:
        ahead = a[metric + "_median"] < b[metric + "_median"] if mode == "min" else \
            a[metric + "_median"] > b[metric + "_median"]
        return "better" if ahead else "worse"
    return "inconclusive"


# a paper's claim that DoPr (or a variant) is better: the comparison's word, in the page's vocabulary
CLAIM_WORD = {"better": "reproduced", "worse": "not reproduced", "inconclusive": "inconclusive"}


def probe(path: str, variant: str) -> list:
    """A probe's last-window training loss per seed: the entries `<variant> | seed <s> | steps <n>[ | ...]` of its
    json, each a curve {step: window mean} (or {"curve": ...})."""
    out = []
    for key, run in selection(path).items():
        if key.split(" | ")[0] == variant:
            curve = run.get("curve", run)
            out.append(float(curve[max(curve, key=int)]))
    if not out:
        raise KeyError(f"{path} has no variant {variant!r}")
    return out


def md_tables(path: str, first_column: str) -> list:
    """Every markdown table in `path` whose header starts `| <first_column> |`: [(the heading above it, [rows as
    dicts of cells])]."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    out, heading = [], ""
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if not line.startswith(f"| {first_column} |"):
            continue
        header = [c.strip() for c in line.strip().strip("|").split("|")]
        table = []
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            table.append(dict(zip(header, (c.strip() for c in row.strip().strip("|").split("|")))))
        out.append((heading, table))
    return out


def md_rows(path: str, first_column: str) -> list:
    """The rows of the first such table."""
    return md_tables(path, first_column)[0][1]


def median_range(cell: str) -> dict:
    """'2102 [1930-2501]' as an arm row {'v_median', 'v_min', 'v_max'} for `compare` and `spread`."""
    med, rest = cell.split(" [")
    lo, hi = rest.rstrip("]").split("-")
    return {"v_median": float(med), "v_min": float(lo), "v_max": float(hi)}


def rank_correlation(x: list, y: list) -> float:
    """Spearman's rank correlation of two equally long lists (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out
    return statistics.correlation(ranks(x), ranks(y))
