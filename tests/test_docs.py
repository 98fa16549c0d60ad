"""The source and the docs: scgrpo.py reads as declared (its length, its sections in data-flow
order, --help from the Config), every docs link resolves."""
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from machinery import cli
from variants import dapo
from variants import eq5_options
import scgrpo as S
from conftest import HERE


def project_text(*path):
    """The text of a file of the project, by its path's parts."""
    with open(os.path.join(HERE, *path), encoding="utf-8") as f:
        return f.read()


def bash_blocks(markdown):
    """The bodies of a Markdown text's bash code blocks, in order."""
    return re.findall(r"```bash\n(.*?)```", markdown, re.S)


def test_readme_reading_table_names_what_scgrpo_defines_in_its_order():
    """docs/notes.md's 'Reading the code' table: every name in it is defined at the top level of
    scgrpo.py (a def, a class or an assignment), in the table's order, and the line counts there
    and in README are the file's."""
    notes = project_text("docs", "notes.md")
    section = notes.split("## Reading the code")[1].split("A test holds")[0]
    src = project_text("scgrpo.py")
    lines = src.splitlines()
    names = re.findall(r"`([A-Za-z_]\w*)`", section)
    assert len(names) >= 25, names
    at = []
    for name in names:
        found = [i for i, line in enumerate(lines) if re.match(rf"(def {name}\(|class {name}\b|{name} = )", line)]
        assert found, name
        at.append(found[0])
    assert at == sorted(at), [n for n, a, b in zip(names, at, sorted(at)) if a != b]
    readme = project_text("README.md")
    for text in (section, readme):
        counts = re.search(r"\(([\d,]+) lines, ([\d,]+) of them code\)", text)
        assert (int(counts[1].replace(",", "")), int(counts[2].replace(",", ""))) == (len(lines), code_lines(src))


def heading_anchors(path):
    """The section anchors GitHub gives a Markdown file's headings: lower case, punctuation but
    '-' and '_' dropped, spaces as '-', a repeated heading numbered -1, -2, ..."""
    out, seen = set(), {}
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return out


def test_docs_links_resolve_the_index_lists_every_page_and_readme_fits_a_page():
    """Every relative link of README, variants/README.md and docs/**/*.md (studies' run logs aside)
    points to a file that exists and, with a #section, to a heading of that file; docs/README.md
    links every page of docs/ (bench/ and a folder of raw outputs with its own README are one link
    each); no benchmark or profile
    output sits at docs/'s top level; README is at most 150 lines and 1,500 words."""
    pages = [os.path.join(HERE, "README.md"), os.path.join(HERE, "variants", "README.md")]
    pages += [p for p in glob.glob(os.path.join(HERE, "docs", "**", "*.md"), recursive=True)
              if "run_logs" not in p and os.sep + "bench" + os.sep not in p]
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full) or (anchor and full.endswith(".md") and anchor not in heading_anchors(full)):
                broken.append(f"{os.path.relpath(page, HERE)}: {target}")
    assert broken == []
    index = project_text("docs", "README.md")
    linked = {os.path.normpath(os.path.join(HERE, "docs", t.partition("#")[0]))
              for t in re.findall(r"\]\(([^)\s]+)\)", index)}
    # a page is listed when the index links it, or the README of its own folder (raw outputs)
    unlisted = [os.path.relpath(p, HERE) for p in pages if p.startswith(os.path.join(HERE, "docs") + os.sep)
                and p != os.path.join(HERE, "docs", "README.md") and p not in linked
                and os.path.join(os.path.dirname(p), "README.md") not in linked]
    assert unlisted == [] and os.path.join(HERE, "docs", "bench") in linked
    assert not [n for n in os.listdir(os.path.join(HERE, "docs")) if re.match(r"(bench|profile)_", n)]
    readme = project_text("README.md")
    assert len(readme.splitlines()) <= 150 and len(readme.split()) <= 1500


def code_lines(src):
    """Lines that are not blank, comment or docstring (the count README states)."""
    import ast
    tree, doc = ast.parse(src), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and n not in doc)


def test_source_reads_as_declared_and_help_comes_from_the_config(capsys):
    """scgrpo.py is at most 600 lines, 400 of code, with its sections in data-flow order and no
    variant's branch in it; no line of it, its companions or its variants over 100 columns, no
    companion over 400 lines, no variant over 150; no companion imports scgrpo.py (no cycle), each
    variant does and assigns none of its names; no behaviour keyed on the algo string but --algo
    grpo's routes in main(); --help shows each Config field's own help text, a variant's too."""
    folders = {"machinery": "companion", "variants": "variant"}
    names = {"scgrpo.py": "story", **{os.path.join(d, n): kind for d, kind in folders.items()
                                      for n in sorted(os.listdir(os.path.join(HERE, d)))
                                      if n.endswith(".py") and not n.startswith("test_") and n != "__init__.py"}}
    src = {}
    for name, kind in names.items():
        src[name] = project_text(name)
        assert [i + 1 for i, line in enumerate(src[name].splitlines()) if len(line) > 100] == [], name
        imports = re.search(r"^\s*(import scgrpo|from scgrpo)", src[name], re.M)
        if kind == "companion":
            assert len(src[name].splitlines()) <= 400 and not imports, name
        if kind == "variant":
            assert len(src[name].splitlines()) <= 150 and imports, name
            assert not re.search(r"^\s*S\.\w+ = ", src[name], re.M), name  # no patching of scgrpo
        if kind != "story":
            assert not re.search(r"\.algo ==", src[name]), name  # a variant asks for what it needs
    lines = src["scgrpo.py"].splitlines()
    assert len(lines) <= 600 and code_lines(src["scgrpo.py"]) <= 400
    assert not re.search(r"dapo|eq5_(window|score|only_step)|overlong|epsilon_high|usable", src["scgrpo.py"], re.I)
    keyed = [i for i, line in enumerate(lines) if re.search(r"\.algo\b", line)]
    main_at = next(i for i, line in enumerate(lines) if line.startswith("def main"))
    assert len(keyed) == 1 and keyed[0] > main_at, keyed  # --algo grpo: GRPO's routes, in main()
    order = ["class Config", "def verify", "def encode_prompt", "def sample", "def sample_answers",
             "def sample_groups", "def group_advantages", "def route_groups", "def grpo_routes", "def make_batch",
             "def teacher_prompts", "def teacher_kl", "def teacher_pass", "def sc_weights", "def weigh_tokens",
             "def diversity_advantages", "def sc_credit", "def policy_loss", "def micro_batch_loss", "def update",
             "def train_step", "def evaluate", "def train(", "def main"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(key)) for key in order]
    assert at == sorted(at), [k for k, a, b in zip(order, at, sorted(at)) if a != b]
    with pytest.raises(SystemExit):
        cli.parse_config(S.Config, S.PRESETS, ["--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse re-wraps, also at hyphens
    for f in dataclasses.fields(S.Config):
        assert "".join(f.metadata["help"].split()) in out, f.name
    for variant in (dapo, eq5_options):
        with pytest.raises(SystemExit):
            variant.main(["--help"])
        out = "".join(capsys.readouterr().out.split())
        for f in dataclasses.fields(variant.Config):
            assert "".join(f.metadata["help"].split()) in out, (variant.__name__, f.name)


def test_the_fork_variants_readme_shows_is_the_file_the_suite_runs():
    """variants/README.md's 'Checking a fork' shows weight_floor.py's code and its test as they are
    (each python block appears in its file, verbatim); the fork is at most 40 lines of code, the
    count README gives."""
    checking = project_text("variants", "README.md").split("## Checking a fork")[1]
    blocks = re.findall(r"```python\n(.*?)```", checking, re.S)
    assert len(blocks) == 2
    for block, name in zip(blocks, ("weight_floor.py", "test_weight_floor.py")):
        src = project_text("variants", name)
        assert block in src, name
    n = code_lines(project_text("variants", "weight_floor.py"))
    assert n <= 40 and f"({n} lines of code)" in " ".join(project_text("README.md").split())


def test_readmes_test_command_is_what_ci_runs(request):
    """The test command README shows (in its first code block) is the last line of .ci/run,
    which CI runs in a fresh virtual environment, and the number of tests it (and the status
    line) says is the number pytest collects (this session's, when it holds every test file
    unfiltered; else a collection of its own)."""
    readme = project_text("README.md")
    block = bash_blocks(readme)[0].splitlines()
    command, said = next(line for line in block if "tools/test.sh" in line).split("#")
    ci_command = project_text(".ci", "run").strip().splitlines()[-1]
    assert ci_command == command.strip() == "bash tools/test.sh"
    files = {"test_scgrpo.py", *glob.glob("tests/test_*.py", root_dir=HERE),
             *glob.glob("variants/test_*.py", root_dir=HERE)}
    items = request.session.items
    if (not request.config.option.keyword and not request.config.option.markexpr
            and {os.path.relpath(str(item.path), HERE) for item in items} == files):
        n = len(items)
    else:
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                                    "no:cacheprovider"], cwd=HERE, capture_output=True, text=True)
        n = int(re.search(r"(\d+) tests? collected", collected.stdout)[1])
    assert f" then {n} tests:" in said and set(re.findall(r"(\d+) tests\b", readme)) == {str(n)}


def test_readmes_quick_start_numbers_are_its_logs():
    """README's quick start line and the sentence under it say what docs/quickstart.log recorded:
    the same command (the log's first line), its wall time (`time`'s real line) and the greedy
    accuracy of its first and last evaluations."""
    readme = project_text("README.md")
    block = bash_blocks(readme)[0].splitlines()
    command, said = next(line for line in block if "python scgrpo.py" in line).split("#")
    log = project_text("docs", "quickstart.log")
    assert log.splitlines()[0].split("#")[0].strip() == "$ time " + command.split("&&")[-1].strip()
    minutes, seconds = re.search(r"^real\s+(\d+)m([\d.]+)s$", log, re.M).groups()
    assert f"{minutes} min {round(float(seconds))} s on 2 CPU cores" in said
    accs = re.findall(r"^eval step \d+ \| greedy acc ([\d.]+)", log, re.M)
    assert f"from {float(accs[0]):.2f} to {float(accs[-1]):.2f} (one seed)." in readme


def test_readmes_commands_name_programs_files_and_flags_that_exist():
    """Each command in README's bash blocks names what exists: every `python PROGRAM` is a file,
    each --flag after it is in that program's --help, every `-r FILE` is a file, and each pinned
    package is pinned alike in tools/test.sh or requirements.txt. Whether they run as shown is
    checked by running them (the quick start's log; for the others, the issues' notes)."""
    blocks = bash_blocks(project_text("README.md"))
    pins = project_text("tools", "test.sh") + project_text("requirements.txt")
    flags = {}
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()]
    for command in (c for line in lines for c in line.split("&&")):
        words = command.split()
        if words[:1] == ["python"]:
            wanted = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
            flags.setdefault(words[1], set()).update(wanted)
        for i, word in enumerate(words):
            if word == "-r":
                assert os.path.isfile(os.path.join(HERE, words[i + 1])), words[i + 1]
            if "==" in word and words[0] == "pip":
                assert word in pins, word
    assert {"scgrpo.py", "tools/plot.py", "tools/compare.py"} <= set(flags)
    for program, wanted in flags.items():
        assert os.path.isfile(os.path.join(HERE, program)), program
        shown = subprocess.run([sys.executable, program, "--help"], cwd=HERE, capture_output=True,
                               text=True, timeout=120)
        assert shown.returncode == 0, (program, shown.stderr[-500:])
        assert not {f for f in wanted if not re.search(rf"{re.escape(f)}\b", shown.stdout)}, program
