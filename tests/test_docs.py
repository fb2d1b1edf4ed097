"""Every repository path the docs name exists in the tree: backticked paths
(`narwhal/...py`, `tests/...`, `docs/...`, `spec/...`, `deploy/...`, `scripts/...`,
`conformance/...`, `generated/...`, `benchmarks/...`, `narwhal_bench/...`) and relative
Markdown links (and their #anchors: a heading of the page they point to), in README.md,
conformance/README.md, spec/README.md, scripts/*/README.md and every page under docs/. A
`path.py::name` also names a test or function in that file, which must be defined there.
Placeholders (`<ROW>`, `*`, `{a,b}`, `...`, NAME) are not paths.
The same pages' other facts: every `narwhal ...` command and flag they name exists, every
configuration key is in the schema, every `tox -e` environment is in tox.ini, and
spec/README.md names every table with its row IDs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "conformance" / "README.md", ROOT / "spec" / "README.md", *ROOT.glob("scripts/*/README.md"), *(ROOT / "docs").glob("*.md")])
PREFIXES = ("narwhal/", "narwhal_bench/", "tests/", "docs/", "spec/", "deploy/", "scripts/", "conformance/", "generated/", "benchmarks/")
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_ANCHORED = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")
_TOKEN = re.compile(r"[A-Za-z0-9_./:\-\[\]]+")


def _placeholder(p: str) -> bool:
    return any(c in p for c in "<>*{}$") or "..." in p or "…" in p or re.search(r"/[A-Z]{2,}(?:/|$|\.)", p) is not None


def named_paths(text: str) -> set[str]:
    """The repository paths a Markdown text names (backticked, or linked relatively)."""
    out = set()
    for code in _CODE.findall(text):
        for word in code.split():
            if _placeholder(word):
                continue
            for tok in _TOKEN.findall(word):
                tok = tok.rstrip(".,:;)")
                if tok.startswith(PREFIXES):
                    out.add(tok)
    return out


def links(text: str) -> set[str]:
    return {u for u in _LINK.findall(text) if "://" not in u and not u.startswith("mailto:")}


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces
    to hyphens, -1, -2 ... for repeats); code blocks hold no headings."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    out: set[str] = set()
    for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        base = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def anchored_links(text: str) -> set[tuple[str, str]]:
    """(file or "" for the same page, anchor) of every relative link with an anchor."""
    return {(f, a) for f, a in _ANCHORED.findall(text) if "://" not in f and (f == "" or f.endswith(".md"))}


def _check(path: str, base: Path) -> str | None:
    """None when `path` (optionally `file::name` or `file:LINE`) exists under base."""
    name = None
    if "::" in path:
        path, name = path.split("::", 1)
        name = re.split(r"[\[(]", name)[0]
    path = re.sub(r":\d+$", "", path)
    target = (base / path).resolve()
    if not target.exists():
        return f"{path} does not exist"
    if name:
        words = name.split("::")
        src = target.read_text(errors="replace")
        for w in words:
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(w)}\b|^{re.escape(w)}\s*[:=]", src, re.M):
                return f"{path} defines no {w}"
    return None


def test_named_paths_finds_paths_and_skips_placeholders() -> None:
    text = ("See `narwhal/core/sse.py`, `tests/abuse/test_clients.py::test_x[ping]`, `python scripts/compat/matrix.py`, "
            "`conformance/cases/<table>/<ROW>.yaml`, `spec/tables/*.yaml`, `narwhal/engines/...`, `deploy/`, "
            "`tables/refusals.yaml`, `narwhal serve`, and [ha](ha.md) or [x](https://example.org/a.md).")
    assert named_paths(text) == {"narwhal/core/sse.py", "tests/abuse/test_clients.py::test_x[ping]", "scripts/compat/matrix.py", "deploy/"}
    assert links(text) == {"ha.md"}


def test_slugs_follow_githubs_rules() -> None:
    md = "# Operations: a fleet\n## Stopping a router: SIGTERM\n```\n# not a heading\n```\n## Measured (`narwhal bench fleet`)\n## Notes\n## Notes\n"
    assert slugs(md) == {"operations-a-fleet", "stopping-a-router-sigterm", "measured-narwhal-bench-fleet", "notes", "notes-1"}
    assert anchored_links("[a](ops.md#x) [b](#y) [c](https://e.org/p.md#z) [d](../generated/TABLES.md#t)") == {("ops.md", "x"), ("", "y"), ("../generated/TABLES.md", "t")}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    wrong = [f"`{p}`: {err}" for p in sorted(named_paths(text)) if (err := _check(p, ROOT))]
    wrong += [f"link ({u}): {err}" for u in sorted(links(text)) if (err := _check(u, doc.parent))]
    for f, anchor in sorted(anchored_links(text)):
        target = doc if f == "" else (doc.parent / f).resolve()
        if target.exists() and anchor not in slugs(target.read_text()):
            wrong.append(f"link ({f}#{anchor}): {f or doc.name} has no heading with that anchor")
    assert not wrong, f"{doc.relative_to(ROOT)} names paths that are not in the tree:\n" + "\n".join(wrong)


# -- commands and flags the docs name ------------------------------------------------------

_CMD = re.compile(r"\s*(?:[A-Z_]+=\S*\s+)*narwhal ((?:bench |spec |gateway )?[a-z][a-z-]*)((?: +[^\s`]+)*)")


def commands(text: str) -> set[tuple[str, str]]:
    """(subcommand, --flag) pairs, and (subcommand, "") for each subcommand, that backticked
    `narwhal ...` command lines in a Markdown text use."""
    out: set[tuple[str, str]] = set()
    for code in _CODE.findall(text):
        for part in re.split(r"&&|;|\|(?!\|)| then ", code):
            m = _CMD.match(part)
            if not m:
                continue
            sub = m.group(1).strip()
            if sub.startswith("spec "):
                sub = "spec"
            out.add((sub, ""))
            for word in m.group(2).split():
                flag = word.strip("[]()…,.").split("=", 1)[0]
                if flag.startswith("--") and len(flag) > 2 and not _placeholder(flag):
                    out.add((sub, flag))
    return out


def test_commands_are_read_from_code_spans() -> None:
    text = ("Run `narwhal bench relay --window 10 [--http 2]` or `narwhal serve --config FILE`; `narwhal spec check`, "
            "`pip install -e . && narwhal serve`, `NARWHAL_BENCH_NOPIN=1 narwhal bench paired` and `kubectl -n narwhal delete pod x`.")
    assert commands(text) == {("bench relay", ""), ("bench relay", "--window"), ("bench relay", "--http"), ("serve", ""), ("serve", "--config"), ("spec", ""), ("bench paired", "")}


def _help(sub: str) -> str | None:
    """`narwhal SUB --help`'s text, or None when SUB is no subcommand."""
    import contextlib
    import io

    from narwhal.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*sub.split(), "--help"])
        except SystemExit as e:
            if e.code:
                return None
    return buf.getvalue()


_NAMED = sorted({c for d in DOCS for c in commands(d.read_text())})


@pytest.mark.parametrize("sub", sorted({s for s, _ in _NAMED}))
def test_every_command_and_flag_the_docs_name_exists(sub: str) -> None:
    text = _help(sub)
    assert text is not None, f"`narwhal {sub}` is named in the docs and is no subcommand"
    flags = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", text))
    unknown = sorted({f for s, f in _NAMED if s == sub and f and f not in flags})
    where = {f: [str(d.relative_to(ROOT)) for d in DOCS if (sub, f) in commands(d.read_text())] for f in unknown}
    assert not unknown, f"`narwhal {sub}` has no flag(s): {where}"


# -- spec/README.md's table of tables ------------------------------------------------------


def _ranges(ids: list[str]) -> str:
    """IDs as spec/README.md writes them: one "X01–Xnn" per letter, in order of appearance."""
    by: dict[str, list[int]] = {}
    for i in ids:
        by.setdefault(i[0], []).append(int(i[1:]))
    return ", ".join(f"{k}{min(v):02d}–{k}{max(v):02d}" for k, v in by.items())


def test_spec_readme_names_every_table_with_its_rows() -> None:
    import yaml

    text = (ROOT / "spec" / "README.md").read_text()
    wrong = []
    for table in sorted((ROOT / "spec" / "tables").glob("*.yaml")):
        doc = yaml.safe_load(table.read_text())
        ids = [r["id"] for v in doc.values() if isinstance(v, list) for r in v if isinstance(r, dict) and re.fullmatch(r"[A-Z]\d\d", str(r.get("id")))]
        want = f"| `tables/{table.name}` | {_ranges(ids)} |"
        if want not in text:
            wrong.append(want)
    assert not wrong, "spec/README.md should have these rows (file and row IDs):\n" + "\n".join(wrong)


# -- configuration keys and tox environments the docs name ---------------------------------


def _schema_keys() -> set[str]:
    import json

    from narwhal.specgen.config_doc import config_keys

    return {k["path"] for k in config_keys(json.loads((ROOT / "spec" / "schema" / "config.schema.json").read_text()))}


def config_keys_named(text: str, sections: set[str]) -> set[str]:
    """Dotted configuration keys in a text's code spans (`serving.workers`,
    `engines[].model`, `tenants.NAME.weight`); file names and placeholders are not keys."""
    alt = "|".join(sorted(sections))
    pat = re.compile(r"(?<![\w./-])((?:" + alt + r")(?:\[\])?(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
    out = set()
    for code in _CODE.findall(text):
        for m in pat.finditer(code):
            key = m.group(1)
            if not re.search(r"\.(py|md|yaml|json|c|NAME)$", key):
                out.add(key)
    return out


def test_config_keys_are_read_from_code_spans() -> None:
    text = "`serving.workers: 4`, `engines[].model`, `ha.py`, `tenants.quiet.weight`, serving.prose and `x.serving.no`"
    assert config_keys_named(text, {"serving", "engines", "ha", "tenants"}) == {"serving.workers", "engines[].model", "tenants.quiet.weight"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_configuration_key_a_doc_names_is_in_the_schema(doc: Path) -> None:
    keys = _schema_keys()
    sections = {k.split(".")[0].split("[")[0] for k in keys}
    wrong = []
    for key in sorted(config_keys_named(doc.read_text(), sections)):
        k = re.sub(r"^engines\.", "engines[].", re.sub(r"^tenants\.(?!NAME\b)[A-Za-z0-9_-]+", "tenants.NAME", key))
        if k not in keys and not any(x.startswith(k + ".") for x in keys):
            wrong.append(key)
    assert not wrong, f"{doc.relative_to(ROOT)} names configuration keys the schema does not have: {wrong}"


def test_every_tox_environment_the_docs_name_exists() -> None:
    import configparser

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    envs = {s.split(":", 1)[1] for s in ini.sections() if s.startswith("testenv:")}
    named = {e for d in DOCS for e in re.findall(r"tox -e ([a-z0-9-]+)", d.read_text())}
    assert named and named <= envs, f"tox environments named in the docs but not in tox.ini: {sorted(named - envs)}"


def test_conformance_readme_names_the_suite_version() -> None:
    from narwhal_conformance import SUITE_VERSION

    assert f"Suite version: **{SUITE_VERSION}**" in (ROOT / "conformance" / "README.md").read_text()
