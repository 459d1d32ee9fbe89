"""The docs run: code blocks in README.md and docs/*.md, their links and the files they name.

The convention, for whoever writes docs:

- A fenced ```bash / ```sh / ```python block runs, unless the line just before it (blank lines
  aside) is ``<!-- no-run: REASON -->``, or ``<!-- slow: REASON -->`` for one that needs the
  real model (run with the ``slow`` tests). Blocks of any other language (```text, none) are
  prose and never run.
- Whether they run or not, every ```python block must compile and use no undefined name
  (ruff's F821), every ``ragkv ...`` line of a shell block must parse with the CLI as it is
  (commands and options exist), and every ``python path.py`` in one must name a file that exists
  (docs/benchmarks-history.md aside: its commands are a record of past commits).
- Relative links (``[text](path#anchor)``) must reach a file or folder of the repository, and an
  anchor must be a heading of the page it points to; a ``*.md`` file named in inline code must exist.

Blocks run in a temporary folder holding a ``docs/`` with one small real page (what the
snippets index), with ``RAGKV_DATA_DIR`` there and the CLI of this checkout first on ``PATH``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL, PYTHON = ("bash", "sh", "shell"), ("python", "py")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>no-run|slow)\s*:\s*(?P<reason>.*?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)")
NAMED_MD = re.compile(r"(?<![\w/.-])(?P<name>[\w./-]+\.md)\b")  # a page named in prose or inline code


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # "no-run" | "slow" | None (runs with the fast tests)
    reason: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_blocks(page: Path, text: str) -> list[Block]:
    """The fenced blocks of ``text`` (``page``'s contents) with the marker just before each."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, indent = i, m["fence"], len(m["indent"])
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        mark = MARKER.match(before)
        blocks.append(
            Block(
                page, start + 1, m["lang"].lower(), "\n".join(body) + "\n",
                mark["kind"] if mark else None, mark["reason"] if mark else "",
            )
        )  # fmt: skip
    return blocks


def prose(text: str) -> str:
    """``text`` without its fenced blocks (links inside code are code, not links)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m["fence"]
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.*)$", prose(page.read_text()), re.M)}


def shell_commands(script: str) -> list[list[str]]:
    """Each simple command of a shell block as words: continuations joined, comments, ``VAR=x``
    prefixes and everything after ``&``, ``|``, ``;`` or a redirection dropped."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = []
        for word in lexer:
            if set(word) <= set("&|;<>()"):
                break
            words.append(word)
        while words and re.match(r"^\w+=", words[0]):
            words.pop(0)
        if words:
            commands.append(words)
    return commands


ALL_BLOCKS = [b for page in PAGES for b in parse_blocks(page, page.read_text())]
RUNNABLE = [b for b in ALL_BLOCKS if b.lang in SHELL + PYTHON and b.marker != "no-run"]


def block_id(b: Block) -> str:
    return b.where


# ---- the convention itself --------------------------------------------------------------------


def test_parse_blocks_reads_languages_markers_and_indentation():
    text = "intro\n\n<!-- no-run: needs a GPU -->\n```bash\nmake gpu\n```\n\n- item\n\n  ```python\n  x = 1\n  ```\n"
    first, second = parse_blocks(ROOT / "README.md", text)
    assert (first.lang, first.marker, first.reason, first.text, first.line) == (
        "bash",
        "no-run",
        "needs a GPU",
        "make gpu\n",
        4,
    )
    assert (second.lang, second.marker, second.text) == ("python", None, "x = 1\n")


def test_shell_commands_split_like_a_shell():
    script = 'X=1 ragkv ask "a b" --json  # note\nragkv serve --port 8 &\nragkv bench fusion \\\n  --limit 2 | tee o\n'
    assert shell_commands(script) == [["ragkv", "ask", "a b", "--json"], ["ragkv", "serve", "--port", "8"],
                                      ["ragkv", "bench", "fusion", "--limit", "2"]]  # fmt: skip


def test_every_marker_gives_a_reason_and_sits_on_a_block_that_could_run():
    for b in ALL_BLOCKS:
        if b.marker:
            assert b.reason, f"{b.where}: <!-- {b.marker}: REASON --> needs its reason"
            assert b.lang in SHELL + PYTHON, f"{b.where}: a ```{b.lang} block never runs; drop the marker"


def test_benchmark_page_blocks_never_run_in_the_tests():
    """docs/benchmarks.md holds the commands behind its figures: minutes to hours each, often on a
    real model. A new one must say so with a marker, or the fast tests would run the benchmark."""
    page = ROOT / "docs" / "benchmarks.md"
    unmarked = [b.where for b in ALL_BLOCKS if b.page == page and b.lang in SHELL + PYTHON and b.marker is None]
    assert not unmarked, f"add <!-- no-run: a benchmark ... --> (or slow:) before: {unmarked}"


# ---- static checks on every block -------------------------------------------------------------


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in PYTHON], ids=block_id)
def test_python_blocks_compile_and_use_no_undefined_name(block):
    compile(block.text, block.where, "exec")
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the dev extra)")
    out = subprocess.run(
        [ruff, "check", "--isolated", "--select", "F821", "--output-format", "concise", "--stdin-filename", "b.py"],
        input=block.text, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, f"{block.where}: {out.stdout}"


def cli_checker(calls: list[tuple[str, dict]]):
    """The CLI's click command with every command body replaced by one that records its arguments
    in ``calls``: main() then only parses."""
    from typer.main import get_command

    from ragkv import cli

    root = get_command(cli.app)

    def mute(command) -> None:
        command.callback = lambda *a, **k: calls.append((command.name, k))
        for sub in getattr(command, "commands", {}).values():
            mute(sub)

    mute(root)
    return root


# The benchmarks' journal keeps its commands as they ran at their commit (its header names it):
# scripts moved and options renamed since are part of the record, so today's CLI does not judge them.
HISTORY = ROOT / "docs" / "benchmarks-history.md"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in SHELL and b.page != HISTORY], ids=block_id)
def test_shell_blocks_name_real_commands_options_and_files(block, capsys):
    calls: list[tuple[str, dict]] = []
    root = cli_checker(calls)
    for words in shell_commands(block.text):
        program = Path(words[0]).name
        if program == "ragkv":
            try:
                root.main(words[1:], prog_name="ragkv", standalone_mode=False)
            except Exception as e:  # click's UsageError and friends: the docs name what is not there
                pytest.fail(f"{block.where}: `{shlex.join(words)}`: {e}")
            # the paths an example indexes are the clone's (absolute ones stand for the reader's own)
            for name, args in calls:
                for path in args.get("paths") or [] if name == "index" else []:
                    assert path.is_absolute() or (ROOT / path).exists(), f"{block.where}: {path} does not exist"
            calls.clear()
        elif program.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
            assert (ROOT / words[1]).is_file(), f"{block.where}: {words[1]} does not exist"
    capsys.readouterr()  # --help and --version print


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_named_pages_exist(page):
    text = prose(page.read_text())
    dead = []
    for m in LINK.finditer(text):
        target = m["target"] or m["image"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target} (no heading #{anchor})")
    for m in NAMED_MD.finditer(LINK.sub("", text)):
        name = m["name"]
        if not any((base / name).exists() for base in (page.parent, ROOT)):
            dead.append(f"`{name}` (no such page)")
    assert not dead, f"{page.relative_to(ROOT)}: {dead}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md" and f"({p.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


# ---- running ------------------------------------------------------------------------------------

# Runs python blocks one after another in one process (torch is imported once, not per block), each
# in a namespace and a folder of its own; prints {where: traceback or None} as JSON.
RUNNER = """
import json, os, sys, traceback
results = {}
for item in json.load(open(sys.argv[1])):
    os.chdir(item["cwd"])
    try:
        exec(compile(item["code"], item["where"], "exec"), {"__name__": "__main__"})
        results[item["where"]] = None
    except BaseException:
        results[item["where"]] = traceback.format_exc()
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def model_cache() -> Path:
    """The test session's conversion cache (tests/conftest.py), never the user's: the default model is
    converted once per session, not once more here."""
    return Path(os.environ["RAGKV_MODEL_CACHE"])


def workspace(folder: Path, model_cache: Path) -> dict[str, str]:
    """Make ``folder`` a block's working folder; the environment to run it with."""
    (folder / "docs").mkdir(parents=True)
    # what the snippets' rag.index(["docs/"]) reads: one small page, so indexing costs a chunk or two
    shutil.copy(ROOT / "docs" / "README.md", folder / "docs" / "README.md")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGKV_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        RAGKV_DATA_DIR=str(folder / "data"), RAGKV_MODEL_CACHE=str(model_cache),
        RAGKV_KERNEL_CACHE=os.environ["RAGKV_KERNEL_CACHE"],  # the session's (tests/conftest.py)
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    return env


def run_python(blocks: list[Block], folder: Path, model_cache: Path) -> dict[str, str | None]:
    """Run ``blocks`` in one process; each block's traceback, or None where it ran through."""
    items = []
    for n, b in enumerate(blocks):
        env = workspace(folder / str(n), model_cache)
        items.append({"where": b.where, "code": b.text, "cwd": str(folder / str(n))})
    (folder / "blocks.json").write_text(json.dumps(items))
    cmd = [sys.executable, "-c", RUNNER, str(folder / "blocks.json"), str(folder / "results.json")]
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((folder / "results.json").read_text())


def run_shell(block: Block, folder: Path, model_cache: Path) -> None:
    env = workspace(folder, model_cache)
    cmd = ["bash", "-euo", "pipefail", "-c", block.text]
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{block.where} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_run_python_reports_each_blocks_failure_apart(tmp_path, model_cache):
    ok = Block(ROOT / "README.md", 1, "python", "import os\nassert os.path.isdir('docs')\n", None, "")
    bad = Block(ROOT / "README.md", 2, "python", "print(retrieved_texts)\n", None, "")
    results = run_python([bad, ok], tmp_path, model_cache)
    assert results["README.md:1"] is None and "NameError" in results["README.md:2"]


FAST = [b for b in RUNNABLE if b.marker is None]
SLOW = [b for b in RUNNABLE if b.marker == "slow"]


@pytest.fixture(scope="module")
def fast_python_results(tmp_path_factory, model_cache) -> dict[str, str | None]:
    return run_python([b for b in FAST if b.lang in PYTHON], tmp_path_factory.mktemp("blocks"), model_cache)


@pytest.mark.parametrize("block", FAST, ids=block_id)
def test_block_runs(block, tmp_path, model_cache, request):
    if block.lang in PYTHON:
        error = request.getfixturevalue("fast_python_results")[block.where]
        assert error is None, f"{block.where} raised:\n{error}"
    else:
        run_shell(block, tmp_path, model_cache)


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW, ids=block_id)
def test_slow_block_runs(block, tmp_path, model_cache):
    if block.lang in PYTHON:
        error = run_python([block], tmp_path, model_cache)[block.where]
        assert error is None, f"{block.where} raised:\n{error}"
    else:
        run_shell(block, tmp_path, model_cache)
