"""The bounded YAML loader: PyYAML's safe loader with a cap on values and depth, and duplicate keys refused.

Its own module so that PyYAML loads with the first config text parsed (gym_rpc.config._parsing imports it then),
not with `import gym_rpc.client.server_client`: a worker given its config as JSON, or a DictConfig, never needs it.
"""

from __future__ import annotations

from typing import Any

import yaml

from gym_rpc.errors import ConfigError


class _BoundedYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds checked while composing, and duplicate keys refused (YAML silently
    keeps the last one, so a second `policy_model:` would replace the first without a word)."""

    def __init__(self, text: str, source: str, max_values: int, max_depth: int) -> None:
        super().__init__(text)
        self._source = source
        self._max_values = max_values
        self._max_depth = max_depth
        self._open_sizes: list[int] = [0]  # values composed so far under each node being composed
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its expanded size

    def _refuse(self, problem: str, mark: Any) -> ConfigError:
        where = f"{self._source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self._source
        return ConfigError(f"{where}: {problem}")

    def _count(self, size: int, mark: Any) -> None:
        self._open_sizes[-1] += size
        if sum(self._open_sizes) > self._max_values:
            raise self._refuse(
                f"refusing a config of more than {self._max_values:,} values (with its YAML aliases expanded)",
                mark,
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                size = self._sizes.get(id(anchored))
                if size is None:  # the alias points into the node that is still being composed
                    raise self._refuse(f"the alias *{event.anchor} refers to itself", event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)  # an unknown anchor: PyYAML's own error
        mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        if len(self._open_sizes) > self._max_depth:
            raise self._refuse(f"refusing a config nested more than {self._max_depth} levels deep", mark)
        self._open_sizes.append(0)
        try:
            node = super().compose_node(parent, index)
        finally:
            size = 1 + self._open_sizes.pop()
        self._sizes[id(node)] = size
        self._count(size, mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise self._refuse(f"duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_bounded_yaml(text: str, source: str, *, max_values: int, max_depth: int) -> Any:
    """The one YAML document in `text` (None when it holds none); errors name the source and the line. A text of
    more than `max_values` values (aliases expanded) or nested deeper than `max_depth` is refused as it is read."""
    loader = None
    try:
        loader = _BoundedYamlLoader(text, source, max_values, max_depth)  # its reader refuses control characters
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        if isinstance(exc, yaml.reader.ReaderError):  # a control character: no mark, a position in the text
            where = f"{source}:{text.count(chr(10), 0, exc.position) + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]  # one line, without PyYAML's "in ..."
        raise ConfigError(f"{where}: invalid YAML: {problem}") from exc
    except RecursionError:  # a small recursion limit set by the embedding program; max_depth is the rule
        raise ConfigError(f"{source}: config nested too deeply to parse") from None
    finally:
        if loader is not None:
            loader.dispose()
