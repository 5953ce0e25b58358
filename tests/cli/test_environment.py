"""Environment variables: one settings object reads them all, and docs/cli.md's table lists exactly those."""

from __future__ import annotations

import ast
import re

import pytest

from gym_rpc._environment import HEAD_ADDRESS_ENV_VAR, TOKEN_ENV_VAR, environment, variable_names
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "gym_rpc"


def _readme_table_variables() -> list[str]:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n\n", 3)[2]  # intro, then the table
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])]


def test_the_readme_table_lists_every_variable_read_and_no_other() -> None:
    listed = _readme_table_variables()
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(variable_names())


def _reads_the_environment(tree: ast.AST) -> bool:
    """`os.environ` or `os.getenv` anywhere in the module."""
    names = {"environ", "getenv", "environb"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names):
            return True
    return False


def test_only_the_settings_module_reads_os_environ() -> None:
    readers = sorted(
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if "v1" not in path.relative_to(PACKAGE).parts
        and _reads_the_environment(ast.parse(path.read_text(encoding="utf-8")))
    )
    assert readers == ["gym_rpc/_environment.py"]


def test_a_variable_set_after_import_is_seen_and_an_empty_one_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEAD_ADDRESS_ENV_VAR, raising=False)
    assert environment().head_address is None
    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, "10.0.0.1:11000")
    assert environment().head_address == "10.0.0.1:11000"
    assert environment().by_name()[HEAD_ADDRESS_ENV_VAR] == "10.0.0.1:11000"
    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, "")
    assert environment().head_address is None
    assert HEAD_ADDRESS_ENV_VAR not in environment().by_name()


def test_the_token_is_not_in_the_settings_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-token-value-that-must-not-leak"
    monkeypatch.setenv(TOKEN_ENV_VAR, secret)
    assert environment().token == secret
    assert secret not in repr(environment())


def test_every_variable_is_read_into_its_own_field(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in variable_names():
        monkeypatch.setenv(name, f"value of {name}")
    env = environment()
    assert env.by_name() == {name: f"value of {name}" for name in variable_names()}
    assert env.head_address == f"value of {HEAD_ADDRESS_ENV_VAR}"
    assert env.nemo_gym_config_dict == "value of NEMO_GYM_CONFIG_DICT"
    assert "value of NEMO_GYM_CONFIG_DICT" not in repr(env) and f"value of {TOKEN_ENV_VAR}" not in repr(env)
    assert f"value of {HEAD_ADDRESS_ENV_VAR}" in repr(env)
