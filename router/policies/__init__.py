"""Pluggable dispatch policies (`create_policy(name, ...)`): 'kv' (default) and 'round_robin'."""

from pdmesh.router.policies.base import Decision, DispatchPolicy, LocalTargets, PromptInfo
from pdmesh.router.policies.registry import create_policy, register_policy

__all__ = [
    "Decision",
    "DispatchPolicy",
    "LocalTargets",
    "PromptInfo",
    "create_policy",
    "register_policy",
]
