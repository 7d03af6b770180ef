"""Every measured figure in README.md and docs/performance.md equals what its JSON rows in bench/results say.

How a figure is marked: right after the figure (and its unit: ``x``, ``k``, ``GiB``, ``MiB``, ``ms``, ``s``, ``%``)
stands ``<!--f:ID-->``; the page's block ``<!-- figures ... -->`` defines each ID once::

    ID: FILE EXPRESSION

FILE is a file of bench/results (``{"rows": [...]}`` or a bare list); EXPRESSION is arithmetic (``+ - * /``, numbers)
over terms ``AGG(FIELD){KEY=VALUE,...}``: AGG is median, max, min, mean or count over the FIELD values (None skipped;
``a.b`` reads key b of the dict in key a)
of the rows whose KEYs equal the VALUEs (count may be 0; any other AGG needs a row) (``true``/``false``/``null``, numbers, else text). Rows marked
``superseded`` or ``smoke`` never count. A definition may go on over lines that start with a space.

Rounding rule: the expression's value, rounded half up at the text's last written digit (``0.937``: thousandths;
``32``: units; ``1.6e-4``: 1e-5), must equal the figure in the text (``decimal.ROUND_HALF_UP`` on the float's exact
binary value).

Also checked here: each ID is defined once and used, every relative link of README.md and docs/*.md points to an
existing file, and the README stays a front page (at most 200 lines, none over 120 characters).
"""

import ast
import json
import operator
import re
import statistics
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "testing.md"]

MARK = re.compile(r"(\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)(?:x|k|%| ?GiB| ?MiB| ?ms| ?s)?<!--f:([\w.-]+)-->")
BLOCK = re.compile(r"<!-- figures\n(.*?)\n-->", re.S)
TERM = re.compile(r"(median|max|min|mean|count)\(([\w.]+)\)\{([^}]*)\}")
AGGREGATES = {"median": statistics.median, "max": max, "min": min, "mean": statistics.fmean, "count": len}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(text: str):
    text = text.strip()
    if text in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def rows(name: str) -> list[dict]:
    data = json.loads((RESULTS / name).read_text())
    data = data["rows"] if isinstance(data, dict) else data
    return [r for r in data if not r.get("superseded") and not r.get("smoke")]


def _field(row: dict, path: str):
    for key in path.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def term(name: str, agg: str, field: str, selector: str) -> float:
    want = dict((k.strip(), _value(v)) for k, v in (part.split("=", 1) for part in selector.split(",") if part.strip()))
    picked = [r for r in rows(name) if all(r.get(k) == v for k, v in want.items())]
    values = [v for v in (_field(r, field) for r in picked) if v is not None]
    if agg == "count":
        return len(values)
    assert values, f"no row of {name} has {field} where {want}"
    return AGGREGATES[agg](values)


def _arith(node, names: dict) -> float:
    if isinstance(node, ast.Expression):
        return _arith(node.body, names)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_arith(node.left, names), _arith(node.right, names))
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    raise ValueError(f"not allowed in a figure's expression: {ast.dump(node)}")


def evaluate(definition: str) -> float:
    name, _, expression = definition.strip().partition(" ")
    names = {}

    def stash(m):
        names[f"t{len(names)}"] = term(name, *m.groups())
        return f"t{len(names) - 1}"

    return _arith(ast.parse(TERM.sub(stash, expression).strip(), mode="eval"), names)


def definitions(text: str) -> dict[str, str]:
    blocks = BLOCK.findall(text)
    assert len(blocks) == 1, "one <!-- figures ... --> block per page"
    out: dict[str, str] = {}
    for line in blocks[0].splitlines():
        if line.startswith(" ") and out:
            key = list(out)[-1]
            out[key] += " " + line.strip()
        elif line.strip():
            key, _, definition = line.partition(":")
            assert key not in out, f"figure {key} defined twice"
            out[key] = definition.strip()
    return out


def rounded(value: float, text: str) -> Decimal:
    """``value`` rounded half up at the last digit ``text`` writes."""
    return Decimal(value).quantize(Decimal(1).scaleb(Decimal(text).as_tuple().exponent), rounding=ROUND_HALF_UP)


def wrong_figures(page: Path, text: str) -> list[str]:
    """One line per marked figure of ``text`` that differs from its rows."""
    defs = definitions(text)
    out = []
    for number, key in MARK.findall(text):
        assert key in defs, f"{page.name}: figure {key} has no definition"
        number = number.replace(",", "")
        value = evaluate(defs[key])
        if rounded(value, number) != Decimal(number):
            out.append(f"{key}: the text says {number}, the rows say {value!r} ({rounded(value, number)})")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_marked_figure_equals_its_rows(page):
    text = page.read_text()
    marks = MARK.findall(text)
    assert len(marks) == text.count("<!--f:"), "a marker without a figure right before it"
    assert marks, f"{page.name} marks no figure"
    wrong = wrong_figures(page, text)
    assert not wrong, f"{page.name}:\n" + "\n".join(wrong)
    unused = set(definitions(text)) - {key for _, key in marks}
    assert not unused, f"{page.name}: defined but never shown: {sorted(unused)}"


def test_the_check_can_fail():
    """A figure one last digit off is caught; rounding is half up at the text's last digit."""
    assert rounded(0.9375, "0.937") == Decimal("0.938") and rounded(0.93749, "0.937") == Decimal("0.937")
    assert rounded(1.64e-4, "1.6e-4") == Decimal("1.6e-4") and rounded(31.5, "32") == Decimal("32")
    page = ROOT / "README.md"
    text = page.read_text()
    number, key = MARK.findall(text)[-1]
    off = Decimal(number) + Decimal(1).scaleb(Decimal(number).as_tuple().exponent)
    bad = text.replace(f"{number}x<!--f:{key}-->", f"{off}x<!--f:{key}-->")
    assert bad != text
    assert wrong_figures(page, bad) == [f"{key}: the text says {off}, the rows say {evaluate(definitions(text)[key])!r} "
                                        f"({number})"]
    with pytest.raises(AssertionError, match="no row"):
        term("h200_depth.json", "max", "peak_gib", "variant=no-such-variant")


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_files(page):
    """Every relative link names an existing file, and its #anchor (if any) a heading of that file."""
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            missing.append(target)
    assert not missing, f"{page.name} links to missing files or headings: {missing}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters: {long}"
    text = "\n".join(lines)
    assert "cpu_v1_shim" not in text, "v1 users are not sent to a test-only shim"
    for command in ("bash scripts/main.sh", "bash scripts/test.sh", "DISABLE_VERSION_CHECK=1",
                    "`transformers>=4.55.0,<=5.6.0 is required`",
                    "RuntimeError: size mismatch, got input (2), mat (2x4096), vec (65667072)"):
        assert command in text, command


def test_readme_versions_table_is_the_policy():
    """The README's "tested" row tops out at versions.TESTED and its "refused" row is versions.MINIMUM."""
    from llamafactory_liger_fsdp import versions

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "":
            names = cells[1:]
        elif cells[0].startswith(("tested (CI", "refused")):
            rows[cells[0].split()[0]] = dict(zip(names, cells[1:]))
    for name in versions.MINIMUM:
        assert rows["refused"][name] == f"< {versions.MINIMUM[name]}", (name, rows["refused"])
        newest = re.findall(r"\d+(?:\.\d+)+(?:\.dev\d+)?", rows["tested"][name])[-1]
        assert newest == versions.TESTED[name], (name, rows["tested"][name], versions.TESTED[name])
