"""`make_policy(spec)`: the policy named on the command line (`--policy`) or by `nitsum admin set-policy`.

Specs: `adaptive` (default) | `static-tp:K` | `disagg` | `disagg:P/D` | `static-hybrid` | `static-hybrid:H/L`
| `static:LAYOUT` (any fixed layout, e.g. `static:4+2+2`, `static:4p+2d+2d`; see baselines.py for what each is). A spec that is not one of these raises ValueError naming it.
"""

from __future__ import annotations

from nitsum.policy.base import BasePolicy, PolicyConfig
from nitsum.policy.snapshot import NodeView

DEFAULT_POLICY = "adaptive"
POLICY_SPECS: tuple[str, ...] = ("adaptive", "static-tp:K", "disagg[:P/D]", "static-hybrid[:H/L]", "static:LAYOUT")


def _int(spec: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"bad policy spec {spec!r}: {text!r} is not an integer") from None
    if value < 1 or value & (value - 1):
        raise ValueError(f"bad policy spec {spec!r}: TP {value} must be a power of two >= 1")
    return value


def _pair(spec: str, text: str) -> tuple[int, int]:
    parts = text.split("/")
    if len(parts) != 2:
        raise ValueError(f"bad policy spec {spec!r}: expected two TP levels as A/B, got {text!r}")
    return _int(spec, parts[0]), _int(spec, parts[1])


def layout_problem(policy: BasePolicy, node: NodeView) -> str:
    """Why `policy` cannot lay out `node` ('' if it can)."""
    try:
        policy.initial_topology(node)
    except (ValueError, AssertionError) as exc:
        return str(exc)
    return ""


def make_policy(spec: str = DEFAULT_POLICY, config: PolicyConfig | None = None) -> BasePolicy:
    from nitsum.policy.baselines import Disagg, StaticHybrid, StaticLayout, StaticTP
    from nitsum.policy.topology import AdaptivePolicy

    text = spec.strip().lower()
    name, _, arg = text.partition(":")
    if name == "adaptive" and not arg:
        return AdaptivePolicy(config)
    if name == "static-tp" and arg:
        return StaticTP(_int(spec, arg), config)
    if name == "static" and arg:
        return StaticLayout(arg, config)
    if name == "disagg":
        return Disagg(*_pair(spec, arg), config=config) if arg else Disagg(config=config)
    if name == "static-hybrid":
        return StaticHybrid(*_pair(spec, arg), config=config) if arg else StaticHybrid(config=config)
    raise ValueError(f"unknown policy spec {spec!r}; expected one of: {', '.join(POLICY_SPECS)}")
