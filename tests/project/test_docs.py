"""The docs stay honest: every `gym-rpc` command and flag they show exists, and every relative link resolves.

README.md is the front page and docs/ holds the rest; a flag renamed in the parser, a page moved or a heading
reworded must not leave a reader a command that fails or a link that leads nowhere.
"""

from __future__ import annotations

import argparse
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_rpc.cli import build_parser
from gym_rpc.cli._flags import subcommands
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
DOCUMENTS = sorted(
    [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")],
    key=lambda path: str(path),
)
# Lines the command prints, shown in the docs as output rather than as commands to type.
OUTPUT_WORDS = {"listening", "VERSION", "<command>", "COMMAND"}
SHELL_BREAKS = {"|", "||", "&&", ";", "#", ">", "2>", "&"}


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _without_code_blocks(text: str) -> str:
    """The prose of a markdown file: fenced code blocks blanked (their links and `#` lines are not markdown)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _code_blocks(text: str) -> Iterator[str]:
    yield from re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)


def _inline_code(text: str) -> Iterator[str]:
    for span in re.findall(r"`([^`\n]+)`", _without_code_blocks(text)):
        yield span.replace("\\|", "|")  # a pipe escaped inside a table cell


def _commands_shown(text: str) -> Iterator[list[str]]:
    """Every `gym-rpc ...` invocation in a code span or a code block: its words after `gym-rpc`."""
    lines = list(_inline_code(text))
    for block in _code_blocks(text):
        lines += [line.split(" # ", 1)[0] for line in block.splitlines() if not line.lstrip().startswith("#")]
    for line in lines:
        for match in re.finditer(r"(?:^|[\s/\"'(])gym-rpc ((?:[^\s].*)?)$", line):
            words = []
            for word in match.group(1).split():
                if word in SHELL_BREAKS or word.startswith(("$(", "`")):
                    break
                words.append(word)
            yield words


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    return dict(subcommands(build_parser()))


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _flag_words(words: list[str]) -> Iterator[str]:
    """The flags among a command's words: `[--timeout S]` is `--timeout`, `--output=json` is `--output`."""
    for word in words:
        for part in word.split("|"):
            flag = part.strip("[]().,;\"'").split("=", 1)[0]
            if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag):
                yield flag


def _shown_commands() -> list[tuple[str, list[str]]]:
    return [(_relative(path), words) for path in DOCUMENTS for words in _commands_shown(path.read_text("utf-8"))]


def test_the_docs_show_commands() -> None:
    """The finder below finds what it checks (a broken regex would make the next test pass on nothing)."""
    shown = _shown_commands()
    subcommands = {words[0] for _, words in shown if words}
    assert {"head", "bridge", "status", "wait", "config", "demo", "completion"} <= subcommands
    assert len(shown) > 40


def test_every_command_and_flag_shown_exists() -> None:
    subcommands = _subcommands()
    top_flags = _flags(build_parser())
    wrong = []
    for document, words in _shown_commands():
        if not words or words[0] in OUTPUT_WORDS or (len(words) > 1 and words[1] in OUTPUT_WORDS):
            continue
        if words[0].startswith("-"):
            known, flags = top_flags, list(_flag_words(words))
        elif words[0].rstrip(":") in subcommands and words[0].endswith(":"):
            continue  # a message the command prints: `gym-rpc wait: waiting for ...`
        elif all(name in subcommands for name in words[0].split("|")):  # `gym-rpc status|wait|config`
            named = [subcommands[name] for name in words[0].split("|")]
            known = set.intersection(*(_flags(parser) for parser in named))
            flags = list(_flag_words(words[1:]))
        else:
            wrong.append(f"{document}: gym-rpc {' '.join(words)} (no command {words[0]!r})")
            continue
        wrong += [f"{document}: gym-rpc {' '.join(words)} (no flag {flag})" for flag in flags if flag not in known]
    assert wrong == []


def test_every_flag_the_cli_reference_names_exists() -> None:
    """docs/cli.md names flags on their own too (`--probe-interval 0`): each is a flag of some command."""
    every_flag = set().union(_flags(build_parser()), *(_flags(p) for p in _subcommands().values()))
    spans = _inline_code((ROOT / "docs" / "cli.md").read_text("utf-8"))
    named = {flag for span in spans if span.startswith("-") for flag in _flag_words(span.split()[:1])}
    assert len(named) > 15
    assert sorted(named - every_flag) == []


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (not `-` or `_`), spaces as `-`."""
    text = heading.strip().lower().replace("`", "")
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", _without_code_blocks(path.read_text("utf-8")), flags=re.M):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return anchors


def _links(path: Path) -> Iterator[str]:
    prose = re.sub(r"`[^`\n]+`", "", _without_code_blocks(path.read_text("utf-8")))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not ours to check
            yield target


def test_anchors_are_githubs() -> None:
    assert github_anchor("You run `ng_run` today: three steps") == "you-run-ng_run-today-three-steps"
    assert github_anchor("Calling Gym servers: `ServerClient`") == "calling-gym-servers-serverclient"
    assert github_anchor("Migrating from NeMo Gym's HTTP head") == "migrating-from-nemo-gyms-http-head"


@pytest.mark.parametrize("document", DOCUMENTS, ids=_relative)
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in _links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_relative(linked)}")
    assert broken == []


def test_the_readme_is_a_front_page() -> None:
    """A few hundred lines that link every docs page, so nothing moved to docs/ is out of a reader's reach."""
    readme = (ROOT / "README.md").read_text("utf-8")
    assert len(readme.splitlines()) < 400
    linked = {target.partition("#")[0] for target in _links(ROOT / "README.md")}
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert sorted(pages - linked) == []


def test_the_example_ports_never_collide() -> None:
    """Every page's examples give each head port its own number (SECURITY.md's health_port once took the
    README's http_port), so configs copied from two pages can be used together."""
    used: dict[str, set[str]] = {}
    for path in DOCUMENTS:
        text = path.read_text("utf-8")
        for key, port in re.findall(r"\b(health_port|http_port|connect_port|metrics_port): (\d{4,5})\b", text):
            used.setdefault(port, set()).add(key)
    assert {port: keys for port, keys in used.items() if len(keys) > 1} == {}
    assert len(used) >= 3  # the finder finds them
