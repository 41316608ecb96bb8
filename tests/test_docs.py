"""The documentation site (mkdocs.yml, docs/): its reference pages are what docs/gen.py makes, it builds with no
warning, its pages name every spec key and metric and cite nothing a reader cannot open, and the quickstart's
commands run as written."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from process_tree import sigkill_driver

DOCS = ROOT / "docs"
README_MAX_LINES = 200
RUNNABLE = "<!-- runnable -->"
RUNNABLE_LANGUAGES = ("bash", "sh", "shell")  # not `console`: its lines carry prompts and output
_FENCE = re.compile(r"(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<language>[\w+-]*)")


def _gen():
    """docs/gen.py as a module (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("docs_gen", DOCS / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list:
    """The prose a reader follows: README.md, CONTRIBUTING.md and every page under docs/."""
    return [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.is_file()] + sorted(DOCS.rglob("*.md"))


def runnable_blocks(text: str) -> list[str]:
    """The shell blocks of a page marked runnable (a `<!-- runnable -->` line right above the opening fence), in
    order. A marker above anything else is a mistake in the page, and raises ValueError."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        opening = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if opening is None or opening["language"] not in RUNNABLE_LANGUAGES:
            raise ValueError(f"line {i + 1}: {RUNNABLE} must sit on the line right above a ```bash, ```sh or "
                             f"```shell fence")
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*")
        body = []
        for inner in lines[i + 2:]:
            if closing.fullmatch(inner):
                break
            body.append(inner[len(indent):] if inner.startswith(indent) else inner.lstrip())
        else:
            raise ValueError(f"line {i + 2}: the runnable block's fence is never closed")
        blocks.append("\n".join(body) + "\n")
    return blocks


def test_reference_pages_are_what_gen_makes():
    stale = [relative for relative, text in _gen().pages().items()
             if not (ROOT / relative).is_file() or (ROOT / relative).read_text() != text]
    assert not stale, f"{', '.join(stale)} differ from the schema or the parser: run `python docs/gen.py`"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as `mkdocs build --strict` makes it: (the build's process, its folder)."""
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: they are in the test extras (pip install -e '.[test]')"
    folder = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(folder)],
        cwd=ROOT,  # pymdownx.snippets' base_path is relative to it
        env={**{k: v for k, v in os.environ.items() if k != "RAYSWEEP_REPO_URL"}, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True, text=True, timeout=300)
    return proc, folder


def test_site_builds_with_no_warning(site):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a nav entry with no page, a
    snippet that is not there, each fails the build (mkdocs.yml's validation)."""
    proc, _ = site
    problems = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    if proc.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(problems or [proc.stderr[-5000:]]))


def test_every_repository_file_a_page_names_is_a_link_that_opens(site):
    """docs/hooks.py: `cluster.yaml`, `tests/test_ray_up.py`… in a page's text link to a copy shipped with the site
    (no repo_url set), and each link lands on the file's own text."""
    proc, folder = site
    assert proc.returncode == 0, proc.stderr[-3000:]
    linked, dead = set(), []
    for page in folder.rglob("index.html"):
        for target in re.findall(r'href="([^"#]*src/[^"#]+\.txt)"', page.read_text()):
            shipped = (page.parent / target).resolve()
            source = ROOT / shipped.relative_to(folder / "src").as_posix().removesuffix(".txt")
            if not shipped.is_file() or shipped.read_bytes() != source.read_bytes():
                dead.append(f"{page.relative_to(folder)} → {target}")
            linked.add(source.relative_to(ROOT).as_posix())
    assert not dead, dead
    assert {"cluster.yaml", "benchmarks/RESULTS.md", "tests/test_ray_up.py", "deploy/make_env.py"} <= linked, linked
    unlinked = [f"{page.relative_to(folder)}: {name}" for page in folder.rglob("index.html") if "src" not in page.parts
                for name in re.findall(r"<code>((?:benchmarks|tests|raysweep|deploy|search_spaces)/[\w./-]+)</code>",
                                       re.sub(r"<a [^>]*><code>[^<]*</code></a>", "", page.read_text()))
                if (ROOT / name).is_file() and not name.startswith("docs/")]
    assert not unlinked, unlinked


@pytest.mark.timeout(300)
def test_every_page_is_readable_at_1280_px(site, browser):
    """No code block, command or table of any page is cut off (scrolled) in a 1280 px wide window."""
    proc, folder = site
    assert proc.returncode == 0, proc.stderr[-3000:]
    browser.set_window_size(1280, 900)
    cut = []
    pages = sorted(p for p in folder.rglob("index.html") if "src" not in p.relative_to(folder).parts)
    for page in pages:
        browser.get(page.as_uri())
        found = browser.execute_script("""
            const out = [];
            for (const el of document.querySelectorAll(
                    '.md-content pre > code, .md-content .md-typeset__scrollwrap, .md-content table')) {
                if (el.scrollWidth > el.clientWidth + 1) out.push(el.tagName + ': ' + el.innerText.slice(0, 60));
            }
            return out;""")
        cut += [f"{page.parent.relative_to(folder)}: {what}" for what in found]
    assert len(pages) >= 10 and not cut, "\n".join(cut)


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_spec_reference_names_every_key():
    from raysweep.config import iter_keys

    page = (DOCS / "reference" / "spec.md").read_text()
    keys = [key for key, _, _ in iter_keys()]
    assert len(keys) > 40
    missing = [key for key in keys if f"`{key}`" not in page]
    assert not missing, f"docs/reference/spec.md lacks {missing}: run `python docs/gen.py`"


def test_commands_reference_names_every_option():
    from raysweep.cli import build_parser

    gen = _gen()
    page = (DOCS / "reference" / "commands.md").read_text()
    missing = [f"{name} {option}" for name, _, sub in gen._subcommands(build_parser()) for action in sub._actions
               for option in action.option_strings if option not in ("-h", "--help") and f"`{option}" not in page]
    assert not missing, f"docs/reference/commands.md lacks {missing}: run `python docs/gen.py`"
    for named in ("--progress-every", "--max-batch", "--set"):
        assert f"`{named}" in page


def test_results_page_names_every_metric():
    from raysweep.metrics import METRIC_NAMES

    page = DOCS / "results.md"
    assert page.is_file(), "docs/results.md is missing"
    missing = [name for name in METRIC_NAMES if f"`{name}`" not in page.read_text()]
    assert not missing, f"docs/results.md lacks {missing}"


# what a reader of the published pages cannot follow: our tracker is not public (an upstream issue is written
# `ray #12345` or as its full URL), and the machines, device calls and folders of the sessions that wrote raysweep
# are nowhere a reader can look
MACHINE = "a machine only the authors had"
UNFOLLOWABLE = {
    "an issue of a tracker the reader cannot see": re.compile(r"\bissues?\s*#\s*\d+|\bissues?\s+\d+", re.IGNORECASE),
    MACHINE: re.compile(r"\b[Mm]achines? [A-D]\b"),
    "a device call": re.compile(r"\bdevice calls?\b", re.IGNORECASE),
    "a path outside the repository": re.compile(r"(?<![\w.~-])(?:\.\./shared|/work/)"),
}


def _benchmark_texts() -> list:
    """benchmarks/RESULTS.md and the benchmarks' scripts: held to the same rule, but for machines A-D, which
    RESULTS.md defines at its top."""
    folder = ROOT / "benchmarks"
    return [folder / "RESULTS.md"] + sorted(folder.glob("*.sh")) + sorted(folder.glob("*.py"))


def test_pages_cite_nothing_a_reader_cannot_open():
    found = []
    benchmark_patterns = {what: p for what, p in UNFOLLOWABLE.items() if what != MACHINE}
    for path, patterns in [(p, UNFOLLOWABLE) for p in _pages()] + [(p, benchmark_patterns) for p in _benchmark_texts()]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in patterns.items():
                for match in pattern.finditer(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_unfollowable_patterns():
    hits = [line for line in (
        "see issue 12", "as issue #7 says", "issues #3", "on machine A", "machines B and C", "a device call",
        "in ../shared/notes", "at /work/main/x",
    ) if not any(p.search(line) for p in UNFOLLOWABLE.values())]
    assert not hits, f"not caught: {hits}"
    fine = [line for line in (
        "ray #54305", "https://github.com/ray-project/ray/issues/54305", "a machine with 8 GPUs",
        "one A100 machine", "machine-readable", "s3://bucket/work/x", "./work/", "an issue with 2 GPUs",
    ) if any(p.search(line) for p in UNFOLLOWABLE.values())]
    assert not fine, f"caught: {fine}"


def test_runnable_blocks_are_the_marked_shell_blocks():
    text = "\n".join([
        "Intro.", "", RUNNABLE, "```bash", "pip install -e .", "python -m raysweep check x.yaml", "```", "",
        "```bash", "not marked", "```", "",
        RUNNABLE, "````sh", "cat <<'EOF'", "```", "EOF", "````", "",
        "!!! note", "", f"    {RUNNABLE}", '    ```shell title="in a note"', "    echo indented", "      two",
        "    ```",
        "", RUNNABLE, "~~~bash", "echo tilde", "~~~",
    ])
    assert runnable_blocks(text) == [
        "pip install -e .\npython -m raysweep check x.yaml\n", "cat <<'EOF'\n```\nEOF\n", "echo indented\n  two\n",
        "echo tilde\n",
    ]
    assert runnable_blocks("```bash\necho unmarked\n```\n") == []


@pytest.mark.parametrize("text", [
    f"{RUNNABLE}\n\n```bash\necho a blank line between\n```\n",
    f"{RUNNABLE}\n```console\n$ echo prompts\n```\n",
    f"{RUNNABLE}\n```python\nprint()\n```\n",
    f"{RUNNABLE}\n```bash\necho never closed\n",
    f"text\n{RUNNABLE}",
])
def test_a_misplaced_runnable_marker_is_an_error(text):
    with pytest.raises(ValueError):
        runnable_blocks(text)


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_quickstart_runnable_blocks_run(tmp_path):
    """What docs/quickstart.md marks runnable runs, in order, as a reader would: `bash -euo pipefail`, in a folder
    with search_spaces/ (where the sweep's results and mlflow.db land), each block exiting 0."""
    blocks = runnable_blocks((DOCS / "quickstart.md").read_text())
    assert blocks, f"docs/quickstart.md marks no block {RUNNABLE}: nothing would check that its commands run"
    shutil.copytree(ROOT / "search_spaces", tmp_path / "search_spaces")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           # `python` in a block is this test's interpreter (the one raysweep is installed in)
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}
    deadline = time.monotonic() + 870  # inside the test's 900 s, so a slow block fails with its output
    for n, block in enumerate(blocks, 1):
        log = tmp_path / f"block{n}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, min(600.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            sigkill_driver(proc)  # and the local Ray cluster its sweep started
            code = "nothing: it ran past its deadline"
        assert code == 0, (f"runnable block {n} of docs/quickstart.md exited {code}:\n{block}\n--- the end of its "
                           f"output:\n{log.read_text()[-4000:]}")


def test_the_tutorials_schedule_is_raysweeps_lr_at_step_for_step():
    """docs/first-sweep.md's training script says its lr_at is raysweep's (optim.lr_at): the same LR at every step,
    past the end and for a peak below min_lr too (the page's cosine ran to min_lr, upwards from such a peak)."""
    import math

    from raysweep.optim import lr_at

    text = (DOCS / "first-sweep.md").read_text()
    start = text.index("def lr_at(step):")
    source = text[start:text.index("\n\n", start)]
    for peak, floor, warmup, total in ((1e-3, 1e-6, 10, 100), (4e-3, 1e-6, 0, 37), (5e-7, 1e-6, 3, 20),
                                       (2e-3, 1e-4, 5, 5)):
        scope = {"math": math, "a": {"peak_lr": peak, "min_lr": floor}, "warmup": warmup, "total": total}
        exec(source, scope)
        for step in range(total + 5):
            assert scope["lr_at"](step) == pytest.approx(lr_at(step, peak, floor, warmup, total), rel=1e-12), \
                (peak, floor, warmup, total, step)
