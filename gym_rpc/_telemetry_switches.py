"""NeMo Gym's own telemetry switches, read as the OpenTelemetry variables they mean, so that tracing
(`gym_rpc.telemetry`) and metrics (`gym_rpc.metrics`) decide from one environment.

NeMo Gym's telemetry work (the `nemo_gym.telemetry` package of its `ahmadki/lens-gym-*` branches; not on its main
branch at 07d6b0d) has a `telemetry:` block in the global config (`enabled`, `traces_enabled`, `metrics_enabled`,
`exporter`: `otlp` or `console`) which its launcher turns into `NEMO_GYM_OTEL_ENABLED`,
`NEMO_GYM_OTEL_TRACES_ENABLED`, `NEMO_GYM_OTEL_METRICS_ENABLED`, `NEMO_GYM_OTEL_EXPORTER` for every server it
starts, with `os.environ.setdefault` (a variable set by hand wins over the block), `NEMO_LENS_<KEY>` being read
when `NEMO_GYM_OTEL_<KEY>` is unset, and truthy meaning `1`, `true`, `yes`, `on`. A block's `enabled: false` is
never written out, so only a variable can switch Gym's telemetry off. Here the same rules give:

* Gym's telemetry on (`enabled`): traces and metrics on (each unless its `*_enabled` is false), exported with
  `exporter` (default `otlp`) unless `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER` name one;
* switched off by a variable (`NEMO_GYM_OTEL_ENABLED=0`), or one signal off (`*_ENABLED=0` while on): that signal
  off, as `OTEL_*_EXPORTER=none` would, whatever else the environment or the config say;
* not mentioned: nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gym_rpc._environment import NEMO_GYM_TELEMETRY_PREFIXES

TELEMETRY_KEY = "telemetry"  # NeMo Gym's top-level config block
_TRUTHY = frozenset({"1", "true", "yes", "on"})
# The block's fields -> the key after the prefix.
_BLOCK_KEYS = {"enabled": "ENABLED", "traces_enabled": "TRACES_ENABLED", "metrics_enabled": "METRICS_ENABLED"}
_EXPORTER_KEY = "EXPORTER"
SIGNAL_EXPORTER_VARIABLES = {"TRACES": "OTEL_TRACES_EXPORTER", "METRICS": "OTEL_METRICS_EXPORTER"}


def _variable(environ: Mapping[str, str], key: str) -> str | None:
    for prefix in NEMO_GYM_TELEMETRY_PREFIXES:  # in this order, as NeMo Gym's NemoLensConfig.from_env
        value = (environ.get(f"{prefix}_{key}") or "").strip()
        if value:
            return value
    return None


def _switch(value: str | bool | None) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    return value.strip().lower() in _TRUTHY


def _gym_switches(environ: Mapping[str, str], block: Any) -> dict[str, str | bool | None]:
    """Each switch from its variable, else from the config block (the launcher's setdefault)."""
    block = block if isinstance(block, Mapping) else {}
    switches: dict[str, str | bool | None] = {}
    for field, key in _BLOCK_KEYS.items():
        value = _variable(environ, key)
        from_block = block.get(field)
        if value is None and from_block is not None and (field != "enabled" or _switch(str(from_block))):
            value = str(from_block)
        switches[key] = _switch(value)
    exporter = _variable(environ, _EXPORTER_KEY) or block.get("exporter")
    switches[_EXPORTER_KEY] = str(exporter).strip().lower() if exporter else None
    return switches


def effective_environment(environ: Mapping[str, str], telemetry_block: Any = None) -> Mapping[str, str]:
    """`environ` with NeMo Gym's telemetry switches (its variables, then `telemetry_block`: the config's
    `telemetry:`) applied as the OTEL_* exporter variables they mean; `environ` itself when Gym's say nothing."""
    switches = _gym_switches(environ, telemetry_block)
    enabled = switches["ENABLED"]
    if enabled is None:
        return environ
    result = dict(environ)
    for signal, variable in SIGNAL_EXPORTER_VARIABLES.items():
        if not enabled or switches[f"{signal}_ENABLED"] is False:
            result[variable] = "none"
        elif not (result.get(variable) or "").strip():
            result[variable] = str(switches[_EXPORTER_KEY] or "otlp")
    return result
