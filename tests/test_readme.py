"""The README against what it shows: its drop-in diff is the example file's lines, its install commands are the
ones CI runs plus the CPU-only route, and it speaks to users (no issue numbers, no CI internals), with links that
resolve."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "examples" / "drop_in_generate.py"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def _drop_in_diff() -> str:
    (diff,) = [block for block in _blocks("diff") if "cache_implementation=\"paged\"" in block]
    return diff


def _hunks(diff: str) -> list[list[tuple[str, str]]]:
    """The diff's hunks, each a list of (mark, line) with mark in ' ', '+', '-'; an empty line is context."""
    hunks: list[list[tuple[str, str]]] = []
    for line in diff.splitlines():
        if line.startswith("@@"):
            hunks.append([])
            continue
        assert hunks, "the README's drop-in diff must start with a hunk header (@@ ... @@)"
        hunks[-1].append((line[:1] or " ", line[1:]))
    return hunks


def test_the_drop_in_diff_is_the_example_files_lines():
    """Each hunk's after side (context and + lines) is a run of consecutive lines of the example, the hunks in file
    order; the + lines are exactly the lines the file marks CHANGED."""
    file_lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    position = 0
    added = []
    for hunk in _hunks(_drop_in_diff()):
        after = [line for mark, line in hunk if mark in " +"]
        added += [line for mark, line in hunk if mark == "+"]
        starts = [i for i in range(position, len(file_lines) - len(after) + 1)
                  if file_lines[i:i + len(after)] == after]
        assert starts, f"this hunk of the README's diff is not a run of {EXAMPLE.name}'s lines:\n" + "\n".join(after)
        position = starts[0] + len(after)
    assert added == [line for line in file_lines if "# CHANGED" in line]


def test_the_drop_in_diff_sets_a_pad_token():
    """Run literally on a tokenizer without a pad token (stories260K), the shown lines must still pad."""
    after = "\n".join(line for hunk in _hunks(_drop_in_diff()) for mark, line in hunk if mark in " +")
    assert "tokenizer.pad_token = tokenizer.eos_token" in after and 'padding_side = "left"' in after


def _pip_installs(script: str) -> list[list[str]]:
    """Every `pip install ...` of a shell text, as argument lists (pip's options and the packages)."""
    commands = []
    lines = [line for line in script.splitlines() if re.match(r"\s*(python -m )?pip install", line)]
    for part in (part for line in lines for part in line.split("&&")):
        words = shlex.split(part, comments=True)
        if "pip" in words and words[words.index("pip") + 1:words.index("pip") + 2] == ["install"]:
            commands.append(words[words.index("pip") + 2:])
    return commands


def test_the_install_commands_are_cis_and_say_how_a_cpu_machine_gets_the_cpu_build():
    first = _blocks("bash")[0]
    demo_line, test_line = [line for line in first.splitlines() if line.startswith("pip install")]
    test_command = test_line.split("&&")[-1].strip()
    assert demo_line.endswith("paged-hf demo") and test_command.startswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert [line for line in ci.splitlines() if "pytest" in line and not line.startswith(("#", "echo"))] == \
        [test_command]  # CI runs the README's test command
    assert _pip_installs(test_line) == [[arg.strip("'") for arg in words] for words in _pip_installs(ci)]
    cpu = [words for block in _blocks("bash") for words in _pip_installs(block) if "--index-url" in words]
    assert cpu == [["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]]


def test_the_readme_speaks_to_users():
    for pattern in (r"#\d+\b", r"\bissues?\b", r"\.ci\b", r"\bCI\b", r"device tool"):
        found = re.findall(rf".*{pattern}.*", README, re.I)
        assert not found, f"{pattern!r} in the README: {found}"
    for name in ("architecture", "testing", "gpu"):
        assert f"(docs/{name}.md)" in README


def test_the_readme_and_docs_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_the_module_map_names_every_module():
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    package = ROOT / "paged_hf"
    for path in sorted(package.glob("*.py")):
        assert f"`{path.name}`" in architecture, path.name
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")):
        assert f"`{folder.name}/" in architecture, folder.name
