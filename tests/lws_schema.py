"""The LeaderWorkerSet v1 API (leaderworkerset.x-k8s.io, https://lws.sigs.k8s.io) as a JSON
schema, written from its API reference: the fields of `spec` and their types and values. No
package ships the CRD for offline use, so this is the project's own transcription; the pod
templates inside are checked against Kubernetes' own schema (kubernetes_validate)."""

from __future__ import annotations

from typing import Any


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    # Unknown fields are refused, as the API server does with strict field validation.
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_ANY_OBJECT = {"type": "object"}
_COUNT = {"type": "integer", "minimum": 0}

LWS_V1 = _object(
    {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": _ANY_OBJECT,
        "spec": _object(
            {
                "replicas": _COUNT,
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": _ANY_OBJECT,
                "networkConfig": _object(
                    {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}
                ),
                "leaderWorkerTemplate": _object(
                    {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "leaderTemplate": _ANY_OBJECT,
                        "workerTemplate": _ANY_OBJECT,
                        "subGroupPolicy": _object({"subGroupSize": {"type": "integer"}}),
                    },
                    required=("workerTemplate",),
                ),
            },
            required=("leaderWorkerTemplate",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)
